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
    noise: int = 0  # parameter elements left out after optimizer steps (see compare_training)

    def max(self) -> float:
        return max([*self.loss, *(e for e, _ in self.grad), *(e for e, _ in self.param)], default=0)

    def __str__(self) -> str:
        rows = [f"step {i}: loss {l:.2e}  grad {g:.2e} ({gn})  param {p:.2e} ({pn})"
                for i, (l, (g, gn), (p, pn)) in enumerate(zip(self.loss, self.grad, self.param))]
        return "\n".join(rows + [f"({self.noise} elements with zero true gradient not compared "
                                  "after optimizer steps)"] * bool(self.noise))


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
    The plan is built on the first batch; ``model`` itself is left untouched. Under
    ``shardfx.launch`` every rank runs both and compares full (gathered) tensors.

    One comparison is ill-posed and left out, visibly: elements whose true gradient is exactly
    zero (GPT-2's key bias: softmax ignores a constant shift) get rounding noise as gradient,
    and Adam rescales noise to full-size steps, so after an optimizer step those elements
    differ by design whenever the summation order differs (as it does across devices). The
    parameter comparison skips elements whose eager gradient was nonzero but below 1e-6 of the
    tensor's largest at some step; ``Report.noise`` counts them; gradients are compared in full.
    """
    import shardfx  # the package imports this module's users, not the other way round

    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt = optimizer(list(eager.parameters()))
    args0, targets0 = batches[0]
    plan = shardfx.partition(compiled, args0, loss_fn, targets0, **partition_kwargs)
    runner = plan.runner(optimizer=optimizer)
    report = Report()
    noise: dict[str, torch.Tensor] = {}
    for step, (args, targets) in enumerate(batches):
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = loss_fn(eager(*args), *targets)
        eager_loss.backward()
        eager_opt.step()
        loss = runner.step(args, targets)
        grads, state = runner.grads(), runner.state_dict()
        report.loss.append(rel_error(loss, eager_loss))
        expected = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
        missing = sorted(set(expected) ^ set(grads))
        assert not missing, f"step {step}: gradient present in one run only: {missing}"
        for n, g in expected.items():
            small = (g != 0) & (g.abs() <= 1e-6 * g.abs().max())  # exact zeros compare fine
            noise[n] = noise[n] | small if n in noise else small
        report.grad.append(max(((rel_error(grads[n], g), n) for n, g in expected.items()),
                               default=(0.0, "-")))
        report.param.append(max(
            ((rel_error(*_keep(state[n], p.detach().float(), noise.get(n))), n)
             for n, p in [*eager.named_parameters(), *eager.named_buffers()] if n in state),
            default=(0.0, "-")))
        report.noise = sum(int(m.sum()) for m in noise.values())
        assert report.max() < rtol, f"shardfx differs from eager (rtol {rtol}):\n{report}"
    return report


def _keep(a: torch.Tensor, b: torch.Tensor, skip: torch.Tensor | None):
    """``a`` and ``b`` without the elements ``skip`` marks."""
    if skip is None or not skip.any():
        return a, b
    return a[~skip], b[~skip]


def compare_inference(model: torch.nn.Module, args: tuple, rtol: float = 1e-5,
                      **partition_kwargs: Any) -> float:
    """Run ``model(*args)`` eagerly and through a shardfx inference plan; return the worst
    relative error over the output's tensors (asserting it is below ``rtol``)."""
    import shardfx
    import torch.utils._pytree as pytree

    expected = model(*args)
    plan = shardfx.partition(copy.deepcopy(model), args, **partition_kwargs)
    got = plan.runner().forward(args)
    if isinstance(got, Mapping):  # Hugging Face outputs: shardfx traces with use_cache=False
        expected = {k: expected[k] for k in got}
    pairs = list(zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)))
    assert pairs and len(pytree.tree_leaves(got)) == len(pytree.tree_leaves(expected))
    worst = max(rel_error(a, b) for a, b in pairs)
    assert worst < rtol, f"inference differs from eager: rel error {worst:.2e}"
    return worst
