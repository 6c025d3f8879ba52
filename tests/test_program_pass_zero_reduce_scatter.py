"""Program pass ``zero_reduce_scatter`` (``passes/zero.py``, collectives from ``codegen/zero.py``),
unit level: the SPMD program of a hand-written IR text on a dp=2 mesh, ``Options(zero=2)``.

Plain dp returns each gradient ``wait(all_reduce(g, group_dp))``: every rank gets the whole
sum. Under ZeRO-2 (and 3) each rank keeps only its rows of each gradient (``ZeroShard``: dim 0
split over dp, padded), so the pass takes the all-reduces out and reduce-scatters the
gradients in buckets instead: issued right after the bucket's last gradient, waited for just
before the output, each gradient returned as this rank's rows. A gradient that is already
whole on every rank (no dp reduction on its way out) takes its rows with a ``narrow`` at
``coord(dp)``, no collective. With ``Precision(reduce="bf16")`` the bucket is summed in bf16.

The program cannot run in one process (it needs a dp process group): the tests check its text
(which collectives, in which order, on which buffers), its output shapes, its inputs, and its
``collectives`` records.
"""

from __future__ import annotations

from shardfx.codegen.program import verify_program
from shardfx.codegen.spmd import generate_spmd
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.program import bucket_gradients_pass, program_passes
from shardfx.passes.zero import zero_reduce_scatter
from shardfx.request.options import Options
from shardfx.request.precision import Precision

from program_graphs import ZERO_MLP, WITH_SCALAR

ZERO2 = Options(mesh=MeshSpec.parse("dp=2"), zero=2)

# Two Linears without bias, a sum of squares as the loss; the batch split over dp. Rows: 7 of
# layers.0.weight over 2 ranks is 4 each (one padding row), 4 of layers.1.weight is 2 each.
MLP = ZERO_MLP

# Codegen returns every P value through an all-reduce at the end of the program:
SPMD_TAIL = """\
  all_reduce_default: f32[] = _c10d_functional.all_reduce.default(loss, 'sum', group_dp)
  wait_tensor_default: f32[] = _c10d_functional.wait_tensor.default(all_reduce_default)
  all_reduce_default_1: f32[7, 5] = _c10d_functional.all_reduce.default(grad_w0, 'sum', group_dp)
  wait_tensor_default_1: f32[7, 5] = _c10d_functional.wait_tensor.default(all_reduce_default_1)
  all_reduce_default_2: f32[4, 7] = _c10d_functional.all_reduce.default(grad_w1, 'sum', group_dp)
  wait_tensor_default_2: f32[4, 7] = _c10d_functional.wait_tensor.default(all_reduce_default_2)
  output loss loss = wait_tensor_default
  output grad layers.0.weight = wait_tensor_default_1
  output grad layers.1.weight = wait_tensor_default_2
"""

# After the pass: one bucket of both gradients in the order they are ready (grad_w1 first),
# each as (dp, its rows per rank) side by side, reduce-scattered as soon as grad_w0 exists;
# the loss's all-reduce is untouched; each rank's 34 elements split back into its rows.
ZERO_TAIL = """\
  zero_rs0_in0: f32[2, 14] = aten.reshape.default(grad_w1, [2, 14])  # bwd
  zero_rs0_1_pad: f32[8, 5] = aten.constant_pad_nd.default(grad_w0, [0, 0, 0, 1])  # bwd
  zero_rs0_in1: f32[2, 20] = aten.reshape.default(zero_rs0_1_pad, [2, 20])  # bwd
  zero_rs0_cat: f32[2, 34] = aten.cat.default([zero_rs0_in0, zero_rs0_in1], 1)  # bwd
  zero_rs0_flat: f32[68] = aten.reshape.default(zero_rs0_cat, [-1])  # bwd
  zero_rs0_reduce_scatter: f32[34] = _c10d_functional.reduce_scatter_tensor.default(\
zero_rs0_flat, 'sum', 2, group_dp)  # bwd
  all_reduce_default: f32[] = _c10d_functional.all_reduce.default(loss, 'sum', group_dp)
  wait_tensor_default: f32[] = _c10d_functional.wait_tensor.default(all_reduce_default)
  zero_rs0_wait: f32[34] = _c10d_functional.wait_tensor.default(zero_rs0_reduce_scatter)  # bwd
  zero_rs0_split: (f32[14], f32[20]) = aten.split_with_sizes.default(zero_rs0_wait, [14, 20])  # bwd
  zero_rs0_part0: f32[14] = operator.getitem(zero_rs0_split, 0)  # bwd
  zero_rs0_part1: f32[20] = operator.getitem(zero_rs0_split, 1)  # bwd
  zero_rs0_out0: f32[2, 7] = aten.reshape.default(zero_rs0_part0, [2, 7])  # bwd
  zero_rs0_out1: f32[4, 5] = aten.reshape.default(zero_rs0_part1, [4, 5])  # bwd
  output loss loss = wait_tensor_default
  output grad layers.0.weight = zero_rs0_out1
  output grad layers.1.weight = zero_rs0_out0
"""


def text(program) -> str:
    return ir_to_text(program.module, people=False)


def records(program) -> list[tuple]:
    return [(c.kind, c.axis, c.nbytes, c.reason) for c in program.collectives]


def test_it_runs_for_zero_2_and_3_before_the_buckets():
    for zero in (2, 3):
        passes = program_passes(Options(mesh=MeshSpec.parse("dp=2"), zero=zero))
        assert passes.index(zero_reduce_scatter) < passes.index(bucket_gradients_pass)
    for zero in (0, 1):
        assert zero_reduce_scatter not in program_passes(Options(mesh=MeshSpec.parse("dp=2"),
                                                                 zero=zero))


def test_gradient_all_reduces_become_a_reduce_scatter_into_rows():
    program = generate_spmd(text_to_ir(MLP))
    before = text(program)
    assert before.endswith(SPMD_TAIL)
    unchanged = before.removesuffix(SPMD_TAIL)  # everything up to grad_w0
    assert unchanged.endswith("grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd\n")

    program = zero_reduce_scatter(program, ZERO2)
    verify_program(program)
    assert text(program) == unchanged + ZERO_TAIL
    out = program.module.graph.output_node()
    assert [tuple(v.meta[M.VAL].shape) for v in out.args[0]] == [(), (4, 5), (2, 7)]
    assert records(program) == [
        ("all_reduce", "dp", 4, "return loss loss: P -> R on dp"),
        ("reduce_scatter", "dp", 68 * 4, "ZeRO gradient bucket 0 (2 grads: layers.1.weight, "
         "layers.0.weight): P -> ZeRO rows on dp")]


# A 0-d parameter whose gradient is computed from replicated values only (a regulariser's):
# whole on every rank, no dp reduction to take out.
SCALED = WITH_SCALAR

# the 0-d gradient as one row, padded to dp rows, this rank's row taken at coord(dp)
WHOLE = """\
  grad_scale: f32[] = aten.mul.Tensor(two, tangent_loss)  # bwd
  zero_rows2_row: f32[1] = aten.reshape.default(grad_scale, [1])  # bwd
  zero_rows2_pad: f32[2] = aten.constant_pad_nd.default(zero_rows2_row, [0, 1])  # bwd
  mul: - = operator.mul({coord}, 1)  # bwd
  zero_rows2_narrow: f32[1] = aten.narrow.default(zero_rows2_pad, 0, mul, 1)  # bwd
  zero_rows2: f32[1] = aten.clone.default(zero_rows2_narrow)  # bwd
  zero_rs0_wait: f32[8] = _c10d_functional.wait_tensor.default(zero_rs0_reduce_scatter)  # bwd
  zero_rs0_out0: f32[2, 4] = aten.reshape.default(zero_rs0_wait, [2, 4])  # bwd
  output loss loss = loss
  output grad w = zero_rs0_out0
  output grad scale = zero_rows2
"""


def test_a_gradient_whole_on_every_rank_takes_its_rows_without_a_collective():
    program = generate_spmd(text_to_ir(SCALED))
    mesh_inputs = [r.name for r in program.inputs if r.kind is M.InputKind.MESH]
    assert mesh_inputs == ["group(dp)"]  # nothing read coord(dp) before

    program = zero_reduce_scatter(program, ZERO2)
    verify_program(program)
    assert program.inputs[-1] == M.InputRole(M.InputKind.MESH, "coord(dp)")  # added
    coord = program.input_names[-1]
    assert f"  {coord}: - = mesh coord(dp)\n  h: " in text(program)
    assert text(program).endswith(WHOLE.format(coord=coord))
    # only w's gradient is reduced: 3 rows padded to 4, 2 per rank
    assert "zero_rs0_0_pad: f32[4, 4] = aten.constant_pad_nd.default(grad_w, [0, 0, 0, 1])" \
        in text(program)
    assert records(program) == [
        ("all_reduce", "dp", 4, "loss: P -> R on dp"),
        ("reduce_scatter", "dp", 16 * 4, "ZeRO gradient bucket 0 (1 grads: w): "
         "P -> ZeRO rows on dp")]


def test_a_narrower_reduce_dtype_sums_the_bucket_in_it():
    options = Options(mesh=MeshSpec.parse("dp=2"), zero=2,
                      precision=Precision(compute="fp32", reduce="bf16"))
    program = zero_reduce_scatter(generate_spmd(text_to_ir(MLP)), options)
    verify_program(program)
    out = text(program)
    for lines in [
            "  zero_rs0_narrow: bf16[68] = aten._to_copy.default(zero_rs0_flat, "
            "dtype=torch.bfloat16)  # bwd\n"
            "  zero_rs0_reduce_scatter: bf16[34] = _c10d_functional.reduce_scatter_tensor."
            "default(zero_rs0_narrow, 'sum', 2, group_dp)  # bwd\n",
            "  zero_rs0_wait: bf16[34] = _c10d_functional.wait_tensor.default("
            "zero_rs0_reduce_scatter)  # bwd\n"
            "  zero_rs0_widen: f32[34] = aten._to_copy.default(zero_rs0_wait, "
            "dtype=torch.float32)  # bwd\n"
            "  zero_rs0_split: (f32[14], f32[20]) = aten.split_with_sizes.default("
            "zero_rs0_widen, [14, 20])  # bwd\n"]:
        assert lines in out, lines
    assert records(program)[1][:3] == ("reduce_scatter", "dp", 68 * 2)  # bf16: half the bytes
