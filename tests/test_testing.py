"""The differential checker fails a real bug and passes rounding.

``compare_training`` is what every other test trusts, so it is tested against runs we break on
purpose, each break a small version of a bug a compiler for training could have: one gradient
element wrong, a microbatch's contribution lost, a parameter's update lost or its weight decay
skipped, a wrong optimizer hyperparameter, the optimizer's state lost, a buffer update lost,
the loss scaled. The break goes into the shardfx side only (``Plan.runner``, ``Runner.step`` or
``partition`` is wrapped) while the eager copies run untouched. The other way round, a shardfx
run that only sums in another order (a matmul split in two halves, as tensor parallelism
computes it; each half of the batch on its own, as data parallelism does) must pass, although
AdamW turns the rounding noise of a gradient that is truly zero into steps.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.errors import InputError
from shardfx.testing import _float64, compare_inference, compare_training, rel_error

from models import VOCAB, lm_loss, tiny, token_batches

LR, WEIGHT_DECAY = 1e-3, 0.01  # shardfx.testing.adamw


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def batches(n: int, rows: int = 2) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(rows, 4, generator=g),), (torch.randn(rows, 3, generator=g),))
            for _ in range(n)]


class Attention(torch.nn.Module):
    """Self-attention with a key bias, as GPT-2: softmax over the keys ignores it, so its true
    gradient is exactly zero and what fp32 computes for it is rounding noise, which Adam turns
    into steps of up to lr. ``rounding`` (set on the shardfx copy only) sums in another order:
    "split" computes the output projection as two halves added (tp's row-parallel matmul),
    "rows" each half of the batch on its own, so the weight gradients add two halves (dp)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (torch.nn.Linear(8, 8) for _ in range(4))
        self.rounding = None

    def forward(self, x):  # (B, T, 8)
        if self.rounding == "rows":
            return torch.cat([self.attend(x[:2]), self.attend(x[2:])])
        return self.attend(x)

    def attend(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), dim=-1)  # (B, T, T)
        h = att @ self.v(x)  # (B, T, 8)
        if self.rounding != "split":
            return self.out(h)
        w = self.out.weight
        return h[..., :4] @ w[:, :4].T + h[..., 4:] @ w[:, 4:].T + self.out.bias


def attention_batches(n: int) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(4, 6, 8, generator=g),), (torch.randn(4, 6, 8, generator=g),))
            for _ in range(n)]


def break_runner_optimizer(monkeypatch, name: str, before=None, after=None) -> None:
    """Make every runner call ``before(param)`` and ``after(param, state)`` on parameter
    ``name`` around each optimizer step (``state``: what ``before`` returned)."""
    runner = shardfx.Plan.runner

    def patched(plan, optimizer=None, **kw):
        def factory(params):
            opt = optimizer(params)
            param, state = dict(plan.model.named_parameters())[name], {}
            opt.register_step_pre_hook(lambda *_: state.update(v=before and before(param)))
            if after:
                opt.register_step_post_hook(lambda *_: after(param, state["v"]))
            return opt

        return runner(plan, factory, **kw)

    monkeypatch.setattr(shardfx.Plan, "runner", patched)


def change_partition(monkeypatch, model=None, loss_fn=None) -> None:
    """Make ``shardfx.partition`` apply ``model(m)`` to the model it plans and trace
    ``loss_fn(original)`` instead of the loss function: the shardfx copy only."""
    partition = shardfx.partition

    def patched(m, args, loss, *rest, **kwargs):
        if model:
            model(m)
        return partition(m, args, loss_fn(loss) if loss_fn else loss, *rest, **kwargs)

    monkeypatch.setattr(shardfx, "partition", patched)


def caught(run, step: int = 0) -> str:
    """The failure message of ``run()``, which must fail at ``step``."""
    with pytest.raises(AssertionError, match="shardfx differs from eager") as info:
        run()
    msg = str(info.value)
    assert msg.startswith(f"shardfx differs from eager beyond fp32 rounding at step {step} "), msg
    return msg


def failing(msg: str) -> set[tuple[str, ...]]:
    """The failing (kind, tensor) pairs a failure message lists."""
    return {tuple(line.split()[2:3] + line.split()[-1:]) for line in msg.splitlines()
            if line.startswith("  step") and " FAIL " in line}


# --- unbroken runs pass -----------------------------------------------------------------------


def test_unbroken_run_passes_and_reports_each_kind():
    report = compare_training(mlp(), batches(3), F.mse_loss)
    assert report.max() == 0 and not report.failures() and len(report.loss) == 3
    lines = str(report).splitlines()
    assert "bound = 8 x eager fp32's error + 1e-05" in lines[0], lines[0]
    assert [line.split()[:3] for line in lines[1:4]] == [
        ["step", "0:", "loss"], ["step", "0:", "grad"], ["step", "0:", "replay"]], lines
    assert all("shardfx" in line and "eager fp32" in line and "bound" in line
               for line in lines[1:]), lines


@pytest.mark.parametrize("rounding", ["split", "rows"])
def test_rounding_in_another_order_passes(monkeypatch, rounding):
    """Only the summation order differs. The key bias's true gradient is zero, so what both
    fp32 runs compute for it is rounding noise, 1e8 times fp64's (relative error > 1e6 of its
    own norm), which AdamW turns into steps of up to lr: within the rule, since every step
    starts from shardfx's weights and the update is replayed with shardfx's gradients."""
    def use(m):
        m.rounding = rounding

    change_partition(monkeypatch, model=use)
    report = compare_training(Attention(), attention_batches(3), F.mse_loss)
    key_bias = [c for c in report.checks if c.name == "k.bias" and c.kind == "grad"]
    assert len(key_bias) == 3 and all(c.shardfx > 1e6 for c in key_bias), report
    assert len(report.replay) == 3 and report.max() == 0, report


def deepseek_v3() -> torch.nn.Module:
    """HF DeepSeek-V3, tiny: multi-head latent attention, 4 routed experts."""
    import transformers as T

    torch.manual_seed(0)
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=VOCAB,
        intermediate_size=64))


def _deepseek_v3_tp() -> tuple[float, float]:
    report = compare_training(deepseek_v3(), token_batches(3, batch=4), lm_loss, mesh={"tp": 2},
                              shard="megatron")
    return report.max(), max(c.shardfx for c in report.checks if c.kind == "replay")


def test_adam_amplified_rounding_passes_on_deepseek_v3_under_tp():
    """Where this model was measured with each run on its own trajectory, an o_proj.weight
    gradient element (-4.5e-8 in truth, 1e-6 of the tensor's largest; eager fp32 0.1% off,
    tp=2 3% off) became, through AdamW, a parameter 1.25e-4 off fp64 (bound 5e-5). From
    shardfx's state at every step, with the update replayed, the run passes and the replayed
    update is exact. (The mechanism itself: test_rounding_sized_gradient_error_near_adam_eps.)"""
    for worst, replay in shardfx.launch(_deepseek_v3_tp, nprocs=2):
        assert worst == 0 and replay < 1e-6, (worst, replay)


def test_rounding_sized_gradient_error_near_adam_eps_passes(monkeypatch):
    """Adam's step is most sensitive to a gradient element near its eps: an error of 2e-8 of
    the tensor's largest gradient (a fraction of an fp32 ulp of it) on the column whose true
    gradient is ~1e-8 moves that column's update by ~lr/2, 3.8e-4 of the parameter, which
    failed a rule that compared parameters against fp64. Gradients are within the floor, and
    the replayed update is the one those gradients give: it passes."""
    def rounding(p):
        p.grad[:, 0] += 2e-8 * p.grad.abs().max()

    break_runner_optimizer(monkeypatch, "0.weight", before=rounding)
    data = [((x * torch.tensor([1e-7, 1, 1, 1]),), y) for (x,), y in batches(3)]  # grad col 0 ~1e-8
    report = compare_training(mlp(), data, F.mse_loss)
    assert report.max() == 0 and all(c.ok for c in report.checks), report


# --- broken runs fail, at the first step, naming the tensor -----------------------------------


@pytest.mark.parametrize("name", ["0.weight", "2.bias"])
def test_one_gradient_element_off_by_1e_3_of_itself_is_caught(monkeypatch, name):
    def perturb(p):
        g = p.grad.view(-1)
        g[g.abs().argmax()] *= 1 + 1e-3

    break_runner_optimizer(monkeypatch, name, before=perturb)
    msg = caught(lambda: compare_training(mlp(), batches(3), F.mse_loss))
    assert failing(msg) == {("grad", name)}, msg


def test_lost_microbatch_is_caught(monkeypatch):
    """The program computes the loss and gradients from 3 of the batch's 4 microbatches."""
    change_partition(monkeypatch, loss_fn=lambda loss: lambda out, y: loss(out[:6], y[:6]))
    msg = caught(lambda: compare_training(mlp(), batches(3, rows=8), F.mse_loss))
    assert {("loss", "loss"), ("grad", "0.weight"), ("grad", "2.bias")} <= failing(msg), msg


def test_lost_parameter_update_is_caught(monkeypatch):
    """The optimizer step does not reach one parameter (a shard left out of the optimizer)."""
    def restore(p, before):
        with torch.no_grad():
            p.copy_(before)

    break_runner_optimizer(monkeypatch, "2.bias", before=lambda p: p.detach().clone(),
                           after=restore)
    msg = caught(lambda: compare_training(mlp(), batches(3), F.mse_loss))
    assert failing(msg) == {("replay", "2.bias")}, msg


def test_weight_decay_skipped_on_one_parameter_is_caught(monkeypatch):
    """AdamW without its decay on ``0.weight``: the update is off by lr * wd * p, 1e-5 of the
    parameter (the floor of the checks against fp64), 10x the replay's bound: caught at once."""
    def undo_decay(p, before):
        with torch.no_grad():
            p.add_(LR * WEIGHT_DECAY * before)

    break_runner_optimizer(monkeypatch, "0.weight", before=lambda p: p.detach().clone(),
                           after=undo_decay)
    msg = caught(lambda: compare_training(mlp(), batches(3), F.mse_loss))
    assert failing(msg) == {("replay", "0.weight")}, msg
    error = float(re.search(r"step 0: replay +shardfx (\S+)", msg).group(1))
    assert error == pytest.approx(LR * WEIGHT_DECAY, rel=1e-2), msg


def test_wrong_optimizer_hyperparameter_is_caught(monkeypatch):
    """The runner's AdamW takes lr 1.01e-3 where the factory says 1e-3: every update is off by
    1% of itself, caught at the first step on every parameter."""
    runner = shardfx.Plan.runner
    monkeypatch.setattr(shardfx.Plan, "runner", lambda plan, optimizer=None, **kw: runner(
        plan, lambda params: torch.optim.AdamW(params, lr=LR * 1.01), **kw))
    msg = caught(lambda: compare_training(mlp(), batches(3), F.mse_loss))
    assert failing(msg) == {("replay", n) for n in ("0.weight", "0.bias", "2.weight", "2.bias")}


def test_lost_optimizer_state_is_caught(monkeypatch):
    """The runner's AdamW forgets its moments after every step: the first step is right, the
    second is not (the replay's optimizer keeps its state, as the runner's should)."""
    runner = shardfx.Plan.runner

    def forgetful(params):
        opt = torch.optim.AdamW(params, lr=LR)
        opt.register_step_post_hook(lambda o, *_: o.state.clear())
        return opt

    monkeypatch.setattr(shardfx.Plan, "runner",
                        lambda plan, optimizer=None, **kw: runner(plan, forgetful, **kw))
    msg = caught(lambda: compare_training(mlp(), batches(3), F.mse_loss), step=1)
    assert {kind for kind, _ in failing(msg)} == {"replay"}, msg


def normed() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_buffers_updated_in_forward_are_checked(monkeypatch):
    """BatchNorm's running statistics: checked against fp64 as gradients are. A step that
    loses their update fails on them at the first step."""
    report = compare_training(normed(), batches(3, rows=4), F.mse_loss)
    assert {c.name for c in report.checks if c.kind == "buffer"} == {
        "1.running_mean", "1.running_var", "1.num_batches_tracked"}, report

    step = shardfx.Runner.step

    def forget_stats(self, *args):  # on one device the runner's buffers are the model's
        stats = {n: b.clone() for n, b in self.plan.model.named_buffers()}
        loss = step(self, *args)
        with torch.no_grad():
            for n, b in self.plan.model.named_buffers():
                b.copy_(stats[n])
        return loss

    monkeypatch.setattr(shardfx.Runner, "step", forget_stats)
    msg = caught(lambda: compare_training(normed(), batches(3, rows=4), F.mse_loss))
    assert failing(msg) == {("buffer", "1.running_mean"), ("buffer", "1.running_var"),
                            ("buffer", "1.num_batches_tracked")}, msg


def test_loss_scaled_by_1_0001_is_caught(monkeypatch):
    step = shardfx.Runner.step
    monkeypatch.setattr(shardfx.Runner, "step", lambda self, *a: step(self, *a) * (1 + 1e-4))
    msg = caught(lambda: compare_training(mlp(), batches(2), F.mse_loss))
    assert failing(msg) == {("loss", "loss")}, msg
    error = float(re.search(r"step 0: loss +shardfx (\S+)", msg).group(1))
    assert error == pytest.approx(1e-4, rel=1e-2), msg


def test_missing_gradient_is_caught(monkeypatch):
    def drop(p):
        p.grad = None

    break_runner_optimizer(monkeypatch, "2.weight", before=drop)
    with pytest.raises(AssertionError, match=r"gradient present in one run only: \['2.weight'\]"):
        compare_training(mlp(), batches(2), F.mse_loss)


def test_wrong_inference_output_is_caught(monkeypatch):
    (x,), _ = batches(1)[0]
    assert compare_inference(mlp(), (x,)) == 0
    forward = shardfx.Runner.forward
    monkeypatch.setattr(shardfx.Runner, "forward", lambda self, a: forward(self, a) * (1 + 1e-4))
    with pytest.raises(AssertionError, match="inference differs from eager beyond fp32 rounding"):
        compare_inference(mlp(), (x,))


# --- dropout: shardfx's masks are not eager's --------------------------------------------------


class Dropped(torch.nn.Module):
    def __init__(self, p: float, functional: bool = False):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.drop = torch.nn.Dropout(0.0 if functional else p)
        self.p, self.functional = p, functional

    def forward(self, x):
        h = torch.relu(self.fc(x))
        h = F.dropout(h, self.p, self.training) if self.functional else self.drop(h)
        return self.head(h)


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_active_dropout_is_compared_with_eager_on_shardfx_stream(functional):
    """Eager replays shardfx's masks (``random_draws.on_stream_eagerly``), so a model with
    dropout is checked against eager like any other."""
    report = compare_training(Dropped(0.5, functional), batches(3), F.mse_loss)
    assert "native_dropout x1 on shardfx's stream" in str(report.plan) and report.max() == 0


def test_replay_of_the_wrong_draws_is_caught(monkeypatch):
    """Eager drawing the next op's mask (or any other) fails the comparison: the replay is a
    real check, not a pass-through."""
    from shardfx.passes import random_draws

    real = random_draws.sample
    monkeypatch.setattr(random_draws, "sample", lambda f, t, a, k, rng, op, *rest:
                        real(f, t, a, k, rng, op + 1, *rest))
    with pytest.raises(AssertionError, match="shardfx differs from eager"):
        compare_training(Dropped(0.5), batches(2), F.mse_loss)


class Shuffled(torch.nn.Module):
    """Rows in a random order (``randperm``: off shardfx's stream) plus Gaussian noise (on it)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x[torch.randperm(x.shape[0])] + 0.1 * torch.randn_like(x))


def test_random_ops_off_the_stream_are_refused_naming_them():
    with pytest.raises(InputError, match="does not draw from its own stream") as info:
        compare_training(Shuffled(), batches(2), F.mse_loss)
    assert "randperm at " in info.value.where and "test_testing.py" in info.value.where
    assert "randn_like at" not in info.value.where  # on the stream: replayed, not refused
    x, y = batches(1)[0]
    text = str(shardfx.partition(Shuffled(), x, F.mse_loss, y))
    assert "randn_like x1 on shardfx's stream" in text and "randperm at " in text, text


def test_random_ops_with_accumulated_batches_are_refused():
    with pytest.raises(InputError, match="accumulates several batches") as info:
        compare_training(Dropped(0.1), batches(4), F.mse_loss, accumulate=2)
    assert "dropout modules ['drop']" in info.value.where and "accumulate=1" in info.value.fix


class Recomputed(torch.nn.Module):
    """Dropout inside an activation checkpoint whose RNG state is or is not preserved."""

    def __init__(self, reentrant: bool, preserve: bool):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.drop = torch.nn.Dropout(0.5)
        self.reentrant, self.preserve = reentrant, preserve

    def region(self, h):
        return self.drop(torch.relu(h))  # the line the error names

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.region, self.fc(x), use_reentrant=self.reentrant,
                                              preserve_rng_state=self.preserve)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_dropout_without_its_rng_state_is_said_not_comparable(reentrant):
    """preserve_rng_state=False: eager's backward recomputes the region with a fresh mask, so
    its gradients are not those of its own loss; shardfx's are (it keeps the forward's mask).
    No false alarm: the checker says the two cannot be compared and why; preserved, they are
    compared and equal."""
    with pytest.raises(InputError, match=r"cannot be compared with eager PyTorch: eager's "
                                         r"backward draws random values its forward did not "
                                         r"\(aten\.bernoulli_\.float") as info:
        compare_training(Recomputed(reentrant, preserve=False), batches(2), F.mse_loss)
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1)
                if "# the line the error names" in text)
    assert info.value.where.endswith(f"test_testing.py:{line}")
    assert "preserve_rng_state=True" in info.value.fix
    compare_training(Recomputed(reentrant, preserve=True), batches(2), F.mse_loss)  # equal


@pytest.mark.parametrize("eval_mode", [False, True])
def test_inactive_dropout_is_compared(eval_mode):
    """p = 0, or dropout in eval mode: nothing random, so the runs are compared."""
    model = Dropped(0.1).eval() if eval_mode else Dropped(0.0)
    assert compare_training(model, batches(2), F.mse_loss).max() == 0


# --- the truth ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hugging_face_models_run_in_float64(name):
    """Mixtral's experts default to torch._grouped_mm, which has no float64 kernel: the truth
    uses their loop over experts, and the fp32 model keeps its own."""
    model = tiny(name)
    experts = model.config._experts_implementation
    (tokens,), _ = token_batches(1)[0]
    truth = _float64(model)
    with torch.no_grad():
        want, got = truth(tokens).logits, model(tokens).logits
    assert want.dtype == torch.float64 and want.shape == (*tokens.shape, VOCAB)
    assert rel_error(got, want) < 1e-5
    assert truth.config._experts_implementation == "eager"
    assert model.config._experts_implementation == experts


def test_model_that_cannot_run_in_float64_is_named():
    class Fp32Only(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x) @ torch.eye(3, dtype=torch.float32)

    with pytest.raises(InputError, match="does not run in float64") as info:
        compare_training(Fp32Only(), batches(1), F.mse_loss)
    assert "Fp32Only" in info.value.where
