"""fusion: the memory-bound ops between the matmuls, grouped into one Triton kernel each.

Requires: a per-device program's graph (``codegen``): ``meta["val"]`` on every node, local
          shapes, collectives as ops of their own; PHASE where the IR had it.
Ensures:  every group of two or more ops ``codegen.triton_ops`` computes (pointwise ops, casts,
          reductions over the last dimension keeping it, softmax and log-softmax and their
          backward) that share one iteration shape ``S`` is one call_function node whose target
          is a ``FusedKernel``, returning a tuple of the values read outside the group, each
          read through ``operator.getitem`` (with the VAL, PHASE and STAGE of the op it stands
          for); the group's other values are never materialized. A group never takes in a
          collective or an op of the other phase (forward vs backward), and its kernel runs
          where its last op ran: an op joins a group only if no op outside the group reads a
          member before it. ``graph.meta``-free: the groups are returned, in program order.

Rows: the kernels (``codegen.triton``) hold one row of ``S`` (its last dimension) per Triton
program, so a value of a group is either full (``S``) or one value per row (``S[:-1] + [1]``,
what a reduction over the last dimension leaves); an operand from outside may be anything that
broadcasts to one of the two. RMSNorm as Hugging Face writes it (``pow``, ``mean``, ``add``,
``rsqrt``, ``mul``, ``mul``) is one group; so are SwiGLU's ``silu`` and ``mul``, a residual add
with the cast before it, the softmax of eager attention, and LayerNorm with the residual add
before it, once ``passes.decompose`` has written it as those ops.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from shardfx.codegen.triton import FusedKernel, Group, KernelInput, KernelOp, Ref
from shardfx.codegen.triton_ops import REDUCTIONS, ROW_OPS, fusible
from shardfx.ir import meta as M
from shardfx.ir.graph import inherit_place
from shardfx.passes.decompose import decompose


@dataclass(eq=False)
class _Building:
    shape: tuple[int, ...]  # S
    phase: object
    nodes: list[fx.Node] = field(default_factory=list)
    row: dict[fx.Node, bool] = field(default_factory=dict)  # member -> a row value
    moved: list[fx.Node] = field(default_factory=list)  # aliases moved after the kernel


def fuse(graph: fx.Graph, prefix: str = "fused") -> list[Group]:
    """Replace each group of ``graph`` by its kernel (see the module docstring), LayerNorm
    and its backward first written as the ops a group can hold (``passes.decompose``)."""
    decompose(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    group_of: dict[fx.Node, _Building] = {}
    building: list[_Building] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or not fusible(node):
            continue
        producers = list(dict.fromkeys(group_of[a] for a in node.all_input_nodes
                                       if a in group_of))
        if len(producers) > 1:  # all of them in one kernel, if they agree; else the first
            producers.insert(0, _merged(producers, order))
        joined = False
        for g in producers:
            row = _role(node, g) if g.shape else None
            aliases = _early_aliases(g, node, order) if row is not None else None
            if aliases is not None:
                g.moved += [u for u in aliases if u not in g.moved]
                for n in g.nodes:  # a merge: its groups' members are the merged group's
                    old = group_of[n]
                    if old is not g:
                        old.nodes = []
                    group_of[n] = g
                if g not in building:
                    building.append(g)
                g.nodes.append(node)
                g.row[node] = row
                group_of[node] = g
                joined = True
                break
        if not joined:
            g = _start(node)
            if g is not None:
                building.append(g)
                group_of[node] = g
    groups = []
    for g in building:
        if len(g.nodes) >= 2:
            groups.append(_replace(graph, g, f"{prefix}_{len(groups)}", order))
    return groups


def _merged(groups: list[_Building], order: dict) -> _Building:
    """One group of ``groups``' members (no shape if they differ in shape or phase)."""
    first = groups[0]
    same = all(g.shape == first.shape and g.phase == first.phase for g in groups)
    merged = _Building(first.shape if same else (), first.phase)
    merged.nodes = sorted((n for g in groups for n in g.nodes), key=order.__getitem__)
    for g in groups:
        merged.row.update(g.row)
        merged.moved += g.moved
    return merged


def _val(n) -> torch.Tensor | None:
    v = n.meta.get(M.VAL) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _start(node: fx.Node) -> _Building | None:
    """A group of one: its S is the op's full shape (a reduction's operand's)."""
    out = _val(node)
    if out is None or out.dim() == 0:
        return None
    shape = tuple(_val(node.args[0]).shape) if node.target in REDUCTIONS else tuple(out.shape)
    g = _Building(shape, node.meta.get(M.PHASE))
    row = _role(node, g)
    if row is None:
        return None
    g.nodes.append(node)
    g.row[node] = row
    return g


def _role(node: fx.Node, g: _Building) -> bool | None:
    """Whether ``node`` in ``g`` is a row value (True), a full one (False), or cannot join
    (None)."""
    if node.meta.get(M.PHASE) != g.phase:
        return None
    out, S = _val(node), g.shape
    row_shape = (*S[:-1], 1)
    if out is None or S[-1] == 1:
        return None
    if tuple(out.shape) == S:
        row = False
    elif tuple(out.shape) == row_shape and node.target not in ROW_OPS:
        row = True
    else:
        return None
    if node.target in REDUCTIONS and not row:
        return None
    for a in node.all_input_nodes:
        if a in g.row:  # a member
            if g.row[a] and (not row and node.target in (*REDUCTIONS, *ROW_OPS)):
                return None  # a reduction or a row op reads full values
            if g.row[a] is False and row and node.target not in REDUCTIONS:
                return None  # a row value made from a full one is a reduction's
            continue
        v = _val(a)
        reads = S if node.target in REDUCTIONS or not row else row_shape  # what it broadcasts to
        if v is None or not _broadcasts(tuple(v.shape), reads):
            return None
        if node.target in (*REDUCTIONS, *ROW_OPS) and _is_row(tuple(v.shape), S):
            return None
    return row


def _broadcasts(shape: tuple, to: tuple) -> bool:
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to)))


def _is_row(shape: tuple, S: tuple) -> bool:
    return (len(shape) == 0 or shape[-1] == 1) and S[-1] != 1


# Ops that only alias their operand: one that reads a member before the kernel can be moved
# after it (the ``detach`` the joint graph makes of a value saved for the backward).
_ALIASES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def _early_aliases(g: _Building, node: fx.Node, order: dict) -> list[fx.Node] | None:
    """The kernel runs where ``node`` is: nothing outside the group may read a member before
    that, but an alias whose own readers come after (returned: it moves after the kernel).
    None: ``node`` cannot join."""
    members = set(g.nodes) | {node}
    early = [u for m in g.nodes for u in m.users if u not in members and order[u] < order[node]]
    if not all(u.target in _ALIASES and all(order[w] > order[node] for w in u.users)
               for u in early):
        return None
    return early


def _replace(graph: fx.Graph, g: _Building, name: str, order: dict) -> Group:
    members = set(g.nodes)
    names: dict[fx.Node, str] = {}
    inputs: list[KernelInput] = []
    input_nodes: list[fx.Node] = []
    ops: list[KernelOp] = []
    unfused = 0

    def ref(a):
        if not isinstance(a, fx.Node):
            return a
        if a not in names:
            v = _val(a)
            names[a] = f"x{len(inputs)}"
            inputs.append(KernelInput(names[a], a.name, v.dtype, tuple(v.shape),
                                      _is_row(tuple(v.shape), g.shape)))
            input_nodes.append(a)
        return Ref(names[a])

    for node in g.nodes:
        args = fx.node.map_aggregate(node.args, ref)
        kwargs = dict(fx.node.map_aggregate(dict(node.kwargs), ref))
        names[node] = f"v{len(ops)}"
        out = _val(node)
        ops.append(KernelOp(names[node], node.name, node.target, tuple(args), kwargs, out.dtype,
                            g.row[node]))
        unfused += out.numel() * out.element_size() + sum(
            _val(a).numel() * _val(a).element_size() for a in node.all_input_nodes)
    leaving = [n for n in g.nodes if any(u not in members for u in n.users)]
    group = Group(name, g.shape, tuple(inputs), tuple(ops),
                  tuple((names[n], tuple(_val(n).shape)) for n in leaving), unfused)
    last = max(g.nodes, key=order.__getitem__)
    with graph.inserting_after(last):
        call = graph.call_function(FusedKernel(group), tuple(input_nodes))
    call.meta[M.VAL] = tuple(_val(n) for n in leaving)
    inherit_place(last, call)
    with graph.inserting_after(call):
        for i, n in reversed(list(enumerate(leaving))):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta[M.VAL] = _val(n)
            inherit_place(n, item)
            n.replace_all_uses_with(item)
    anchor = call
    while anchor.next.op == "call_function" and anchor.next.target is operator.getitem \
            and anchor.next.args[0] is call:
        anchor = anchor.next
    for alias in sorted(g.moved, key=order.__getitem__):
        anchor.append(alias)
        anchor = alias
    for n in reversed(g.nodes):
        graph.erase_node(n)
    return group

