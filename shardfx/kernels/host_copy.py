"""Activation offload's copies: a value to host memory after its last forward reader
(``to_host``), and back to the device before its first backward reader (``from_host``).

Host memory is a pool of its own: a storage made or written under ``on_host()`` is the
host's, so ``runtime.measure`` counts it apart from the device's (on a CPU, where host and
"device" are one memory, the split is still measured; ``runtime.offload`` makes the offloaded
optimizer's tensors there too). The memory model (``estimate.memory``) counts what ``to_host``
returns as the host's (``to_host.on_host``), until ``from_host`` last reads it.

On CUDA both copies run on one copy stream per device, beside the kernels: ``to_host`` into
pinned memory once the compute stream has made the value (``record_stream`` keeps the
device's memory from being reused before the copy has read it); ``from_host`` on the same
stream (so after the value's copy out), into memory the compute stream then owns, which waits
for the copy where the program calls it: the program issues it one block ahead of its first
reader (``auto.remat``'s prefetch point), while the device still runs the kernels queued
before it. On a CPU both are plain copies.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_HOST: contextvars.ContextVar[bool] = contextvars.ContextVar("on_host", default=False)
_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


@contextlib.contextmanager
def on_host():
    """Within: every storage made or written is the host's (module docstring)."""
    token = _HOST.set(True)
    try:
        yield
    finally:
        _HOST.reset(token)


def in_host_pool() -> bool:
    """Whether storages made now are the host's (``on_host``)."""
    return _HOST.get()


def to_host(value: torch.Tensor) -> torch.Tensor:
    """A host copy of ``value`` (module docstring)."""
    if value.device.type != "cuda":
        with on_host():
            return value.clone()
    stream = _copy_stream(value.device)
    stream.wait_stream(torch.cuda.current_stream(value.device))
    with on_host():  # its strides where they are dense, else contiguous (as clone's)
        out = torch.empty_like(value, device="cpu", pin_memory=True)
    with torch.cuda.stream(stream):
        out.copy_(value, non_blocking=True)
    value.record_stream(stream)
    out.shardfx_device = value.device  # where from_host brings it back
    return out


def from_host(value: torch.Tensor) -> torch.Tensor:
    """``to_host``'s copy back on the device (module docstring)."""
    device = getattr(value, "shardfx_device", None)
    if device is None:
        return value.clone()
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        out = value.to(device, non_blocking=True)
    compute = torch.cuda.current_stream(device)
    out.record_stream(compute)
    compute.wait_stream(stream)
    return out


to_host.on_host = True  # the memory model: its result is the host's


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
