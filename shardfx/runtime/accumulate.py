"""Gradient accumulation: one optimizer step over the gradients of several batches.

``runner.step_batches([(args, targets), ...])`` runs each batch's forward and backward in
turn (each a whole global batch of the plan's shapes, cut over the mesh as ``runner.step``
cuts one), adds their gradients, and steps once, as an eager loop that calls
``(loss_fn(...) / k).backward()`` on each of k batches and then ``optimizer.step()``: the
backward of each starts from ``1/k`` (times the loss scale), so the gradients are those of the
mean of the batches' losses, and the step returns that mean. ``runner.step(args, targets)`` is
``step_batches`` of one batch. Each batch draws its own dropout masks (the RNG input's third
entry is the batch's index in the step). On dp, each batch's gradients are reduced as the
program reduces them; the sum of the reductions is the reduction of the sum.

A plan made with ``microbatches=m`` and no pp axis traces one slice of the batch (``m`` of
them make ``example_args``) and accumulates the same way inside every step: each batch runs as
``m`` slices of its rows (``slices``), whose losses make the batch's as the loss makes them
(their mean, or their sum: ``Options.loss_reduction``), each slice drawing the random values
of its rows' places in the batch (the RNG input's third entry: batch index x m + slice), so
the step is one device's on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch

from shardfx.errors import InputError

WHERE = "runner.step_batches(batches)"
FIX = "pass a list of (args, targets) pairs, one per batch, each shaped as the plan's example"


def accumulated(batches: Any) -> list[tuple[tuple, tuple]]:
    """``batches`` as a list of (args, targets) pairs, checked."""
    try:
        batches = list(batches)
    except TypeError:
        raise InputError(f"batches must be an iterable of (args, targets), got "
                         f"{type(batches).__name__}", where=WHERE, fix=FIX) from None
    if not batches:
        raise InputError("no batches to step on", where=WHERE, fix=FIX)
    for i, b in enumerate(batches):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise InputError(f"batch {i} is {type(b).__name__}, not an (args, targets) pair",
                             where=f"{WHERE}, batch {i}", fix=FIX)
    return [(tuple(a) if isinstance(a, list) else a, tuple(t) if isinstance(t, list) else t)
            for a, t in batches]


def mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The step's loss: one batch's as the program gave it, or the mean of several."""
    return losses[0].detach() if len(losses) == 1 else torch.stack([v.detach() for v in losses]).mean()


def sum_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """A batch's loss from its slices' where the loss sums over rows."""
    return losses[0].detach() if len(losses) == 1 else torch.stack([v.detach() for v in losses]).sum()


def slices(flat: list[torch.Tensor], m: int) -> list[list[torch.Tensor]]:
    """A batch's flat inputs as ``m`` slices of its rows (dim 0), in order."""
    if m == 1:
        return [flat]
    parts = [t.chunk(m) for t in flat]
    return [[p[k] for p in parts] for k in range(m)]
