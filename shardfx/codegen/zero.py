"""ZeRO's collectives as graph code: a bucket of shards gathered, a bucket of gradients
reduce-scattered, each in two halves so a pass can issue one early and wait for it late.

Every tensor is held over dp as ``ir.meta.ZeroShard`` says: rank i holds rows
``i * per_rank`` on of the tensor, padded with zeros. One collective serves a bucket of
tensors (fewer, larger messages), laid out so each rank's part of the flat buffer is its rows
of every tensor in the bucket, in order:

    gather          flat = cat(shard_0.flatten(), shard_1.flatten(), ...)       # (S,)
                    all = all_gather_into_tensor(flat, dp, group_dp)            # (dp * S,)
                    tensor_j = all.view(dp, S)[:, o_j : o_j + k_j]              # rank-major rows
                               .reshape(dp * per_rank_j, ...)[:rows_j]          # unpadded

    reduce-scatter  x_j = pad(grad_j, rows to dp * per_rank_j).view(dp, k_j)   # (dp, k_j)
                    flat = cat(x_0, x_1, ..., dim=1).flatten()                  # (dp * S,)
                    mine = reduce_scatter_tensor(flat, "sum", dp, group_dp)     # (S,)
                    shard_j = mine[o_j : o_j + k_j].view(per_rank_j, ...)

(``k_j = per_rank_j * row_numel_j``.) A bucket of one tensor skips the cat and the split.
Nodes are named after the bucket (``zero3_fwd0_all_gather``, ``zero_rs2_wait``) so the program
reads as what it does.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module

from shardfx.codegen.redistribute import Collective, Purpose
from shardfx.ir import meta as M
from shardfx.ir.graph import insert_op
from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.codegen.program import Program

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def emit(graph: fx.Graph, name: str, phase: M.Phase, target, *args, **kwargs) -> fx.Node:
    """At the insertion point: ``target(*args, **kwargs)`` named ``name``, in ``phase``."""
    node = insert_op(graph, target, *args, **kwargs)
    node._rename(name)
    node.meta[M.PHASE] = phase
    return node


def emit_padded(graph: fx.Graph, whole: fx.Node, z: M.ZeroShard, name: str,
                phase: M.Phase) -> fx.Node:
    """At the insertion point: ``whole`` (a tensor of layout ``z``) as ``dp * per_rank`` rows,
    the last ones zeros (a 0-d tensor as one row)."""
    x = whole if z.shape else emit(graph, f"{name}_row", phase, aten.reshape.default, whole, [1])
    pad = z.dp * z.per_rank - z.rows
    if pad:
        x = emit(graph, f"{name}_pad", phase, aten.constant_pad_nd.default, x,
                 [0, 0] * (len(z.shape) - 1) + [0, pad])
    return x


def issue_gather(graph: fx.Graph, shards: list[fx.Node], group: fx.Node, dp: int, name: str,
                 phase: M.Phase) -> fx.Node:
    """At the insertion point: start the all-gather of ``shards`` (one bucket)."""
    flat = [emit(graph, f"{name}_in{i}", phase, aten.reshape.default, s, [-1])
            for i, s in enumerate(shards)]
    buffer = flat[0] if len(flat) == 1 else \
        emit(graph, f"{name}_flat", phase, aten.cat.default, flat)
    return emit(graph, f"{name}_all_gather", phase, c10d.all_gather_into_tensor.default,
               buffer, dp, group)


def finish_gather(graph: fx.Graph, started: fx.Node, layouts: list[M.ZeroShard], name: str,
                  phase: M.Phase, rows_only: bool = False) -> list[fx.Node]:
    """At the insertion point: wait for ``started`` and take each tensor out of it; with
    ``rows_only``, each tensor's rows as every rank sent them, a ``(dp, per_rank * row_numel)``
    view of the gathered buffer (for a runner to copy into storage of its own)."""
    dp = layouts[0].dp
    done = emit(graph, f"{name}_wait", phase, c10d.wait_tensor.default, started)
    sizes = [z.per_rank * z.row_numel for z in layouts]
    grid = emit(graph, f"{name}_grid", phase, aten.reshape.default, done, [dp, sum(sizes)])
    if len(layouts) == 1:
        parts = [grid]
    else:
        split = emit(graph, f"{name}_split", phase, aten.split_with_sizes.default, grid, sizes, 1)
        parts = [emit(graph, f"{name}_part{i}", phase, operator.getitem, split, i)
                 for i in range(len(layouts))]
    if rows_only:
        return parts
    out = []
    for i, (part, z) in enumerate(zip(parts, layouts)):
        full = emit(graph, f"{name}_rows{i}", phase, aten.reshape.default, part,
                   [dp * z.per_rank, *z.shape[1:]])
        if dp * z.per_rank != z.rows:  # padding rows: a view without them
            full = emit(graph, f"{name}_unpad{i}", phase, aten.narrow.default, full, 0, 0, z.rows)
        if not z.shape:  # a 0-d tensor travelled as one row
            full = emit(graph, f"{name}_scalar{i}", phase, aten.reshape.default, full, [])
        out.append(full)
    return out


def issue_reduce_scatter(graph: fx.Graph, grads: list[fx.Node], layouts: list[M.ZeroShard],
                         group: fx.Node, name: str, reduce_dtype: torch.dtype | None = None
                         ) -> fx.Node:
    """At the insertion point: start the reduce-scatter (sum) of ``grads`` (one bucket; each
    this rank's partial sum of a whole gradient), in ``reduce_dtype`` if given."""
    phase = M.Phase.BACKWARD
    dp = layouts[0].dp
    rows = [emit(graph, f"{name}_in{i}", phase, aten.reshape.default,
                 emit_padded(graph, g, z, f"{name}_{i}", phase), [dp, z.per_rank * z.row_numel])
            for i, (g, z) in enumerate(zip(grads, layouts))]
    buffer = rows[0] if len(rows) == 1 else \
        emit(graph, f"{name}_cat", phase, aten.cat.default, rows, 1)
    flat = emit(graph, f"{name}_flat", phase, aten.reshape.default, buffer, [-1])
    if reduce_dtype is not None and flat.meta[M.VAL].dtype != reduce_dtype:
        flat = emit(graph, f"{name}_narrow", phase, aten._to_copy.default, flat, dtype=reduce_dtype)
    return emit(graph, f"{name}_reduce_scatter", phase, c10d.reduce_scatter_tensor.default, flat,
               "sum", dp, group)


def across_replicas(graph: fx.Graph, started: fx.Node, group: fx.Node, name: str) -> fx.Node:
    """At the insertion point: wait for the reduce-scatter ``started`` and start the all-reduce
    (sum) of this rank's part of it over ``group``, HSDP's replicas of the ZeRO group: each
    replica's sum of its own batch becomes the sum over all of them, on 1/dp of the bytes an
    all-reduce of the whole gradients would send."""
    phase = M.Phase.BACKWARD
    done = emit(graph, f"{name}_wait", phase, c10d.wait_tensor.default, started)
    return emit(graph, f"{name}_replicas_all_reduce", phase, c10d.all_reduce.default, done, "sum",
                group)


def finish_reduce_scatter(graph: fx.Graph, started: fx.Node, layouts: list[M.ZeroShard],
                          name: str, dtype: torch.dtype) -> list[fx.Node]:
    """At the insertion point: wait for ``started`` (the reduce-scatter, or the all-reduce
    over replicas that ``across_replicas`` started after it); this rank's shard of each
    gradient, in ``dtype`` (the gradients' own)."""
    phase = M.Phase.BACKWARD
    wait = f"{name}_replicas_wait" if started.target is c10d.all_reduce.default else f"{name}_wait"
    done = emit(graph, wait, phase, c10d.wait_tensor.default, started)
    if done.meta[M.VAL].dtype != dtype:
        done = emit(graph, f"{name}_widen", phase, aten._to_copy.default, done, dtype=dtype)
    sizes = [z.per_rank * z.row_numel for z in layouts]
    parts = [done]
    if len(layouts) > 1:
        split = emit(graph, f"{name}_split", phase, aten.split_with_sizes.default, done, sizes)
        parts = [emit(graph, f"{name}_part{i}", phase, operator.getitem, split, i)
                 for i in range(len(layouts))]
    return [emit(graph, f"{name}_out{i}", phase, aten.reshape.default, part, list(z.shard_shape))
            for i, (part, z) in enumerate(zip(parts, layouts))]


def zero_gather_programs(whole: dict[str, torch.Tensor], dp: int) -> list["Program"]:
    """``gather_programs`` for the parameters ``whole`` (FQN -> its tp-local value, real or
    fake) held over ``dp``, in ``BUCKET_BYTES`` buckets in FQN order: what a runner runs and
    the memory model walks."""
    layouts = {f: M.ZeroShard(tuple(v.shape), dp) for f, v in sorted(whole.items())}
    return gather_programs(layouts, {f: v.dtype for f, v in whole.items()}, BUCKET_BYTES)


def program_gathers(program: "Program", layouts: dict[str, M.ZeroShard], dp: int
                    ) -> list["Program"]:
    """``zero_gather_programs`` for the parameters of ``program`` that ``layouts`` shards."""
    whole = {n.meta[M.ROLE].name: n.meta[M.VAL]
             for n in program.module.graph.find_nodes(op="placeholder")
             if n.meta[M.ROLE].name in layouts}
    return zero_gather_programs(whole, dp)


def gather_programs(layouts: dict[str, M.ZeroShard], dtypes: dict[str, torch.dtype],
                    bucket_bytes: int) -> list["Program"]:
    """The programs ZeRO-1 and -2 run after the optimizer step, one per bucket of parameters
    (in the order of ``layouts``, one dtype, at most ``bucket_bytes`` of whole parameters
    each): every rank's updated rows of the bucket's parameters in, one all-gather, every
    rank's rows of each parameter out, a ``(dp, per_rank * row_numel)`` view of the gathered
    buffer, which the runner copies into the parameter's own padded storage (viewed so:
    FSDP2's copy-out) before it runs the next bucket's: one bucket's buffer exists at a time,
    and no whole copy of a parameter is made. Inputs: one PARAM per FQN (this rank's rows),
    then ``group(dp)``; outputs: one OUTPUT per FQN, named by it."""
    buckets: list[list[str]] = []
    size = bucket_bytes
    for fqn, z in layouts.items():
        nbytes = z.dp * z.per_rank * z.row_numel * dtypes[fqn].itemsize
        if size + nbytes > bucket_bytes or dtypes[fqn] != dtypes[buckets[-1][0]]:
            buckets.append([])
            size = 0
        buckets[-1].append(fqn)
        size += nbytes
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()  # one for all: buckets of the same shapes share each op's value
    return [_gather_bucket(b, bucket, layouts, dtypes, fake) for b, bucket in enumerate(buckets)]


def _gather_bucket(b: int, bucket: list[str], layouts: dict[str, M.ZeroShard],
                   dtypes: dict[str, torch.dtype], fake) -> "Program":
    graph = fx.Graph()
    shards = []
    for fqn in bucket:
        node = graph.placeholder(re.sub(r"^(?=\d)", "p", re.sub(r"\W", "_", fqn)))  # "0.weight"
        node.meta[M.ROLE] = M.InputRole(M.InputKind.PARAM, fqn)
        with fake:
            node.meta[M.VAL] = torch.empty(layouts[fqn].shard_shape, dtype=dtypes[fqn])
        node.meta[M.ZERO] = layouts[fqn]
        shards.append(node)
    group = graph.placeholder("group_dp")
    group.meta[M.ROLE] = M.InputRole(M.InputKind.MESH, "group(dp)")
    group.meta[M.VAL] = "<dp group>"
    name, phase = f"zero_gather{b}", M.Phase.FORWARD
    started = issue_gather(graph, shards, group, layouts[bucket[0]].dp, name, phase)
    rows = finish_gather(graph, started, [layouts[f] for f in bucket], name, phase,
                         rows_only=True)
    graph.output(tuple(rows))
    roles = tuple(M.OutputRole(M.OutputKind.OUTPUT, f) for f in bucket)
    graph.output_node().meta[M.OUTPUTS] = roles
    module = _make_graph_module(torch.nn.Module(), graph, class_name="ShardfxZeroGather")
    inputs = tuple(n.meta[M.ROLE] for n in graph.find_nodes(op="placeholder"))
    nbytes = started.args[0].meta[M.VAL].numel() * dtypes[bucket[0]].itemsize
    record = Collective("all_gather", "dp", nbytes, f"ZeRO parameter bucket {b} ({len(bucket)} "
                        "params, after the optimizer step): ZeRO rows -> R on dp",
                        purpose=Purpose.ZERO)
    return Program(module, inputs, roles, (record,))
