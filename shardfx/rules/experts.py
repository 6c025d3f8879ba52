"""Mixture-of-experts layers (``shardfx::experts`` and its backward, ``shardfx.experts``).

The experts compute each token's output from that token alone, so the op splits like a
row-wise op over tokens (T, ...), its expert weights (E, ...) replicated; on the ``ep`` axis of a
mesh shardfx plans on, the weights may be split by expert as well (each rank holding E/ep of
them), which ``codegen.spmd`` runs as expert parallelism: each rank's tokens sent by all-to-all
to the ranks holding their experts and the results brought back (``codegen.expert_parallel``).

    strategy   x, index, weights   w_in, w_out, b_in, b_out   y, xd, h, zs    their gradients
    replicate  R                   R                          R               R
    tokens     S(0)                R                          S(0)            S(0); weights' P
    experts    S(0)                S(0)                       S(0)            S(0)   (ep only)
    hidden     R                   S(I), S(I), S(I), P        P, R, S(I), P   P; S(I) x3, R

``hidden`` is tensor parallelism inside each expert (Megatron's MLP, per expert): every
expert's intermediate dimension I split, ``w_in``'s and ``b_in``'s (its gate and up halves
each where they stand side by side: a strided split, ``shardfx.ir.strided``; interleaved, a
plain split keeps each (gate, up) pair on one rank) and ``w_out``'s, so each rank computes its
part of every row's MLP and the layer's output is a partial sum. The down projection's bias
joins that sum as a partial value (each rank adds 1/tp of it, the way DTensor makes a
replicated value partial), and its gradient, made from the whole output gradient, is
replicated. The backward reads ``zs`` as the partial sum the forward made
(``passes.shard_propagate``'s ``CARRIES_PARTIAL``): the routing weights' gradient is linear in
it. The biases are optional (GPT-OSS has them): an absent one has no placement.

``xd`` and ``h`` (the rows each held expert received, and their first projection) are split as
their tokens are: each rank keeps its own. Under expert parallelism without a capacity their
row count follows the routing; the program's shapes are the even routing's (``forward_shapes``).
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import (expand_to_full_mesh_op_strategy,
                                                register_op_strategy)

from shardfx.kernels.expert_compute import Form
from shardfx.kernels.experts import EXPERTS, EXPERTS_BACKWARD, TENSORS
from shardfx.rules.attention import is_planning

OPS = (EXPERTS, EXPERTS_BACKWARD)
R, S0, P = Replicate(), Shard(0), Partial()
AXIS = "ep"


def _rows(outputs: int, inputs: int, weights_at: tuple[int, ...],
          weight_grads: tuple[int, ...] = ()) -> list[list]:
    """[outputs..., inputs...] for the strategies ``replicate``, ``tokens`` and ``experts`` on
    one mesh dim: the outputs and the inputs other than the weights split on dim 0 (tokens), the
    weights at ``weights_at`` (expert weights and biases) replicated (their gradients, outputs
    ``weight_grads``, partial) or split by expert."""
    rows = [[R] * (outputs + inputs)]
    for experts in (False, True):
        out = [S0] * outputs
        for i in weight_grads:
            out[i] = S0 if experts else P
        ins = [S0] * inputs
        for i in weights_at:
            ins[i] = S0 if experts else R
        rows.append(out + ins)
    return rows


def _on_ep_only(weights_at: int):
    """Keeps the strategies whose weights are split on dim 0 only on the ``ep`` axis of a mesh
    shardfx plans on."""
    def valid(input_specs, _output_specs) -> bool:
        spec = input_specs[weights_at]
        names = spec.mesh.mesh_dim_names or ()
        return all(p != S0 or (names[i] == AXIS and is_planning(spec.mesh))
                   for i, p in enumerate(spec.placements))
    return valid


def hidden_split(form: Form) -> tuple:
    """(w_in's, w_out's, h's, b_in's) placements splitting each expert's intermediate
    dimension: ``w_in`` (E, 2I, H) or, transposed, (E, H, 2I), its gate and up halves each
    split where they stand side by side; ``w_out`` (E, H, I) or (E, I, H); ``h`` (rows, 2I)
    and ``b_in`` (E, 2I) as ``w_in``'s output."""
    side_by_side = form.gate.gated and not form.gate.interleaved
    split = (lambda d: _StridedShard(d, split_factor=2)) if side_by_side else Shard
    return split(2 if form.transposed else 1), Shard(1 if form.transposed else 2), split(1), \
        split(1)


def _biases(rows: list[list], op_schema: OpSchema, at: int, grads_at: int | None = None
            ) -> list[list]:
    """``rows`` for experts without one or both biases (the op's args ``at``, ``at + 1``
    None): no placement for the absent one (a row's last two places are the biases'), and its
    gradient (output ``grads_at`` or ``grads_at + 1``, an empty tensor) replicated."""
    absent = [i for i in (0, 1) if op_schema.args_schema[at + i] is None]
    out = []
    for row in rows:
        row = list(row)
        for i in absent:
            row[len(row) - 2 + i] = None
            if grads_at is not None:
                row[grads_at + i] = R
        out.append(row)
    return out


@register_op_strategy(EXPERTS, schema_info=RuntimeSchemaInfo(TENSORS))
def experts(op_schema: OpSchema) -> OpStrategy:
    # outputs: y, xd, h, zs; tensor inputs: x, index, weights, w_in, w_out, b_in, b_out
    mesh = op_schema.get_mesh_from_args()
    w_in, w_out, h, b_in = hidden_split(Form.from_args(op_schema.args_schema))
    rows = _rows(4, 7, (3, 4, 5, 6)) + [[P, R, h, P, R, R, R, w_in, w_out, b_in, P]]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _biases(rows, op_schema, 5),
                                           input_index=4, is_valid_strategy_cb=_on_ep_only(3))


@register_op_strategy(EXPERTS_BACKWARD, schema_info=RuntimeSchemaInfo(TENSORS + 4))
def experts_backward(op_schema: OpSchema) -> OpStrategy:
    # outputs: grad x, weights, w_in, w_out, b_in, b_out; tensor inputs: grad_y, x, index,
    # weights, w_in, w_out, xd, h, zs, b_in, b_out
    mesh = op_schema.get_mesh_from_args(validate=False)
    w_in, w_out, h, b_in = hidden_split(Form.from_args(op_schema.args_schema))
    rows = _rows(6, 11, (4, 5, 9, 10), weight_grads=(2, 3, 4, 5)) + \
        [[P, P, w_in, w_out, b_in, R, R, R, R, R, w_in, w_out, R, h, P, b_in, R]]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _biases(rows, op_schema, 9, 4),
                                           input_index=6, is_valid_strategy_cb=_on_ep_only(4))
