"""Memory: the plan's estimate against the peak of live tensor storage measured while a real
step runs (``shardfx.measure``)."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.measure import measured_peak
from shardfx.testing import adamw

from models import lm_loss, tiny, token_batches

MIB = 1 << 20


def test_measured_peak_counts_what_is_live_at_once():
    """Three 1 MiB tensors made one after another, the first freed before the third, then a
    sum: 2 MiB and the 4-byte sum at the peak, on top of a 1 MiB tensor that existed before."""
    before = torch.zeros(MIB // 4)

    def run():
        a = torch.ones(MIB // 4)
        b = a * 2
        del a
        c = b + 1
        return c.sum()

    peak = measured_peak(run, before)
    assert peak.activations == 2 * MIB + 4
    assert peak.other == MIB
    assert peak.total == 3 * MIB + 4


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_one_device_estimate_is_the_measured_peak(name):
    """Parameters, gradients and peak activations as the plan predicts them, against a step's
    measured peak. The estimate leaves the optimizer's state out (it is the optimizer's): it
    is taken out of the measured peak here."""
    batches = token_batches(3, batch=8)
    model = tiny(name)
    plan = shardfx.partition(model, *batches[0][:1], lm_loss, batches[0][1])
    runner = plan.runner(adamw)
    runner.step(*batches[0])  # the optimizer's state exists from here on
    (x,), (y,) = batches[1]
    peak = measured_peak(lambda: runner.step((x,), (y,)), model, runner.optimizer, x, y)
    measured = peak.total - peak.optimizer - peak.other  # the batch is the caller's
    predicted = plan.memory_estimate()[0]
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured, peak)
