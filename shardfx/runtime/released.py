"""On CPU, a collective's wait also waits until gloo has let go of its buffer.

A gloo collective runs on one of its process group's worker threads, and that thread holds the
work, with its tensors, for a moment after it marks the work done: ``wait_tensor`` can return
while the worker still holds the result. When the program then drops its last reference first,
the worker is left to free the buffer, and it needs Python's GIL to do so: it frees it tens of
ops later, at a moment thread scheduling decides. A step's peak then varies from run to run by
a collective's buffer, above what the memory model (``shardfx.memory``) counts — the buffer's
last reader — and above a ``memory_budget`` the plan was fitted to (measured: a 32 KiB
all-reduce of a tp=2 Llama's activations alive through the next layer's attention, or through
the optimizer's step, in one step of three).

``released(module)`` is the module the runners run on a CPU device: a copy whose waits return
once the worker has let go (the tensor's only owner is then the program; about one yield of the
GIL per wait at most, measured: 0 yields in 83% of 2000 all-reduces, at most 4), so a
collective's buffer is freed where the program drops it, as the memory model counts, on every
run. On CUDA the module runs as it is: NCCL's wait is ordered on the stream, and the host must
not wait for the device.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.fx as fx

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_YIELDS = 10_000  # a bound, not a timeout that is ever expected: a few suffice (docstring)
_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wait_released(tensor: torch.Tensor) -> torch.Tensor:
    """``wait_tensor``, then the GIL yielded until no other owner (gloo's worker) holds the
    tensor. A Python object holds its tensor once, however many names it has."""
    out = _WAIT(tensor)
    for _ in range(_YIELDS):
        if out._use_count() <= 1:
            break
        time.sleep(0)
    return out


def released(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``module`` as the runner runs it on ``device``: on CPU, a copy (made once) whose
    ``wait_tensor`` calls are ``wait_released``; else ``module`` itself."""
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
    for node in graph.nodes:
        if node.target is _WAIT:
            node.target = wait_released
    return fx.GraphModule(module, graph, class_name=type(module).__name__)
