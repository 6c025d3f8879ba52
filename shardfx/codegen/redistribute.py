"""Redistribution as graph code: turn a value's placements into the ones an op needs.

Each mesh axis is handled on its own, with torch's functional collectives, so the program reads
as plain ATen plus collectives (a tensor dim split over several axes is nested in mesh order:
its splits are gathered innermost first, and made outermost first):

    have -> want          emitted on that axis
    P    -> R             all_reduce(sum), then / n for P(avg)
    P    -> S(d)          reduce_scatter along d
    S(d) -> R             all_gather along d
    R    -> S(d)          narrow(d, coord * size, size)    (no communication; copied dense
                                                            when the slice is strided)
    R    -> P             x / n for P(sum): every rank holds a share that sums back to x
    S(a) -> S(b), S -> P  through R

On ``cp`` a rank holds two chunks of the dim, one from the front and one from the back
(``cp_layout``): its narrow is two, concatenated; a gather puts the chunks back in order and a
reduce-scatter's input is ordered so that each rank receives its two. A strided split on
another axis (``_StridedShard``: GPT-2's fused q, k, v columns, see ``strided``) is placed the
same way: its slice of each part taken, its parts put back in order after a gather, and ordered
before a reduce-scatter.

Process-group names and the rank's coordinate on each axis are program inputs (``group_tp``,
``coord_tp``), never constants: one program serves every rank (the SPMD property).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.ir import cp_layout

from shardfx.ir import strided
from shardfx.ir import meta as M

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@dataclass
class MeshInputs:
    """The per-rank program inputs for one mesh axis, created on first use."""

    axis: str
    size: int
    group: fx.Node
    coord: fx.Node


class Purpose(str, Enum):
    """What a collective is for."""

    OPERAND = "operand"  # an op's operand, or a returned value, moved to the placement it needs
    BUCKET = "bucket"  # a bucket of gradients summed over an axis (``codegen.bucketing``)
    ZERO = "zero"  # ZeRO's gradient rows or parameter gathers (``passes.zero``, ``codegen.zero``)
    EXPERTS = "experts"  # the experts' all-to-alls on ep (``codegen.expert_parallel``)


@dataclass(frozen=True)
class Collective:
    """One collective the program issues: for communication accounting."""

    kind: str  # all_reduce | all_gather | reduce_scatter
    axis: str
    nbytes: int  # bytes of the local tensor the collective takes in
    reason: str  # "node_name: S(0) -> R"
    module: str = ""  # the model's module whose op needs it ("model.layers.0.mlp.down_proj")
    phase: str = ""  # that op's: fwd | bwd
    output: M.OutputRole | None = None  # the returned value it makes (a gradient's sum), if any
    purpose: Purpose = Purpose.OPERAND


Emit = Callable[..., fx.Node]  # emit(op, *args) -> node with its local value filled in


def redistribute(emit: Emit, x: fx.Node, have: M.Placements, want: M.Placements,
                 mesh: list[MeshInputs], reason: str, log: list[Collective],
                 module: tuple[str, str] = ("", ""), output: M.OutputRole | None = None
                 ) -> fx.Node:
    have = list(have)
    # Sums first, on the smaller local values; then gathers, the last axis first: a dim split
    # over several axes is nested in mesh order, so the innermost split is gathered before the
    # one around it; then the rest.
    for i, (h, w) in enumerate(zip(have, want)):
        if isinstance(h, Partial) and isinstance(w, Replicate):
            x = _one(emit, x, h, w, mesh[i], reason, log, module, output)
            have[i] = w
    for i in reversed(range(len(have))):
        if split(have[i]) and have[i] != want[i]:
            x = _one(emit, x, have[i], Replicate(), mesh[i], reason, log, module, output)
            have[i] = Replicate()
    for i, (h, w) in enumerate(zip(have, want)):
        if h == w:
            continue
        if isinstance(h, Partial) and isinstance(w, Partial):
            x = _one(emit, x, h, Replicate(), mesh[i], reason, log, module, output)
            h = Replicate()
        x = _one(emit, x, h, w, mesh[i], reason, log, module, output)
    return x


def _one(emit: Emit, x: fx.Node, h, w, axis: MeshInputs, reason: str, log: list,
         module: tuple[str, str], output: M.OutputRole | None = None) -> fx.Node:
    """``module``: (module, phase) of the op that needs it, for the record."""
    n = axis.size
    why = f"{reason}: {M.placements_str((h,))} -> {M.placements_str((w,))} on {axis.axis}"
    if isinstance(h, Partial) and isinstance(w, Replicate):
        log.append(Collective("all_reduce", axis.axis, _bytes(x), why, *module, output=output))
        x = _dim_to_front(emit, x, 0)  # collectives read dense memory: a transposed view is not
        x = emit(c10d.wait_tensor.default, emit(c10d.all_reduce.default, x, "sum", axis.group))
        return emit(aten.div.Tensor, x, n) if h.reduce_op == "avg" else x
    if isinstance(h, Partial) and split(w):
        log.append(Collective("reduce_scatter", axis.axis, _bytes(x), why, *module, output=output))
        x = _dim_to_front(emit, x, w.dim)
        if cp_layout.chunked(w):
            x = cp_layout.shuffle(emit, x, tuple(x.meta[M.VAL].shape), n,
                                  cp_layout.split_factor(w))
        elif strided.factor(w) > 1:
            x = strided.shuffle(emit, x, tuple(x.meta[M.VAL].shape), n, strided.factor(w))
        x = emit(c10d.wait_tensor.default,
                 emit(c10d.reduce_scatter_tensor.default, x, "sum", n, axis.group))
        x = _dim_from_front(emit, x, w.dim)
        return emit(aten.div.Tensor, x, n) if h.reduce_op == "avg" else x
    if split(h) and isinstance(w, Replicate):
        log.append(Collective("all_gather", axis.axis, _bytes(x), why, *module, output=output))
        x = _dim_to_front(emit, x, h.dim)
        x = emit(c10d.wait_tensor.default,
                 emit(c10d.all_gather_into_tensor.default, x, n, axis.group))
        if cp_layout.chunked(h):
            x = cp_layout.unshuffle(emit, x, tuple(x.meta[M.VAL].shape), n,
                                    cp_layout.split_factor(h))
        elif strided.factor(h) > 1:
            x = strided.unshuffle(emit, x, tuple(x.meta[M.VAL].shape), n, strided.factor(h))
        return _dim_from_front(emit, x, h.dim)
    if isinstance(h, Replicate) and cp_layout.chunked(w):
        return cp_layout.take(emit, x, tuple(x.meta[M.VAL].shape), w.dim, axis.coord, n,
                              cp_layout.split_factor(w))
    if isinstance(h, Replicate) and strided.factor(w) > 1:
        return strided.take(emit, x, tuple(x.meta[M.VAL].shape), w.dim, axis.coord, n,
                            strided.factor(w))
    if isinstance(h, Replicate) and isinstance(w, Shard):
        size = x.meta[M.VAL].shape[w.dim] // n
        start = emit(operator.mul, axis.coord, size)
        x = emit(aten.narrow.default, x, w.dim, start, size)
        # A slice along a later dim is strided; kernels such as CPU native_layer_norm_backward
        # read their saved statistics as dense memory and silently misread it: leave dense.
        if not x.meta[M.VAL].is_contiguous():
            x = emit(aten.clone.default, x, memory_format=torch.contiguous_format)
        return x
    if isinstance(h, Replicate) and isinstance(w, Partial):
        return emit(aten.div.Tensor, x, n) if w.reduce_op == "sum" else x
    raise NotImplementedError(f"redistribution {h} -> {w}")


def split(p) -> bool:
    """A split of a dim over the axis: ``Shard``, or ``_StridedShard`` (``strided``)."""
    return isinstance(p, (Shard, _StridedShard))


def _dim_to_front(emit: Emit, x: fx.Node, dim: int) -> fx.Node:
    """Collectives split and concatenate along dim 0 and read dense memory: bring ``dim``
    there, contiguous."""
    dim = dim % max(1, x.meta[M.VAL].dim())
    if dim != 0:
        x = emit(aten.transpose.int, x, 0, dim)
    if dim != 0 or not x.meta[M.VAL].is_contiguous():
        x = emit(aten.clone.default, x, memory_format=torch.contiguous_format)
    return x


def _dim_from_front(emit: Emit, x: fx.Node, dim: int) -> fx.Node:
    """Undo ``_dim_to_front``, contiguous again: some kernels (the CPU flash attention among
    them) silently misread a last dim whose stride is not 1, so values leave redistribution in
    the dense layout the ops that made them had."""
    dim = dim % max(1, x.meta[M.VAL].dim())
    if dim == 0:
        return x
    x = emit(aten.transpose.int, x, 0, dim)
    return emit(aten.clone.default, x, memory_format=torch.contiguous_format)


def _bytes(x: fx.Node) -> int:
    v = x.meta[M.VAL]
    return v.numel() * v.element_size()
