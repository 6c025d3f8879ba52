"""Small helpers to edit the IR while keeping every node's ``meta["val"]`` filled in."""

from __future__ import annotations

import operator
import re
import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from shardfx.ir import meta as M


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode the graph's values were traced under."""
    for node in graph.nodes:
        val = node.meta.get(M.VAL)
        if isinstance(val, FakeTensor):
            return val.fake_mode
    raise ValueError("graph has no FakeTensor values; was it captured by shardfx?")


def right_after(node: fx.Node):
    """Insert where ``node``'s value has just been made: right after it; for an input, at the
    end, before the output (code never goes between inputs, and what is inserted for one
    input follows what was inserted for the inputs before it)."""
    graph = node.graph
    return graph.inserting_before(graph.output_node() if node.op == "placeholder" else node.next)


def insert_op(graph: fx.Graph, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> fx.Node:
    """Insert ``op(*args)`` at the graph's current insertion point, with its FakeTensor value."""
    node = graph.call_function(op, args, kwargs)
    node.meta[M.VAL] = fake_value(fake_mode_of(graph), op, args, kwargs)
    return node


_VALUES: "weakref.WeakKeyDictionary[FakeTensorMode, dict]" = weakref.WeakKeyDictionary()


def fake_value(mode: FakeTensorMode, op: Any, args: tuple, kwargs: dict) -> Any:
    """``op``'s FakeTensor value on the values of the nodes in ``args``/``kwargs``, under
    ``mode``. Remembered per mode by what determines it (the op, each operand's shape, strides,
    offset, dtype and device, the other arguments): a graph of 80 identical layers runs each
    distinct op through fake dispatch once, not 80 times. Values are shared between nodes and
    must not be mutated."""
    vals = map_nodes((args, kwargs), lambda n: n.meta[M.VAL])
    key = (op, hashable(vals))
    try:
        hash(key)
    except TypeError:  # an argument we cannot key: compute it
        key = None
    memo = _VALUES.setdefault(mode, {})
    if key is None or key not in memo:
        with mode:
            value = op(*vals[0], **vals[1])
        if key is None:
            return value
        memo[key] = value
    return memo[key]


def hashable(x: Any) -> Any:
    """``x`` as a key: nested tuples, lists and dicts as tuples tagged with their type, a tensor
    as its layout (shape, strides, offset, dtype, device), anything else as (its type's name,
    itself), so ``1``, ``1.0`` and ``True`` differ. ``hash`` of the result raises TypeError
    when a leaf is unhashable."""
    if isinstance(x, torch.Tensor):
        return ("t", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(hashable(v) for v in x))
    if isinstance(x, dict):
        return ("d", *((k, hashable(v)) for k, v in x.items()))
    return (type(x).__name__, x)


def tensor_val(n: Any) -> torch.Tensor | None:
    """``n``'s FakeTensor value, or None (not a node, no value, or a tuple of values)."""
    v = n.meta.get(M.VAL) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def inherit_place(src: fx.Node, dst: fx.Node) -> None:
    """``dst``, made to stand for or beside ``src``, goes where ``src`` is: its PHASE, STAGE
    and module (``nn_module_stack``, which names the repeated block)."""
    dst.meta.update({k: src.meta[k] for k in (M.PHASE, M.STAGE, "nn_module_stack")
                     if k in src.meta})


def phases(graph: fx.Graph) -> dict[fx.Node, M.Phase]:
    """Each node's PHASE; a node without one (inserted by codegen: a collective, a reshape)
    takes the phase of the node before it."""
    out, current = {}, M.Phase.FORWARD
    for node in graph.nodes:
        current = node.meta.get(M.PHASE, current)
        out[node] = current
    return out


def arg_values(node: fx.Node) -> list:
    """``node``'s positional arguments, each node as its value (VAL), others as they are: what
    a program op's ``workspace``, ``flops`` or ``sends`` take."""
    return [a.meta.get(M.VAL) if isinstance(a, fx.Node) else a for a in node.args]


def is_getitem(node: fx.Node) -> bool:
    """``node`` takes one element of a multi-output op's result."""
    return node.op == "call_function" and node.target is operator.getitem


def operands(node: fx.Node) -> list[fx.Node]:
    """The nodes among ``node``'s arguments, in argument order (positional, then keyword), one
    entry per use: the order a rule's per-operand answers come in."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def map_nodes(x: Any, fn) -> Any:
    """``x`` (nested tuples, lists, dicts) with every node ``n`` in it replaced by ``fn(n)``;
    fx's own walk, many times faster than pytree's on big graphs."""
    return fx.node.map_arg(x, fn)


def op_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The call_function nodes, in program order."""
    return [n for n in graph.nodes if n.op == "call_function"]


def placeholder_name(role: M.InputRole) -> str:
    """A placeholder's name: its role's name as an identifier (``model.layers.0.mlp.weight`` ->
    ``model_layers_0_mlp_weight``, ``args[0]`` -> ``args_0``)."""
    if role.kind is M.InputKind.TANGENT:
        return "tangent_loss"
    return re.sub(r"\W", "_", role.name.replace("[", "_").replace("]", "")).strip("_")


def copy_ir(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` to rewrite on its own: new nodes with the same names, each with its own
    ``meta`` dict (whose values, FakeTensors included, are shared), and the graph's meta."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {})).meta = dict(gm.graph.output_node().meta)
    out = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    return out
