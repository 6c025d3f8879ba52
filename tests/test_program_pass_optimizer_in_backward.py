"""Program pass ``optimizer_in_backward`` (``codegen/step_in_backward.py``), unit level: programs
generated from hand-written IR texts, on one device and on a dp=2 mesh after
``bucket_gradients``.

For each block's parameters (``layers.1.weight`` and ``layers.1.bias`` together; any other
parameter alone) the pass puts one ``step_parameters(temporaries, names, *grads)`` op where
their gradients are final and the last op reading the parameters (through views: ``t(t(w))``)
has run, and returns None for those gradients. On a dp mesh a gradient is final once its
bucket's all-reduce is waited for, so each bucket's wait (and the split after it) moves up to
right after the next bucket's all-reduce is issued (``wait_one_behind``).

On one device the program runs: with a stepper installed (``stepping``, as the runner does)
it hands the stepper the same gradients the program returned before the pass, block by block
in backward order. The dp program needs a process group: its text is checked.
``temporaries`` is AdamW's fused step's (``cost.optimizer``): none.
"""

from __future__ import annotations

import pytest
import torch

from shardfx.codegen.program import generate, verify_program
from shardfx.codegen.spmd import generate_spmd
from shardfx.codegen.step_in_backward import stepping
from shardfx.errors import InputError
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.program import bucket_gradients_pass, optimizer_in_backward, program_passes
from shardfx.passes.zero import zero_gather
from shardfx.request.options import Options

from program_graphs import TWO_BUCKETS

ONE = Options(optimizer_in_backward=True)
DP2 = Options(mesh=MeshSpec.parse("dp=2"), optimizer_in_backward=True)

MLP = """\
graph train Mlp
  layers_0_weight: f32[7, 5] = param layers.0.weight
  layers_1_weight: f32[4, 7] = param layers.1.weight
  layers_1_bias: f32[4] = param layers.1.bias
  x: f32[6, 5] = input args[0]
  y: f32[6, 4] = target targets[0]
  tangent_loss: f32[] = tangent loss
  t_w0: f32[5, 7] = aten.t.default(layers_0_weight)  # fwd
  h: f32[6, 7] = aten.mm.default(x, t_w0)  # fwd
  r: f32[6, 7] = aten.relu.default(h)  # fwd
  t_w1: f32[7, 4] = aten.t.default(layers_1_weight)  # fwd
  o: f32[6, 4] = aten.addmm.default(layers_1_bias, r, t_w1)  # fwd
  d: f32[6, 4] = aten.sub.Tensor(o, y)  # fwd
  sq: f32[6, 4] = aten.mul.Tensor(d, d)  # fwd
  loss: f32[] = aten.sum.default(sq)  # fwd
  d2: f32[6, 4] = aten.mul.Tensor(d, 2.0)  # bwd
  grad_o: f32[6, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd
  t_go: f32[4, 6] = aten.t.default(grad_o)  # bwd
  grad_w1: f32[4, 7] = aten.mm.default(t_go, r)  # bwd
  grad_b1: f32[4] = aten.sum.dim_IntList(grad_o, [0])  # bwd
  t_t_w1: f32[4, 7] = aten.t.default(t_w1)  # bwd
  grad_r: f32[6, 7] = aten.mm.default(grad_o, t_t_w1)  # bwd
  grad_h: f32[6, 7] = aten.threshold_backward.default(grad_r, r, 0)  # bwd
  t_gh: f32[7, 6] = aten.t.default(grad_h)  # bwd
  grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd
  output loss loss = loss
  output grad layers.0.weight = grad_w0
  output grad layers.1.weight = grad_w1
  output grad layers.1.bias = grad_b1
"""

# layer 1's gradients exist after grad_b1, but grad_r still reads its weight (as t(t(w))):
# its step comes after grad_r. Layer 0's comes after its gradient, the last op.
STEPPED = """\
  grad_r: f32[6, 7] = aten.mm.default(grad_o, t_t_w1)  # bwd
  step_parameters_1: - = shardfx.codegen.step_in_backward.step_parameters(0, \
('layers.1.weight', 'layers.1.bias'), grad_w1, grad_b1)  # bwd
  grad_h: f32[6, 7] = aten.threshold_backward.default(grad_r, r, 0)  # bwd
  t_gh: f32[7, 6] = aten.t.default(grad_h)  # bwd
  grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd
  step_parameters: - = shardfx.codegen.step_in_backward.step_parameters(0, \
('layers.0.weight',), grad_w0)  # bwd
  output loss loss = loss
  output grad layers.0.weight = None
  output grad layers.1.weight = None
  output grad layers.1.bias = None
"""


def text(program) -> str:
    return ir_to_text(program.module, people=False)


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (4, 7), (4,), (6, 5), (6, 4)]
    return [torch.randn(s, generator=g) for s in shapes] + [torch.ones(())]


def test_it_runs_when_asked_after_the_buckets_and_zero():
    passes = program_passes(DP2)
    assert passes.index(bucket_gradients_pass) < passes.index(optimizer_in_backward)
    zero3 = program_passes(Options(mesh=MeshSpec.parse("dp=2"), zero=3,
                                   optimizer_in_backward=True))
    assert zero3.index(zero_gather) < zero3.index(optimizer_in_backward)
    assert optimizer_in_backward not in program_passes(Options())


def test_each_block_is_stepped_where_its_gradients_are_final():
    program = generate(text_to_ir(MLP))
    before = text(program)
    head = before[:before.index("  grad_r:")]  # the program up to grad_r, as it was
    program = optimizer_in_backward(program, ONE)
    verify_program(program)
    assert text(program) == head + STEPPED


def test_the_stepper_gets_the_gradients_the_program_returned():
    program = generate(text_to_ir(MLP))
    args = inputs()
    loss, *grads = program.module(*args)
    program = optimizer_in_backward(program, ONE)
    steps = []
    with stepping(lambda names, gs: steps.append((names, [g.clone() for g in gs]))):
        after = program.module(*args)
    assert torch.equal(after[0], loss) and after[1:] == (None, None, None)
    assert [names for names, _ in steps] == [("layers.1.weight", "layers.1.bias"),
                                             ("layers.0.weight",)]
    (_, (w1, b1)), (_, (w0,)) = steps
    for got, want in zip((w0, w1, b1), grads):
        assert torch.equal(got, want)
    with pytest.raises(InputError, match="no runner installed a stepper"):
        program.module(*args)


# dp=2: layers.0.weight is 32 MiB (FakeTensors: nothing is allocated), a bucket of its own;
# layer 1's gradients share the other bucket.
MLP_DP = TWO_BUCKETS

# bucket 0 is waited for (and split) right after bucket 1's all-reduce is issued, and layer 1
# stepped at once; layer 0 after bucket 1's wait, at the end.
STEPPED_DP = """\
  bucket1_all_reduce: f32[8388608] = _c10d_functional.all_reduce.default(bucket1_in0, 'sum', \
group_dp)
  bucket0_wait: f32[16388] = _c10d_functional.wait_tensor.default(bucket0_all_reduce)
  bucket0_split: (f32[16384], f32[4]) = aten.split_with_sizes.default(bucket0_wait, [16384, 4])
  bucket0_part0: f32[16384] = operator.getitem(bucket0_split, 0)
  bucket0_part1: f32[4] = operator.getitem(bucket0_split, 1)
  bucket0_out0: f32[4, 4096] = aten.view.default(bucket0_part0, [4, 4096])
  bucket0_out1: f32[4] = aten.view.default(bucket0_part1, [4])
  step_parameters_1: - = shardfx.codegen.step_in_backward.step_parameters(0, \
('layers.1.weight', 'layers.1.bias'), bucket0_out0, bucket0_out1)  # bwd
  all_reduce_default: f32[] = _c10d_functional.all_reduce.default(loss, 'sum', group_dp)
  wait_tensor_default: f32[] = _c10d_functional.wait_tensor.default(all_reduce_default)
  bucket1_wait: f32[8388608] = _c10d_functional.wait_tensor.default(bucket1_all_reduce)
  bucket1_out0: f32[4096, 2048] = aten.view.default(bucket1_wait, [4096, 2048])
  step_parameters: - = shardfx.codegen.step_in_backward.step_parameters(0, \
('layers.0.weight',), bucket1_out0)  # bwd
  output loss loss = wait_tensor_default
  output grad layers.0.weight = None
  output grad layers.1.weight = None
  output grad layers.1.bias = None
"""


def test_on_dp_each_bucket_is_waited_for_one_behind_and_its_block_stepped():
    program = bucket_gradients_pass(generate_spmd(text_to_ir(MLP_DP)), DP2)
    before = text(program)
    collectives = program.collectives
    head = before[:before.index("  bucket1_all_reduce:")]
    assert "bucket0_wait" not in head  # waited for at the end, before the pass

    program = optimizer_in_backward(program, DP2)
    verify_program(program)
    assert text(program) == head + STEPPED_DP
    assert program.collectives == collectives
