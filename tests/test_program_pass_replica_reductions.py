"""Program pass ``replica_reductions`` (``passes/program.py``, parts from ``codegen/replicas.py``),
unit level: the one-device program of a hand-written IR text whose ops carry their pipeline
stage (``@0``, ``@1``), split for pp=2 on a pp=2 x dp=2 mesh.

A pipeline rank's gradients are final only after its stage's last microbatch, so the sum over
its dp replicas is not in its parts: for each stage that makes gradients the pass writes that
sum in the SPMD form (``replica_program``: ``wait(all_reduce(g, "sum", group_dp))`` each), runs
the SPMD program passes on it (``zero_reduce_scatter`` under ZeRO-2, ``bucket_gradients``) and
cuts the result (``cut``) into a ``Reduction``: per bucket an issue part that starts its
collective, one finish part that waits and splits the buckets back into the gradients. It is
kept in ``module.meta[REPLICAS]``; the parts, inputs, outputs and collectives stay as they were.

The tests check which gradients each bucket reads, the parts' text (where the collective is
started and where it is waited for), the outputs' roles and shapes (ZeRO-2: this rank's rows),
the ``collectives`` records, and, in one process with a gloo world of one rank (the sum over
one replica is the gradient itself), that issue then finish returns the gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from shardfx.codegen.program import generate, graphs, verify_program
from shardfx.codegen.redistribute import Purpose
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.mesh import MeshSpec
from shardfx.passes.program import program_passes, replica_reductions, split_stages
from shardfx.request.options import Options

PP2_DP2 = Options(mesh=MeshSpec.parse({"pp": 2, "dp": 2}), microbatches=2)
ZERO2 = dataclasses.replace(PP2_DP2, zero=2)

# test_program_pass_split_stages's MLP with a bias on layer 1: stage 0 makes one gradient
# (7 rows: odd, padded under ZeRO-2), stage 1 two (weight, then bias), one bucket each.
MLP = """\
graph train Mlp
  layers_0_weight: f32[7, 5] = param layers.0.weight  # @0
  layers_1_weight: f32[4, 7] = param layers.1.weight  # @1
  layers_1_bias: f32[4] = param layers.1.bias  # @1
  x: f32[6, 5] = input args[0]  # @0
  y: f32[6, 4] = target targets[0]  # @1
  tangent_loss: f32[] = tangent loss  # @1
  t_w0: f32[5, 7] = aten.t.default(layers_0_weight)  # fwd @0
  h: f32[6, 7] = aten.mm.default(x, t_w0)  # fwd @0
  r: f32[6, 7] = aten.relu.default(h)  # fwd @0
  t_w1: f32[7, 4] = aten.t.default(layers_1_weight)  # fwd @1
  o: f32[6, 4] = aten.addmm.default(layers_1_bias, r, t_w1)  # fwd @1
  d: f32[6, 4] = aten.sub.Tensor(o, y)  # fwd @1
  sq: f32[6, 4] = aten.mul.Tensor(d, d)  # fwd @1
  loss: f32[] = aten.sum.default(sq)  # fwd @1
  d2: f32[6, 4] = aten.mul.Tensor(d, 2.0)  # bwd @1
  grad_o: f32[6, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd @1
  t_go: f32[4, 6] = aten.t.default(grad_o)  # bwd @1
  grad_w1: f32[4, 7] = aten.mm.default(t_go, r)  # bwd @1
  grad_b1: f32[4] = aten.sum.dim_IntList(grad_o, [0])  # bwd @1
  t_t_w1: f32[4, 7] = aten.t.default(t_w1)  # bwd @1
  grad_r: f32[6, 7] = aten.mm.default(grad_o, t_t_w1)  # bwd @1
  grad_h: f32[6, 7] = aten.threshold_backward.default(grad_r, r, 0)  # bwd @0
  t_gh: f32[7, 6] = aten.t.default(grad_h)  # bwd @0
  grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd @0
  output loss loss = loss
  output grad layers.0.weight = grad_w0
  output grad layers.1.weight = grad_w1
  output grad layers.1.bias = grad_b1
"""

SHAPES = {"layers.0.weight": (7, 5), "layers.1.weight": (4, 7), "layers.1.bias": (4,)}
NAMES = {0: ("layers.0.weight",), 1: ("layers.1.weight", "layers.1.bias")}


def reductions(options: Options) -> dict:
    """The pass's ``meta[REPLICAS]``, checking it leaves the split program as it was."""
    program = split_stages(generate(text_to_ir(MLP)), options)
    code = {name: module.code for name, module in graphs(program)}
    before = (program.inputs, program.outputs, program.collectives)
    program = replica_reductions(program, options)
    verify_program(program)
    assert {name: module.code for name, module in graphs(program)} == code
    assert (program.inputs, program.outputs, program.collectives) == before
    return program.module.meta[M.REPLICAS]


def returned_shapes(module) -> list[tuple[int, ...]]:
    return [tuple(v.meta[M.VAL].shape) for v in module.graph.output_node().args[0]]


def test_it_runs_right_after_split_stages_on_pp_with_dp_only():
    """The pass follows split_stages on pp x dp, and is not run on pp alone or dp alone."""
    passes = program_passes(PP2_DP2)
    assert passes.index(replica_reductions) == passes.index(split_stages) + 1
    for alone in ("pp=2", "dp=2"):
        assert replica_reductions not in program_passes(Options(mesh=MeshSpec.parse(alone)))


def test_each_stage_s_gradients_are_all_reduced_in_a_bucket_started_in_its_issue_part():
    """One bucket per stage: issue flattens and starts the all-reduce, finish waits and splits."""
    found = reductions(PP2_DP2)
    assert sorted(found) == [0, 1]
    for stage, reduction in found.items():
        names = NAMES[stage]
        assert [b.names for b in reduction.buckets] == [names]
        issue = reduction.buckets[0].issue.code
        assert issue.count("_c10d_functional.all_reduce.default(") == 1
        assert "wait_tensor" not in issue
        assert ("aten.cat.default" in issue) == (len(names) > 1)
        finish = reduction.finish.code
        assert finish.count("_c10d_functional.wait_tensor.default(") == 1
        assert ("aten.split_with_sizes.default" in finish) == (len(names) > 1)
        assert finish.count("aten.view.default(") == len(names)
        assert returned_shapes(reduction.finish) == [SHAPES[n] for n in names]
        assert reduction.outputs == tuple(M.OutputRole(M.OutputKind.GRAD, n) for n in names)
        assert [(c.kind, c.axis, c.purpose, c.nbytes) for c in reduction.collectives] == [
            ("all_reduce", "dp", Purpose.BUCKET, 4 * sum(torch.Size(SHAPES[n]).numel()
                                                        for n in names))]
        assert f"# bucket0 issue: {', '.join(names)}\n" in reduction.source


def test_under_zero_2_each_bucket_is_reduce_scattered_into_this_rank_s_rows():
    """ZeRO-2: issue starts a reduce-scatter, finish returns each gradient's padded rows."""
    found = reductions(ZERO2)
    assert M.ZeroShard((7, 5), 2).shard_shape == (4, 5)  # 7 rows: one padding row
    for stage, reduction in found.items():
        names = NAMES[stage]
        assert [b.names for b in reduction.buckets] == [names]
        issue = reduction.buckets[0].issue.code
        assert issue.count("_c10d_functional.reduce_scatter_tensor.default(") == 1
        assert "all_reduce" not in issue and "wait_tensor" not in issue
        assert "wait_tensor" in reduction.finish.code
        layouts = [M.ZeroShard(SHAPES[n], 2) for n in names]
        assert returned_shapes(reduction.finish) == [z.shard_shape for z in layouts]
        assert reduction.outputs == tuple(M.OutputRole(M.OutputKind.GRAD, n) for n in names)
        padded = sum(z.dp * z.per_rank * z.row_numel for z in layouts)  # what each rank sends
        assert [(c.kind, c.axis, c.purpose, c.nbytes) for c in reduction.collectives] == [
            ("reduce_scatter", "dp", Purpose.ZERO, 4 * padded)]
    assert [returned_shapes(found[s].finish) for s in (0, 1)] == [[(4, 5)], [(2, 7), (2,)]]


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone; the group name the issue parts take."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    assert dist.get_world_size() == 1
    yield dist.group.WORLD.group_name
    if made:
        dist.destroy_process_group()


def test_issue_then_finish_sums_over_the_replicas(world_of_one):
    """Over one replica the sum is the gradient: issue each bucket, finish, get them back.

    Plain dp only: under ZeRO-2 the reduce-scatter splits over dp=2, which a world of one rank
    cannot run (gloo checks output rows * world size == input rows)."""
    g = torch.Generator().manual_seed(0)
    for stage, reduction in reductions(PP2_DP2).items():
        grads = {n: torch.randn(SHAPES[n], generator=g) for n in NAMES[stage]}
        started = [out for b in reduction.buckets
                   for out in b.issue(*(grads[n] for n in b.names), world_of_one)]
        outs = reduction.finish(*started)
        assert len(outs) == len(reduction.outputs)
        for role, out in zip(reduction.outputs, outs):
            assert torch.equal(out, grads[role.name]), role.name
