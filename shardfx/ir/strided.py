"""A strided split: ``_StridedShard(d, split_factor=k)`` on a mesh axis of n ranks (not cp).

Dim ``d`` is ``k`` parts one after another, and each part is split over the n ranks: rank r
holds the r-th slice of every part, in part order. GPT-2's fused attention projection is the
case it is for: ``c_attn``'s 3h outputs are the query's h, the key's h and the value's h, so a
Megatron split of its columns over tp must give each rank its heads of all three
(``_StridedShard(1, split_factor=3)``), and the ``split`` into q, k and v that follows leaves
each of them ``Shard`` on its heads, with no communication. The backward's ``cat`` of their
gradients makes the strided split again.

Viewed as ``(k, n, m)`` (m = size / (k n)), dim ``d`` on rank r is ``[:, r, :]``. Where a split
is made or undone the parts are placed: ``codegen.redistribute`` (in the program: ``emit``
builds graph nodes) and ``runtime.shards`` (parameters cut on load and gathered back: ``emit``
calls the op, ``cp_layout.call``) share the functions below. (On ``cp`` a strided split is the
sequences of a flattened batch, each cut into cp's two chunks: ``cp_layout``.)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import _StridedShard

aten = torch.ops.aten


def factor(p) -> int:
    """The parts one after another in a split dim (``_StridedShard``'s split factor), else 1."""
    return p.split_factor if isinstance(p, _StridedShard) else 1


def take(emit, x, shape: tuple[int, ...], dim: int, coord, n: int, k: int):
    """Rank ``coord``'s slice of each of the ``k`` parts of ``x`` (of ``shape``) along ``dim``,
    concatenated in part order (a new dense tensor)."""
    m = shape[dim] // (k * n)
    parts = emit(aten.view.default, x, [*shape[:dim], k, n, m, *shape[dim + 1:]])
    mine = emit(aten.select.int, parts, dim + 1, coord)  # (..., k, m, ...)
    mine = emit(aten.clone.default, mine, memory_format=torch.contiguous_format)
    return emit(aten.view.default, mine, [*shape[:dim], k * m, *shape[dim + 1:]])


def unshuffle(emit, gathered, shape: tuple[int, ...], n: int, k: int):
    """The whole value, each part in order, from every rank's slices gathered along dim 0 in
    rank order (``gathered``: dense, of ``shape``)."""
    m = shape[0] // (k * n)
    ranks = emit(aten.view.default, gathered, [n, k, m, *shape[1:]])
    whole = emit(aten.clone.default, emit(aten.transpose.int, ranks, 0, 1),
                 memory_format=torch.contiguous_format)  # (k, n, m, ...)
    return emit(aten.view.default, whole, list(shape))


def shuffle(emit, x, shape: tuple[int, ...], n: int, k: int):
    """``x`` (dense, of ``shape``, the parts in order along dim 0) reordered so that an even
    split of dim 0 over the n ranks (a reduce-scatter's) gives each rank its slice of every
    part."""
    m = shape[0] // (k * n)
    parts = emit(aten.view.default, x, [k, n, m, *shape[1:]])
    ranked = emit(aten.clone.default, emit(aten.transpose.int, parts, 0, 1),
                  memory_format=torch.contiguous_format)  # (n, k, m, ...)
    return emit(aten.view.default, ranked, list(shape))
