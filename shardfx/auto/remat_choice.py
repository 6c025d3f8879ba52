"""remat_choice: ``auto.remat``'s choice applied to the IR (recomputed copies in the backward,
offload marks), undone, and named by module for ``print(plan)``.

Requires: what ``auto.remat`` requires; flags from its ``Problem``.
Ensures:  ``apply`` leaves the IR as ``auto.remat``'s module docstring says (each recomputed
          value copied right before its first backward reader, ``REMAT`` naming the original;
          each offloaded value marked ``OFFLOAD`` with the op before which it comes back);
          ``undo`` removes both again.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import numpy as np
import torch.fx as fx

from shardfx.auto.remat import Choice, Problem, local_bytes, recompute_seconds
from shardfx.cost.device_model import model_of
from shardfx.cost.node import is_view
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.ir.text import block_pattern, module_of, origin
from shardfx.passes.stage_cut import block_of_path


def apply(gm: fx.GraphModule, problem: Problem, keep: np.ndarray, again: np.ndarray,
          off: np.ndarray | None = None, recompile: bool = True) -> Choice:
    """Copy the values chosen for recomputation into the backward, and mark those chosen for
    offload (``OFFLOAD``: the op before which the backward brings it back; see the module
    docstring). ``recompile=False``: ``gm``'s Python code is left as it was (a trial's
    ``undo`` follows; code generation reads the graph)."""
    graph = gm.graph
    var = problem.var
    redo = {n for n in problem.forward if again[var[n]] and not keep[var[n]]}
    away = [] if off is None else [n for n in problem.forward if off[var[n]]
                                   and not keep[var[n]] and not again[var[n]]]
    if redo:
        _sink_views(graph, redo)
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(node: fx.Node, before: fx.Node) -> fx.Node:
        if node in copies:
            return copies[node]
        args = {u: copy_of(u, before) if u in redo else u for u in node.all_input_nodes}
        with graph.inserting_before(before):
            new = graph.node_copy(node, lambda a: args[a])
        new.meta = dict(node.meta)
        new.meta[M.PHASE] = M.Phase.BACKWARD
        new.meta[M.REMAT] = node.name
        copies[node] = new
        return new

    for node in list(op_nodes(graph)):
        if node.meta[M.PHASE] is not M.Phase.BACKWARD or M.REMAT in node.meta:
            continue
        reads = [a for a in node.all_input_nodes if a in redo]
        if reads:
            mapping = {a: copy_of(a, node) for a in reads}
            node.args = fx.node.map_arg(node.args, lambda a: mapping.get(a, a))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda a: mapping.get(a, a))
    if away:
        point = _prefetch_points(graph)
        for node in away:
            readers = [u for u in node.users if u in point]
            if readers:  # (one no backward op reads has nothing to come back for)
                node.meta[M.OFFLOAD] = point[min(readers, key=lambda u: point[u][1])][0].name
    graph.lint()
    if recompile:
        gm.recompile()
    flops = sum(c.meta[M.COST].flops for c in copies.values())
    seconds = sum(recompute_seconds(c, model_of(gm)) for c in copies.values())
    axes = gm.meta[M.GRAPH].mesh
    return Choice(tuple(n.name for n in copies), flops, seconds, {}, {},
                  tuple(n.name for n in away), sum(local_bytes(n, axes) for n in away))


def _prefetch_points(graph: fx.Graph) -> dict[fx.Node, tuple[fx.Node, int]]:
    """For each backward op: (where a value it is the first to read comes back from the host,
    its position). One block ahead: the first op of the backward of the block before its own
    (``model.layers.4`` for an op of ``model.layers.3``'s backward), the backward's first op
    for the block the backward starts in, so the copy runs while the device computes."""
    out: dict[fx.Node, tuple[fx.Node, int]] = {}
    block, start, before = None, None, None
    for i, node in enumerate(op_nodes(graph)):
        if node.meta.get(M.PHASE) is not M.Phase.BACKWARD:
            continue
        if start is None:
            start = node
        name = block_of_path(module_of(node))  # (a backward op: its forward's module)
        if name is not None and name != block:
            block, before, start = name, start, node
        out[node] = (before or start, i)
    return out


def _sink_views(graph: fx.Graph, redo: set[fx.Node]) -> None:
    """Move each backward view (a transpose, a ``detach`` of a saved value) and each backward
    element of a recomputed result (attention's logsumexp) to just before its first reader.
    The joint graph may take them early, even in the forward, and a recomputed value is made
    just before its first backward reader: one taken early would recompute a block long
    before its backward and keep it until then. (An element of a result that is not
    recomputed stays: moving it would keep the whole result.)"""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.meta.get(M.PHASE) is not M.Phase.BACKWARD:
            continue
        element = node.target is operator.getitem
        if not node.users or (element and node.args[0] not in redo) or \
                (not element and not is_view(node)):
            continue
        first = min(node.users, key=lambda u: order[u])
        if first.op == "call_function" and order[first] > order[node] + 1:
            first.prepend(node)
            order[node] = order[first] - 0.5


def undo(gm: fx.GraphModule, recompile: bool = True) -> None:
    """Remove every recomputed copy (its readers read the original again) and every offload
    mark."""
    graph = gm.graph
    for node in graph.nodes:
        node.meta.pop(M.OFFLOAD, None)
    by_name = {n.name: n for n in graph.nodes}
    copies = [n for n in graph.nodes if M.REMAT in n.meta]
    for node in copies:
        node.replace_all_uses_with(by_name[node.meta[M.REMAT]])
    for node in reversed(copies):
        graph.erase_node(node)
    if recompile:
        gm.recompile()


def module_rows(gm: fx.GraphModule, names: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """The ops ``names`` by the module that runs them (``ir.text.origin``), a repeated block's
    index as ``*``, most ops first: (module, ops per block, blocks, bytes on one device)."""
    wanted, ops, blocks, size = set(names), defaultdict(int), defaultdict(set), defaultdict(int)
    axes = gm.meta[M.GRAPH].mesh
    for node in gm.graph.nodes:
        if node.name in wanted:
            path = origin(node).split(" ")[0] or "(no module)"
            key = block_pattern(path)
            ops[key] += 1
            blocks[key].add(path)
            size[key] += local_bytes(node, axes)
    return [(k, ops[k] // len(blocks[k]), len(blocks[k]), size[k])
            for k in sorted(ops, key=lambda k: -ops[k])]


def by_module(gm: fx.GraphModule, names: tuple[str, ...], most: int = 8) -> str:
    """``module_rows`` as text: "model.layers.*.mlp.act_fn (1 op x 8 blocks), ..."."""
    rows = module_rows(gm, names)
    text = ", ".join(f"{k} ({n} op{'s' * (n > 1)}" + (f" x {b} blocks)" if b > 1 else ")")
                     for k, n, b, _ in rows[:most])
    return text + (f", and {len(rows) - most} more modules" if len(rows) > most else "")


def group_name(group) -> str:
    return f"pp rank {group}" if isinstance(group, int) else str(group)
