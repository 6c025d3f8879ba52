"""Differential checking: a shardfx plan against the same model run eagerly on one device.

``compare_training`` trains two copies of a model from the same initial weights on the same
batches, one eagerly and one through ``shardfx.partition(...).runner(...)``, and after every step
compares the loss, every gradient and every updated parameter by relative error
``||a - b|| / ||b||``. It is what the test suite uses, and what a user can run on their own model
before trusting a plan.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


@dataclass
class Report:
    """Worst relative errors seen, per step; ``worst`` names the tensor."""

    loss: list[float] = field(default_factory=list)
    grad: list[tuple[float, str]] = field(default_factory=list)
    param: list[tuple[float, str]] = field(default_factory=list)  # parameters and buffers

    def max(self) -> float:
        return max([*self.loss, *(e for e, _ in self.grad), *(e for e, _ in self.param)], default=0)

    def __str__(self) -> str:
        rows = [f"step {i}: loss {l:.2e}  grad {g:.2e} ({gn})  param {p:.2e} ({pn})"
                for i, (l, (g, gn), (p, pn)) in enumerate(zip(self.loss, self.grad, self.param))]
        return "\n".join(rows)


def compare_training(
    model: torch.nn.Module,
    batches: list[tuple[tuple, tuple]],
    loss_fn: Callable[..., torch.Tensor],
    optimizer: OptimizerFactory = adamw,
    rtol: float = 1e-5,
    **partition_kwargs: Any,
) -> Report:
    """Train ``model`` eagerly and through shardfx on ``batches`` ((args, targets) per step).

    Raises AssertionError naming the step and tensor if any relative error reaches ``rtol``.
    The plan is built on the first batch; ``model`` itself is left untouched.
    """
    import shardfx  # the package imports this module's users, not the other way round

    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt = optimizer(list(eager.parameters()))
    args0, targets0 = batches[0]
    plan = shardfx.partition(compiled, args0, loss_fn, targets0, **partition_kwargs)
    runner = plan.runner(optimizer=optimizer)
    report = Report()
    for step, (args, targets) in enumerate(batches):
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = loss_fn(eager(*args), *targets)
        eager_loss.backward()
        eager_opt.step()
        loss = runner.step(args, targets)
        report.loss.append(rel_error(loss, eager_loss))
        ours = dict(compiled.named_parameters())
        missing = [n for n, p in eager.named_parameters() if (p.grad is None) != (ours[n].grad is None)]
        assert not missing, f"step {step}: gradient present in one run only: {missing}"
        grads = [(rel_error(ours[n].grad, p.grad), n) for n, p in eager.named_parameters()
                 if p.grad is not None]
        state = dict(compiled.named_buffers()) | ours
        params = [(rel_error(state[n], p.float()), n) for n, p in
                  [*eager.named_parameters(), *eager.named_buffers()]]
        report.grad.append(max(grads, default=(0.0, "-")))
        report.param.append(max(params, default=(0.0, "-")))
        assert report.max() < rtol, f"shardfx differs from eager (rtol {rtol}):\n{report}"
    return report


def compare_inference(model: torch.nn.Module, args: tuple, rtol: float = 1e-5) -> float:
    """Run ``model(*args)`` eagerly and through a shardfx inference plan; return the worst
    relative error over the output's tensors (asserting it is below ``rtol``)."""
    import shardfx
    import torch.utils._pytree as pytree

    expected = model(*args)
    plan = shardfx.partition(copy.deepcopy(model), args)
    got = plan.runner().forward(args)
    if isinstance(got, Mapping):  # Hugging Face outputs: shardfx traces with use_cache=False
        expected = {k: expected[k] for k in got}
    pairs = list(zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)))
    assert pairs and len(pytree.tree_leaves(got)) == len(pytree.tree_leaves(expected))
    worst = max(rel_error(a, b) for a, b in pairs)
    assert worst < rtol, f"inference differs from eager: rel error {worst:.2e}"
    return worst
