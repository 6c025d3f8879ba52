"""The bytes a graph's values own, and which values share storage: a view, a wait on a
collective, an op updating its input in place, or an element of an op's result that the op
says is one of its inputs (``ALIASES``) all use the storage of another value."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from shardfx.cost.node import is_view, node_bytes
from shardfx.ir import meta as M

_WAIT = torch.ops._c10d_functional.wait_tensor.default  # returns the tensor it waits for


def value_bytes(node: fx.Node) -> int:
    """Bytes of the storage a value owns: a view owns none; an element of a multi-output op's
    result (``getitem(native_layer_norm(...), 1)``) owns its own tensor, the op's tuple none."""
    if node.op != "call_function" or node.target is _WAIT:  # a wait returns its input
        return 0
    if node.target is operator.getitem and not aliases_input(node.args[0]):
        val = node.meta.get(M.VAL)
        return tensor_bytes(val)
    if isinstance(node.meta.get(M.VAL), (tuple, list)):
        return 0  # its elements (getitem) own the bytes
    return node_bytes(node)


def aliases_input(node) -> bool:
    """Does ``node``'s value (or each element of it) alias an input?"""
    return isinstance(node, fx.Node) and node.op == "call_function" and is_view(node)


def bases(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """View -> the node that owns its storage. An element of a multi-output op's result owns
    its own, but a second ``getitem`` of the same element (``auto.remat`` reads an element
    again in the backward) is the first one's tensor, an in-place op's result is the tensor
    it updated (``codegen.accumulate_into``'s ``addmm_``), and an op may say that an element
    of its result is one of its inputs, updated in place (``ALIASES``: output index ->
    argument index; ``kernels.linear_ce``)."""
    base: dict[fx.Node, fx.Node] = {}
    element: dict[tuple[fx.Node, object], fx.Node] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not node.all_input_nodes:
            continue
        if node.target is operator.getitem and not aliases_input(node.args[0]):
            src = element_alias(node, element)
            if src is not None:
                base[node] = base.get(src, src)
            continue
        if is_view(node) or node.target is _WAIT or writes_input(node):
            src = node.all_input_nodes[0]  # an in-place op returns its first argument
            base[node] = base.get(src, src)
    return base


ALIASES = "aliases"  # an op's attribute: {output index: argument index} it returns in place


def element_alias(item: fx.Node, first: dict) -> fx.Node | None:
    """The node whose tensor ``getitem`` node ``item`` returns, when it is not a tensor of
    its own (see ``bases``); ``first`` maps (producer, index) to its first getitem."""
    producer, index = item.args[0], item.args[1]
    arg = getattr(producer.target, ALIASES, {}).get(index)
    if arg is not None and isinstance(producer.args[arg], fx.Node):
        return producer.args[arg]
    seen = first.get((producer, index))
    if seen is None:
        first[(producer, index)] = item
    return seen


def readers(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` and of the views of it."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            out.append(u)
            if u.op == "call_function" and is_view(u) and u.all_input_nodes[0] is n:
                stack.append(u)
    return out


def is_collective(node: fx.Node) -> bool:
    ns = getattr(node.target, "namespace", None) or getattr(
        getattr(node.target, "_schema", None), "name", "").split("::")[0]
    return ns in ("_c10d_functional", "c10d_functional", "c10d")


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def writes_input(node: fx.Node) -> bool:
    """Does ``node`` return an argument it updated in place (an ``add_``, an ``out=``)?"""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and r.alias_info.is_write
                                      for r in schema.returns)
