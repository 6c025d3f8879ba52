"""shard_propagate alone, on IR text: from the inputs' ANNOTATION, a SHARDING on every op.

Each test writes the graph as ``shard_propagate`` should leave it, with every op's placements
(``# fwd S(0)S(1)``); the pass runs on that text with the ops' placements taken out (the
inputs keep theirs) and must print it back exactly. Where the text does not show it, the
placements an op needs its operands in (``NodeSharding.inputs``: where a collective goes) are
asserted too. The graphs are a two-linear MLP, ``fc1`` column-parallel and ``fc2``
row-parallel over tp as ``shard_annotate``'s Megatron plan places them.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.shard_propagate import shard_propagate
from shardfx.request.options import Options


def unplaced(text: str) -> str:
    """``text`` with the ops' placements taken out: what the pass starts from."""
    return re.sub(r"# (fwd|bwd) .*$", r"# \1", text, flags=re.M)


def propagate(expected: str, shard="megatron"):
    """The graph of ``expected`` without op placements, after ``shard_propagate``."""
    gm = text_to_ir(unplaced(expected))
    mesh = MeshSpec(gm.meta[M.GRAPH].mesh)
    return shard_propagate(gm, Options(mesh=mesh, shard=shard))


def needs(gm) -> dict[str, str]:
    """Each op's required operand placements, as printed: ``(P, S(1), S(0))``."""
    return {n.name: M.placements_str(n.meta[M.SHARDING].inputs) for n in gm.graph.nodes
            if M.SHARDING in n.meta}


TP = textwrap.dedent("""\
    graph train MLP mesh tp=2
      fc1_weight: f32[8, 4] = param fc1.weight  # S(0)
      fc1_bias: f32[8] = param fc1.bias  # S(0)
      fc2_weight: f32[4, 8] = param fc2.weight  # S(1)
      fc2_bias: f32[4] = param fc2.bias  # R
      args_0: f32[4, 4] = input args[0]  # R
      tangent_loss: f32[] = tangent loss  # R
      t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd S(1)
      addmm: f32[4, 8] = aten.addmm.default(fc1_bias, args_0, t)  # fwd S(1)
      relu: f32[4, 8] = aten.relu.default(addmm)  # fwd S(1)
      t_1: f32[8, 4] = aten.t.default(fc2_weight)  # fwd S(0)
      addmm_1: f32[4, 4] = aten.addmm.default(fc2_bias, relu, t_1)  # fwd P
      add: f32[4, 4] = aten.add.Tensor(addmm_1, args_0)  # fwd R
      sum_1: f32[] = aten.sum.default(add)  # fwd R
      output loss loss = sum_1
    """)


def test_column_then_row_parallel_is_one_partial_sum_reduced_before_the_residual():
    gm = propagate(TP)
    assert ir_to_text(gm) == TP
    need = needs(gm)
    assert need["addmm"] == "(S(0), R, S(1))"  # column-parallel: no collective
    assert need["addmm_1"] == "(P, S(1), S(0))"  # row-parallel: the bias added on one rank
    assert need["add"] == "(R, R)"  # the all-reduce, once, before the residual add
    assert need["sum_1"] == "(R)"


DP_TP = textwrap.dedent("""\
    graph train MLP mesh dp=2,tp=2
      fc1_weight: f32[8, 4] = param fc1.weight  # RS(0)
      fc1_bias: f32[8] = param fc1.bias  # RS(0)
      fc2_weight: f32[4, 8] = param fc2.weight  # RS(1)
      fc2_bias: f32[4] = param fc2.bias  # RR
      args_0: f32[4, 4] = input args[0]  # S(0)R
      tangent_loss: f32[] = tangent loss  # RR
      t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd RS(1)
      addmm: f32[4, 8] = aten.addmm.default(fc1_bias, args_0, t)  # fwd S(0)S(1)
      relu: f32[4, 8] = aten.relu.default(addmm)  # fwd S(0)S(1)
      t_1: f32[8, 4] = aten.t.default(fc2_weight)  # fwd RS(0)
      addmm_1: f32[4, 4] = aten.addmm.default(fc2_bias, relu, t_1)  # fwd S(0)P
      add: f32[4, 4] = aten.add.Tensor(addmm_1, args_0)  # fwd S(0)R
      sum_1: f32[] = aten.sum.default(add)  # fwd PR
      output loss loss = sum_1
    """)


def test_a_dp_split_batch_stays_split_and_the_loss_is_a_partial_sum_over_dp():
    gm = propagate(DP_TP)
    assert ir_to_text(gm) == DP_TP
    assert needs(gm)["add"] == "(S(0)R, S(0)R)"  # tp's partial sum reduced, the batch kept
    assert needs(gm)["output"] == "(RR)"  # the loss is returned whole: reduced over dp


JOINT = textwrap.dedent("""\
    graph train MLP mesh dp=2,tp=2
      fc1_weight: f32[8, 4] = param fc1.weight  # RS(0)
      fc1_bias: f32[8] = param fc1.bias  # RS(0)
      fc2_weight: f32[4, 8] = param fc2.weight  # RS(1)
      fc2_bias: f32[4] = param fc2.bias  # RR
      args_0: f32[4, 4] = input args[0]  # S(0)R
      tangent_loss: f32[] = tangent loss  # RR
      t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd RS(1)
      addmm: f32[4, 8] = aten.addmm.default(fc1_bias, args_0, t)  # fwd S(0)S(1)
      relu: f32[4, 8] = aten.relu.default(addmm)  # fwd S(0)S(1)
      t_1: f32[8, 4] = aten.t.default(fc2_weight)  # fwd RS(0)
      addmm_1: f32[4, 4] = aten.addmm.default(fc2_bias, relu, t_1)  # fwd S(0)P
      sum_1: f32[] = aten.sum.default(addmm_1)  # fwd PP
      expand: f32[4, 4] = aten.expand.default(tangent_loss, [4, 4])  # bwd RR
      mm: f32[4, 8] = aten.mm.default(expand, fc2_weight)  # bwd RS(1)
      t_2: f32[4, 4] = aten.t.default(expand)  # bwd RR
      mm_1: f32[4, 8] = aten.mm.default(t_2, relu)  # bwd PS(1)
      sum_2: f32[1, 4] = aten.sum.dim_IntList(expand, [0], True)  # bwd RR
      view: f32[4] = aten.view.default(sum_2, [4])  # bwd RR
      threshold_backward: f32[4, 8] = aten.threshold_backward.default(mm, relu, 0)  # bwd S(0)S(1)
      t_3: f32[8, 4] = aten.t.default(threshold_backward)  # bwd S(1)S(0)
      mm_2: f32[8, 4] = aten.mm.default(t_3, args_0)  # bwd PS(0)
      sum_3: f32[1, 8] = aten.sum.dim_IntList(threshold_backward, [0], True)  # bwd PS(1)
      view_1: f32[8] = aten.view.default(sum_3, [8])  # bwd PS(0)
      output loss loss = sum_1
      output grad fc1.weight = mm_2
      output grad fc1.bias = view_1
      output grad fc2.weight = mm_1
      output grad fc2.bias = view
    """)


def test_weight_gradients_are_split_like_their_weights_and_partial_over_dp():
    """The backward, trimmed by hand from a captured MLP's (with a sum loss): each weight
    gradient comes out split on tp as its weight is and a partial sum over dp (each dp rank's
    share of the batch); the output node asks each gradient in its parameter's placements,
    which is where the dp all-reduce goes."""
    gm = propagate(JOINT)
    assert ir_to_text(gm) == JOINT
    assert needs(gm)["output"] == "(RR, RS(0), RS(0), RS(1), RR)"  # loss, then the grads


NO_RULE = textwrap.dedent("""\
    graph train M mesh dp=2
      w: f32[4, 4] = param w  # R
      args_0: f32[4, 4] = input args[0]  # S(0)
      targets_0: f32[4, 4] = target targets[0]  # S(0)
      tangent_loss: f32[] = tangent loss  # R
      mm: f32[4, 4] = aten.mm.default(args_0, w)  # fwd S(0)
      mse_loss: f32[] = aten.mse_loss.default(mm, targets_0)  # fwd R (no rule: replicated)
      output loss loss = mse_loss
    """)


def test_an_op_without_a_usable_rule_runs_replicated():
    """``mse_loss`` has no DTensor strategy shardfx may use (a decomposition's constants
    would be the global shape's): it runs on whole tensors, its split operands gathered."""
    gm = propagate(NO_RULE, shard="replicate")
    assert ir_to_text(gm) == NO_RULE
    (mse,) = [n for n in gm.graph.nodes if n.name == "mse_loss"]
    assert mse.meta[M.SHARDING].replicated
    assert needs(gm)["mse_loss"] == "(R, R)"
    assert needs(gm)["mm"] == "(S(0), R)"  # the op before it keeps the batch split


SEQUENCE = textwrap.dedent("""\
    graph train MLP mesh tp=2
      fc1_weight: f32[8, 4] = param fc1.weight  # S(0)
      fc2_weight: f32[4, 8] = param fc2.weight  # S(1)
      args_0: f32[2, 4, 4] = input args[0]  # {tokens}
      tangent_loss: f32[] = tangent loss  # R
      view: f32[8, 4] = aten.view.default(args_0, [8, 4])  # fwd R
      t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd S(1)
      mm: f32[8, 8] = aten.mm.default(view, t)  # fwd S(1)
      t_1: f32[8, 4] = aten.t.default(fc2_weight)  # fwd S(0)
      mm_1: f32[8, 4] = aten.mm.default(mm, t_1)  # fwd P
      view_1: f32[2, 4, 4] = aten.view.default(mm_1, [2, 4, 4])  # fwd P
      relu: f32[2, 4, 4] = aten.relu.default(view_1)  # fwd {residual}
      add: f32[2, 4, 4] = aten.add.Tensor(relu, args_0)  # fwd {residual}
      sum_1: f32[] = aten.sum.default(add)  # fwd {loss}
      output loss loss = sum_1
    """)


@pytest.mark.parametrize("shard,tokens,residual,loss", [
    ("megatron", "R", "R", "R"),  # the row-parallel output all-reduced
    ("megatron-sp", "S(1)", "S(1)", "P"),  # reduce-scattered onto the sequence instead; the
    # loss a partial sum of each rank's tokens
])
def test_megatron_sp_reduce_scatters_onto_the_sequence(shard, tokens, residual, loss):
    """A (batch, sequence) activation under ``megatron-sp``: outside the parallel matmuls it
    is split on the sequence (the row-parallel matmul's partial sum is reduce-scattered, not
    all-reduced, before the next op that cannot take a partial sum), and gathered where it is
    flattened into the column-parallel matmul."""
    expected = SEQUENCE.format(tokens=tokens, residual=residual, loss=loss)
    gm = propagate(expected, shard=shard)
    assert ir_to_text(gm) == expected
    assert needs(gm)["view"] == "(R)"  # under megatron-sp: the all-gather of the sequence
    assert needs(gm)["relu"] == f"({residual})"  # P -> R, or P -> S(1): a reduce-scatter


CP = textwrap.dedent("""\
    graph train Scale mesh cp=2,tp=2
      w: f32[8] = param w  # RR
      x: f32[2, 8, 8] = input args[0]  # C(1)R
      tangent_loss: f32[] = tangent loss  # RR
      m: f32[2, 8, 8] = aten.mul.Tensor(x, w)  # fwd C(1)R
      loss: f32[] = aten.sum.default(m)  # fwd PR
      e: f32[2, 8, 8] = aten.expand.default(tangent_loss, [2, 8, 8])  # bwd RR
      gm: f32[2, 8, 8] = aten.mul.Tensor(e, x)  # bwd C(1)R
      gw: f32[8] = aten.sum.dim_IntList(gm, [0, 1])  # bwd PR
      output loss loss = loss
      output grad w = gw
    """)


def test_a_split_over_cp_is_its_balanced_chunks():
    """A sequence split over cp is ``C(1)`` (``ir.cp_layout.Chunks``: rank r holds chunks r and
    2n-1-r), on the input and on every op that keeps it; a plain ``S(1)`` declared on the cp
    axis comes out as the chunks it is, and the printed text reads back the same."""
    from shardfx.ir.cp_layout import Chunks

    gm = propagate(CP.replace("# C(1)R", "# S(1)R", 1))
    assert ir_to_text(gm) == CP
    x = gm.graph.find_nodes(op="placeholder")[1]
    assert type(x.meta[M.ANNOTATION][0]) is Chunks
    assert type(x.meta[M.ANNOTATION][1]).__name__ == "Replicate"
    assert needs(gm)["gm"] == "(C(1)R, C(1)R)"  # the replicated e: its chunks taken (take)
    assert ir_to_text(text_to_ir(CP)) == CP
