"""Differential checking: a shardfx plan against the same model run eagerly on one device.

The truth is the model run eagerly in float64. ``compare_training`` runs a shardfx plan
(``shardfx.partition(...).runner(...)``, fp32) on the batches and checks every step from a
shared state: before the step it sets two eager copies of the model, one in fp32 and one in
fp64 (``deepcopy(model).double()``, floating inputs and targets cast to double), to shardfx's
current parameters and buffers (``runner.state_dict()``, the fp64 copy cast to double). All
three then compute the loss and gradients on the same batch, from the same weights, and of
each tensor (the loss, each gradient, each buffer updated in forward, such as BatchNorm's
running statistics) the check requires

    err(shardfx) <= factor * err(eager fp32) + rtol

shardfx may round differently from eager PyTorch (it sums in another order across devices and
microbatches), but not by more than a small multiple of what fp32 rounding costs eager
PyTorch itself on the same tensor from the same weights; ``rtol`` is the floor under which any
difference is accepted. ``compare_inference`` applies the same rule to a forward pass. This is
shardfx's correctness contract (docs/architecture.md); the test suite checks every capability
with it, and a user can run it on their own model before trusting a plan.

The optimizer step is checked by replay: the eager fp32 copy's optimizer (built by the same
factory over its parameters) is stepped with shardfx's gradients (``p.grad`` set to shardfx's
full gradient of each parameter) from the same parameters, so its state (Adam's moments, the
step count) evolves as the runner's should; shardfx's updated parameters must equal the
replayed ones to ``REPLAY_RTOL``. That is the same fp32 arithmetic on the same inputs, exact but
for kernels that vectorize or fuse differently (a shard's shape, foreach or fused kernels on a
GPU): a few roundings per element. A skipped weight decay (lr 1e-3 x wd 1e-2: 1e-5 of the
parameter), a lost update, a wrong optimizer hyperparameter or a lost optimizer state fail at
the step they happen. On a mesh the runner steps its own shards with its own optimizer
instances: for an elementwise optimizer (SGD, Adam, AdamW) that is the same computation on each
element. An optimizer whose step mixes elements across a tensor (one that uses a tensor-wide
norm, such as LAMB's trust ratio or Adafactor's factored moments) computes something else on
shards, and the replay fails it: rightly, since the sharded step is not the model's step.

Why a shared state and a replay: each copy trained on its own would follow its own trajectory,
and AdamW amplifies rounding. Adam's step is most sensitive to an element's gradient where that
gradient is near Adam's eps (``d step / d g = lr * eps / (|g| + eps)^2``, 1e4 at lr 1e-3), and a
difference in a parameter changes every later gradient: the trajectories drift apart, and pure
rounding failed a rule on parameters. Measured on an HF DeepSeek-V3 (hidden 32) under tp=2: one
``o_proj.weight`` element whose true gradient is -4.458e-8 (1e-6 of the tensor's largest);
eager fp32 rounds it 0.1% off and shardfx 3% off, every gradient within 3x of eager's own error,
yet after AdamW that parameter was 1.25e-4 off fp64 against a bound of 5e-5. Where a
gradient is exactly zero in truth (GPT-2's attention key bias: softmax ignores a constant
shift), what fp32 computes is rounding noise, which Adam turns into steps of up to lr; two fp32
runs differ there by full steps. From a shared state nothing accumulates, and the update is
checked against the replay, which is exact: rounding cannot be amplified into a failure, and a
bug in the update is measured without fp64's noise.

What an error is: for every tensor the norm-relative error ``||x - x64|| / ||x64||`` over the
whole tensor, in float64, as ``rel_error`` (the replay: ``||p - p_replayed|| / ||p_replayed||``).
A gradient's bound has one more term, a noise floor at the model's scale: ``GRAD_NOISE``
(1e-6, about 16 fp32 eps) of the step's largest gradient norm, in absolute terms. Rounding in a
gradient comes from the sums that make it, whose scale is the model's, not the gradient's own:
a gradient that is zero in truth (a bias that only shifts a softmax's input along the axis it
normalizes) is pure noise of that scale in any fp32 program, and with only a few elements the
two fp32 runs' noise can differ by more than the factor (found by the fuzzer: a 2-element bias
under tp=2, shardfx 5e-8 and eager fp32 3e-9 of the largest gradient's norm, 15x apart). A
bug of 1% in any gradient of norm 1e-4 of the largest or more still exceeds that floor.

Why a factor of eager's own error and not a fixed tolerance: where a gradient is nearly zero,
its relative error is large in both fp32 runs (the key bias above: above 1e6), and eager fp32
is the measure of what rounding costs on that tensor.

The factor, measured (``FACTOR``): ``err(shardfx) / err(eager fp32)`` per tensor and step, 3
AdamW steps, 5391 checks, with each copy on its own trajectory (a harder setting than the
shared state, where no drift adds to the errors): the suite's tiny GPT-2, Llama, Mixtral and
nanoGPT (hidden 32) on one device, tp=2 (megatron), dp=2, dp=2 x tp=2, pp=2 (GPipe, 1F1B,
zero-bubble, interleaved) and pp=2 x tp=2; HF Llama and GPT-2 of hidden 64 on tp=2, dp=2 and
pp=2. Where shardfx's error exceeds the floor the ratio is 3.87 at most. Below the floor it
reaches 17 (a loss of error 1.2e-7 where eager's was 7.2e-9): single values where eager
happened to round almost exactly, which the floor covers. ``FACTOR = 8`` leaves about 2x
margin over every ratio the factor decides. A real bug is far beyond it: one gradient element
off by 1e-3 of itself, a microbatch lost, the loss scaled by 1.0001 are caught at the first
step, as is (by the replay) a parameter's update lost or its weight decay skipped
(tests/test_testing.py).

Low precision: with ``precision="bf16"`` or ``"fp16"`` the reference is no longer eager fp32
but eager fp32 weights with the forward under ``torch.autocast`` to that dtype, and the bound
is ``factor`` x autocast's own error against fp64. shardfx's casts follow autocast's lists, so
its rounding is of the same size, not the same bits (it sums a bias's gradient in fp32 where
autocast sums in bf16; tp rounds partial sums before adding them). Measured over the suite's
tiny models (Llama, GPT-2, Mixtral, nanoGPT, Qwen3-MoE, Gemma 3, OLMo 2, DeepSeek-V3,
GPT-NeoX), two steps on one device in bf16 and fp16: every error is under 0.42 of its bound.

A model on the meta device: shardfx's runner makes its weights (each rank its shards,
``runtime.materialize``); ``compare_training`` first checks that they equal, bit for bit, what
``shardfx.materialize`` gives one device from the same ``init_seed`` (0), and the eager copies
start from those.

Random ops: shardfx draws dropout masks and other random values (a router's Gumbel noise, jitter)
from its own stream (``shardfx.passes.rng``), not eager's generator. So that eager computes the
same function, both eager copies run each step's forward on that stream too
(``random_draws.on_stream_eagerly``, with the runner's seed and step): the same values, numbered
in the order the forward draws them. A random op off the stream (randint, randperm,
multinomial...) draws from the device's generator in both runs, which no rule can relate:
``compare_training`` refuses it (``InputError`` naming the op and its line), as it does random
ops with ``accumulate > 1`` (the batches of a step each draw their own slice). Activation
checkpointing with ``preserve_rng_state=False`` around a random op cannot be compared either:
eager recomputes the region in its backward with fresh values, so its gradients are of another
mask than its loss's, where shardfx's are those of the forward it ran; the eager run notices the
fresh draw and ``compare_training`` says so (``InputError`` naming the line), never a mismatch.

Limitations. A small tensor (a bias) whose every true gradient is near zero has an error made
of one or a few elements' luck; when eager fp32 happens to round those almost exactly and
shardfx does not, the check fails. None of the suite's models does. Where a model casts to
float32 on purpose (Hugging Face's RMSNorm, Llama's attention softmax, rotary tables), the fp64
truth rounds there too: an error both fp32 runs share, which loosens the bound by that much and
no more.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from shardfx.errors import InputError
from shardfx.passes.random_draws import on_stream_eagerly
from shardfx.passes.rng import describe_off_stream, off_stream, reads_rng
from shardfx.runtime.materialize import on_meta
import shardfx  # the package imports this module's users, not the other way round
from shardfx.request.precision import Precision

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

FACTOR = 8.0  # shardfx's error may be this many times eager fp32's own (measured: see above)
# The replayed update is the same fp32 arithmetic on the same inputs: it differs only where a
# kernel vectorizes or fuses differently, a few roundings (fp32 eps 1.2e-7) per element; 1e-6
# is 8 eps, and 10x under the smallest bug it must catch (weight decay skipped: 1e-5).
REPLAY_RTOL = 1e-6


GRAD_NOISE = 1e-6  # rounding floor of a gradient, in units of the step's largest gradient norm


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` when ``b`` is zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


@dataclass(frozen=True)
class Check:
    """One tensor at one step: shardfx's error, and what bounds it."""

    step: int
    kind: str  # "loss" | "grad" | "buffer" | "output" (inference): against fp64; "replay"
    name: str
    shardfx: float  # against fp64; a replay: against eager fp32 stepped with shardfx's grads
    eager: float  # eager fp32's own error against fp64 (0 for a replay)
    bound: float  # factor * eager + floor (+ a gradient's noise floor); a replay: REPLAY_RTOL
    reference: str = "eager fp32"  # what ``eager`` ran: "eager fp32" or "autocast bf16"

    @property
    def ok(self) -> bool:
        return self.shardfx <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        eager = "replayed" if self.kind == "replay" else f"{self.eager:.2e}"
        return (f"step {self.step}: {self.kind:<6} shardfx {self.shardfx:.2e}  {self.reference} "
                f"{eager}  bound {self.bound:.2e}  {verdict:<4}  {self.name}")


@dataclass
class Report:
    """Every check of a run; ``str`` shows, per step and tensor kind, the tensor nearest its
    bound (errors against eager fp64, bound = factor x eager fp32's error + floor; the replay's
    against eager fp32's optimizer stepped with shardfx's gradients, bound REPLAY_RTOL)."""

    factor: float = FACTOR
    floor: float = 1e-5
    replay_rtol: float = REPLAY_RTOL
    checks: list[Check] = field(default_factory=list)
    plan: Any = field(default=None, repr=False, compare=False)  # what compare_training ran
    runner: Any = field(default=None, repr=False, compare=False)  # ... and its runner, trained
    reference: str = "eager fp32"  # the run whose error bounds shardfx's

    def add(self, step: int, kind: str, name: str, shardfx: float, eager: float,
            noise: float = 0.0) -> None:
        """``noise``: a gradient's floor at the model's scale, relative to its own norm."""
        bound = self.factor * eager + self.floor + noise
        self.checks.append(Check(step, kind, name, shardfx, eager, bound, self.reference))

    def add_replay(self, step: int, name: str, shardfx: float) -> None:
        self.checks.append(Check(step, "replay", name, shardfx, 0.0, self.replay_rtol))

    def worst(self, kind: str) -> list[Check]:
        """Per step, the check of ``kind`` with the largest error-to-bound ratio."""
        steps = sorted({c.step for c in self.checks})
        return [max((c for c in self.checks if c.step == s and c.kind == kind),
                    key=lambda c: c.shardfx / c.bound if c.bound else math.inf) for s in steps
                if any(c.step == s and c.kind == kind for c in self.checks)]

    @property
    def loss(self) -> list[Check]:
        return self.worst("loss")

    @property
    def grad(self) -> list[Check]:
        return self.worst("grad")

    @property
    def buffer(self) -> list[Check]:
        return self.worst("buffer")

    @property
    def replay(self) -> list[Check]:
        return self.worst("replay")

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def max(self) -> float:
        """The largest error beyond ``factor`` x eager fp32's own: ``shardfx - factor *
        eager``, at least 0, over every check against fp64. A run passes while it stays within
        the floor. A replay check has no floor: within its bound it adds 0, beyond it the floor
        plus its excess, so ``max() > floor`` says some check failed, whichever its kind."""
        def beyond(c: Check) -> float:
            if c.kind == "replay":
                return 0.0 if c.ok else self.floor + c.shardfx - c.bound
            return max(0.0, c.shardfx - self.factor * c.eager)

        return max(map(beyond, self.checks), default=0.0)

    def __str__(self) -> str:
        kinds = ("loss", "grad", "buffer", "replay", "output")
        rows = sorted((c for k in kinds for c in self.worst(k)),
                      key=lambda c: (c.step, kinds.index(c.kind)))
        head = (f"errors against eager fp64; bound = {self.factor:g} x {self.reference}'s error + "
                f"{self.floor:g} (gradients: + {GRAD_NOISE:g} x the largest gradient's norm); "
                "replay: updated parameters against eager fp32's optimizer "
                f"stepped with shardfx's gradients, bound {self.replay_rtol:g}; per step and "
                "kind, the tensor nearest its bound:")
        return "\n".join([head, *map(str, rows)])


def compare_training(
    model: torch.nn.Module,
    batches: list[tuple[tuple, tuple]],
    loss_fn: Callable[..., torch.Tensor],
    optimizer: OptimizerFactory = adamw,
    rtol: float = 1e-5,
    *,
    factor: float = FACTOR,
    loss_scaling: Any = None,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
    **partition_kwargs: Any,
) -> Report:
    """Train ``model`` through shardfx on ``batches`` ((args, targets) per step), and check
    each step against eager fp64 and fp32 copies set to shardfx's state before it, and the
    update against eager fp32's optimizer replaying shardfx's gradients (see the module
    docstring).

    Raises AssertionError naming the step and the tensors beyond their bound: ``factor`` x
    eager fp32's own error plus ``rtol`` (the floor), or ``REPLAY_RTOL`` for the update.
    Raises InputError if the plan draws random values off shardfx's stream (they cannot
    be eager's); those on it are replayed in eager (see the module docstring). With
    ``precision`` bf16 or fp16 among ``partition_kwargs`` the eager fp32 copy runs its forward
    under ``torch.autocast`` to that dtype, and it is autocast's error that bounds shardfx's;
    ``loss_scaling`` goes to ``plan.runner`` (a step the fp16 loss scale skips has inf
    gradients, and fails: start from a scale the model's gradients do not overflow). The plan is built
    on the first batch; ``model`` itself is left untouched. Under ``shardfx.launch`` every rank
    runs all three and compares full (gathered) tensors. Returns the ``Report`` of every check,
    with the plan and its runner (trained on ``batches``) as ``report.plan``, ``report.runner``.
    """

    precision = Precision.parse(partition_kwargs.get("precision"))
    low = precision.dtype
    compiled = copy.deepcopy(model)  # on meta, if the model is: the runner makes its shards
    if on_meta(model):
        model = shardfx.materialize(copy.deepcopy(model))  # what one device starts from
    truth, eager = _float64(model), copy.deepcopy(model)
    replay = optimizer(list(eager.parameters()))
    args0, targets0 = batches[0]
    plan = shardfx.partition(compiled, args0, loss_fn, targets0, **partition_kwargs)
    stream = _random_stream(plan, model, accumulate)
    runner = plan.runner(optimizer=optimizer, loss_scaling=loss_scaling,
                         clip_grad_norm=clip_grad_norm, keep_grads=True)
    reference = f"autocast {precision.compute}" if precision.low else "eager fp32"
    report = Report(factor, rtol, plan=plan, runner=runner, reference=reference)
    state = runner.state_dict()
    if on_meta(compiled):
        _check_made(state, model.state_dict())
    steps = [batches[i:i + accumulate] for i in range(0, len(batches), accumulate)]
    for step, group in enumerate(steps):
        for m in (eager, truth):  # shardfx's weights and buffers (cast to double in the truth)
            m.load_state_dict(state)
        draws = stream and (runner.rng_seed, runner.step_count)  # this step's random values
        base = _forward_backward(eager, loss_fn, group, low, clip=clip_grad_norm, draws=draws)
        want = _run_float64(truth, lambda m: _forward_backward(
            m, loss_fn, [(_double(a), _double(t)) for a, t in group], clip=clip_grad_norm,
            draws=draws))
        loss = runner.step(*group[0]) if accumulate == 1 else runner.step_batches(group)
        got = (loss, runner.grads(), runner.state_dict())
        _check_step(report, step, got, base, want)
        if clip_grad_norm is not None:
            norms = [torch.tensor(x) for x in (runner.grad_norm, base[3], want[3])]
            report.add(step, "grad norm", "global", *(rel_error(n, norms[2]) for n in norms[:2]))
        _replay(report, step, eager, replay, got[1], got[2])
        _assert_within(report, step, "shardfx differs from eager")
        state = got[2]
    return report


def compare_inference(model: torch.nn.Module, args: tuple, rtol: float = 1e-5, *,
                      factor: float = FACTOR, **partition_kwargs: Any) -> float:
    """Run ``model(*args)`` eagerly in fp64 and fp32 and through a shardfx inference plan;
    check every output tensor as ``compare_training`` checks a gradient.

    Raises AssertionError naming the outputs beyond the bound; returns the largest error
    beyond ``factor`` x eager fp32's own (as ``Report.max``).
    """
    with torch.no_grad():
        base = model(*args)
        want = _run_float64(_float64(model), lambda m: m(*_double(args)))
    got = shardfx.partition(copy.deepcopy(model), args, **partition_kwargs).runner().forward(args)
    if isinstance(got, Mapping):  # Hugging Face outputs: shardfx traces with use_cache=False
        want, base = ({k: out[k] for k in got} for out in (want, base))
    leaves = [pytree.tree_leaves_with_path(out) for out in (got, base, want)]
    assert leaves[0] and len({len(x) for x in leaves}) == 1, \
        f"inference outputs differ in structure: {[len(x) for x in leaves]} tensors"
    report = Report(factor, rtol)
    for (path, g), (_, b), (_, w) in zip(*leaves):
        report.add(0, "output", pytree.keystr(path) or "output", rel_error(g, w), rel_error(b, w))
    _assert_within(report, 0, "inference differs from eager")
    return report.max()


# --- the runs -----------------------------------------------------------------------------------


def _random_stream(plan, model: torch.nn.Module, accumulate: int) -> bool:
    """Whether ``plan``'s training program draws random values, all on shardfx's stream (which
    eager then replays). Raises if one is off the stream, or with ``accumulate > 1``."""
    program = plan.program.module if plan.program is not None else plan.stage_program
    if program is None or not reads_rng(program) and not off_stream(program):
        return False
    if off := off_stream(program):
        raise InputError(
            f"{type(model).__name__} draws random values shardfx does not draw from its own "
            "stream; they come from each device's generator, so neither a mesh nor this "
            "comparison can reproduce one device's draws",
            where=describe_off_stream(off),
            fix="compare with those ops out of the training step (eval-mode branches, a fixed "
                "tensor), or compare two shardfx plans with each other")
    if accumulate > 1:
        drops = [name or type(m).__name__ for name, m in model.named_modules()
                 if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
        raise InputError(
            "the model draws random values (dropout or other random ops) and the step "
            "accumulates several batches: the eager replay of shardfx's stream covers one batch "
            "a step", where=f"dropout modules {drops}" if drops else
            f"random ops in {type(model).__name__}.forward",
            fix="compare with accumulate=1, or with dropout set to 0")
    return True


def _check_made(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """A runner made from a meta model starts from ``shardfx.materialize``'s weights exactly."""
    differ = [k for k in want if not torch.equal(state[k].cpu(), want[k].cpu())]
    if differ:
        raise AssertionError(f"the runner made {len(differ)} of {len(want)} tensors of the meta "
                             f"model unlike shardfx.materialize: {', '.join(differ[:4])}")


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model``, the truth. Hugging Face MoE experts default to
    ``torch._grouped_mm``, which has no float64 kernel; their loop over experts ("eager")
    computes the same function."""
    truth = copy.deepcopy(model).double()
    for m in truth.modules():
        experts = getattr(getattr(m, "config", None), "_experts_implementation", None)
        if experts not in (None, "eager") and hasattr(m, "set_experts_implementation"):
            m.set_experts_implementation("eager")
    return truth


def _double(tree: Any) -> Any:
    """``tree`` with its floating tensors cast to float64 (token ids stay integers)."""
    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor)
                           and t.is_floating_point() else t, tree)


def _run_float64(truth: torch.nn.Module, fn: Callable[[torch.nn.Module], Any]) -> Any:
    """``fn(truth)``; a model that cannot run in float64 is an error naming why. (Callers run
    the fp32 model first, so an error here is about float64.)"""
    try:
        return fn(truth)
    except (RuntimeError, TypeError) as e:
        raise InputError(
            f"the model does not run in float64, which shardfx.testing measures both fp32 "
            f"runs against: {type(e).__name__}: {e}", where=f"{type(truth).__name__}.double()",
            fix="make forward follow its parameters' dtype (no hard-coded float32 tensors or "
            "kernels without a float64 version)") from e


def _forward_backward(model: torch.nn.Module, loss_fn, batches: list[tuple[tuple, tuple]],
                      autocast: torch.dtype = torch.float32, clip: float | None = None,
                      draws: tuple[int, int] | None = None) -> tuple:
    """Eager forwards and backwards of each batch's loss / k (k batches), then clipping:
    (mean loss, gradients by FQN, buffers after the last forward, global norm before
    clipping); the forwards and losses under ``torch.autocast`` to ``autocast`` unless fp32,
    and on shardfx's random stream at ``draws`` = (seed, step) when given."""
    for p in model.parameters():
        p.grad = None
    device = next((t.device.type for t in pytree.tree_leaves(batches[0][0])
                   if isinstance(t, torch.Tensor)), "cpu")
    total = 0.0
    for piece, (args, targets) in enumerate(batches):
        stream = on_stream_eagerly(*draws, piece) if draws else None
        with stream or contextlib.nullcontext():  # the backward too: checkpointing draws its
            with torch.autocast(device, dtype=autocast,  # region's values again there
                                enabled=autocast != torch.float32):
                loss = loss_fn(model(*args), *targets) / len(batches)
            if stream is not None:
                stream.backward = True
            loss.backward()
        if stream is not None and stream.fresh:
            raise _fresh_in_backward(stream.fresh)
        total = total + loss.detach()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {n: t for n, t in model.state_dict().items() if n not in params}
    return total, grads, buffers, norm


def _fresh_in_backward(fresh: list[str]) -> InputError:
    """Eager's backward drew random values its forward did not (checkpointing with
    ``preserve_rng_state=False``): its gradients are of another mask than its loss's."""
    return InputError(
        f"this model cannot be compared with eager PyTorch: eager's backward draws random values "
        f"its forward did not ({fresh[0]}; {len(fresh)} in all), as activation checkpointing "
        "with preserve_rng_state=False does when it recomputes a region with dropout, so eager's "
        "gradients are those of another dropout mask than the one its loss used; shardfx's "
        "are those of the forward it ran (as with preserve_rng_state=True)",
        where=fresh[0].rpartition("(")[2].rstrip(")"),
        fix="compare with preserve_rng_state=True (the default), which eager computes as "
            "shardfx does; shardfx trains the same either way")


def _check_step(report: Report, step: int, got, base, want) -> None:
    """Add one step's checks against fp64: (loss, grads, state or buffers) of shardfx, eager
    fp32 and the truth."""
    (loss, grads, state), (eager_loss, eager_grads, eager_buffers, _), \
        (loss64, grads64, buffers64, _) = got, base, want
    report.add(step, "loss", "loss", rel_error(loss, loss64), rel_error(eager_loss, loss64))
    missing = sorted(set(grads64) ^ set(grads))
    assert not missing, f"step {step}: gradient present in one run only: {missing}"
    largest = max((g.double().norm().item() for g in grads64.values()), default=0.0)
    for n, g in grads64.items():
        norm = g.double().norm().item()  # the noise floor, relative to this gradient's norm:
        noise = GRAD_NOISE * largest / norm if norm else GRAD_NOISE * largest
        report.add(step, "grad", n, rel_error(grads[n], g), rel_error(eager_grads[n], g), noise)
    for n, b in buffers64.items():
        report.add(step, "buffer", n, rel_error(state[n], b), rel_error(eager_buffers[n], b))


def _replay(report: Report, step: int, eager: torch.nn.Module, opt: torch.optim.Optimizer,
            grads: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Step ``opt`` (over ``eager``'s parameters, set to shardfx's before the step) with
    shardfx's ``grads``; check shardfx's updated parameters in ``state`` against the result."""
    for n, p in eager.named_parameters():
        p.grad = grads[n].detach().clone() if n in grads else None
    opt.step()
    for n, p in eager.named_parameters():
        report.add_replay(step, n, rel_error(state[n], p))


def _assert_within(report: Report, step: int, headline: str) -> None:
    """Raise naming every tensor of ``step`` beyond its bound, with the whole report."""
    bad = [c for c in report.failures() if c.step == step]
    assert not bad, "\n".join([
        f"{headline} beyond fp32 rounding at step {step} (error against eager fp64 > "
        f"{report.factor:g} x eager fp32's + {report.floor:g}; replayed update: error > "
        f"{report.replay_rtol:g}):",
        *(f"  {c}" for c in bad[:10]),
        *([f"  ... and {len(bad) - 10} more"] if len(bad) > 10 else []), str(report)])
