"""Rules for a strided split (``_StridedShard(d, split_factor=k)`` on tp: see ``shardfx.ir.strided``).

DTensor's strategies place ``Shard`` only: given a strided operand they gather it. A strided
split is a ``Shard`` of the same dim whose indices are permuted (each part's slice per rank),
so an op that treats every index of that dim alike -- pointwise ops, matmuls, transposes, sums,
views that keep the dim whole -- runs on it as on a ``Shard``, and its result is permuted the
same way. For those ops the rule is DTensor's, asked with ``Shard`` in place of each strided
split, kept only where it runs the strided operands as they are; its answer's splits on that
axis become strided again (``EQUIVARIANT``). Two ops make and undo the split:

    op                                   operand                  result
    split(x, size / k, d) into k parts   _StridedShard(d, k)      each part Shard(d)
    cat([x1 .. xk], d), equal parts      each Shard(d)            _StridedShard(d, k)

(GPT-2's attention: ``c_attn``'s output split into q, k and v; their gradients concatenated in
the backward.) Any other op reading a strided operand gets no answer here: DTensor's rule
gathers it. Not on cp, whose strided split is a flattened batch's sequences (``cp_layout``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._pointwise_ops import pointwise_ops
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.ir import cp_layout
from shardfx.ir import meta as M

aten = torch.ops.aten
EQUIVARIANT = frozenset(pointwise_ops) | {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.t.default, aten.transpose.int, aten.permute.default,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.sum.dim_IntList, aten.mean.dim, aten.sum.default,
    aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default,
}
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def answer(node: fx.Node, have: dict, ask):
    """(result, the specs the operands must have, the schema to take local arguments from) for
    ``node`` where a rule above applies, else None. ``have``: operand -> DTensorSpec; ``ask``:
    DTensor's rule, ``ask(node, have)`` (``shard_propagate._ask``)."""
    axes = _strided_axes(have.values())
    if node.target is aten.cat.default:
        return _cat(node, have) if not axes else None
    if not axes:
        return None
    if node.target in SPLITS:
        return _split(node, have, axes)
    if node.target in EQUIVARIANT and \
            torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return _as_shard(node, have, axes, ask)  # (a random op's draws depend on positions)
    return None


def _strided_axes(specs) -> dict[int, int]:
    """Mesh axis -> split factor of the strided splits (not cp's) among ``specs``; every
    strided split on an axis must have one factor."""
    out = {}
    for s in specs:
        for i, p in enumerate(s.placements):
            if type(p) is _StridedShard and p.split_factor > 1 and \
                    s.mesh.mesh_dim_names[i] != cp_layout.AXIS:
                if out.setdefault(i, p.split_factor) != p.split_factor:
                    out[i] = 0  # two factors on one axis: no rule
    return out if all(out.values()) else {}


def _spec(s: DTensorSpec, placements) -> DTensorSpec:
    return DTensorSpec(s.mesh, tuple(placements), s.tensor_meta)


def _as_shard(node, have, axes: dict[int, int], ask):
    plain = {n: _spec(s, [Shard(p.dim) if i in axes and type(p) is _StridedShard else p
                          for i, p in enumerate(s.placements)]) for n, s in have.items()}
    got = ask(node, plain)
    if got is None:
        return None
    result, target_specs, target = got
    operands = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    for n, want in zip(operands, target_specs):
        if have[n].placements != plain[n].placements and want.placements != plain[n].placements:
            return None  # the rule would move a strided operand: gathered by DTensor's instead
    sizes = {have[n].tensor_meta.shape[p.dim] for n in operands
             for i, p in enumerate(have[n].placements) if i in axes and type(p) is _StridedShard}

    def strided(s: DTensorSpec | None):
        if s is None:
            return None
        placements = list(s.placements)
        for i, k in axes.items():
            p = placements[i]
            if type(p) is Shard:
                if s.tensor_meta is not None and s.tensor_meta.shape[p.dim] not in sizes:
                    raise _NotKept  # a dim the op made: not the parts' order
                placements[i] = _StridedShard(p.dim, split_factor=k)
        return _spec(s, placements)

    try:
        out = result.output_spec
        out = tuple(strided(s) for s in out) if isinstance(out, (tuple, list)) else strided(out)
        specs = [strided(s) for s in target_specs]
        target = OpSchema(target.op, *pytree.tree_map_only(
            DTensorSpec, strided, (tuple(target.args_schema), dict(target.kwargs_schema))),
            schema_info=target.schema_info)
    except _NotKept:
        return None
    return OutputSharding(out, redistribute_schema=target, needs_redistribute=True,
                          use_val_from_redistribute_schema=result.use_val_from_redistribute_schema
                          ), specs, target


class _NotKept(Exception):
    """A split on the strided axis of a dim whose size no strided operand has."""


def _split(node, have, axes: dict[int, int]):
    x = node.args[0]
    s = have[x]
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(
        s.tensor_meta.shape)
    size = s.tensor_meta.shape[dim]
    if len(axes) != 1:
        return None
    (i, k), = axes.items()
    p = s.placements[i]
    if type(p) is not _StridedShard or p.dim != dim:
        return None
    parts = node.args[1]
    parts = [parts] * (size // parts) if isinstance(parts, int) else list(parts)
    if len(parts) != k or any(q * k != size for q in parts):
        return None  # not the k equal parts the split is made of
    n = s.mesh.shape[i]
    vals = node.meta[M.VAL]
    placements = [Shard(dim) if j == i else q for j, q in enumerate(s.placements)]
    out = tuple(DTensorSpec(s.mesh, tuple(placements), _meta(v)) for v in vals)
    local = parts[0] // n if node.target is aten.split.Tensor else [q // n for q in parts]
    target = OpSchema(node.target, (s, local, dim), {})
    return OutputSharding(out, redistribute_schema=target, needs_redistribute=False,
                          use_val_from_redistribute_schema=True), [s], target


def _cat(node, have):
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if len(tensors) < 2:
        return None
    specs = [have[t] for t in tensors]
    first = specs[0]
    ndim = len(first.tensor_meta.shape)
    dim %= ndim
    if any(s.placements != first.placements or s.tensor_meta.shape != first.tensor_meta.shape
           for s in specs):
        return None  # equal parts, placed alike
    axes = [i for i, p in enumerate(first.placements)
            if type(p) is Shard and p.dim == dim and first.mesh.mesh_dim_names[i] != cp_layout.AXIS]
    if len(axes) != 1 or any(type(p) is _StridedShard for p in first.placements):
        return None
    (i,) = axes
    k = len(tensors)
    placements = [_StridedShard(dim, split_factor=k) if j == i else p
                  for j, p in enumerate(first.placements)]
    out = DTensorSpec(first.mesh, tuple(placements), _meta(node.meta[M.VAL]))
    target = OpSchema(node.target, ([*specs], dim), {})
    return OutputSharding(out, redistribute_schema=target, needs_redistribute=False,
                          use_val_from_redistribute_schema=False), specs, target


def _meta(v: torch.Tensor):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(v.shape, v.stride(), v.dtype)
