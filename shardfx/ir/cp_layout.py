"""The cp axis's split of a sequence: two chunks per rank, one from the front, one from the back.

Causal attention makes a token attend to the ones before it, so a contiguous split would give
the last of n ranks n blocks of work and the first one. Here a dimension split over ``cp`` of
size n is cut into 2n equal chunks and rank r holds chunks r and 2n-1-r, in that order (n = 4:
rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4): every rank does the same attention work
(``codegen.ring_attention``), as Megatron's and PyTorch's context parallelism balance it.

Such a split is the placement ``Chunks(d)`` (``StridedChunks(d, k)`` for a dim of k sequences
one after another, tokens flattened from (batch, sequence)), printed ``C(d)`` (``C(d,k)``) in
the IR's text. They are ``Shard(d)`` and ``_StridedShard(d, k)`` to DTensor's rules (equal to
them, hashed alike): every value split on the cp axis has its rows in this order, every operand
of an op alike, so the ops that keep a dimension (pointwise ops, matmuls, norms, reshapes
keeping the split) are unchanged and sums over it do not care; every value that depends on a
position (RoPE's angles, position ids, a dropout mask's element index) enters through a
``Replicate -> Chunks`` on cp, which takes the chunks (``take``). ``passes.shard_propagate``
propagates plain splits and marks those on the cp axis as chunks when it is done (``mark``);
from then on the IR says what each split is. Where a chunked split is made or undone, the two
chunks are placed: ``codegen.redistribute`` (in the program, ``emit`` building graph nodes)
and ``runtime.shards`` (cutting the batch, putting outputs back together; ``emit`` calling the
op) share the functions below.
"""

from __future__ import annotations

import operator

import torch

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

aten = torch.ops.aten
AXIS = "cp"


class Chunks(Shard):
    """Dim ``dim`` split over cp in 2n chunks, rank r holding chunks r and 2n-1-r."""

    def __repr__(self) -> str:
        return f"Chunks(dim={self.dim})"


class StridedChunks(_StridedShard):
    """Dim ``dim`` as ``split_factor`` sequences one after another, each split as ``Chunks``."""

    def __repr__(self) -> str:
        return f"StridedChunks(dim={self.dim}, split_factor={self.split_factor})"


def chunked(p) -> bool:
    """Whether placement ``p`` is a split in balanced chunks."""
    return isinstance(p, (Chunks, StridedChunks))


def as_chunks(p):
    """``p``, a split made on the cp axis, as the chunked split it is (else ``p``)."""
    if type(p) is _StridedShard:
        return StridedChunks(p.dim, split_factor=p.split_factor)
    if type(p) is Shard:
        return Chunks(p.dim)
    return p


def plain(p):
    """``p`` as DTensor's rules know it: a chunked split as the plain split it is to them."""
    if isinstance(p, StridedChunks):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return Shard(p.dim) if isinstance(p, Chunks) else p


def mark(placements, axis: int):
    """``placements`` (one per mesh axis; a tuple of such per output of a multi-output op; None)
    with the split on mesh axis ``axis`` (cp's) made chunks."""
    if placements is None or not placements:
        return placements
    if isinstance(placements[0], tuple) or placements[0] is None:
        return tuple(mark(p, axis) for p in placements)
    return tuple(as_chunks(p) if i == axis else p for i, p in enumerate(placements))


def call(op, *args, **kwargs):
    """``emit`` for tensors in hand: run the op."""
    return op(*args, **kwargs)


def take(emit, x, shape: tuple[int, ...], dim: int, coord, n: int, sf: int = 1):
    """Rank ``coord``'s part of ``x`` (of ``shape``) along ``dim``: chunks coord and 2n-1-coord,
    concatenated (a new dense tensor). ``sf`` > 1: the dim is ``sf`` sequences one after
    another (tokens flattened from (batch, sequence): DTensor's ``_StridedShard``), each cut."""
    length = shape[dim] // sf
    if sf > 1:
        x = emit(aten.view.default, x, [*shape[:dim], sf, length, *shape[dim + 1:]])
    at = dim + 1 if sf > 1 else dim
    c = length // (2 * n)
    front = emit(aten.narrow.default, x, at, emit(operator.mul, coord, c), c)
    back_start = emit(operator.mul, emit(operator.sub, 2 * n - 1, coord), c)
    back = emit(aten.narrow.default, x, at, back_start, c)
    out = emit(aten.cat.default, [front, back], at)
    if sf > 1:
        out = emit(aten.view.default, out, [*shape[:dim], shape[dim] // n, *shape[dim + 1:]])
    return out


def unshuffle(emit, gathered, shape: tuple[int, ...], n: int, sf: int = 1):
    """The whole value, in sequence order, from every rank's part gathered along dim 0 in
    rank order (``gathered``: dense, of ``shape``; ``sf`` sequences along dim 0, as ``take``)."""
    c = shape[0] // (2 * n * sf)
    parts = emit(aten.view.default, gathered, [n, sf, 2, c, *shape[1:]])
    front = emit(aten.select.int, parts, 2, 0)  # chunks 0 .. n-1, in rank order
    back = emit(aten.flip.default, emit(aten.select.int, parts, 2, 1), [0])  # n .. 2n-1
    whole = emit(aten.cat.default, [front, back], 0)  # (2n, sf, c, ...)
    if sf > 1:  # each sequence's chunks together
        whole = emit(aten.clone.default, emit(aten.transpose.int, whole, 0, 1),
                     memory_format=torch.contiguous_format)
    return emit(aten.view.default, whole, list(shape))


def shuffle(emit, x, shape: tuple[int, ...], n: int, sf: int = 1):
    """``x`` (dense, of ``shape``, in sequence order along dim 0; ``sf`` sequences, as
    ``take``) reordered so that an even split of dim 0 over the n ranks (a reduce-scatter's)
    gives each rank its two chunks of each sequence."""
    c = shape[0] // (2 * n * sf)
    halves = emit(aten.view.default, x, [sf, 2, n, c, *shape[1:]])
    front = emit(aten.select.int, halves, 1, 0)  # (sf, n, c, ...)
    back = emit(aten.flip.default, emit(aten.select.int, halves, 1, 1), [1])
    paired = emit(aten.stack.default, [front, back], 2)  # (sf, n, 2, c, ...)
    if sf > 1:  # rank-major
        paired = emit(aten.clone.default, emit(aten.transpose.int, paired, 0, 1),
                      memory_format=torch.contiguous_format)
    return emit(aten.view.default, paired, list(shape))


def split_factor(p) -> int:
    """Sequences one after another in a split dim (``_StridedShard``'s), else 1."""
    return getattr(p, "split_factor", 1)


def chunks(coord: int, n: int) -> tuple[int, int]:
    """The two chunks rank ``coord`` holds, of 2n."""
    return coord, 2 * n - 1 - coord
