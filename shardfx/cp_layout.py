"""The cp axis's split of a sequence: two chunks per rank, one from the front, one from the back.

Causal attention makes a token attend to the ones before it, so a contiguous split would give
the last of n ranks n blocks of work and the first one. Here a dimension split over ``cp`` of
size n is cut into 2n equal chunks and rank r holds chunks r and 2n-1-r, in that order (n = 4:
rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4): every rank does the same attention work
(``codegen.ring_attention``), as Megatron's and PyTorch's context parallelism balance it.

The placement stays ``Shard(d)``: every value split on the cp axis has its rows in this order,
every operand of an op alike, so the ops that keep a dimension (pointwise ops, matmuls, norms,
reshapes keeping the split) are unchanged and sums over it do not care; every value that depends
on a position (RoPE's angles, position ids, a dropout mask's element index) enters through a
``Replicate -> Shard`` on cp, which takes the chunks (``take``). Where a cp split is made or
undone, the two chunks are placed: ``codegen.redistribute`` (in the program, ``emit`` building
graph nodes) and ``runtime.shards`` (cutting the batch, putting outputs back together; ``emit``
calling the op) share the functions below.
"""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten
AXIS = "cp"


def call(op, *args, **kwargs):
    """``emit`` for tensors in hand: run the op."""
    return op(*args, **kwargs)


def take(emit, x, dim: int, length: int, coord, n: int):
    """Rank ``coord``'s part of ``x`` (``length`` long along ``dim``): chunks coord and
    2n-1-coord, concatenated (a new dense tensor)."""
    c = length // (2 * n)
    front = emit(aten.narrow.default, x, dim, emit(operator.mul, coord, c), c)
    back_start = emit(operator.mul, emit(operator.sub, 2 * n - 1, coord), c)
    back = emit(aten.narrow.default, x, dim, back_start, c)
    return emit(aten.cat.default, [front, back], dim)


def unshuffle(emit, gathered, shape: tuple[int, ...], n: int):
    """The whole value, in sequence order, from every rank's part gathered along dim 0 in
    rank order (``gathered``: dense, of ``shape``)."""
    c = shape[0] // (2 * n)
    parts = emit(aten.view.default, gathered, [n, 2, c, *shape[1:]])
    front = emit(aten.select.int, parts, 1, 0)  # chunks 0 .. n-1, in rank order
    back = emit(aten.flip.default, emit(aten.select.int, parts, 1, 1), [0])  # n .. 2n-1
    whole = emit(aten.cat.default, [front, back], 0)
    return emit(aten.view.default, whole, list(shape))


def shuffle(emit, x, shape: tuple[int, ...], n: int):
    """``x`` (dense, of ``shape``, in sequence order along dim 0) reordered so that an even
    split of dim 0 over the n ranks (a reduce-scatter's) gives each rank its two chunks."""
    c = shape[0] // (2 * n)
    halves = emit(aten.view.default, x, [2, n, c, *shape[1:]])
    front = emit(aten.select.int, halves, 0, 0)
    back = emit(aten.flip.default, emit(aten.select.int, halves, 0, 1), [0])
    paired = emit(aten.stack.default, [front, back], 1)  # (n, 2, c, ...): rank r's chunks
    return emit(aten.view.default, paired, list(shape))


def chunks(coord: int, n: int) -> tuple[int, int]:
    """The two chunks rank ``coord`` holds, of 2n."""
    return coord, 2 * n - 1 - coord
