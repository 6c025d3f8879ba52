"""Program pass ``bucket_gradients`` (``codegen/bucketing.py``), unit level: the SPMD program of
a hand-written IR text on a dp=2 mesh.

Codegen returns each gradient through an all-reduce of its own, all at the end of the program.
The pass packs the gradient all-reduces into DDP's buckets (per dtype, at most
``BUCKET_BYTES`` = 25 MiB, in the order the gradients are made): right after a bucket's last
gradient the program flattens the bucket into one buffer and starts one all-reduce, waits for
it just before the output, and splits the sum back into the gradients. With
``Precision(reduce="bf16")`` a bucket is summed in bf16 and widened back.

Here layers.0.weight is 32 MiB (FakeTensors: nothing is allocated), so it gets a bucket of its
own, and layer 1's weight and bias share the other, which starts while layer 0's backward
still computes. The program cannot run in one process (it needs a dp process group): the
tests check its text (which collectives, in which order, on which buffers) and its
``collectives`` records.
"""

from __future__ import annotations

from shardfx.codegen.program import verify_program
from shardfx.codegen.spmd import generate_spmd
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.program import bucket_gradients_pass, program_passes
from shardfx.request.options import Options
from shardfx.request.precision import Precision

from program_graphs import TWO_BUCKETS

DP2 = Options(mesh=MeshSpec.parse("dp=2"))

MLP = TWO_BUCKETS

BUCKETED = """\
graph
  layers_0_weight: f32[4096, 2048] = param layers.0.weight  # R
  layers_1_weight: f32[4, 4096] = param layers.1.weight  # R
  layers_1_bias: f32[4] = param layers.1.bias  # R
  x: f32[3, 2048] = input args[0]  # S(0)
  y: f32[3, 4] = target targets[0]  # S(0)
  tangent_loss: f32[] = tangent loss  # R
  group_dp: - = mesh group(dp)
  t_w0: f32[2048, 4096] = aten.t.default(layers_0_weight)  # fwd
  h: f32[3, 4096] = aten.mm.default(x, t_w0)  # fwd
  r: f32[3, 4096] = aten.relu.default(h)  # fwd
  t_w1: f32[4096, 4] = aten.t.default(layers_1_weight)  # fwd
  o: f32[3, 4] = aten.addmm.default(layers_1_bias, r, t_w1)  # fwd
  d: f32[3, 4] = aten.sub.Tensor(o, y)  # fwd
  sq: f32[3, 4] = aten.mul.Tensor(d, d)  # fwd
  loss: f32[] = aten.sum.default(sq)  # fwd
  d2: f32[3, 4] = aten.mul.Tensor(d, 2.0)  # bwd
  grad_o: f32[3, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd
  t_go: f32[4, 3] = aten.t.default(grad_o)  # bwd
  grad_w1: f32[4, 4096] = aten.mm.default(t_go, r)  # bwd
  grad_b1: f32[4] = aten.sum.dim_IntList(grad_o, [0])  # bwd
  bucket0_in0: f32[16384] = aten.reshape.default(grad_w1, [-1])
  bucket0_in1: f32[4] = aten.reshape.default(grad_b1, [-1])
  bucket0_flat: f32[16388] = aten.cat.default([bucket0_in0, bucket0_in1])
  bucket0_all_reduce: f32[16388] = _c10d_functional.all_reduce.default(bucket0_flat, 'sum', \
group_dp)
  t_t_w1: f32[4, 4096] = aten.t.default(t_w1)  # bwd
  grad_r: f32[3, 4096] = aten.mm.default(grad_o, t_t_w1)  # bwd
  grad_h: f32[3, 4096] = aten.threshold_backward.default(grad_r, r, 0)  # bwd
  t_gh: f32[4096, 3] = aten.t.default(grad_h)  # bwd
  grad_w0: f32[4096, 2048] = aten.mm.default(t_gh, x)  # bwd
  bucket1_in0: f32[8388608] = aten.reshape.default(grad_w0, [-1])
  bucket1_all_reduce: f32[8388608] = _c10d_functional.all_reduce.default(bucket1_in0, 'sum', \
group_dp)
  all_reduce_default: f32[] = _c10d_functional.all_reduce.default(loss, 'sum', group_dp)
  wait_tensor_default: f32[] = _c10d_functional.wait_tensor.default(all_reduce_default)
  bucket0_wait: f32[16388] = _c10d_functional.wait_tensor.default(bucket0_all_reduce)
  bucket0_split: (f32[16384], f32[4]) = aten.split_with_sizes.default(bucket0_wait, [16384, 4])
  bucket0_part0: f32[16384] = operator.getitem(bucket0_split, 0)
  bucket0_part1: f32[4] = operator.getitem(bucket0_split, 1)
  bucket0_out0: f32[4, 4096] = aten.view.default(bucket0_part0, [4, 4096])
  bucket0_out1: f32[4] = aten.view.default(bucket0_part1, [4])
  bucket1_wait: f32[8388608] = _c10d_functional.wait_tensor.default(bucket1_all_reduce)
  bucket1_out0: f32[4096, 2048] = aten.view.default(bucket1_wait, [4096, 2048])
  output loss loss = wait_tensor_default
  output grad layers.0.weight = bucket1_out0
  output grad layers.1.weight = bucket0_out0
  output grad layers.1.bias = bucket0_out1
"""


def text(program) -> str:
    return ir_to_text(program.module, people=False)


def records(program) -> list[tuple]:
    return [(c.kind, c.axis, c.nbytes, c.reason) for c in program.collectives]


def bucketed(options: Options):
    program = generate_spmd(text_to_ir(MLP))
    assert records(program) == [  # one all-reduce per returned value, as codegen made them
        ("all_reduce", "dp", 4, "return loss loss: P -> R on dp"),
        ("all_reduce", "dp", 4096 * 2048 * 4, "return grad layers.0.weight: P -> R on dp"),
        ("all_reduce", "dp", 4 * 4096 * 4, "return grad layers.1.weight: P -> R on dp"),
        ("all_reduce", "dp", 4 * 4, "return grad layers.1.bias: P -> R on dp")]
    program = bucket_gradients_pass(program, options)
    verify_program(program)
    return program


def test_it_runs_on_a_dp_mesh_only():
    assert bucket_gradients_pass in program_passes(DP2)
    assert bucket_gradients_pass.__name__ == "bucket_gradients"  # as plan.history names it
    assert bucket_gradients_pass not in program_passes(Options())
    assert bucket_gradients_pass not in program_passes(Options(mesh=MeshSpec.parse("pp=2")))


def test_gradients_are_reduced_in_buckets_started_after_their_last_gradient():
    program = bucketed(DP2)
    assert text(program) == BUCKETED
    assert records(program) == [
        ("all_reduce", "dp", 4, "return loss loss: P -> R on dp"),
        ("all_reduce", "dp", (4 * 4096 + 4) * 4, "dp gradient bucket 0 (2 grads: "
         "layers.1.weight, layers.1.bias): P -> R on dp"),
        ("all_reduce", "dp", 4096 * 2048 * 4, "dp gradient bucket 1 (1 grad: layers.0.weight): "
         "P -> R on dp")]


def test_a_narrower_reduce_dtype_sums_each_bucket_in_it():
    program = bucketed(Options(mesh=MeshSpec.parse("dp=2"),
                               precision=Precision(compute="fp32", reduce="bf16")))
    out = text(program)
    for line in [
            "  bucket0_narrow: bf16[16388] = aten._to_copy.default(bucket0_flat, "
            "dtype=torch.bfloat16)\n"
            "  bucket0_all_reduce: bf16[16388] = _c10d_functional.all_reduce.default("
            "bucket0_narrow, 'sum', group_dp)\n",
            "  bucket0_wait: bf16[16388] = _c10d_functional.wait_tensor.default("
            "bucket0_all_reduce)\n"
            "  bucket0_widen: f32[16388] = aten._to_copy.default(bucket0_wait, "
            "dtype=torch.float32)\n"
            "  bucket0_split: (f32[16384], f32[4]) = aten.split_with_sizes.default("
            "bucket0_widen, [16384, 4])\n",
            "  bucket1_narrow: bf16[8388608] = aten._to_copy.default(bucket1_in0, "
            "dtype=torch.bfloat16)\n",
            "  bucket1_widen: f32[8388608] = aten._to_copy.default(bucket1_wait, "
            "dtype=torch.float32)\n"
            "  bucket1_out0: f32[4096, 2048] = aten.view.default(bucket1_widen, [4096, 2048])\n"]:
        assert line in out, line
    assert records(program)[1:] == [  # half the bytes; the loss is summed in fp32 as before
        ("all_reduce", "dp", (4 * 4096 + 4) * 2, "dp gradient bucket 0 (2 grads: "
         "layers.1.weight, layers.1.bias, summed in bfloat16): P -> R on dp"),
        ("all_reduce", "dp", 4096 * 2048 * 2, "dp gradient bucket 1 (1 grad: layers.0.weight, "
         "summed in bfloat16): P -> R on dp")]
