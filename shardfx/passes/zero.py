"""ZeRO (Rajbhandari et al. 2020) as program passes over the SPMD program of a dp mesh.

``partition(..., zero=k)``: the dp ranks each keep 1/dp of what the replicas of plain data
parallelism all keep whole, as ``ir.meta.ZeroShard`` lays it out (dim-0 rows of each tensor,
padded: FSDP2's layout):

    zero=1  the optimizer's state: the runner steps each rank's rows of every parameter, then
            gathers the updated rows (``codegen.zero``'s all-gather, in a program of its own);
    zero=2  and the gradients: ``zero_reduce_scatter`` returns each rank's rows of each gradient,
            reduce-scattered in buckets where plain dp all-reduces the whole;
    zero=3  and the parameters: ``zero_gather`` makes each parameter input a shard, gathered
            before its first reader in forward and again, into another buffer, before its first
            reader in backward, each copy freed after its last reader (SimpleFSDP: the backward
            recomputes the all-gather instead of keeping the forward's copy). Gathers go in
            buckets of a block's parameters, each issued when the bucket before it is waited
            for: the next block's parameters come in while this block computes.

The passes only move communication: every op computes what it did, on the same values.
"""

from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.fx as fx

from shardfx.codegen.bucketing import BUCKET_BYTES, fill_buckets
from shardfx.codegen.program import Program
from shardfx.codegen.redistribute import Collective, Purpose
from shardfx.codegen.zero import (across_replicas, emit, emit_padded, finish_gather,
                                  finish_reduce_scatter, issue_gather, issue_reduce_scatter)
from shardfx.ir import meta as M
from shardfx.ir.graph import fake_mode_of, phases, right_after, tensor_val
from shardfx.codegen.program import BUCKETED, NO_BUCKET
from shardfx.ir.contract import contract

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def zero_layouts(program: Program, dp: int) -> dict[str, M.ZeroShard]:
    """Parameter FQN -> how ZeRO holds it over ``dp``: every parameter the program returns a
    gradient of (one the optimizer steps); its tp shard's shape from the input (``ZERO`` once
    ``zero_gather`` made the input a shard)."""
    trained = {r.name for r in program.outputs if r.kind is M.OutputKind.GRAD}
    out = {}
    for node in program.module.graph.find_nodes(op="placeholder"):
        role = node.meta[M.ROLE]  # a parameter, or a pipeline stage's gradient (codegen.replicas)
        if role.kind in (M.InputKind.PARAM, M.InputKind.GRAD) and role.name in trained:
            out[role.name] = node.meta.get(M.ZERO) or M.ZeroShard(tuple(node.meta[M.VAL].shape), dp)
    return out


@contract(requires=[NO_BUCKET])
def zero_reduce_scatter(program: Program, options) -> Program:
    """Requires: the SPMD program of a mesh with dp (``codegen.spmd``): each gradient returned
    reduced over every axis it is partial on (``wait(all_reduce(g, "sum", group_dp))`` among
    the collectives on its way out); PHASE on the program's ops.
    Ensures: each gradient of ``zero_layouts`` is returned as this rank's ``ZeroShard`` rows of
    it: its dp all-reduce is gone, and buckets of gradients (in the order they are ready, one
    dtype each, at most ``BUCKET_BYTES``) are reduce-scattered over dp, each issued right after
    its last gradient is computed and waited for before the output; other axes' reductions
    stay. A gradient reduced over dp before the op that made it (a tied embedding's: its
    activation gradient was) is whole on every rank: it takes its rows with no collective (a
    ``coord(dp)`` input is added if the program had none). HSDP (a ``dp_replicate`` axis):
    a gradient also summed over the replicas has that all-reduce taken out too, and made on
    its rows instead, per bucket: the bucket's reduce-scatter is waited for when the next
    bucket's is issued (the last's before the output), its rows all-reduced over
    ``dp_replicate`` from there, and waited for before the output. ``collectives`` says so.
    Other outputs are unchanged."""
    dp = options.mesh.axis("dp")
    graph = program.module.graph
    layouts = zero_layouts(program, dp)
    program = _with_mesh_input(program, "group(dp)")
    group = _placeholder(graph, "group(dp)")
    replicas = _placeholder(graph, "group(dp_replicate)", None)
    out = graph.output_node()
    values = list(out.args[0])
    grads = []  # (output index, partial gradient, layout, summed over replicas on its rows)
    whole = []  # (output index, gradient already reduced over dp, layout)
    for i, (value, role) in enumerate(zip(values, program.outputs)):
        if role.kind is M.OutputKind.GRAD and role.name in layouts:
            partial = _unreduced_over(value, group)
            if partial is None:
                whole.append((i, value, layouts[role.name]))
                continue
            own = None if replicas is None else _unreduced_over(partial, replicas)
            grads.append((i, partial if own is None else own, layouts[role.name],
                          own is not None))
    if whole:  # reduced upstream (a tied embedding's): each rank takes its rows, no collective
        program = _with_mesh_input(program, "coord(dp)")
        coord = _placeholder(graph, "coord(dp)")
        for index, value, z in whole:
            with graph.inserting_before(value.next):
                values[index] = _my_rows(graph, value, z, coord, f"zero_rows{index}")
    order = {n: i for i, n in enumerate(graph.nodes)}
    buckets = fill_buckets(grads, ready=lambda g: order[g[1]],
                           key=lambda g: (_dtype_bytes(g[1])[0], g[3]),
                           nbytes=lambda g: _dtype_bytes(g[1])[1])
    records = []
    narrow = options.precision.narrower_reduce
    issued = []
    for b, bucket in enumerate(buckets):
        with right_after(bucket[-1][1]):  # its last gradient exists: start it
            issued.append(issue_reduce_scatter(graph, [g[1] for g in bucket],
                                               [g[2] for g in bucket], group, f"zero_rs{b}",
                                               narrow))
    for b, (bucket, started) in enumerate(zip(buckets, issued)):
        name, parts = f"zero_rs{b}", [g[2] for g in bucket]
        fqns = [program.outputs[g[0]].name for g in bucket]
        what = f"ZeRO gradient bucket {b} ({len(fqns)} grads: " \
               f"{', '.join(fqns[:4])}{', ...' if len(fqns) > 4 else ''})"
        records.append(Collective("reduce_scatter", "dp", _dtype_bytes(started.args[0])[1],
                                  f"{what}: P -> ZeRO rows on dp", purpose=Purpose.ZERO))
        if bucket[0][3]:  # HSDP: the rows summed over the replicas, from the next bucket's issue
            at = right_after(issued[b + 1]) if b + 1 < len(issued) else graph.inserting_before(out)
            with at:
                started = across_replicas(graph, started, replicas, name)
            records.append(Collective("all_reduce", "dp_replicate", _dtype_bytes(started)[1],
                                      f"{what}: ZeRO rows P -> R on dp_replicate",
                                      purpose=Purpose.ZERO))
        with graph.inserting_before(out):  # wait as late as possible
            shards = finish_reduce_scatter(graph, started, parts, name, _dtype_bytes(bucket[0][1])[0])
        for (index, *_), shard in zip(bucket, shards):
            values[index] = shard
    out.args = (tuple(values),)
    graph.eliminate_dead_code()
    program.module.recompile()
    reduced = {program.outputs[g[0]]: g[3] for g in grads}
    kept = [c for c in program.collectives if not (c.output in reduced and (
        c.axis == "dp" or c.axis == "dp_replicate" and reduced[c.output]))]
    return dataclasses.replace(program, collectives=tuple(kept + records))


def _unreduced_over(value: fx.Node, group: fx.Node) -> fx.Node | None:
    """``value`` with its reduction over ``group`` taken out of its way to the output (the
    sums over other axes and scalings kept: all linear, so their order does not matter); None
    when no reduction over ``group`` is on that way (the value is whole on every rank)."""
    node = value
    while node.op == "call_function":
        if node.target is c10d.wait_tensor.default and \
                node.args[0].target is c10d.all_reduce.default:
            reduce = node.args[0]
            if reduce.args[2] is group and len(node.users) == 1:
                partial = reduce.args[0]
                node.replace_all_uses_with(partial)
                node.graph.erase_node(node)
                node.graph.erase_node(reduce)
                return partial if node is value else value
            node = reduce.args[0]
        elif node.target is aten.clone.default or (
                node.target is aten.div.Tensor and not isinstance(node.args[1], fx.Node)):
            node = node.args[0]  # a layout copy, a mean's division: linear
        else:
            break
    return None  # reduced before the op that made it: whole on every rank


@contract(requires=[BUCKETED])
def zero_gather(program: Program, options) -> Program:
    """Requires: ``zero_reduce_scatter`` ran; PHASE on the program's ops.
    Ensures: each parameter of ``zero_layouts`` is taken as this rank's shard (its VAL the
    shard's shape, ``ZERO`` its layout); its forward readers read a copy gathered before the
    first of them, its backward readers another gathered in backward, and forward values made
    from the parameter alone that the backward reads (a transpose, a cast) are made again from
    the backward's copy; gathers in buckets (a block's parameters, at most ``BUCKET_BYTES``),
    each issued when the one before it is waited for. ``collectives`` lists each gather."""
    dp = options.mesh.axis("dp")
    graph = program.module.graph
    layouts = zero_layouts(program, dp)
    group = _placeholder(graph, "group(dp)")
    phase = phases(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    fake = fake_mode_of(graph)
    params = [n for n in graph.find_nodes(op="placeholder")
              if n.meta[M.ROLE].kind is M.InputKind.PARAM and n.meta[M.ROLE].name in layouts]
    uses: dict[M.Phase, dict[fx.Node, list[fx.Node]]] = {M.Phase.FORWARD: {}, M.Phase.BACKWARD: {}}
    derived: dict[fx.Node, list[fx.Node]] = {}
    for p in params:
        derived[p] = _made_from(p, phase, order)
        uses[M.Phase.FORWARD][p] = [u for u in p.users if phase[u] is M.Phase.FORWARD]
        back = [u for n in (p, *derived[p]) for u in n.users if phase[u] is M.Phase.BACKWARD]
        if back:
            uses[M.Phase.BACKWARD][p] = list(dict.fromkeys(back))
        if not uses[M.Phase.FORWARD][p]:
            del uses[M.Phase.FORWARD][p]
    for p in params:  # the input is now the shard
        z = layouts[p.meta[M.ROLE].name]
        val = p.meta[M.VAL]
        with fake:
            p.meta[M.VAL] = torch.empty(z.shard_shape, dtype=val.dtype, device=val.device)
        p.meta[M.ZERO] = z
    records = []
    gathered: dict[fx.Node, fx.Node] = {}  # parameter -> its forward copy
    for ph, tag in ((M.Phase.FORWARD, "fwd"), (M.Phase.BACKWARD, "bwd")):
        first = {p: min(users, key=order.get) for p, users in uses[ph].items()}
        buckets = _gather_buckets(sorted(first, key=lambda p: order[first[p]]), layouts)
        issued = None
        for b, bucket in enumerate(buckets):
            name = f"zero3_{tag}{b}"
            at = min((first[p] for p in bucket), key=order.get)
            with graph.inserting_before(at):
                if issued is None:
                    issued = issue_gather(graph, bucket, group, dp, name, ph)
                started, issued = issued, None
                if b + 1 < len(buckets):  # the next bucket's gather comes in meanwhile
                    issued = issue_gather(graph, buckets[b + 1], group, dp,
                                          f"zero3_{tag}{b + 1}", ph)
                fulls = finish_gather(graph, started, [layouts[p.meta[M.ROLE].name]
                                                       for p in bucket], name, ph)
            for p, full in zip(bucket, fulls):
                _read_from(full, p, derived[p], uses[ph][p], ph, graph, gathered.get(p))
                if ph is M.Phase.FORWARD:
                    gathered[p] = full
            nbytes = sum(_shard_bytes(layouts[p.meta[M.ROLE].name], p) for p in bucket)
            records.append(Collective("all_gather", "dp", nbytes, f"ZeRO-3 {tag} bucket {b} "
                                      f"({_names(bucket)}): ZeRO rows -> R on dp",
                                      purpose=Purpose.ZERO))
    graph.eliminate_dead_code()
    graph.lint()
    program.module.recompile()
    return dataclasses.replace(program, collectives=tuple(program.collectives) + tuple(records))


def _made_from(p: fx.Node, phase: dict, order: dict[fx.Node, int]) -> list[fx.Node]:
    """Forward ops computed from ``p`` alone (views, casts), in program order: found from
    ``p``'s users outwards (a walk of the whole program per parameter was quadratic in the
    layers: a minute of an 80-layer plan)."""
    mine, todo = {p}, list(p.users)
    while todo:
        node = todo.pop()
        if node.op == "call_function" and node not in mine and phase[node] is M.Phase.FORWARD \
                and set(node.all_input_nodes) <= mine:
            mine.add(node)
            todo += node.users
    return sorted(mine - {p}, key=order.__getitem__)


def _read_from(full: fx.Node, p: fx.Node, derived: list[fx.Node], users: list[fx.Node],
               ph: M.Phase, graph: fx.Graph, forward: fx.Node | None = None) -> None:
    """Make ``users`` (of phase ``ph``) read ``full`` where they read ``p``; in backward, the
    values made from ``p`` alone that they read are made again from ``full``. ``forward``:
    the forward's copy of ``p``, which those values read by now (the forward's readers were
    rewired first): their backward copies read ``full`` instead, or the forward's gathered
    parameter would live on into the backward beside the backward's."""
    env = {p: full} if forward is None else {p: full, forward: full}
    if ph is M.Phase.BACKWARD:
        needed = {a for u in users for a in u.all_input_nodes if a in set(derived)}
        for node in reversed(derived):  # what the needed ones are made from
            if node in needed:
                needed |= set(node.all_input_nodes) - {p}
        anchor = full
        for node in derived:
            if node in needed:
                with graph.inserting_after(anchor):
                    copy = graph.node_copy(node, lambda a: env.get(a, a))
                copy.meta = {**node.meta, M.PHASE: M.Phase.BACKWARD}
                env[node] = anchor = copy
    for user in users:
        user.args = fx.node.map_arg(user.args, lambda a: env.get(a, a))
        user.kwargs = fx.node.map_arg(user.kwargs, lambda a: env.get(a, a))


def _gather_buckets(params: list[fx.Node], layouts: dict) -> list[list[fx.Node]]:
    """Parameters in the order they are first read, in buckets: a new one where the repeated
    block changes (``model.layers.3.``) or the bucket would pass ``BUCKET_BYTES``."""
    buckets: list[list[fx.Node]] = []
    block, size = None, 0
    for p in params:
        fqn = p.meta[M.ROLE].name
        here = _block(fqn)
        nbytes = _shard_bytes(layouts[fqn], p) * layouts[fqn].dp
        if not buckets or here != block or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        block, size = here, size + nbytes
    return buckets


def _block(fqn: str) -> str:
    """The repeated block a parameter is in (``model.layers.3``), or its own name."""
    m = re.match(r"(.*?\.\d+)\.", fqn)
    return m.group(1) if m else fqn


def _my_rows(graph: fx.Graph, value: fx.Node, z: M.ZeroShard, coord: fx.Node,
             name: str) -> fx.Node:
    """At the insertion point: this rank's rows of ``value`` (whole on every rank), padded, in
    a tensor of their own (the whole can go)."""
    ph = M.Phase.BACKWARD
    x = emit_padded(graph, value, z, name, ph)
    start = graph.call_function(operator.mul, (coord, z.per_rank))
    start.meta[M.VAL], start.meta[M.PHASE] = 0, ph
    mine = emit(graph, f"{name}_narrow", ph, aten.narrow.default, x, 0, start, z.per_rank)
    return emit(graph, name, ph, aten.clone.default, mine)


def _with_mesh_input(program: Program, name: str) -> Program:
    """``program`` with a MESH input ``name`` (``coord(dp)``, ``group(dp)``), added after its
    last input if it has none (codegen drops the mesh inputs a program does not read)."""
    graph = program.module.graph
    if any(r.kind is M.InputKind.MESH and r.name == name for r in program.inputs):
        return program
    last = graph.find_nodes(op="placeholder")[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name.replace("(", "_").rstrip(")"))
    role = M.InputRole(M.InputKind.MESH, name)
    node.meta[M.ROLE] = role
    node.meta[M.VAL] = 0 if name.startswith("coord") else f"<{name[6:-1]} group>"
    return dataclasses.replace(program, inputs=(*program.inputs, role))


_NONE = object()


def _placeholder(graph: fx.Graph, name: str, default=_NONE) -> fx.Node:
    """The MESH input ``name``; ``default`` where the program has none (else an error)."""
    for node in graph.find_nodes(op="placeholder"):
        if node.meta[M.ROLE].kind is M.InputKind.MESH and node.meta[M.ROLE].name == name:
            return node
    if default is not _NONE:
        return default
    raise NotImplementedError(f"the program has no {name} input")


def _dtype_bytes(node: fx.Node) -> tuple[torch.dtype, int]:
    v = tensor_val(node)
    return v.dtype, v.numel() * v.element_size()


def _shard_bytes(z: M.ZeroShard, p: fx.Node) -> int:
    return z.per_rank * z.row_numel * p.meta[M.VAL].element_size()


def _names(bucket: list[fx.Node]) -> str:
    fqns = [p.meta[M.ROLE].name for p in bucket]
    return ", ".join(fqns[:3]) + (f", and {len(fqns) - 3} more" if len(fqns) > 3 else "")
