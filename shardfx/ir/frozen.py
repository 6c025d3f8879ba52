"""A graph as it stood after a pass, kept so its text can be rendered later, when asked.

``plan.dump`` writes the IR after every pass; rendering all of them as planning goes was a
quarter of an 80-layer plan's time (8 texts of 19k lines each), for a dump most plans never
write. ``freeze`` keeps instead what the text is made of: each node's name, op, target,
operands and a shallow copy of its meta. That is enough because passes replace what they
change rather than mutate it in place: an fx node's operands are a new tuple after every
rewrite, and shardfx's meta values are frozen dataclasses (``compiler.manager.changes`` compares
them by identity for the same reason). ``ir_to_text`` reads a ``FrozenGraph`` as it reads a
``GraphModule``.

A node whose name, operands and meta values are all the ones the previous freeze held is that
freeze's node again (a pass that annotates a few nodes costs a few nodes' copies to keep).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx


class FrozenNode:
    """One node as it stood: what ``ir.text.node_line`` reads of an ``fx.Node``."""

    __slots__ = ("name", "op", "target", "args", "kwargs", "meta")

    def __init__(self, node: fx.Node):
        self.name, self.op, self.target = node.name, node.op, node.target
        self.args, self.kwargs, self.meta = node.args, node.kwargs, dict(node.meta)

    def same(self, node: fx.Node) -> bool:
        """Whether ``node`` still is what this one kept (identity of every part)."""
        if self.args is not node.args or self.kwargs is not node.kwargs \
                or self.target is not node.target or len(self.meta) != len(node.meta):
            return False
        kept = self.meta
        return all(kept.get(k, kept) is v for k, v in node.meta.items())


class FrozenGraph:
    """A graph module as it stood: ``.meta`` and ``.graph.nodes``, as ``ir_to_text`` reads."""

    def __init__(self, gm: fx.GraphModule, previous: FrozenGraph | None = None):
        old = previous.by_name if previous is not None else {}
        nodes = []
        for node in gm.graph.nodes:
            kept = old.get(node.name)
            nodes.append(kept if kept is not None and kept.same(node) else FrozenNode(node))
        self.nodes: list[FrozenNode] = nodes
        self.by_name = {n.name: n for n in nodes}
        self.meta: dict[str, Any] = dict(gm.meta)

    @property
    def graph(self) -> FrozenGraph:  # gm.graph.nodes, as on a GraphModule
        return self


def freeze(gm: fx.GraphModule, previous: FrozenGraph | None = None) -> FrozenGraph:
    """``gm`` as it stands now, sharing with ``previous`` the nodes it still holds unchanged."""
    return FrozenGraph(gm, previous)
