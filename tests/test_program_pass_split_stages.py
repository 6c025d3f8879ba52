"""Program pass ``split_stages`` (``codegen/stages.py``), unit level: the one-device program of a
hand-written IR text whose ops carry their pipeline stage (``@0``, ``@1``), for pp=2.

The pass cuts the program into parts, one submodule per (stage, kind): ``stage{s}_F`` (the
stage's forward), ``stage{s}_B`` (its chain of activation gradients, down to what the previous
stage is sent) and ``stage{s}_W`` (the weight gradients hanging off that chain, which a
zero-bubble schedule may defer). Under a memory budget with a schedule that has no W actions
the whole backward of a stage is one B part. The program's inputs, outputs and collectives
stay as they were, and the cut program computes the same numbers.

The text gives the stages by hand: ``passes.stage_cut`` pairs each backward op with its
forward op by torch's ``seq_nr``, which a text cannot carry.
"""

from __future__ import annotations

import torch

from shardfx.codegen.program import generate, graphs, verify_program
from shardfx.codegen.stages import stage_parts
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.mesh import MeshSpec
from shardfx.passes.program import program_passes, split_stages, triton_fusion
from shardfx.request.options import Options

PP2 = Options(mesh=MeshSpec.parse("pp=2"), microbatches=2)

# Layer 0 in stage 0, layer 1 and the loss in stage 1, each backward op where its forward is.
MLP = """\
graph train Mlp
  layers_0_weight: f32[7, 5] = param layers.0.weight  # @0
  layers_1_weight: f32[4, 7] = param layers.1.weight  # @1
  x: f32[6, 5] = input args[0]  # @0
  y: f32[6, 4] = target targets[0]  # @1
  tangent_loss: f32[] = tangent loss  # @1
  t_w0: f32[5, 7] = aten.t.default(layers_0_weight)  # fwd @0
  h: f32[6, 7] = aten.mm.default(x, t_w0)  # fwd @0
  r: f32[6, 7] = aten.relu.default(h)  # fwd @0
  t_w1: f32[7, 4] = aten.t.default(layers_1_weight)  # fwd @1
  o: f32[6, 4] = aten.mm.default(r, t_w1)  # fwd @1
  d: f32[6, 4] = aten.sub.Tensor(o, y)  # fwd @1
  sq: f32[6, 4] = aten.mul.Tensor(d, d)  # fwd @1
  loss: f32[] = aten.sum.default(sq)  # fwd @1
  d2: f32[6, 4] = aten.mul.Tensor(d, 2.0)  # bwd @1
  grad_o: f32[6, 4] = aten.mul.Tensor(d2, tangent_loss)  # bwd @1
  t_go: f32[4, 6] = aten.t.default(grad_o)  # bwd @1
  grad_w1: f32[4, 7] = aten.mm.default(t_go, r)  # bwd @1
  t_t_w1: f32[4, 7] = aten.t.default(t_w1)  # bwd @1
  grad_r: f32[6, 7] = aten.mm.default(grad_o, t_t_w1)  # bwd @1
  grad_h: f32[6, 7] = aten.threshold_backward.default(grad_r, r, 0)  # bwd @0
  t_gh: f32[7, 6] = aten.t.default(grad_h)  # bwd @0
  grad_w0: f32[7, 5] = aten.mm.default(t_gh, x)  # bwd @0
  output loss loss = loss
  output grad layers.0.weight = grad_w0
  output grad layers.1.weight = grad_w1
"""

# Each part as "name: what it takes -> its ops -> what it returns". Stage 1's B is the chain
# to grad_r (what stage 0 is sent) and W its weight's gradient; stage 0 sends nothing back (x
# needs no gradient), so its whole backward is W and it has no B part.
SPLIT = """\
stage0_F: layers_0_weight, x -> t_w0, h, r -> r
stage1_F: layers_1_weight, r, y -> t_w1, o, d, sq, loss -> d, t_w1, loss
stage1_B: d, tangent_loss, t_w1 -> d2, grad_o, t_t_w1, grad_r -> grad_o, grad_r
stage1_W: grad_o, r -> t_go, grad_w1 -> grad_w1
stage0_W: grad_r, r, x -> grad_h, t_gh, grad_w0 -> grad_w0
"""

# One B part per stage, W's ops in it: for schedules that run W right after B.
WHOLE_BACKWARD = """\
stage0_F: layers_0_weight, x -> t_w0, h, r -> r
stage1_F: layers_1_weight, r, y -> t_w1, o, d, sq, loss -> d, t_w1, loss
stage1_B: d, tangent_loss, r, t_w1 -> d2, grad_o, t_go, grad_w1, t_t_w1, grad_r -> grad_r, grad_w1
stage0_B: grad_r, r, x -> grad_h, t_gh, grad_w0 -> grad_w0
"""


def documented_order(part: str) -> tuple:
    """F parts by stage, then from the last stage down its B and its W."""
    stage, kind = int(part[len("stage")]), part[-1]
    return (0, stage, kind) if kind == "F" else (1, -stage, kind)


def parts(program) -> str:
    lines = []
    for name, module in sorted(graphs(program), key=lambda p: documented_order(p[0])):
        takes = [n.name for n in module.graph.find_nodes(op="placeholder")]
        ops = [n.name for n in module.graph.nodes if n.op == "call_function"]
        returns = [v.name for v in module.graph.output_node().args[0]]
        lines.append(f"{name}: {', '.join(takes)} -> {', '.join(ops)} -> {', '.join(returns)}")
    return "\n".join(lines) + "\n"


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (4, 7), (6, 5), (6, 4)]
    return [torch.randn(s, generator=g) for s in shapes] + [torch.ones(())]


def split(options: Options):
    """(the program's outputs before the pass, the program after it, its outputs)."""
    program = generate(text_to_ir(MLP))
    args = inputs()
    before = program.module(*args)
    cut = split_stages(program, options)
    verify_program(cut)
    assert (cut.inputs, cut.outputs, cut.collectives) == \
        (program.inputs, program.outputs, program.collectives)
    return before, cut, cut.module(*args)


def test_it_runs_on_pp_before_triton_fusion():
    passes = program_passes(Options(mesh=MeshSpec.parse("pp=2"), kernels="triton"))
    assert passes.index(split_stages) < passes.index(triton_fusion)
    assert split_stages in program_passes(Options(mesh=MeshSpec.parse("dp=2,pp=2")))
    assert split_stages not in program_passes(Options(mesh=MeshSpec.parse("dp=2")))


def test_the_program_is_cut_into_forward_input_and_weight_gradient_parts():
    before, program, after = split(PP2)
    assert parts(program) == SPLIT
    called = stage_parts(program.module)  # the order the cut program calls its parts in
    assert called[:2] == ["stage0_F", "stage1_F"]  # the forwards first, in stage order
    assert sorted(called) == sorted(line.split(":")[0] for line in SPLIT.splitlines())
    for name, module in graphs(program):  # each part holds its own stage's ops only
        stage = int(name[len("stage")])
        assert {n.meta[M.STAGE] for n in module.graph.nodes if n.op == "call_function"} == \
            {stage}, name
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_under_a_memory_budget_a_stage_s_backward_is_one_part():
    options = Options(mesh=MeshSpec.parse("pp=2"), microbatches=2, memory_budget=2**30)
    before, program, after = split(options)
    assert parts(program) == WHOLE_BACKWARD
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    zero_bubble = Options(mesh=MeshSpec.parse("pp=2"), microbatches=2, memory_budget=2**30,
                          schedule="zero-bubble")  # has W actions: W parts stay
    assert parts(split(zero_bubble)[1]) == SPLIT
