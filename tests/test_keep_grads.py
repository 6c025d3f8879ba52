"""Gradients live until the optimizer step: both runners free each parameter's ``.grad`` after
it, as ``zero_grad(set_to_none=True)`` would, unless asked (``plan.runner(keep_grads=True)``);
``runner.grads()`` on a runner that frees them is a named error."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.errors import InputError

from models import lm_loss, tiny, token_batches


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _grads_after_a_step(mesh: dict, options: dict) -> tuple[list, list, str]:
    """On every rank: the .grad of each trained tensor after a step, freed and kept, and the
    error runner.grads() gives when they are freed."""
    out = []
    for keep in (False, True):
        (x,), (y,) = token_batches(1, 4)[0]
        plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh=mesh, **options)
        runner = plan.runner(sgd, keep_grads=keep)
        runner.step((x,), (y,))
        out.append([p.grad is not None for p in runner.parameters()])
        if keep:
            assert runner.grads()  # the full gradients, gathered
        else:
            with pytest.raises(InputError) as info:
                runner.grads()
            message = str(info.value)
    return out[0], out[1], message


def _check(results) -> None:
    for freed, kept, message in results:
        assert kept and all(kept), kept
        assert not any(freed), freed
        assert "keep_grads=True" in message and "runner.grads()" in message


def test_one_device():
    _check([_grads_after_a_step({}, {})])


def test_pipeline_and_dp():
    _check(shardfx.launch(_grads_after_a_step, {"pp": 2}, {"microbatches": 2},
                          nprocs=2, timeout=120, deadline=300))
    _check(shardfx.launch(_grads_after_a_step, {"dp": 2}, {"zero": 2},
                          nprocs=2, timeout=120, deadline=300))
