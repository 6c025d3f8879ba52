"""Gradient accumulation (``runner.step_batches``) and clipping by the global norm
(``plan.runner(clip_grad_norm=...)``): equal to one device by ``shardfx.testing`` on every
mesh, with the clip engaged, the norm measured over every shard (tp, pp, dp, ZeRO's rows)."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.errors import InputError
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches

CLIP = 0.5  # below every tiny model's gradient norm: the clip engages at every step


def _train(cases: list[tuple]) -> list[tuple]:
    """On every rank: each (model, mesh, options) trained two steps of two batches each,
    clipped; the largest error beyond the rule and the last norm before clipping."""
    out = []
    for name, mesh, options in cases:
        shard = "megatron" if "tp" in mesh else "replicate"
        rows = 8 if "microbatches" in options else 4
        report = compare_training(tiny(name), token_batches(4, rows), lm_loss, mesh=mesh,
                                  shard=shard, accumulate=2, clip_grad_norm=CLIP, **options)
        out.append((f"{name} {mesh} {options}", report.max(), report.runner.grad_norm))
    return out


def _check(results: list[list[tuple]]) -> None:
    for rank in results:
        for label, err, norm in rank:
            assert err < 1e-5, (label, err)
            assert norm > CLIP, (label, norm)  # the clip did something
    assert results[0] == results[-1]  # every rank measured the same norm


def test_one_device():
    _check([_train([("llama", {}, {}), ("gpt2", {}, {})])])


def test_two_ranks():
    _check(shardfx.launch(_train, [
        ("gpt2", {"dp": 2}, {}), ("llama", {"tp": 2}, {}),
        ("llama", {"pp": 2}, {"microbatches": 2}),
    ], nprocs=2, timeout=120, deadline=600))


def test_four_ranks():
    _check(shardfx.launch(_train, [
        ("llama", {"dp": 2, "tp": 2}, {}),
        ("gpt2", {"pp": 2, "tp": 2}, {"microbatches": 2}),
        ("llama", {"dp": 2, "pp": 2}, {"microbatches": 2, "zero": 1}),
        ("gpt2", {"dp": 4}, {"zero": 2}),
        ("mixtral", {"dp": 2, "tp": 2}, {"zero": 3}),
    ], nprocs=4, timeout=120, deadline=900))


def test_bad_input_is_named():
    (x,), (y,) = token_batches(1, 4)[0]
    plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,))
    with pytest.raises(InputError, match="clip_grad_norm"):
        plan.runner(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), clip_grad_norm=-1.0)
    runner = plan.runner(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(InputError, match="no batches"):
        runner.step_batches([])
    with pytest.raises(InputError, match="batch 1 is Tensor"):
        runner.step_batches([((x,), (y,)), x])
