"""What users write inside a forward that tracing used to change in silence: a custom
``torch.autograd.Function`` keeps its own backward, and reentrant activation checkpointing
trains (it is traced as the function it recomputes). Each against eager PyTorch."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import shardfx
from shardfx.errors import CaptureError
from shardfx.testing import compare_training

from models import hf, lm_loss, tiny, token_batches


class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward (the forward's own
    derivative is 0 everywhere)."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledProduct(torch.autograd.Function):
    """New style (``setup_context``): non-tensor arguments, two outputs, a tensor kept on ctx
    as an attribute, and a backward that is deliberately not the forward's derivative."""

    @staticmethod
    def forward(x, w, scale, name):
        return x * w * scale, (x * w).sum(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, scale, _ = inputs
        ctx.save_for_backward(x, w)
        ctx.scale, ctx.positive = scale, x > 0

    @staticmethod
    def backward(ctx, grad, grad_sum):
        x, w = ctx.saved_tensors
        grad = grad * ctx.scale * 0.5 * ctx.positive
        return grad * w + grad_sum[..., None] * w, (grad * x).sum(0), None, None


class Quantized(torch.nn.Module):
    """Linear, the two Functions, linear; the middle optionally under activation
    checkpointing (``reentrant`` True / False)."""

    def __init__(self, reentrant: bool | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.w = torch.nn.Parameter(torch.randn(8))
        self.reentrant = reentrant

    def middle(self, h):
        y, total = ScaledProduct.apply(RoundSTE.apply(h * 3), self.w, 2.0, "scaled")
        return y + total[..., None]  # (B, 8)

    def forward(self, x):
        h = self.a(x)
        if self.reentrant is None:
            h = self.middle(h)
        else:
            h = checkpoint.checkpoint(self.middle, h, use_reentrant=self.reentrant)
        return self.b(h)


def mse(out, target):
    return ((out - target) ** 2).mean()


def batches(n: int = 2):
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(4, 8, generator=g),), (torch.randn(4, 4, generator=g),))
            for _ in range(n)]


def test_straight_through_estimator_trains_the_layer_before_it():
    """The bug: the forward's derivative (round: 0) gave ``a`` a gradient of exactly 0."""
    report = compare_training(Quantized(), batches(), mse, mesh={})
    assert report.runner.grads()["a.weight"].abs().sum() > 0


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_region_trains_as_without_checkpointing(reentrant):
    """The bug: under ``use_reentrant=True`` the step returned the right loss but no
    parameter had a gradient, not even ``b`` outside the region."""
    report = compare_training(Quantized(reentrant), batches(), mse, mesh={})
    assert set(report.runner.grads()) == {"a.weight", "a.bias", "b.weight", "b.bias", "w"}


def test_hugging_face_reentrant_gradient_checkpointing_equals_eager():
    model = tiny("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    report = compare_training(model, token_batches(2), lm_loss, mesh={})
    assert len(report.runner.grads()) == len(list(model.parameters()))


def test_function_that_writes_its_input_in_place_is_named():
    class Clamp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.clamp_(min=0)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 4)

        def forward(self, x):
            return Clamp.apply(self.a(x))

    (x,), (y,) = batches(1)[0]
    with pytest.raises(CaptureError, match=r"Clamp changes one of its inputs in place") as e:
        shardfx.partition(Model(), (x,), mse, (y,), mesh={})
    assert "test_functions.py:" in e.value.where



class Gate(torch.autograd.Function):
    """A gate whose backward gives the gate's weights no gradient (``None``), as a frozen
    or separately trained gate does: eager leaves them unchanged, though they reach the
    loss."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * torch.sigmoid(w)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * torch.sigmoid(w), None


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.b(Gate.apply(self.a(x), self.w))


def _gated_on_dp2() -> None:
    report = compare_training(Gated(), batches(), mse, mesh={"dp": 2}, zero=2)
    assert "w" not in report.runner.grads()


def test_a_function_whose_backward_gives_none_trains_as_eager():
    """Valid code once refused: eager treats ``None`` as no gradient, and so does shardfx (the
    weights stay as they were; the layer before the gate trains through it)."""
    report = compare_training(Gated(), batches(3), mse, mesh={})
    grads = report.runner.grads()
    assert "w" not in grads and grads["a.weight"].abs().sum() > 0
    assert torch.equal(report.runner.state_dict()["w"], Gated().w.detach())


@pytest.mark.multiprocess
def test_a_function_whose_backward_gives_none_trains_as_eager_on_dp():
    shardfx.launch(_gated_on_dp2, nprocs=2, timeout=120)


def test_phimoe_router_trains_as_eager_one_device():
    """PhiMoE's router: Gumbel sampling (``exponential_``), Heun's mask (``rand_like``), input
    jitter (``uniform_``) on shardfx's stream, which eager replays, and ``PhimoeMultiplier``'s
    own backward. Before: the router's gradient 38% off."""
    model = hf("phimoe")
    report = compare_training(model, token_batches(2), lm_loss, mesh={})
    routers = [k for k in report.runner.grads() if "router" in k or "gate.weight" in k]
    assert routers, sorted(report.runner.grads())
    assert "exponential x" in str(report.plan) and "OFF the stream" not in str(report.plan)


def test_a_function_that_takes_a_module_is_named():
    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, layer, x):
            return layer(x)

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.b(Recompute.apply(self.a, x))

    (x,), (y,) = batches(1)[0]
    with pytest.raises(CaptureError, match=r"Recompute takes a module \(Linear\)") as e:
        shardfx.partition(Model(), (x,), mse, (y,), mesh={})
    assert "test_functions.py:" in e.value.where and "layer.weight" in e.value.fix


def test_a_parameter_eager_trains_and_the_trace_does_not_is_named(monkeypatch):
    """The safety net at planning: a trainable parameter the traced step gives no gradient
    while eager autograd (run on fake tensors) gives it one. Shown by tracing reentrant
    checkpointing the way torch.export alone does (the forward under no_grad: no gradient
    anywhere), which is what shardfx did before."""
    from shardfx.partitioner import capture

    monkeypatch.setattr(capture, "routed_through_carrier", contextlib.nullcontext)
    (x,), (y,) = batches(1)[0]
    with pytest.raises(CaptureError, match=r"no gradient for .*eager PyTorch gives it one"):
        shardfx.partition(Quantized(reentrant=True), (x,), mse, (y,), mesh={})
