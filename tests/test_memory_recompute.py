"""Recomputation under mixed precision: the recomputed copies run in the backward, where
remat put them, so the predicted and measured peaks fall as they do in fp32 (the published
configurations, bench/published.py, recompute in bf16 and fp16)."""

from __future__ import annotations

import pytest

import shardfx
from shardfx.ir import meta as M
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw

from models import lm_loss, tiny, token_batches

LAYERS, ROWS = 4, 16


def planned(name: str, policy: str, **kw) -> shardfx.Plan:
    (x,), (y,) = token_batches(1, ROWS)[0]
    return shardfx.partition(tiny(name, LAYERS), (x,), lm_loss, (y,), recompute=policy, **kw)


@pytest.mark.parametrize("name", ["llama", "nanogpt"])
def test_full_recompute_in_bf16_recomputes_in_the_backward(name):
    """No recomputed copy before the forward's last op: the casts' views left without readers
    are gone (``mixed_precision``), not taken by remat for backward readers in the forward."""
    plan = planned(name, "full", precision="bf16")
    nodes = list(plan.ir.graph.nodes)
    end = max(i for i, n in enumerate(nodes) if n.meta.get(M.PHASE) is M.Phase.FORWARD)
    early = [n.name for n in nodes[:end] if M.REMAT in n.meta]
    assert not early, early
    assert not [n.name for n in nodes if n.op == "call_function" and not n.users]
    none = max(planned(name, "none", precision="bf16").memory_estimate().values())
    assert max(plan.memory_estimate().values()) < none


def test_full_recompute_in_bf16_peak_is_as_measured():
    plan = planned("llama", "full", precision="bf16")
    batches = token_batches(2, ROWS)
    runner = plan.runner(adamw)
    runner.step(*batches[0])
    (x,), (y,) = batches[1]
    measured = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y).total \
        - x.nbytes - y.nbytes
    assert abs(plan.memory_estimate()[0] - measured) <= 0.05 * measured, \
        (plan.memory_estimate()[0], measured)
