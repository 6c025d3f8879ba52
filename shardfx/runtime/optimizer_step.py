"""The end of a training step, on every rank: unscale, measure the gradients, clip, step.

Both runners call ``finish_step`` once a step's gradients are final (summed over its
microbatches and accumulated batches, reduced over dp):

1. with loss scaling, the gradients are divided by the scale and checked for inf/nan on every
   rank (``runtime.loss_scale``);
2. with ``clip_grad_norm`` set, the global L2 norm of the gradients is measured (``global_norm``)
   and, when it exceeds the limit, every gradient is multiplied by ``limit / (norm + 1e-6)``, as
   ``torch.nn.utils.clip_grad_norm_`` does on one device;
3. the optimizer steps, unless a rank overflowed;
4. the gradients go (``release``), as ``zero_grad(set_to_none=True)`` after the step would:
   they are not held between steps (through the next forward, where the activations peak)
   unless the runner was asked to keep them (``plan.runner(keep_grads=True)``, for
   ``runner.grads()`` or ``p.grad``).

The global norm is one device's: the norm of the whole gradients, however they are cut. Each
rank adds the squares of the gradient elements it *counts*: a tensor sharded over a mesh axis
is counted on every rank of that axis (each holds other elements), a tensor replicated over an
axis only on that axis' rank 0 (the others hold the same elements), ZeRO's rows on every dp
rank (their padding rows are zeros), a pipeline's gradients on the stage that owns them. One
all-reduce of a float64 over every process sums them: the square of the norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.cost.optimizer import grads_laid_out_as_params
from shardfx.errors import InputError
from shardfx.kernels.device import collective_device
from shardfx.runtime.loss_scale import LossScaler

WHERE = "plan.runner(..., clip_grad_norm=...)"


@dataclass
class Grad:
    """A gradient this rank holds and whether it counts it in the global norm."""

    tensor: torch.Tensor
    counted: bool


def counted(placements, axes, coord: dict[str, int], rows_over: str | None = None) -> bool:
    """Whether this rank counts a tensor laid out by ``placements`` (one per mesh axis of
    ``axes``, (name, size) pairs) in the global norm: it does unless it is not the first rank
    of an axis the tensor is replicated over. ``rows_over``: an axis over which the tensor is
    ZeRO's rows (sharded, whatever its placement says)."""
    placements = tuple(placements) + (None,) * (len(axes) - len(placements))  # () replicates
    return all(axis == rows_over or isinstance(p, (Shard, _StridedShard))
               or coord.get(axis, 0) == 0
               for (axis, _), p in zip(axes, placements))


def global_norm(grads: list[Grad]) -> float:
    """The L2 norm of the whole gradients over every process (module docstring)."""
    squares = torch.zeros(1, dtype=torch.float64, device=collective_device())
    mine = [g.tensor for g in grads if g.counted and g.tensor.numel()]
    if mine:
        low = [t for t in mine if t.dtype.itemsize < 4]  # their norms in fp32: bf16 rounds
        high = [t for t in mine if t.dtype.itemsize >= 4]
        norms = [*(torch._foreach_norm(low, 2, dtype=torch.float32) if low else ()),
                 *(torch._foreach_norm(high) if high else ())]
        squares[0] = torch.stack([n.double() for n in norms]).square().sum().to(squares.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squares)
    return math.sqrt(squares.item())  # inf or nan when a gradient is


def clip_limit(value: float | None) -> float | None:
    """``clip_grad_norm`` checked: None (off) or a positive number (``inf``: measure only)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InputError(f"clip_grad_norm must be a positive number or None, got {value!r}",
                         where=WHERE, fix="clip_grad_norm=1.0 clips the global gradient norm "
                         "to 1; float('inf') only measures it; None does neither")
    return float(value)


def release(params, keep: bool) -> None:
    """Drop each parameter's ``.grad`` after the optimizer step, unless ``keep``."""
    if not keep:
        for p in params:
            p.grad = None


def check_kept(keep: bool) -> None:
    """``runner.grads()`` on a runner that frees its gradients after each step: a named error."""
    if not keep:
        raise InputError("the runner frees each step's gradients after its optimizer step, so "
                         "there are none to return", where="runner.grads()",
                         fix="plan.runner(..., keep_grads=True) keeps the last step's "
                             "gradients (in .grad and for runner.grads())")


def finish_step(optimizer: torch.optim.Optimizer | None, scaler: LossScaler | None,
                grads: list[Grad], limit: float | None) -> float | None:
    """Unscale, measure and clip ``grads`` (this rank's), then step the optimizer unless some
    rank overflowed; returns the global norm before clipping (None when not measured)."""
    tensors = [g.tensor for g in grads]
    if scaler is not None:
        found_inf = scaler.unscale(tensors)
        scaler.update(found_inf)
        if found_inf:
            return float("inf") if limit is not None else None
    norm = None
    if limit is not None:
        norm = global_norm(grads)
        coefficient = limit / (norm + 1e-6)
        if coefficient < 1.0 and tensors:
            torch._foreach_mul_(tensors, coefficient)
    if optimizer is not None:
        grads_laid_out_as_params(optimizer)
        optimizer.step()
    return norm
