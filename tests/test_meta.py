"""Planning on the meta device: the same training graph as on CPU, a plan that runs once the
model is materialized, and a named error when a traced backward misses gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.errors import CaptureError
from shardfx.ir import meta as M
from shardfx.ir.text import ir_to_text
from shardfx.partitioner import capture as capture_module
from shardfx.partitioner.capture import capture
from models import lm_loss, tiny, token_batches


def on_meta(name: str, layers: int = 3) -> torch.nn.Module:
    with torch.device("meta"):
        return tiny(name, layers)


def grads(gm) -> list[str]:
    return [r.name for r in gm.graph.output_node().meta[M.OUTPUTS] if r.kind is M.OutputKind.GRAD]


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_meta_traces_the_cpu_training_graph(name):
    """F.cross_entropy on meta: torch 2.13's joint trace alone gives no gradients at all."""
    (x,), (y,) = token_batches(1)[0]
    cpu = capture(tiny(name, 3), (x,), lm_loss, (y,)).gm
    meta = capture(on_meta(name), (x.to("meta"),), lm_loss, (y.to("meta"),))
    assert meta.path.startswith("stamped ")  # block 2 copied from block 1, on meta as on CPU
    assert len(grads(meta.gm)) == len(list(tiny(name, 3).parameters())) > 0
    assert ir_to_text(meta.gm) == ir_to_text(cpu)


def test_meta_model_with_cpu_inputs_plans_like_cpu():
    (x,), (y,) = token_batches(1)[0]
    model = on_meta("llama")
    plan = shardfx.partition(model, (x,), lm_loss, (y,), mesh={"dp": 2, "tp": 2},
                             shard="megatron")
    want = shardfx.partition(tiny("llama", 3), (x,), lm_loss, (y,), mesh={"dp": 2, "tp": 2},
                             shard="megatron")
    assert ir_to_text(plan.program.module) == ir_to_text(want.program.module)
    assert all(p.is_meta for p in model.parameters())  # the user's model is left as it was


def test_meta_inputs_on_a_pipeline():
    """The loss-reduction check ran loss_fn on CPU outputs and meta targets: a raw RuntimeError."""
    (x,), (y,) = token_batches(1)[0]
    kw = dict(mesh={"pp": 2}, microbatches=2)
    plan = shardfx.partition(on_meta("llama"), (x.to("meta"),), lm_loss, (y.to("meta"),), **kw)
    want = shardfx.partition(tiny("llama", 3), (x,), lm_loss, (y,), **kw)
    assert plan.options.loss_reduction == want.options.loss_reduction == "mean"
    assert [(n, p.code) for n, p in plan.stage_program.named_children()] == \
        [(n, p.code) for n, p in want.stage_program.named_children()]


def test_plan_on_meta_then_train_the_materialized_model():
    """The plan holds no meta device: materialize the model, load weights, and train."""
    batches = token_batches(2)
    (x,), (y,) = batches[0]
    model = on_meta("nanogpt")
    plan = shardfx.partition(model, (x.to("meta"),), lm_loss, (y.to("meta"),))
    reference = tiny("nanogpt", 3)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    want = shardfx.partition(reference, (x,), lm_loss, (y,))
    got_runner, want_runner = plan.runner(shardfx.testing.adamw), want.runner(shardfx.testing.adamw)
    for args, targets in batches:
        assert torch.equal(got_runner.step(args, targets), want_runner.step(args, targets))
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name


class NoGrad(torch.nn.Module):
    """``b`` is used only under no_grad and through detach: eager gives it no gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            k = self.b(x)
        return self.a(x) * self.b.weight.detach().sum() + k


def test_parameters_used_without_grad_need_no_gradient():
    x = torch.randn(2, 4)
    gm = capture(NoGrad(), (x,), F.mse_loss, (x,)).gm
    assert grads(gm) == ["a.weight", "a.bias"]


_lib = torch.library.Library("shardfx_test_meta", "DEF")
_lib.define("square(Tensor x) -> Tensor")
_lib.impl("square", lambda x: x * x, "CPU")
_lib.impl("square", lambda x: torch.empty_like(x), "Meta")


class Opaque(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.shardfx_test_meta.square(self.a(x))


def test_an_op_without_backward_is_an_error():
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match="no backward for shardfx_test_meta::square") as e:
        capture(Opaque(), (x,), F.mse_loss, (x,))
    assert "register_autograd" in e.value.fix


def test_gradients_missing_from_the_trace_are_an_error(monkeypatch):
    """Should a trace drop gradients unannounced, the plan is refused, naming a parameter."""
    monkeypatch.setattr(capture_module, "run_device", lambda model, example: None)
    monkeypatch.setattr(capture_module, "no_silent_backward",
                        lambda model: contextlib.nullcontext())
    (x,), (y,) = token_batches(1)[0]
    with pytest.raises(CaptureError, match=r"no gradient for model\.embed_tokens\.weight "
                                           r"\(and \d+ more\)") as e:
        with pytest.warns(UserWarning):  # torch's own, about nll_loss's missing autograd kernel
            capture(on_meta("llama"), (x.to("meta"),), lm_loss, (y.to("meta"),))
    assert e.value.where == "LlamaForCausalLM.model.embed_tokens.weight"
