"""codegen.bucketing: DDP's gradient buckets, as a pass over the per-device program.

Requires: a ``Program`` from ``codegen.spmd``: ``meta["val"]`` on every node, ROLE on
          placeholders (process groups are MESH inputs ``group(axis)``), one OutputRole per
          returned value in ``Program.outputs``.
Ensures:  every gradient that was returned as ``wait_tensor(all_reduce(g, op, group))`` and
          nothing more (or as such a chain over several groups: a partial sum over dp and tp)
          is now reduced in a bucket: per (groups, op, dtype), gradients in the
          order the program produces them are packed into buckets of at most ``bucket_bytes``
          (a larger gradient gets a bucket of its own). Right after a bucket's last gradient
          is computed the program flattens the bucket into one buffer (``bucketN_flat``)
          and starts one ``bucketN_all_reduce``; ``bucketN_wait`` comes just before the
          output, followed by the split of the reduced buffer back into the gradients' shapes.
          The old per-gradient collectives are gone; every new node has ``meta["val"]``.
          Anything else (the loss all-reduce, a reduction followed by a division or by more
          redistribution) is left as it was.

Why: one collective per gradient pays a collective's fixed cost (latency, launch, the
ring's start-up) once per parameter, and the spmd program waits for each one before going on.
A few large collectives use the network's bandwidth instead, and issuing each one as soon as
its last gradient exists, waiting only at the end, lets the reduction of the last layers'
gradients run while the backward pass of the first layers still computes (DDP's overlap,
Li et al. 2020). Buckets follow readiness, like DDP: gradients produced later in the program
go in later buckets, so no bucket waits on work that comes after it.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module

from shardfx.codegen.program import Program
from shardfx.codegen.redistribute import Collective, Purpose
from shardfx.ir import meta as M
from shardfx.ir.graph import insert_op, right_after

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@dataclass
class _Grad:
    """One gradient reduced on its own: ``wait(all_reduce(value))``, returned as ``role``; or
    reduced over several axes in turn (a partial sum over dp and tp), ``wait(all_reduce(
    wait(all_reduce(value, tp)), dp))``: ``chain`` the (all_reduce, wait) pairs, innermost
    first."""

    value: fx.Node  # the local partial gradient, the innermost all_reduce's input
    chain: list[tuple[fx.Node, fx.Node]]
    role: M.OutputRole

    @property
    def nbytes(self) -> int:
        v = self.value.meta[M.VAL]
        return v.numel() * v.element_size()

    @property
    def groups(self) -> tuple[fx.Node, ...]:
        return tuple(reduce.args[2] for reduce, _ in self.chain)


@dataclass
class _Bucket:
    groups: tuple[fx.Node, ...]  # reduced over each in turn
    op: str
    grads: list[_Grad] = field(default_factory=list)
    reduce_dtype: torch.dtype | None = None  # the dtype it is summed in, if not its own

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.grads)

    @property
    def sent_bytes(self) -> int:
        """Bytes of the all-reduce's buffer."""
        if self.reduce_dtype is None:
            return self.nbytes
        own = self.grads[0].value.meta[M.VAL].element_size()
        return self.nbytes * self.reduce_dtype.itemsize // own

    @property
    def axes(self) -> list[str]:
        return [_axis(g) for g in self.groups]


def _axis(group: fx.Node) -> str:
    return group.meta[M.ROLE].name.removeprefix("group(").removesuffix(")")


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap


def bucket_gradients(program: Program, *, bucket_bytes: int = BUCKET_BYTES,
                     reduce_dtype: torch.dtype | None = None, in_place: bool = False) -> Program:
    """The program with its gradient all-reduces bucketed, and its ``collectives`` with their
    per-gradient records replaced by one per bucket. ``program`` is left untouched unless
    ``in_place`` (the program pass: a program just generated; the copy was 0.15 s of an
    8-layer plan's 0.65 s emission, which a ``memory_budget`` repeats per candidate). With
    ``reduce_dtype`` (``Precision.reduce``) a dp bucket of another floating dtype is cast to
    it for the all-reduce and back after it."""
    graph = program.module.graph if in_place else copy.deepcopy(program.module.graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    buckets = _buckets(_grads(graph, program.outputs), bucket_bytes, order)
    output = graph.output_node()
    for b in buckets:
        dtype = b.grads[0].value.meta[M.VAL].dtype
        if reduce_dtype is not None and "dp" in b.axes and dtype.is_floating_point:
            b.reduce_dtype = reduce_dtype
    for i, b in enumerate(buckets):
        _emit_bucket(graph, f"bucket{i}", b, output)
    graph.lint()
    module = _make_graph_module(program.module, graph, class_name=type(program.module).__name__)
    return Program(module, program.inputs, program.outputs,
                   tuple(_account(program.collectives, buckets)))


def _grads(graph: fx.Graph, roles: Sequence[M.OutputRole]) -> list[_Grad]:
    """The gradients returned straight from ``wait(all_reduce(g, op, group))``."""
    returned: dict[fx.Node, list[M.OutputRole]] = {}
    for value, role in zip(graph.output_node().args[0], roles):
        if isinstance(value, fx.Node):
            returned.setdefault(value, []).append(role)
    out = []
    for reduce in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        wait = _waited(reduce)
        if wait is None:
            continue
        wait_roles = returned.get(wait, [])
        if not (wait_roles and set(wait.users) == {graph.output_node()}
                and all(r.kind is M.OutputKind.GRAD for r in wait_roles)):
            continue
        chain = [(reduce, wait)]
        while True:  # the same sum over another axis first: one chain, bucketed as one
            inner = chain[0][0].args[0]
            if not (inner.target == c10d.wait_tensor.default and len(inner.users) == 1
                    and inner.args[0].target == c10d.all_reduce.default
                    and inner.args[0].args[1] == reduce.args[1]
                    and _waited(inner.args[0]) is inner):
                break
            chain.insert(0, (inner.args[0], inner))
        value = chain[0][0].args[0]
        if isinstance(value, fx.Node) and value.op in ("call_function", "placeholder"):
            out.append(_Grad(value, chain, wait_roles[0]))
    return out


def _waited(reduce: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` of an all_reduce over a mesh axis's group (None: not so)."""
    group = reduce.args[2]
    waits = list(reduce.users)
    if len(waits) != 1 or waits[0].target != c10d.wait_tensor.default:
        return None
    if not (isinstance(group, fx.Node) and group.op == "placeholder"
            and group.meta[M.ROLE].kind is M.InputKind.MESH):
        return None
    return waits[0]


def fill_buckets(items: list, *, ready, key, nbytes, cap: int = BUCKET_BYTES) -> list[list]:
    """``items`` in the order they are ready (``ready(item)``: where the program makes it),
    packed per ``key(item)`` into buckets of at most ``cap`` bytes (``nbytes(item)``; a larger
    item gets a bucket of its own); the buckets in the order their last item is ready. DDP's
    rule: no bucket waits on work that comes after it."""
    open_: dict = {}
    done: list[list] = []
    for item in sorted(items, key=ready):
        k = key(item)
        bucket = open_.get(k)
        if bucket is not None and bucket[0] + nbytes(item) > cap:
            done.append(bucket[1])
            bucket = None
        if bucket is None:
            bucket = open_[k] = [0, []]
        bucket[0] += nbytes(item)
        bucket[1].append(item)
    done += [b[1] for b in open_.values()]
    return sorted(done, key=lambda b: ready(b[-1]))


def _buckets(grads: list[_Grad], cap: int, order: dict[fx.Node, int]) -> list[_Bucket]:
    """Buckets per (groups, op, dtype), in the order gradients become ready."""
    filled = fill_buckets(grads, ready=lambda g: order[g.value], nbytes=lambda g: g.nbytes,
                          key=lambda g: (g.groups, g.chain[0][0].args[1],  # groups, op
                                         g.value.meta[M.VAL].dtype),
                          cap=cap)
    return [_Bucket(b[0].groups, b[0].chain[0][0].args[1], b) for b in filled]


def _emit_bucket(graph: fx.Graph, name: str, b: _Bucket, output: fx.Node) -> None:
    def op(target, *args, rename: str | None = None) -> fx.Node:
        node = insert_op(graph, target, *args)
        if rename:
            node._rename(rename)
        return node

    # Flatten and start the reduction as soon as the bucket's last gradient exists. (A bucket
    # of one gradient reduces it flat, without the copy a cat would make.)
    with right_after(b.grads[-1].value):
        flat = []
        for i, g in enumerate(b.grads):
            # reshape, not view: a kernel may lay a gradient out unlike its traced strides
            # (codegen.program); on a dense one it is a view
            flat.append(op(aten.reshape.default, g.value, [-1], rename=f"{name}_in{i}"))
        buffer = op(aten.cat.default, flat, rename=f"{name}_flat") if len(flat) > 1 else flat[0]
        own = buffer.meta[M.VAL].dtype
        if b.reduce_dtype is not None:
            buffer = insert_op(graph, aten._to_copy.default, buffer, dtype=b.reduce_dtype)
            buffer._rename(f"{name}_narrow")
        reduce = op(c10d.all_reduce.default, buffer, b.op, b.groups[0],
                    rename=f"{name}_all_reduce")
    # Wait as late as possible: the gradients' only use is the output. A sum over several
    # axes goes on over the next once the one before is done.
    with graph.inserting_before(output):
        for k, group in enumerate(b.groups[1:], 1):
            done = op(c10d.wait_tensor.default, reduce, rename=f"{name}_wait{k - 1}")
            reduce = op(c10d.all_reduce.default, done, b.op, group,
                        rename=f"{name}_all_reduce{k}")
        reduced = op(c10d.wait_tensor.default, reduce, rename=f"{name}_wait")
        if b.reduce_dtype is not None:
            reduced = insert_op(graph, aten._to_copy.default, reduced, dtype=own)
            reduced._rename(f"{name}_widen")
        parts = [reduced]
        if len(b.grads) > 1:
            sizes = [g.value.meta[M.VAL].numel() for g in b.grads]
            split = op(aten.split_with_sizes.default, reduced, sizes, rename=f"{name}_split")
            parts = [op(operator.getitem, split, i, rename=f"{name}_part{i}")
                     for i in range(len(b.grads))]
        for i, (g, part) in enumerate(zip(b.grads, parts)):
            shape = list(g.value.meta[M.VAL].shape)
            grad = op(aten.view.default, part, shape, rename=f"{name}_out{i}")
            g.chain[-1][1].replace_all_uses_with(grad)
            for reduce, wait in reversed(g.chain):
                graph.erase_node(wait)
                graph.erase_node(reduce)


def _account(collectives: Sequence[Collective], buckets: list[_Bucket]) -> list[Collective]:
    """Drop each bucketed gradient's all_reduce record (``return grad NAME: ... on AXIS``);
    the buckets' records, in bucket order, take the place of the first one dropped."""
    records, replaced = [], set()
    for i, b in enumerate(buckets):
        names = [g.role.name for g in b.grads]
        shown = ", ".join(names[:4]) + (f", and {len(names) - 4} more" if len(names) > 4 else "")
        grads = f"{len(names)} grad{'s' if len(names) > 1 else ''}"
        have = "P" if b.op == "sum" else f"P({b.op})"  # as redistribute words it
        summed = "" if b.reduce_dtype is None else \
            f", summed in {str(b.reduce_dtype).removeprefix('torch.')}"
        for axis in b.axes:
            records.append(Collective("all_reduce", axis, b.sent_bytes,
                                      f"{axis} gradient bucket {i} ({grads}: {shown}{summed}): "
                                      f"{have} -> R on {axis}", purpose=Purpose.BUCKET))
            replaced |= {(axis, g.role) for g in b.grads}
    out = []
    for c in collectives:
        if c.kind == "all_reduce" and (c.axis, c.output) in replaced:
            out += records
            records = []
        else:
            out.append(c)
    return out + records
