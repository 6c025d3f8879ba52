"""Small helpers to edit the IR while keeping every node's ``meta["val"]`` filled in."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from shardfx.ir import meta as M


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode the graph's values were traced under."""
    for node in graph.nodes:
        val = node.meta.get(M.VAL)
        if isinstance(val, FakeTensor):
            return val.fake_mode
    raise ValueError("graph has no FakeTensor values; was it captured by shardfx?")


def insert_op(graph: fx.Graph, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> fx.Node:
    """Insert ``op(*args)`` at the graph's current insertion point, with its FakeTensor value."""
    node = graph.call_function(op, args, kwargs)
    vals = pytree.tree_map_only(fx.Node, lambda n: n.meta[M.VAL], (args, kwargs))
    with fake_mode_of(graph):
        node.meta[M.VAL] = op(*vals[0], **vals[1])
    return node


def op_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The call_function nodes, in program order."""
    return [n for n in graph.nodes if n.op == "call_function"]
