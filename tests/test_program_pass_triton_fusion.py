"""Program pass ``triton_fusion`` (``passes/fusion.py``, kernels from ``kernels/triton.py``), unit
level: one-device programs generated from hand-written IR texts, run on CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, which importing shardfx sets on a machine without CUDA).

The pass replaces each group of two or more memory-bound ops of one iteration shape (pointwise
ops, row reductions, ...) by one call of a ``FusedKernel``, returning the group's values read
outside it through ``getitem``. A group never mixes forward and backward ops, and in a
pipeline never spans two parts (each part's kernels are named after it).

The tests check the program's text after the pass, what each kernel computes and returns,
and that the program computes the same loss and gradients before and after (tensors are
tiny: the interpreter is slow).
"""

from __future__ import annotations

import torch

from shardfx.codegen.program import generate, graphs, verify_program
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.kernels.triton import FusedKernel
from shardfx.mesh import MeshSpec
from shardfx.passes.program import program_passes, split_stages, triton_fusion
from shardfx.request.options import Options

TRITON = Options(kernels="triton")

# A Linear, then bias + SiLU + scale (three pointwise ops), summed; the backward's scale and
# silu_backward (two more). The matmuls, the sums and the expand stay ATen ops.
SWISH = """\
graph train Swish
  w: f32[8, 6] = param w
  b: f32[8] = param b
  x: f32[4, 6] = input args[0]
  tangent_loss: f32[] = tangent loss
  t: f32[6, 8] = aten.t.default(w)  # fwd
  h: f32[4, 8] = aten.mm.default(x, t)  # fwd
  a: f32[4, 8] = aten.add.Tensor(h, b)  # fwd
  s: f32[4, 8] = aten.silu.default(a)  # fwd
  m: f32[4, 8] = aten.mul.Tensor(s, 2.0)  # fwd
  loss: f32[] = aten.sum.default(m)  # fwd
  ge: f32[4, 8] = aten.expand.default(tangent_loss, [4, 8])  # bwd
  g: f32[4, 8] = aten.mul.Tensor(ge, 2.0)  # bwd
  grad_a: f32[4, 8] = aten.silu_backward.default(g, a)  # bwd
  grad_b: f32[8] = aten.sum.dim_IntList(grad_a, [0])  # bwd
  t_g: f32[8, 4] = aten.t.default(grad_a)  # bwd
  grad_w: f32[8, 6] = aten.mm.default(t_g, x)  # bwd
  output loss loss = loss
  output grad w = grad_w
  output grad b = grad_b
"""

# fused_0 returns a (the backward reads it) and m (the sum does); s never leaves the kernel.
FUSED = """\
graph
  w: f32[8, 6] = param w
  b: f32[8] = param b
  x: f32[4, 6] = input args[0]
  tangent_loss: f32[] = tangent loss
  t: f32[6, 8] = aten.t.default(w)  # fwd
  h: f32[4, 8] = aten.mm.default(x, t)  # fwd
  fused_0: (f32[4, 8], f32[4, 8]) = shardfx.kernels.triton.fused_0(h, b)  # fwd
  getitem_1: f32[4, 8] = operator.getitem(fused_0, 0)  # fwd
  getitem: f32[4, 8] = operator.getitem(fused_0, 1)  # fwd
  loss: f32[] = aten.sum.default(getitem)  # fwd
  ge: f32[4, 8] = aten.expand.default(tangent_loss, [4, 8])  # bwd
  fused_1: (f32[4, 8]) = shardfx.kernels.triton.fused_1(ge, getitem_1)  # bwd
  getitem_2: f32[4, 8] = operator.getitem(fused_1, 0)  # bwd
  grad_b: f32[8] = aten.sum.dim_IntList(getitem_2, [0])  # bwd
  t_g: f32[8, 4] = aten.t.default(getitem_2)  # bwd
  grad_w: f32[8, 6] = aten.mm.default(t_g, x)  # bwd
  output loss loss = loss
  output grad w = grad_w
  output grad b = grad_b
"""


def kernels(program) -> list[tuple]:
    """Per kernel: its name, the program ops it stands for, and those it returns."""
    out = []
    for _, module in graphs(program):
        for node in module.graph.nodes:
            if isinstance(node.target, FusedKernel):
                g = node.target.group
                out.append((g.name, [op.source for op in g.ops],
                            [g.op(name).source for name, _ in g.outputs]))
    return out


def random(shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in shapes] + [torch.ones(())]


def fused(ir_text: str, options: Options, args: list[torch.Tensor], split: bool = False):
    """(the program's outputs before ``triton_fusion``, the program after it, its outputs);
    with ``split``, cut into pipeline parts first."""
    program = generate(text_to_ir(ir_text))
    if split:
        program = split_stages(program, options)
    before = program.module(*args)
    program = triton_fusion(program, options)
    verify_program(program)
    return before, program, program.module(*args)


def test_it_runs_last_and_only_for_triton_kernels():
    assert program_passes(TRITON)[-1] is triton_fusion
    assert program_passes(Options(mesh=MeshSpec.parse("pp=2"), kernels="triton"))[-1] \
        is triton_fusion
    assert triton_fusion not in program_passes(Options())  # "auto": ATen ops everywhere


def test_a_chain_of_pointwise_ops_becomes_one_kernel_per_phase():
    before, program, after = fused(SWISH, TRITON, random([(8, 6), (8,), (4, 6)]))
    assert ir_to_text(program.module, people=False) == FUSED
    assert kernels(program) == [("fused_0", ["a", "s", "m"], ["a", "m"]),
                                ("fused_1", ["g", "grad_a"], ["grad_a"])]
    assert program.collectives == ()
    assert [t.shape for t in after] == [(), (8, 6), (8,)]
    for want, got in zip(before, after):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# Two stages: stage 1's forward (sub, mul) and backward (mul, mul) chains are kernels of
# their parts; stage 0's relu and threshold_backward each stand alone and stay ATen ops.
STAGED = """\
graph train Mlp
  w0: f32[3, 5] = param layers.0.weight  # @0
  w1: f32[4, 3] = param layers.1.weight  # @1
  x: f32[2, 5] = input args[0]  # @0
  y: f32[2, 4] = target targets[0]  # @1
  tangent_loss: f32[] = tangent loss  # @1
  t_w0: f32[5, 3] = aten.t.default(w0)  # fwd @0
  h: f32[2, 3] = aten.mm.default(x, t_w0)  # fwd @0
  r: f32[2, 3] = aten.relu.default(h)  # fwd @0
  t_w1: f32[3, 4] = aten.t.default(w1)  # fwd @1
  o: f32[2, 4] = aten.mm.default(r, t_w1)  # fwd @1
  d: f32[2, 4] = aten.sub.Tensor(o, y)  # fwd @1
  sq: f32[2, 4] = aten.mul.Tensor(d, d)  # fwd @1
  loss: f32[] = aten.sum.default(sq)  # fwd @1
  d2: f32[2, 4] = aten.mul.Tensor(d, 2.0)  # bwd @1
  grad_o: f32[2, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd @1
  t_go: f32[4, 2] = aten.t.default(grad_o)  # bwd @1
  grad_w1: f32[4, 3] = aten.mm.default(t_go, r)  # bwd @1
  t_t_w1: f32[4, 3] = aten.t.default(t_w1)  # bwd @1
  grad_r: f32[2, 3] = aten.mm.default(grad_o, t_t_w1)  # bwd @1
  grad_h: f32[2, 3] = aten.threshold_backward.default(grad_r, r, 0)  # bwd @0
  t_gh: f32[3, 2] = aten.t.default(grad_h)  # bwd @0
  grad_w0: f32[3, 5] = aten.mm.default(t_gh, x)  # bwd @0
  output loss loss = loss
  output grad layers.0.weight = grad_w0
  output grad layers.1.weight = grad_w1
"""


def test_in_a_pipeline_each_part_gets_kernels_of_its_own():
    options = Options(mesh=MeshSpec.parse("pp=2"), microbatches=2, kernels="triton")
    before, program, after = fused(STAGED, options, random([(3, 5), (4, 3), (2, 5), (2, 4)]),
                                   split=True)
    assert kernels(program) == [("stage1_F_fused_0", ["d", "sq"], ["d", "sq"]),
                                ("stage1_B_fused_0", ["d2", "grad_o"], ["grad_o"])]
    for want, got in zip(before, after):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
