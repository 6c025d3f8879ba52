"""The differential checker can fail: a slightly wrong shardfx run is caught and named.

``compare_training`` is what every other test trusts, so it is tested against runs we break on
purpose. The break goes into the shardfx side only: ``Plan.runner`` is wrapped so the runner's
optimizer gets a step pre-hook that perturbs one parameter's gradient (or the runner's loss is
nudged) while the eager copy trains untouched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.testing import compare_training


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def batches(n: int) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(2, 4, generator=g),), (torch.randn(2, 3, generator=g),))
            for _ in range(n)]


def break_runner_grads(monkeypatch, name: str, edit) -> None:
    """Make every runner call ``edit(param)`` on parameter ``name`` before its optimizer steps."""
    runner = shardfx.Plan.runner

    def patched(plan, optimizer=None):
        def factory(params):
            opt = optimizer(params)
            param = dict(plan.model.named_parameters())[name]
            opt.register_step_pre_hook(lambda *_: edit(param))
            return opt

        return runner(plan, factory)

    monkeypatch.setattr(shardfx.Plan, "runner", patched)


def test_unbroken_run_passes():
    report = compare_training(mlp(), batches(2), F.mse_loss)
    assert report.max() < 1e-5 and len(report.loss) == 2


@pytest.mark.parametrize("name", ["0.weight", "2.bias"])
def test_perturbed_gradient_is_caught(monkeypatch, name):
    def perturb(p):
        p.grad.view(-1)[0] += 1e-3

    break_runner_grads(monkeypatch, name, perturb)
    with pytest.raises(AssertionError, match="shardfx differs from eager") as info:
        compare_training(mlp(), batches(3), F.mse_loss)
    msg = str(info.value)
    assert "grad" in msg and f"({name})" in msg, msg
    assert "step 0:" in msg and "step 1:" not in msg, "caught at the first step: " + msg


def test_missing_gradient_is_caught(monkeypatch):
    def drop(p):
        p.grad = None

    break_runner_grads(monkeypatch, "2.weight", drop)
    with pytest.raises(AssertionError, match=r"gradient present in one run only: \['2.weight'\]"):
        compare_training(mlp(), batches(2), F.mse_loss)


def test_wrong_loss_is_caught(monkeypatch):
    step = shardfx.Runner.step
    monkeypatch.setattr(shardfx.Runner, "step", lambda self, *a: step(self, *a) * (1 + 1e-4))
    with pytest.raises(AssertionError, match=r"step 0: loss 1\.0\de-04"):
        compare_training(mlp(), batches(2), F.mse_loss)
