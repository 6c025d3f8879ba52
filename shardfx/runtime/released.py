"""On CPU, a collective's wait also waits until gloo has let go of its buffer.

A gloo collective runs on one of its process group's worker threads, and that thread holds the
work, with its tensors, for a moment after it marks the work done: ``wait_tensor`` can return
while the worker still holds the result. When the program then drops its last reference first,
the worker is left to free the buffer, and it needs Python's GIL to do so: it frees it tens of
ops later, at a moment thread scheduling decides. A step's peak then varies from run to run by
a collective's buffer, above what the memory model (``shardfx.estimate.memory``) counts — the buffer's
last reader — and above a ``memory_budget`` the plan was fitted to (measured: a 32 KiB
all-reduce of a tp=2 Llama's activations alive through the next layer's attention, or through
the optimizer's step, in one step of three).

The worker does not always hold the result itself: gloo's all-gather holds views of it (one
chunk per rank), so "let go" is read off the result's storage, not its tensor. And it holds
the collective's input (an all-gather's or a reduce-scatter's flat bucket, which the program
drops when it issues the collective) until it lets go of the work; that input's last owner is
then the worker, which needs the GIL to free it, and may hold the result's views meanwhile
(measured: a ZeRO-3 bucket's input and gathered buffer, 73 KiB, alive a few dozen ops past
the wait, in two full runs of the test suite: exactly their sum above the model's peak).

``released(module)`` is the module the runners run on a CPU device: a copy whose waits return
once the worker has let go of the result's storage and of each input the program dropped at
the collective (the program is then their only owner; a few yields of the GIL per wait at
most: 0 in 83% of 2000 all-reduces, at most 4, measured when only the result tensor was
looked at), so a collective's buffers are freed where the program drops them, as the memory
model counts, on every run. On CUDA the module runs as it is: NCCL's wait is ordered on the
stream, and the host must not wait for the device.

The CPU copy also issues each all-gather through ``gather_alone``: it first waits for the
all-gather issued before it, if the program has not yet. Two functional
``all_gather_into_tensor`` in flight at once (ZeRO-3 prefetches the next bucket's gather before
it waits on this one) corrupt gloo's heap: that op runs gloo's coalesced all-gather. Measured on
4 gloo processes, torch 2.13, two of 32 B to 18 KiB in flight: ``malloc(): unaligned tcache
chunk detected`` within 3 to 17 s in every run; with one in flight, and with the functional
all-reduce and reduce-scatter two in flight, 60 s clean. (Gloo's coalesced all-gather has
aborted this way before: pytorch#65231.) Gloo's plain all-gather
(``all_gather_into_tensor_out``) ran clean with several in flight, but a process that used it
under torchrun aborted at exit ("terminate called without an active exception") in 1 of 20
runs on a loaded machine, so the op the program names is kept, one at a time.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.fx as fx

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_YIELDS = 10_000  # a bound, not a timeout that is ever expected: a few suffice (docstring)
_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wait_released(tensor: torch.Tensor, *inputs: weakref.ref | None) -> torch.Tensor:
    """``wait_tensor``, then the GIL yielded until no other owner (gloo's worker) holds the
    result or a view of it, and until each of ``inputs`` (weak references to the inputs the
    program dropped when it issued the collective, ``dropped_input``) is gone. A Python object
    holds its tensor once, however many names it has; a tensor only C++ holds keeps its Python
    object, and with it the weak reference, until C++ lets go."""
    out = _WAIT(tensor)
    for _ in range(_YIELDS):
        if not _held_elsewhere(out) and all(r is None or r() is None for r in inputs):
            break
        time.sleep(0)
    return out


def _held_elsewhere(out: torch.Tensor) -> bool:
    """Whether anything but the program's tensor holds ``out`` or its storage (the storage's
    count includes the tensor and the storage object asked for here)."""
    storage = out.untyped_storage()
    return out._use_count() > 1 or torch._C._storage_Use_Count(storage._cdata) > 2


def dropped_input(value) -> weakref.ref | None:
    """A weak reference to ``value`` if it is a tensor (a collective's input the program holds
    no longer), for ``wait_released`` to wait on."""
    return weakref.ref(value) if isinstance(value, torch.Tensor) else None


def gather_alone(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """``all_gather_into_tensor``, once the all-gather issued before it (if any) is done
    (module docstring); the program's own ``wait_tensor`` of that one then returns at once."""
    earlier = _gathering[0]() if _gathering else None
    if earlier is not None:
        _WAIT(earlier)
    out = _GATHER(tensor, group_size, group_name)
    _gathering[:] = [weakref.ref(out)]
    return out


_gathering: list = []  # a weak reference to the last all-gather issued


def released(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``module`` as the runner runs it on ``device``: on CPU, a copy (made once) whose
    ``wait_tensor`` calls are ``wait_released`` and whose all-gathers are ``gather_alone``;
    else ``module`` itself."""
    if device.type != "cpu" or not isinstance(module, fx.GraphModule):
        return module
    if module not in _copies:  # None: it waits for nothing (a weak key's value must not
        _copies[module] = _with_released_waits(module)  # hold the key)
    return _copies[module] or module


def _with_released_waits(module: fx.GraphModule) -> fx.GraphModule | None:
    if not any(n.target is _WAIT for n in module.graph.nodes):
        return None
    graph = fx.Graph()
    graph._codegen = module.graph._codegen
    graph.output(graph.graph_copy(module.graph, {}))
    for node in list(graph.nodes):
        if node.target is _WAIT:
            node.target = wait_released
            node.args = (*node.args, *_dropped_inputs(graph, node.args[0]))
    for node in graph.find_nodes(op="call_function", target=_GATHER):
        node.target = gather_alone
    return fx.GraphModule(module, graph, class_name=type(module).__name__)


def _dropped_inputs(graph: fx.Graph, collective) -> list[fx.Node]:
    """Weak references, made just after ``collective``, to the inputs it is the only reader
    of: the program drops them there, the worker holds them until it lets go of the work.
    (The program's inputs are held by its caller.)"""
    if not isinstance(collective, fx.Node):
        return []
    refs = []
    for node in collective.all_input_nodes:
        if set(node.users) == {collective} and node.op != "placeholder":
            with graph.inserting_after(collective):
                refs.append(graph.call_function(dropped_input, (node,)))
    return refs
