"""Checks a runner makes on what the user hands it at run time.

- ``make_optimizer``: the ``optimizer`` argument of ``plan.runner`` is a factory that, given the
  parameters this rank trains (its own shards on a mesh), returns an optimizer that steps them.
  An optimizer instance, a factory that raises, returns ``None`` or an optimizer of other
  tensors (``model.parameters()`` instead of the ones given: on a mesh the program never reads
  those) is an ``InputError``, not parameters that silently never change. An Adam, AdamW or
  SGD that leaves ``foreach`` and ``fused`` unset then steps with torch's fused kernel
  (``cost.optimizer.fused_step``).
- ``SameBatch``: every rank passes the same global batch to ``runner.step`` and takes its own
  slice of it. Ranks that load or shuffle data differently would train on a batch no single
  device ever saw. Each rank sums each input three ways (plainly, weighted by row and by
  column, so reordered rows count too) and the ranks gather those few float64s: on the first
  step, and on every step in debug mode (``SHARDFX_DEBUG=1``).
- ``same_plan``: every rank made the same plan. Each rank plans on its own; a plan that
  depended on something only some ranks see would issue collectives of other kinds or sizes
  than its peers', which gloo meets with a crash or a hang, not an error. The ranks gather a
  fingerprint of the plan's collectives (kind, axis, bytes, in order) and its ZeRO stage once,
  when the runner is made.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from shardfx.cost.optimizer import fused_step
from shardfx.errors import InputError, ShardfxError
from shardfx.ir import meta as M
from shardfx.kernels.device import collective_device
from shardfx.partitioner.constants import describe

if TYPE_CHECKING:
    from shardfx.plan import Plan

WHERE = "plan.runner(optimizer=...)"
EXAMPLE = "plan.runner(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))"
RTOL = 1e-9  # of a checksum's scale: far above float64 summation-order noise, far below data


def make_optimizer(factory: Callable | None, params: list[torch.nn.Parameter]) -> Any:
    """``factory(params)``, checked; None without a factory or without parameters to train."""
    if factory is None:
        return None
    if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
        instance = " (an optimizer instance)" if isinstance(factory, torch.optim.Optimizer) else ""
        raise InputError(
            f"optimizer must be a function from parameters to an optimizer, got "
            f"{type(factory).__name__}{instance}",
            where=WHERE, fix=f"pass a factory: the runner calls it with the parameters it "
            f"trains (on a mesh, this rank's shards), e.g. {EXAMPLE}")
    if not params:
        return None
    try:
        optimizer = factory(params)
    except ShardfxError:
        raise
    except Exception as e:
        raise InputError(f"the optimizer factory raised {type(e).__name__}: {e}",
                         where=f"{WHERE}, called with a list of {len(params)} parameters",
                         fix=f"make it build an optimizer of the parameters it is given, e.g. "
                             f"{EXAMPLE}") from e
    if not callable(getattr(optimizer, "step", None)):
        got = "None" if optimizer is None else type(optimizer).__name__
        raise InputError(
            f"the optimizer factory returned {got}, not an optimizer: the parameters would "
            "never change", where=WHERE,
            fix=f"return the optimizer (a def needs a return statement), e.g. {EXAMPLE}")
    held = {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]}
    if held and not held & {id(p) for p in params}:
        raise InputError(
            "the optimizer steps none of the parameters it was given; on a mesh the runner "
            "trains its own shards, so the tensors it steps would never be read",
            where=WHERE, fix=f"build the optimizer from the factory's argument, e.g. {EXAMPLE}")
    fused_step(optimizer)
    return optimizer


def same_plan(plan: "Plan") -> None:
    """Raise the same ``ShardfxError`` on every rank when the ranks' plans differ (see the
    module docstring). Collective: call it on every rank of the plan's mesh."""
    if plan.mesh.size == 1 or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    collectives = [(c.kind, c.axis, c.nbytes) for c in plan.collectives]
    digest = hashlib.sha256(repr((collectives, plan.options.zero)).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "little"), len(collectives),
                         int(plan.options.zero)], dtype=torch.int64, device=collective_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    every = [t.cpu().tolist() for t in every]
    others = [r for r, facts in enumerate(every) if facts != every[0]]
    if others:
        said = "; ".join(f"rank {r}: {n} collectives, zero={z}"
                         for r, (_, n, z) in enumerate(every) if r in [0, *others])
        raise ShardfxError(
            f"the ranks planned different programs: rank{'s' * (len(others) > 1)} "
            f"{', '.join(map(str, others))} would issue other collectives than rank 0 ({said})",
            where="plan.runner()",
            fix="plan the same model, example batch and options on every rank; a choice that "
                "depends on the rank's machine (a device model file present on some hosts) "
                "must be the same everywhere: pass device_model= explicitly")


class SameBatch:
    """Called with a step's flat inputs on every rank: raises the same InputError on every rank
    when ranks passed different global batches (see the module docstring)."""

    def __init__(self, plan: "Plan"):
        self.names = plan.input_names
        self.debug = plan.options.debug
        self.spans_ranks = plan.mesh.size > 1
        self.checked = False

    def __call__(self, flat: list[torch.Tensor]) -> None:
        if not self.spans_ranks or (self.checked and not self.debug):
            return
        self.checked = True
        mine = torch.stack([_checksum(t).cpu() for t in flat])  # (inputs, 4)
        mine = mine.to(collective_device())  # NCCL's collectives take GPU tensors
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        for i, name in enumerate(self.names):
            first = every[0][i].cpu()
            others = [r for r, sums in enumerate(every) if not _same(first, sums[i].cpu())]
            if others:
                raise InputError(
                    f"ranks passed different global batches: {name} on rank"
                    f"{'s' * (len(others) > 1)} {', '.join(map(str, others))} differs from "
                    "rank 0's", where=f"runner.step, {name}",
                    fix="pass the same global batch on every rank (each takes its own slice): "
                        "load and shuffle data with the same seed everywhere, or build the "
                        "batch on one rank and broadcast it")


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Sum, row-weighted sum, column-weighted sum and sum of magnitudes (the scale), float64."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    x = x.reshape(x.shape[0] if x.dim() else 1, -1)
    f64 = torch.float64
    rows, cols = x.sum(1, dtype=f64), x.sum(0, dtype=f64)
    return torch.stack([
        rows.sum(),
        rows @ torch.arange(1, rows.numel() + 1, dtype=f64, device=x.device),
        cols @ torch.arange(1, cols.numel() + 1, dtype=f64, device=x.device),
        x.abs().sum(dtype=f64) * max(x.shape)]).cpu()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = RTOL * max(float(a[-1]), float(b[-1]))
    close = ((a - b).abs() <= tol) | (a == b) | (a.isnan() & b.isnan())
    return bool(close.all())


def check_step_inputs(plan: "Plan", args: Any, targets: Any, inference: bool = False
                  ) -> list[torch.Tensor]:
    """Flatten a step's inputs, checking them against what the plan was captured with:
    structure, then each tensor's shape, dtype and device (the plan's, or the CPU), and that
    a training step has a training plan."""
    where = "runner.forward" if inference else "runner.step"
    if not inference and plan.mode is not M.Mode.TRAIN:
        raise InputError("this plan was built for inference (no loss_fn)",
                         where=where, fix="call partition(..., loss_fn=...) to "
                         "train, or use runner.forward(args)")
    want_args, want_targets = plan.captured.in_spec.children()
    _check_structure("args", args, want_args, where)
    if not inference:
        _check_structure("targets", targets, want_targets, where)
    leaves = [s for s in plan.captured.leaves
              if not (inference and s.name.startswith("targets"))]
    flat = pytree.tree_leaves((args, () if inference else targets))
    for t, s in zip(flat, leaves):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != s.shape or t.dtype != s.dtype:
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(
                f"{s.name} is {got}; the plan was built for {list(s.shape)} {s.dtype}",
                where=s.name,
                fix="shapes are static: call partition() again with example inputs of this "
                "shape (or pad/batch your data to the planned shape)")
        if t.device != plan.device and t.device.type != "cpu":  # the runner moves CPU ones
            raise InputError(
                f"{s.name} is on {t.device}; the plan runs on {plan.device}",
                where=f"{where}, {s.name}",
                fix=f"pass CPU tensors (each rank moves its slice) or tensors on "
                    f"{plan.device}: x.to({str(plan.device)!r})")
    return flat

def _check_structure(what: str, value: Any, want: pytree.TreeSpec, where: str) -> None:
    """``value`` (a step's args or targets) is structured as the example was, or an
    InputError says how, in plain words."""
    example = f"{where}((x,))" if where == "runner.forward" else f"{where}((x,), (y,))"
    if not isinstance(value, tuple):
        raise InputError(f"{what} must be a tuple, got {describe(value)}",
                         where=f"{where}, {what}",
                         fix=f"wrap a single tensor in a tuple: {example}")
    spec = pytree.tree_flatten(value)[1]
    if spec == want:
        return
    if what == "targets" and value == ():
        n = want.num_leaves
        raise InputError(
            f"targets missing: the plan was built with {n} example target{'s' * (n > 1)} "
            f"{_structure(want)}", where=f"{where}, targets",
            fix=f"pass the targets loss_fn takes, as partition's example_targets: {example}")
    raise InputError(
        f"{what} are structured as {_structure(spec)}; the plan was built with "
        f"{_structure(want)}", where=f"{where}, {what}",
        fix=f"pass {what} as the same tuples/lists/dicts of tensors as the example {what}")


def _structure(spec: pytree.TreeSpec) -> str:
    """A pytree structure in Python's own notation: ``(Tensor, [Tensor], {'mask': Tensor})``."""
    if spec.is_leaf():
        return "Tensor"
    kids = [_structure(c) for c in spec.children()]
    if spec.type is tuple:
        return f"({', '.join(kids)}{',' if len(kids) == 1 else ''})"
    if spec.type is list:
        return f"[{', '.join(kids)}]"
    if spec.type is dict:
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(spec.context, kids)) + "}"
    return f"{getattr(spec.type, '__name__', spec.type)}({', '.join(kids)})"
