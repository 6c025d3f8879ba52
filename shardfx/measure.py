"""Measured memory: the peak of live tensor storage while a step runs, independently of the
plan's own estimate (``Plan.memory_estimate``), which it is there to check.

``measured_peak`` runs a function under torch's ``MemTracker`` (a ``TorchDispatchMode`` that
follows every tensor storage created or read inside it, and frees it when its last reference
goes), with the tensors that exist before it (the model, the optimizer's state, the batch)
registered first. On a GPU, ``torch.cuda.max_memory_allocated`` measures the same thing plus
the allocator's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Peak:
    """Bytes of live tensor storage at the peak of a run, by what holds them."""

    parameters: int
    buffers: int
    gradients: int
    activations: int  # every other tensor the run made: saved values, temporaries
    optimizer: int  # the optimizer's state (Adam's moments, its step counts)
    other: int  # tensors registered before the run that are none of the above (the batch)

    @property
    def total(self) -> int:
        return (self.parameters + self.buffers + self.gradients + self.activations
                + self.optimizer + self.other)


def measured_peak(run: Callable[[], Any], *existing: Any,
                  device: torch.device | str = "cpu") -> Peak:
    """The peak while ``run()`` runs on ``device``. ``existing``: modules, optimizers and
    tensors that live before the run and count towards its peak."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()
    tracker.track_external(*existing)
    with tracker:
        run()
    snap = tracker.get_tracker_snapshot("peak").get(torch.device(device), {})
    kind = {k: snap.get(k, 0) for k in _MemRefType}
    return Peak(parameters=kind[_MemRefType.PARAM], buffers=kind[_MemRefType.BUFFER],
                gradients=kind[_MemRefType.GRAD],
                activations=kind[_MemRefType.ACT] + kind[_MemRefType.TEMP],
                optimizer=kind[_MemRefType.OPT], other=kind[_MemRefType.OTH])
