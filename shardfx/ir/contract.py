"""A pass's contract as code: what it needs of the graph before it runs (``requires``) and what
it leaves (``ensures``), each a condition with the words that say it. The pass manager checks
them around every pass in debug runs (``SHARDFX_DEBUG=1``, ``partition(..., debug=True)``); the
words are the ones docs/architecture.md's pass table shows (a test compares them).

    @contract(requires=[on_ops(M.VAL)], ensures=[on_ops(M.PHASE)])
    def assign_phase(gm, options): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

from shardfx.errors import VerifyError


@dataclass(frozen=True)
class Condition:
    words: str  # "PHASE on every op"
    key: str  # the meta key it is about (what the docs' table names)
    failing: Callable[[Any], str | None]  # None where it holds, else where it does not

    def __str__(self) -> str:
        return self.words


def on_ops(key: str, name: str | None = None) -> Condition:
    """``key`` in the meta of every op (call_function node)."""
    def failing(gm: fx.GraphModule) -> str | None:
        node = next((n for n in gm.graph.nodes if n.op == "call_function" and key not in n.meta),
                    None)
        return None if node is None else node.format_node()
    return Condition(f"{name or key} on every op", name or key, failing)


def on_inputs(key: str, name: str | None = None, tensors_only: bool = True) -> Condition:
    """``key`` in the meta of every placeholder (of those holding a tensor)."""
    def failing(gm: fx.GraphModule) -> str | None:
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if key not in node.meta and (not tensors_only or hasattr(val, "shape")):
                return node.format_node()
        return None
    return Condition(f"{name or key} on every {'tensor ' if tensors_only else ''}input",
                     name or key, failing)


def on_output(key: str, name: str | None = None) -> Condition:
    """``key`` in the output node's meta."""
    def failing(gm: fx.GraphModule) -> str | None:
        return None if key in gm.graph.output_node().meta else "the output node"
    return Condition(f"{name or key} on the output", name or key, failing)


def on_graph(key: str, name: str | None = None) -> Condition:
    """``key`` in the graph module's meta."""
    def failing(gm: fx.GraphModule) -> str | None:
        return None if key in gm.meta else "gm.meta"
    return Condition(f"{name or key} on the graph", name or key, failing)


def holds(words: str, key: str, test: Callable[[Any], str | None]) -> Condition:
    """Any other condition: ``test(graph or program)`` returns None where it holds."""
    return Condition(words, key, test)


def contract(requires: list[Condition] = (), ensures: list[Condition] = ()):
    """Mark a pass with its contract (``requires``, ``ensures`` attributes)."""
    def mark(fn):
        fn.requires, fn.ensures = tuple(requires), tuple(ensures)
        return fn
    return mark


def check(fn, subject, which: str) -> None:
    """``fn``'s ``requires`` (before it ran) or ``ensures`` (after) on ``subject`` (a graph
    module or a program); a VerifyError naming the pass, the condition and where it fails."""
    for condition in getattr(fn, which, ()):
        where = condition.failing(subject)
        if where is not None:
            moment = "before it runs" if which == "requires" else "after it ran"
            raise VerifyError(f"{fn.__name__} {which} {condition.words}, which does not hold "
                              f"{moment}", where=where,
                              fix="a pass before it broke the contract, or the pass's own "
                                  "contract is wrong")
