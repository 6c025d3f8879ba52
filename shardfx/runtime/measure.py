"""Measured memory: the peak of live tensor storage while a step runs, independently of the
plan's own estimate (``Plan.memory_estimate``), which it is there to check.

``measured_peak`` runs a function under a ``TorchDispatchMode`` that sees every op's outputs:
each tensor storage it has not seen is counted from then until Python frees it (a weak
reference's callback, on whatever thread frees it, queues it; the measuring thread takes it
off before its next count). The tensors that exist before the run (the runner's weights, their
gradients, the optimizer's state, the batch) are counted from the start, so the peak is what a
device holds at the fullest moment of the step. Any code that runs ops counts: a plan's program,
the pipeline runner's receive buffers and gradient accumulation, the optimizer's step. Storages
are counted at their size in bytes, as a caching allocator would hand them out before rounding;
on a GPU ``torch.cuda.max_memory_allocated`` measures the same thing plus that rounding.

``mark(name)``, called inside the run, records the peak so far in ``Peak.marks``: shardfx's
runners mark ``"fwd+bwd"`` between the program and the optimizer's step, so a step whose peak
is in the optimizer's update still shows what forward and backward held.

Host memory (``runtime.offload``: an offloaded optimizer's state, its step, what it steps;
``kernels.host_copy``: offloaded activations) is counted apart: a storage made under
``kernels.host_copy.on_host()``, or registered as the host's, counts in
``Peak.host`` and not in ``total``, so a CPU run, where host and "device" are one memory,
still measures the device's peak and the host's each on its own, as a GPU's would be.

``through_compile=True`` lets ``torch.compile``'d code run compiled under the tracker: a
dispatch mode that does not say ``ignore_compile_internals`` makes torch.compile fall back to
eager (and keep skipping the frame), which would measure the eager step instead. Compiled
graphs are seen op by op only with a backend that runs eager kernels (``aot_eager``); inductor's
kernels allocate outside the dispatcher, so their buffers are missed.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from shardfx.kernels.host_copy import in_host_pool


@dataclass(frozen=True)
class Peak:
    """Bytes of live tensor storage at the peak of a run."""

    total: int
    existing: int  # of which: the tensors registered before the run, still live then
    after: int  # live when the run returned
    marks: dict[str, int] = field(default_factory=dict)  # mark(name) -> the peak so far then
    backend: int = 0  # allocated_peak: the collective backend's threads' own peak, not in total
    host: int = 0  # the host's own peak (on_host; offload), not in total
    host_existing: int = 0  # of which: the host's tensors registered before the run


class _Storages(TorchDispatchMode):
    """Live storage bytes, and their peak, of every storage registered, made or written by an
    op. A DTensor counts as its local tensor (its wrapper's ``untyped_storage()`` has the whole
    tensor's size); a storage counts at its current size, resizes followed (``_following``:
    FSDP2 frees and brings back unsharded parameters with ``untyped_storage().resize_``); a
    storage an op writes (``Tensor(a!)`` in its schema) counts from then, as one it returns
    does (FSDP2's ``split_with_sizes_copy(..., out=[...])`` returns nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.host_live = self.host_peak = 0  # the host's storages (on_host), apart
        self._host: set[int] = set()
        self._seen: dict[int, weakref.ref] = {}
        self._bytes: dict[int, int] = {}  # storage -> the bytes it is counted at now
        self._existing: set[int] = set()
        self._dead: collections.deque[int] = collections.deque()  # freed, not yet counted
        self.marks: dict[str, int] = {}

    def add(self, t: torch.Tensor, existing: bool = False, host: bool = False) -> None:
        t = getattr(t, "_local_tensor", t) if type(t).__name__ == "DTensor" else t
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        self.settle()  # a freed storage's address may be this one's
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        self._bytes[key] = storage.nbytes()
        self._seen[key] = weakref.ref(storage, lambda _, k=key: self._dead.append(k))
        if existing:
            self._existing.add(key)
        if host or in_host_pool():
            self._host.add(key)
        self._count(key, self._bytes[key])

    def _count(self, key: int, change: int) -> None:
        if key in self._host:
            self.host_live += change
            self.host_peak = max(self.host_peak, self.host_live)
        else:
            self.live += change
            self.peak = max(self.peak, self.live)

    def resized(self, storage) -> None:
        self.settle()
        key = storage._cdata
        if key in self._bytes:
            change = storage.nbytes() - self._bytes[key]
            self._bytes[key] = storage.nbytes()
            self._count(key, change)

    def settle(self) -> None:
        """Count the storages freed since: before every count that can raise the peak, so
        ``live`` is exact where it is compared. A storage can be freed on any thread (gloo's
        worker drops a collective's buffers when it lets go of the work), so its weak
        reference's callback only queues it (a deque's append is atomic); an update of
        ``live`` there could interleave with this thread's and be lost, and the peak with it."""
        while self._dead:
            key = self._dead.popleft()
            self._seen.pop(key, None)
            self._existing.discard(key)
            self._count(key, -self._bytes.pop(key, 0))
            self._host.discard(key)

    def existing_bytes(self, host: bool = False) -> int:
        self.settle()
        return sum(self._seen[k]().nbytes() for k in self._existing
                   if (k in self._host) == host and self._seen[k]() is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            self.add(t)
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in pytree.tree_leaves(kwargs.get(arg.name, args[i] if i < len(args)
                                                       else None)):
                    self.add(t)
        return out


@contextlib.contextmanager
def _following(tracker: _Storages):
    """Within: every storage resize is told to ``tracker``."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        tracker.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


class _StoragesThroughCompile(_Storages):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def measured_peak(run: Callable[[], Any], *existing: Any, through_compile: bool = False) -> Peak:
    """The peak of live tensor storage while ``run()`` runs. ``existing``: tensors, modules
    (their parameters, buffers and gradients), optimizers (their state and parameters),
    runners (their parameters and gradients, their optimizer) that live before the run.
    ``through_compile``: let torch.compile'd code in ``run`` run compiled (module docstring)."""
    tracker = _StoragesThroughCompile() if through_compile else _Storages()
    _register(tracker, existing)  # in a call of its own: no reference outlives it
    start, host = tracker.existing_bytes(), tracker.existing_bytes(host=True)
    with tracker, _following(tracker):
        run()
    tracker.settle()
    return Peak(total=tracker.peak, existing=start, after=tracker.live, marks=tracker.marks,
                host=tracker.host_peak, host_existing=host)


def allocated_peak(run: Callable[[], Any], *existing: Any) -> Peak:
    """The peak of bytes the CPU allocator holds for the program while ``run()`` runs, above
    what it held before, plus the storage of ``existing`` (as ``measured_peak`` takes them):
    every allocation made on the calling thread counts, by an op or by code that calls the
    allocator directly, as the C++ code Inductor generates for a compiled program does
    (``measured_peak`` misses those buffers). Read off ``torch.profiler``'s allocation events,
    in the order they happened; bytes as asked for (no allocator rounding on CPU). No
    ``marks``.

    Allocations made on other threads are the collective backend's own: gloo's worker thread
    gathers into a scratch copy of the output before it copies it out, which NCCL does not,
    and whether that copy is alive at the program's peak depends on the thread's timing (on a
    dp=2 ZeRO-3 Llama, one copy of 37,120 B moved the whole-process peak by 0 or 5.3% from one
    step to the next, the ATen program's as the compiled one's).
    They are left out of ``total`` wherever they are freed, and their own peak is
    ``Peak.backend``. A tensor the program allocated counts until it is freed, on whatever
    thread: a collective's input that gloo's thread lets go of after the wait returns counts
    that long."""
    from torch._C._profiler import _EventType

    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in _tensors(existing)}
    start = sum(storages.values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        with torch.profiler.record_function(_RUN):
            run()
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    caller = next(n.start_tid for n in nodes if n.name == _RUN)
    events = sorted((n.start_time_ns, n.start_tid, n.extra_fields.ptr, n.extra_fields.alloc_size)
                    for n in nodes if n.tag == _EventType.Allocation
                    and n.extra_fields.device.type == "cpu")
    backends: set[int] = set()  # addresses the backend's threads allocated, still live
    live = peak = backend = backend_peak = 0
    for _, tid, ptr, change in events:
        if change > 0 and tid != caller:
            backends.add(ptr)
        if ptr in backends:
            backend += change
            backend_peak = max(backend_peak, backend)
            if change < 0:
                backends.discard(ptr)
            continue
        live += change
        peak = max(peak, live)
    return Peak(total=start + peak, existing=start, after=start + live, backend=backend_peak)


_RUN = "shardfx.allocated_peak"


def _walk(nodes) -> Iterator:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def mark(name: str) -> None:
    """Inside ``measured_peak``'s run: record the peak so far as ``Peak.marks[name]``. Outside
    one it does nothing (and costs a look at the dispatch mode stack)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _Storages):
            mode.marks[name] = mode.peak


def _register(tracker: _Storages, existing: tuple) -> None:
    host = _host_tensors(existing)
    for t in host:
        tracker.add(t, existing=True, host=True)
    for t in _tensors(existing):
        tracker.add(t, existing=True)  # (the host's already seen: not counted again)


def _host_tensors(things: tuple) -> list[torch.Tensor]:
    """The host's tensors of the runners among ``things`` (``runtime.offload``): what their
    optimizers step, its gradients, the optimizer's state."""
    out = []
    for thing in things:
        if (offload := getattr(thing, "offload", None)) is not None:
            out += _tensors((list(offload.masters.values()),
                             *([thing.optimizer] if thing.optimizer is not None else [])))
    return out


def _tensors(things: tuple) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for thing in things:
        if isinstance(thing, torch.Tensor):
            out.append(thing)
        elif isinstance(thing, torch.optim.Optimizer):
            for group in thing.param_groups:
                out += _tensors(tuple(group["params"]))
            out += [v for s in thing.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
        elif isinstance(thing, torch.nn.Module):
            out += _tensors(tuple(thing.parameters())) + list(thing.buffers())
        elif hasattr(thing, "parameters") and hasattr(thing, "optimizer"):  # a shardfx runner
            out += _tensors(tuple(getattr(thing, "device_parameters", thing.parameters)()))
            out += list(getattr(thing, "_buffers", {}).values())
            if thing.optimizer is not None:
                out += _tensors((thing.optimizer,))
        elif isinstance(thing, (list, tuple)):
            out += _tensors(tuple(thing))
        else:
            raise TypeError(f"measured_peak: cannot find tensors in {type(thing).__name__}")
    for t in list(out):
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            out.append(t.grad)
    return out
