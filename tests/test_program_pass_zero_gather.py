"""Program pass ``zero_gather`` (``passes/zero.py``, collectives from ``codegen/zero.py``), unit
level: the SPMD program of a hand-written IR text on a dp=2 mesh, ``Options(zero=3)``, after
``zero_reduce_scatter`` (which it requires).

Under ZeRO-3 each rank holds only its rows of each parameter (``ZeroShard``: dim 0 split over
dp, padded). The pass makes each parameter input that shard and all-gathers it where it is
needed: once before its first forward reader, and again, into another buffer, before its
first backward reader; forward values made from the parameter alone that the backward reads
(``t(w)``) are made again from the backward's copy, so the forward's copy dies in the forward.
Gathers go in buckets (one per block here), each issued when the one before is waited for.

The program cannot run in one process (it needs a dp process group): the tests check its text
(which gathers, in which order, on which buffers), its inputs' shapes and ``ZERO`` layouts,
and its ``collectives`` records.
"""

from __future__ import annotations

from shardfx.codegen.program import verify_program
from shardfx.codegen.spmd import generate_spmd
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.program import bucket_gradients_pass, program_passes
from shardfx.passes.zero import zero_gather, zero_reduce_scatter
from shardfx.request.options import Options

from program_graphs import ZERO_MLP, WITH_SCALAR

ZERO3 = Options(mesh=MeshSpec.parse("dp=2"), zero=3)

# Two Linears without bias (torch's layout: the forward reads t(w)), a sum of squares as the
# loss, the batch split over dp. layers.0.weight's 7 rows are 4 per rank (one padding row),
# layers.1.weight's 4 rows 2 per rank. The backward reads layers.1.weight (through t(t(w)),
# for the input gradient of layer 1) but not layers.0.weight (x needs no gradient).
MLP = ZERO_MLP

# The program after zero_gather, up to grad_w0 (after it: zero_reduce_scatter's part, as it
# was). Forward: both blocks' gathers issued before the first is waited for (the second comes
# in while layer 0 computes), each copy unpadded and read where the parameter was. Backward:
# one gather, of layers.1.weight, before t(w) is made again from it (t_w1_1).
GATHERED = """\
graph
  layers_0_weight: f32[4, 5] = param layers.0.weight  # R ZeRO(rows 4 of 7 per rank of dp=2)
  layers_1_weight: f32[2, 7] = param layers.1.weight  # R ZeRO(rows 2 of 4 per rank of dp=2)
  x: f32[3, 5] = input args[0]  # S(0)
  y: f32[3, 4] = target targets[0]  # S(0)
  tangent_loss: f32[] = tangent loss  # R
  group_dp: - = mesh group(dp)
  zero3_fwd0_in0: f32[20] = aten.reshape.default(layers_0_weight, [-1])  # fwd
  zero3_fwd0_all_gather: f32[40] = _c10d_functional.all_gather_into_tensor.default(\
zero3_fwd0_in0, 2, group_dp)  # fwd
  zero3_fwd1_in0: f32[14] = aten.reshape.default(layers_1_weight, [-1])  # fwd
  zero3_fwd1_all_gather: f32[28] = _c10d_functional.all_gather_into_tensor.default(\
zero3_fwd1_in0, 2, group_dp)  # fwd
  zero3_fwd0_wait: f32[40] = _c10d_functional.wait_tensor.default(zero3_fwd0_all_gather)  # fwd
  zero3_fwd0_grid: f32[2, 20] = aten.reshape.default(zero3_fwd0_wait, [2, 20])  # fwd
  zero3_fwd0_rows0: f32[8, 5] = aten.reshape.default(zero3_fwd0_grid, [8, 5])  # fwd
  zero3_fwd0_unpad0: f32[7, 5] = aten.narrow.default(zero3_fwd0_rows0, 0, 0, 7)  # fwd
  t_w0: f32[5, 7] = aten.t.default(zero3_fwd0_unpad0)  # fwd
  h: f32[3, 7] = aten.mm.default(x, t_w0)  # fwd
  r: f32[3, 7] = aten.relu.default(h)  # fwd
  zero3_fwd1_wait: f32[28] = _c10d_functional.wait_tensor.default(zero3_fwd1_all_gather)  # fwd
  zero3_fwd1_grid: f32[2, 14] = aten.reshape.default(zero3_fwd1_wait, [2, 14])  # fwd
  zero3_fwd1_rows0: f32[4, 7] = aten.reshape.default(zero3_fwd1_grid, [4, 7])  # fwd
  t_w1: f32[7, 4] = aten.t.default(zero3_fwd1_rows0)  # fwd
  o: f32[3, 4] = aten.mm.default(r, t_w1)  # fwd
  d: f32[3, 4] = aten.sub.Tensor(o, y)  # fwd
  sq: f32[3, 4] = aten.mul.Tensor(d, d)  # fwd
  loss: f32[] = aten.sum.default(sq)  # fwd
  d2: f32[3, 4] = aten.mul.Tensor(d, 2.0)  # bwd
  grad_o: f32[3, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd
  t_go: f32[4, 3] = aten.t.default(grad_o)  # bwd
  grad_w1: f32[4, 7] = aten.mm.default(t_go, r)  # bwd
  zero3_bwd0_in0: f32[14] = aten.reshape.default(layers_1_weight, [-1])  # bwd
  zero3_bwd0_all_gather: f32[28] = _c10d_functional.all_gather_into_tensor.default(\
zero3_bwd0_in0, 2, group_dp)  # bwd
  zero3_bwd0_wait: f32[28] = _c10d_functional.wait_tensor.default(zero3_bwd0_all_gather)  # bwd
  zero3_bwd0_grid: f32[2, 14] = aten.reshape.default(zero3_bwd0_wait, [2, 14])  # bwd
  zero3_bwd0_rows0: f32[4, 7] = aten.reshape.default(zero3_bwd0_grid, [4, 7])  # bwd
  t_w1_1: f32[7, 4] = aten.t.default(zero3_bwd0_rows0)  # bwd
  t_t_w1: f32[4, 7] = aten.t.default(t_w1_1)  # bwd
  grad_r: f32[3, 7] = aten.mm.default(grad_o, t_t_w1)  # bwd
  grad_h: f32[3, 7] = aten.threshold_backward.default(grad_r, r, 0)  # bwd
  t_gh: f32[7, 3] = aten.t.default(grad_h)  # bwd
  grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd
"""


def text(program) -> str:
    return ir_to_text(program.module, people=False)


def reduce_scattered(ir_text: str):
    """The SPMD program of ``ir_text`` after ``zero_reduce_scatter``, what ``zero_gather``
    starts from."""
    program = zero_reduce_scatter(generate_spmd(text_to_ir(ir_text)), ZERO3)
    verify_program(program)
    return program


def test_it_runs_for_zero_3_only_after_the_buckets():
    passes = program_passes(ZERO3)
    assert passes.index(bucket_gradients_pass) < passes.index(zero_gather)
    assert zero_gather not in program_passes(Options(mesh=MeshSpec.parse("dp=2"), zero=2))


def test_parameters_come_in_as_rows_and_are_gathered_before_each_phase_reads_them():
    program = reduce_scattered(MLP)
    before = text(program)
    tail = before[before.index("  zero_rs0_in0:"):]  # the gradients' reduce-scatter, kept
    collectives = list(program.collectives)

    program = zero_gather(program, ZERO3)
    verify_program(program)
    assert text(program) == GATHERED + tail

    params = [n for n in program.module.graph.find_nodes(op="placeholder")
              if n.meta[M.ROLE].kind is M.InputKind.PARAM]
    assert [(n.name, n.meta[M.ZERO]) for n in params] == [
        ("layers_0_weight", M.ZeroShard((7, 5), 2)), ("layers_1_weight", M.ZeroShard((4, 7), 2))]
    assert [tuple(n.meta[M.VAL].shape) for n in params] == [(4, 5), (2, 7)]
    added = [(c.kind, c.axis, c.nbytes, c.reason) for c in program.collectives]
    assert added[:len(collectives)] == [(c.kind, c.axis, c.nbytes, c.reason)
                                        for c in collectives]
    assert added[len(collectives):] == [
        ("all_gather", "dp", 80, "ZeRO-3 fwd bucket 0 (layers.0.weight): ZeRO rows -> R on dp"),
        ("all_gather", "dp", 56, "ZeRO-3 fwd bucket 1 (layers.1.weight): ZeRO rows -> R on dp"),
        ("all_gather", "dp", 56, "ZeRO-3 bwd bucket 0 (layers.1.weight): ZeRO rows -> R on dp")]


def test_the_forward_copy_is_not_read_in_the_backward():
    program = zero_gather(reduce_scattered(MLP), ZERO3)
    nodes = {n.name: n for n in program.module.graph.nodes}
    forward_copy = nodes["t_w1"]  # t(w) of the forward's gathered copy
    assert [u.name for u in forward_copy.users] == ["o"]
    assert nodes["t_t_w1"].args[0] is nodes["t_w1_1"]  # remade from the backward's copy


# A 0-d parameter travels as one row: gathered as two, the padding row cut, made 0-d again.
SCALAR = WITH_SCALAR

SCALAR_FORWARD = """\
  zero3_fwd1_wait: f32[2] = _c10d_functional.wait_tensor.default(zero3_fwd1_all_gather)  # fwd
  zero3_fwd1_grid: f32[2, 1] = aten.reshape.default(zero3_fwd1_wait, [2, 1])  # fwd
  zero3_fwd1_rows0: f32[2] = aten.reshape.default(zero3_fwd1_grid, [2])  # fwd
  zero3_fwd1_unpad0: f32[1] = aten.narrow.default(zero3_fwd1_rows0, 0, 0, 1)  # fwd
  zero3_fwd1_scalar0: f32[] = aten.reshape.default(zero3_fwd1_unpad0, [])  # fwd
  reg: f32[] = aten.mul.Tensor(zero3_fwd1_scalar0, zero3_fwd1_scalar0)  # fwd
"""


def test_a_scalar_parameter_is_gathered_as_one_row():
    program = zero_gather(reduce_scattered(SCALAR), ZERO3)
    verify_program(program)
    out = text(program)
    assert "  scale: f32[1] = param scale  # R ZeRO(rows 1 of 1 per rank of dp=2)\n" in out  # this rank's row
    assert SCALAR_FORWARD in out
    assert "  two: f32[] = aten.mul.Tensor(zero3_bwd0_scalar0, 2.0)  # bwd\n" in out
    assert [c.reason for c in program.collectives if c.kind == "all_gather"] == [
        "ZeRO-3 fwd bucket 0 (w): ZeRO rows -> R on dp",
        "ZeRO-3 fwd bucket 1 (scale): ZeRO rows -> R on dp",
        "ZeRO-3 bwd bucket 0 (scale): ZeRO rows -> R on dp"]
