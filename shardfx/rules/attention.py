"""Fused attention on CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward.

DTensor has rules for the CUDA flash/efficient/cuDNN kernels but not for the CPU one, which is
what ``F.scaled_dot_product_attention`` becomes in a CPU-traced graph. Without a rule the op
would run replicated (all-gathering q, k and v); with these it runs sharded like its CUDA
sibling, over (B, H, T, D) tensors:

    strategy     q, k, v    out, lse   grads      attn_mask (B|1, 1, T, T)
    replicate    R          R          R          R
    heads        S(1)       S(1)       S(1)       R  (broadcast over heads)
    batch        S(0)       S(0)       S(0)       S(0), or R for a mask of batch 1 (the CPU
                                                      kernel takes a mask of batch 1 or the
                                                      local batch, nothing else)
    sequence     S(2)       S(2)       S(2)       R  (a band of keys: the ring reads its band)

The sequence strategy exists on a mesh with a ``cp`` axis that shardfx plans on
(``planning``): ``codegen.spmd`` runs it as ring attention (``codegen.ring_attention``) on
that axis, and only there. A mask there is a band's (``passes.causal_mask`` refused any
other on such a plan), which the ring computes from its band, never reading the mask.
DTensor's own dispatch (a user's DTensors, PyTorch's context_parallel on CPU) never sees it:
there the op would attend within each rank's tokens.
``shard_propagate`` asks DTensor's propagator for these two ops past its cache, so an answer
given to one never reaches the other.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

aten = torch.ops.aten
R = Replicate()
OPS = (aten._scaled_dot_product_flash_attention_for_cpu.default,
       aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
_PLANNING: dict[int, weakref.ref] = {}  # by id: a user's mesh of the same shape is == to ours


def planning(mesh) -> None:
    """``mesh`` is shardfx's, for planning: the sequence strategy is offered on it."""
    _PLANNING[id(mesh)] = weakref.ref(mesh, lambda _, key=id(mesh): _PLANNING.pop(key, None))


def is_planning(mesh) -> bool:
    """``mesh`` is one shardfx plans on (``planning``), not a user's mesh of the same shape."""
    ours = _PLANNING.get(id(mesh))
    return ours is not None and ours() is mesh


def _mask_batch(op_schema: OpSchema) -> int | None:
    """The attention mask's batch size, or None when there is no mask."""
    mask = op_schema.kwargs_schema.get("attn_mask")
    return mask.shape[0] if isinstance(mask, OpStrategy) else None


def _has_cp(mesh) -> bool:
    return is_planning(mesh) and "cp" in (mesh.mesh_dim_names or ())


def _strategies(n_out: int, n_in: int, mask_batch: int | None, ring: bool = False) -> list[list]:
    """Placement lists [outputs..., tensor inputs..., mask?] for the strategies."""
    rows = []
    for p in (R, Shard(1), Shard(0)) + ((Shard(2),) if ring else ()):
        row = [p] * (n_out + n_in)
        if mask_batch is not None:
            row.append(Shard(0) if p == Shard(0) and mask_batch > 1 else R)
        rows.append(row)
    return rows


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default,
                      schema_info=RuntimeSchemaInfo(3))
def flash_attention_cpu(op_schema: OpSchema) -> OpStrategy:
    # outputs: (out, logsumexp); tensor inputs: q, k, v (+ attn_mask kwarg)
    mesh = op_schema.get_mesh_from_args()
    rows = _strategies(2, 3, _mask_batch(op_schema), _has_cp(mesh))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=2)


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                      schema_info=RuntimeSchemaInfo(6))
def flash_attention_cpu_backward(op_schema: OpSchema) -> OpStrategy:
    # outputs: grad q, k, v; tensor inputs: grad_out, q, k, v, out, logsumexp (+ attn_mask)
    mesh = op_schema.get_mesh_from_args(validate=False)
    rows = _strategies(3, 6, _mask_batch(op_schema), _has_cp(mesh))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=3)
