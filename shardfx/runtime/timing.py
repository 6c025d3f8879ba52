"""When a rank's actions ran, on the device's own clock.

On the CPU an action's span is the host's ``perf_counter`` around it. On CUDA the host only
queues kernels, so its clock says when work was launched, not when it ran: the span is a pair
of CUDA events recorded on the current stream around the action, read back after the step
(``seconds``) and placed on the host's clock through an event recorded at the step's start.
A receive's ``wait`` makes the stream (not the host) wait on NCCL, so the start event runs
once the data is there: a span is compute only, waiting is idle time, on both devices.
"""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0, self._e0 = 0.0, None

    def start(self) -> None:
        """The step starts: the origin that CUDA events are measured from."""
        self._t0 = time.perf_counter()
        if self.cuda:
            self._e0 = self.now()

    def now(self):
        """A mark of this moment in the device's work: a time, or a recorded CUDA event."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """A mark as seconds on the host's clock (on CUDA, once the event has run)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self._t0 + self._e0.elapsed_time(mark) / 1e3
