"""fusion: the memory-bound ops between the matmuls, grouped into one Triton kernel each.

Requires: a per-device program's graph (``codegen``): ``meta["val"]`` on every node, local
          shapes, collectives as ops of their own; PHASE where the IR had it.
Ensures:  every group of two or more ops ``kernels.triton_ops`` computes (pointwise ops, casts,
          reductions over the last dimension keeping it, softmax and log-softmax and their
          backward, slices and ``cat`` over the last dimension and ``slice_backward``) that
          share one iteration shape ``S`` is one call_function node whose target
          is a ``FusedKernel``, returning a tuple of the values read outside the group, each
          read through ``operator.getitem`` (with the VAL, PHASE and STAGE of the op it stands
          for); the group's other values are never materialized. A group never takes in a
          collective or an op of the other phase (forward vs backward), and its kernel runs
          where its last op ran: an op joins a group only if no op outside the group reads a
          member before it. ``graph.meta``-free: the groups are returned, in program order.

Rows: the kernels (``kernels.triton``) hold one row of ``S`` (its last dimension) per Triton
program, so a value of a group is full (``S``), one value per row (``S[:-1] + [1]``, what a
reduction over the last dimension leaves) or narrow (``S[:-1] + [w]``, a slice of the row); an
operand from outside may be anything that broadcasts to one of them. RMSNorm as Hugging Face writes it (``pow``, ``mean``, ``add``,
``rsqrt``, ``mul``, ``mul``) is one group; so are SwiGLU's ``silu`` and ``mul``, a residual add
with the cast before it, the softmax of eager attention, RoPE (``q * cos + rotate_half(q) *
sin``: two slices, a ``neg``, a ``cat``) and its gradient, and LayerNorm with the residual add
before it, once ``passes.decompose`` has written it as those ops.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from shardfx.kernels.triton import FusedKernel, Group, KernelInput, KernelOp
from shardfx.kernels.triton_ops import Ref
from shardfx.kernels.triton_ops import COLUMN_OPS, REDUCTIONS, ROW_OPS, columns, fusible
from shardfx.ir import meta as M
from shardfx.ir.graph import inherit_place, tensor_val as _val
from shardfx.passes.decompose import decompose

aten = torch.ops.aten


@dataclass(eq=False)
class _Building:
    shape: tuple[int, ...]  # S
    phase: object
    nodes: list[fx.Node] = field(default_factory=list)
    width: dict[fx.Node, int] = field(default_factory=dict)  # member -> its width
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
            width = _role(node, g) if g.shape else None
            aliases = _early_aliases(g, node, order) if width is not None else None
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
                g.width[node] = width
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
        merged.width.update(g.width)
        merged.moved += g.moved
    return merged


def _start(node: fx.Node) -> _Building | None:
    """A group of one: its S is the op's full shape (a reduction's operand's; a slice's
    operand's, the columns it slices)."""
    out = _val(node)
    if out is None or out.dim() == 0:
        return None
    shape = tuple(out.shape)
    if node.target in REDUCTIONS:
        shape = tuple(_val(node.args[0]).shape)
    elif node.target is aten.slice.Tensor:
        shape = (*shape[:-1], _width(node.args[0]))
    g = _Building(shape, node.meta.get(M.PHASE))
    width = _role(node, g)
    if width is None:
        return None
    g.nodes.append(node)
    g.width[node] = width
    return g


def _role(node: fx.Node, g: _Building) -> int | None:
    """The width ``node``'s value has in ``g``: ``S[-1]`` (full), 1 (a row value) or fewer
    columns (narrow); None if it cannot join."""
    if node.meta.get(M.PHASE) != g.phase:
        return None
    out, S = _val(node), g.shape
    if out is None or S[-1] == 1 or out.dim() != len(S) or tuple(out.shape[:-1]) != S[:-1]:
        return None
    width, t = out.shape[-1], node.target
    if width > S[-1] or (t in REDUCTIONS and width != 1) or \
            (t in ROW_OPS and width != S[-1]) or (t in COLUMN_OPS and width == 1):
        return None
    for a in node.all_input_nodes:
        read = g.width[a] if a in g.width else _width(a)
        if a not in g.width and not _broadcasts(tuple(_val(a).shape), (*S[:-1], read)):
            return None
        if t in REDUCTIONS or t in ROW_OPS:
            ok = read == S[-1]  # they read full rows
        elif t in COLUMN_OPS:
            ok = read > 1  # they move columns
        else:
            ok = read in (width, 1)  # pointwise: a row value broadcasts over the columns
        if not ok:
            return None
    return width


def _width(a: fx.Node) -> int:
    v = _val(a)
    return v.shape[-1] if v is not None and v.dim() else 1


def _broadcasts(shape: tuple, to: tuple) -> bool:
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to)))


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
            inputs.append(KernelInput(names[a], a.name, v.dtype, tuple(v.shape), _width(a)))
            input_nodes.append(a)
        return Ref(names[a])

    for node in g.nodes:
        args = fx.node.map_aggregate(node.args, ref)
        kwargs = dict(fx.node.map_aggregate(dict(node.kwargs), ref))
        if node.target in COLUMN_OPS:  # its operands, then which columns go where
            parts = node.args[0] if node.target is aten.cat.default else node.args[:1]
            args = (*(ref(a) for a in parts), columns(node))
        names[node] = f"v{len(ops)}"
        out = _val(node)
        ops.append(KernelOp(names[node], node.name, node.target, tuple(args), kwargs, out.dtype,
                            g.width[node]))
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

