"""shard_annotate alone, on IR text: the ``shard=`` request becomes an ANNOTATION (one placement
per mesh axis) on every tensor input.

Parameters are placed by the request (Megatron's column/row split by module name, all
replicated, or the first matching glob); inputs and targets are split on the batch over dp, and
under ``megatron-sp`` inputs of the tokens' (batch, sequence) shape also on the sequence over
tp; the tangent is replicated. The graph is a two-linear MLP (``fc1`` column-parallel, ``fc2``
row-parallel by name) with an MSE loss, trimmed to its forward; the tests compare each input's
printed placements in the whole text, so the ops' lines are checked to be left as they
were (placing ops is shard_propagate's).
"""

from __future__ import annotations

import textwrap

import pytest
from torch.distributed.tensor import Replicate, Shard

from shardfx.errors import MeshError, ShardingError
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.shard_annotate import shard_annotate
from shardfx.request.options import Options

INPUTS = """\
  fc1_weight: f32[8, 4] = param fc1.weight{fc1_weight}
  fc1_bias: f32[8] = param fc1.bias{fc1_bias}
  fc2_weight: f32[4, 8] = param fc2.weight{fc2_weight}
  fc2_bias: f32[4] = param fc2.bias{fc2_bias}
  args_0: f32[{batch}, 4] = input args[0]{args_0}
  targets_0: f32[{batch}, 4] = target targets[0]{targets_0}
  tangent_loss: f32[] = tangent loss{tangent_loss}
"""
OPS = """\
  t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd
  addmm: f32[{batch}, 8] = aten.addmm.default(fc1_bias, args_0, t)  # fwd
  relu: f32[{batch}, 8] = aten.relu.default(addmm)  # fwd
  t_1: f32[8, 4] = aten.t.default(fc2_weight)  # fwd
  addmm_1: f32[{batch}, 4] = aten.addmm.default(fc2_bias, relu, t_1)  # fwd
  mse_loss: f32[] = aten.mse_loss.default(addmm_1, targets_0)  # fwd
  output loss loss = mse_loss
"""
NAMES = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "args_0", "targets_0",
         "tangent_loss")


def mlp(mesh: str, batch: int = 4, **placed: str) -> str:
    """The MLP's text on ``mesh``; ``placed`` gives inputs' placements (unplaced: none)."""
    notes = {name: f"  # {placed[name]}" if name in placed else "" for name in NAMES}
    return (f"graph train MLP mesh {mesh}\n" + INPUTS.format(batch=batch, **notes)
            + OPS.format(batch=batch))


def annotate(text: str, shard, mesh: str) -> str:
    gm = shard_annotate(text_to_ir(text), Options(mesh=MeshSpec.parse(mesh), shard=shard))
    return ir_to_text(gm)


def test_megatron_splits_fc1_by_columns_and_fc2_by_rows():
    got = annotate(mlp("dp=2,tp=2"), "megatron", "dp=2,tp=2")
    assert got == mlp("dp=2,tp=2", fc1_weight="RS(0)", fc1_bias="RS(0)", fc2_weight="RS(1)",
                      fc2_bias="RR", args_0="S(0)R", targets_0="S(0)R", tangent_loss="RR")


def test_megatron_on_tp_alone_leaves_the_batch_whole():
    got = annotate(mlp("tp=2"), "megatron", "tp=2")
    assert got == mlp("tp=2", fc1_weight="S(0)", fc1_bias="S(0)", fc2_weight="S(1)",
                      fc2_bias="R", args_0="R", targets_0="R", tangent_loss="R")


@pytest.mark.parametrize("shard", ["replicate", "auto"])
def test_replicate_and_auto_replicate_every_parameter(shard):
    """"auto" leaves the parameters replicated for ``auto_shard`` to decide."""
    got = annotate(mlp("dp=2,tp=2"), shard, "dp=2,tp=2")
    assert got == mlp("dp=2,tp=2", fc1_weight="RR", fc1_bias="RR", fc2_weight="RR",
                      fc2_bias="RR", args_0="S(0)R", targets_0="S(0)R", tangent_loss="RR")


def test_megatron_without_a_tp_axis_is_data_parallel():
    got = annotate(mlp("dp=2"), "megatron", "dp=2")
    assert got == mlp("dp=2", fc1_weight="R", fc1_bias="R", fc2_weight="R", fc2_bias="R",
                      args_0="S(0)", targets_0="S(0)", tangent_loss="R")


def test_globs_place_parameters_first_match_wins():
    shard = {"fc1.weight": [Replicate(), Shard(1)],  # before the glob that also matches it
             "fc*.weight": [Replicate(), Shard(0)],
             "fc2.bias": [Shard(0), Replicate()]}
    got = annotate(mlp("dp=2,tp=2"), shard, "dp=2,tp=2")
    assert got == mlp("dp=2,tp=2", fc1_weight="RS(1)", fc1_bias="RR", fc2_weight="RS(0)",
                      fc2_bias="S(0)R", args_0="S(0)R", targets_0="S(0)R", tangent_loss="RR")


SEQUENCE = textwrap.dedent("""\
    graph train MLP mesh {mesh}
      fc1_weight: f32[8, 4] = param fc1.weight
      args_0: f32[2, 4, 4] = input args[0]
      targets_0: f32[2, 4, 8] = target targets[0]
      other: f32[2, 8] = input args[1]
      tangent_loss: f32[] = tangent loss
      t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd
      view: f32[8, 4] = aten.view.default(args_0, [8, 4])  # fwd
      mm: f32[8, 8] = aten.mm.default(view, t)  # fwd
      view_1: f32[2, 4, 8] = aten.view.default(mm, [2, 4, 8])  # fwd
      mse_loss: f32[] = aten.mse_loss.default(view_1, targets_0)  # fwd
      sum_1: f32[] = aten.sum.default(other)  # fwd
      add: f32[] = aten.add.Tensor(mse_loss, sum_1)  # fwd
      output loss loss = add
    """)


@pytest.mark.parametrize("shard,mesh,tokens,other", [
    ("megatron", "tp=2", "R", "R"),
    ("megatron-sp", "tp=2", "S(1)", "R"),  # (batch, sequence) values split on the sequence
    ("megatron-sp", "dp=2,tp=2", "S(0)S(1)", "S(0)R"),  # another shape: only the batch split
])
def test_megatron_sp_splits_the_sequence_over_tp(shard, mesh, tokens, other):
    got = annotate(SEQUENCE.format(mesh=mesh), shard, mesh).splitlines()
    rep = "R" * len(MeshSpec.parse(mesh).axes)
    assert got[1] == f"  fc1_weight: f32[8, 4] = param fc1.weight  # {rep[:-1]}S(0)"
    assert got[2] == f"  args_0: f32[2, 4, 4] = input args[0]  # {tokens}"
    assert got[3] == f"  targets_0: f32[2, 4, 8] = target targets[0]  # {tokens}"
    assert got[4] == f"  other: f32[2, 8] = input args[1]  # {other}"
    assert got[5] == f"  tangent_loss: f32[] = tangent loss  # {rep}"


def test_a_batch_dp_does_not_divide_is_refused():
    with pytest.raises(MeshError, match=r"args\[0\] has batch size 3, not divisible by dp=2"):
        annotate(mlp("dp=2", batch=3), "replicate", "dp=2")


def test_bad_requests_are_named():
    with pytest.raises(ShardingError, match=r"glob 'fc3\.\*' matches no parameter"):
        annotate(mlp("tp=2"), {"fc3.*": [Shard(0)]}, "tp=2")
    with pytest.raises(ShardingError, match=r"fc1\.weight dim 0 has size 8, not divisible by "
                                            r"mesh axis tp=3"):
        annotate(mlp("tp=3"), {"fc1.weight": [Shard(0)]}, "tp=3")
    with pytest.raises(ShardingError, match="gives 1 placements for a mesh of 2 axes"):
        annotate(mlp("dp=2,tp=2"), {"fc1.weight": [Shard(0)]}, "dp=2,tp=2")
