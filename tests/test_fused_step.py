"""The runner steps Adam, AdamW and SGD with torch's fused kernel where the user leaves the
choice open (``cost.optimizer.fused_step``): equal to the for-loop within a rounding of each
update in float32 on CPU (one unit in the last place of a parameter, where they differ), no
temporaries in the memory model; a choice the user made is kept, with a warning that
the plan did not count its temporaries."""

from __future__ import annotations

import logging

import pytest
import torch

import shardfx
from shardfx.cost.optimizer import (OPTIMIZERS, fused_step, grads_laid_out_as_params,
                                    optimizer_temporaries)
from shardfx.testing import adamw

from models import lm_loss, tiny, token_batches


def _plan():
    batches = token_batches(3)
    (x,), (y,) = batches[0]
    return shardfx.partition(tiny("llama"), (x,), lm_loss, (y,)), batches


def _within_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal but for a few roundings of an elementwise update: 4 units in the last place of
    the tensor's largest element."""
    return bool((a - b).abs().max() <= 4 * torch.finfo(a.dtype).eps * a.abs().max())


def test_adamw_left_unset_steps_fused_as_the_for_loop_does():
    (plan, batches), (other, _) = _plan(), _plan()  # two models: a runner trains its own
    fused = plan.runner(adamw)
    loop = other.runner(lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False))
    assert all(g["fused"] is True for g in fused.optimizer.param_groups)
    assert all(g["fused"] is None for g in loop.optimizer.param_groups)
    for args, targets in batches:
        assert torch.equal(fused.step(args, targets), loop.step(args, targets))
        a, b = fused.state_dict(), loop.state_dict()
        assert a.keys() == b.keys() and all(_within_rounding(a[k], b[k]) for k in a)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
])
def test_adam_and_sgd_fused_step_as_their_for_loops_do(make):
    torch.manual_seed(0)
    ps = [torch.randn(300, 7, requires_grad=True), torch.randn(11, requires_grad=True)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    fused, loop = make(ps), make(qs)
    assert fused_step(fused)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        loop.step()
    assert all(_within_rounding(p, q) for p, q in zip(ps, qs))


def test_a_gradient_laid_out_unlike_its_parameter_is_stepped_right():
    """torch's fused kernel walks a gradient in its parameter's memory order: a transposed
    gradient must first take the parameter's layout (``grads_laid_out_as_params``)."""
    torch.manual_seed(0)
    p = torch.randn(40, 30, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    fused, loop = torch.optim.AdamW([p]), torch.optim.AdamW([q], foreach=False)
    assert fused_step(fused)
    for _ in range(2):
        g = torch.randn(30, 40).t()  # a transposed gradient
        p.grad, q.grad = g, g.clone()
        grads_laid_out_as_params(fused)
        assert p.grad.stride() == p.stride()
        fused.step()
        loop.step()
    assert _within_rounding(p, q)


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("why, make", [
    ("foreach chosen", lambda ps: torch.optim.AdamW(ps, foreach=True)),
    ("for-loop chosen", lambda ps: torch.optim.AdamW(ps, fused=False)),
    ("a subclass", lambda ps: _MyAdamW(ps)),
    ("another optimizer", lambda ps: torch.optim.Adagrad(ps)),
    ("bfloat16", lambda ps: torch.optim.AdamW([p.detach().bfloat16() for p in ps])),
    ("differentiable", lambda ps: torch.optim.AdamW(ps, differentiable=True)),
])
def test_a_choice_made_or_not_offered_is_kept(why, make):
    opt = make([torch.randn(4, 4, requires_grad=True)])
    before = [dict(g) for g in opt.param_groups]
    assert not fused_step(opt), why
    assert [dict(g) for g in opt.param_groups] == before, why


def test_an_optimizer_that_stepped_is_kept():
    p = torch.randn(4, requires_grad=True)
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    assert not fused_step(opt) and opt.param_groups[0]["fused"] is None


def test_the_memory_model_counts_temporaries_only_where_the_step_is_not_fused():
    model = OPTIMIZERS["adamw"]
    cpu = torch.device("cpu")
    f32 = [torch.empty(30, device="meta"), torch.empty(10, 10, device="meta")]
    assert optimizer_temporaries(f32, model, cpu) == 0
    bf16 = [t.to(torch.bfloat16) for t in f32]
    # the for-loop: two temporaries of a parameter while the previous one's denom is bound
    assert optimizer_temporaries(bf16, model, cpu) == 2 * 200 + 60


def test_a_for_loop_chosen_is_warned_about(caplog):
    plan, _ = _plan()
    with caplog.at_level(logging.WARNING, logger="shardfx.estimate.memory"):
        plan.runner(lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False))
    assert "fused" in caplog.text and "temporaries" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardfx.estimate.memory"):
        plan.runner(adamw)
    assert caplog.text == ""
