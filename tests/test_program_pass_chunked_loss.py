"""Program pass ``chunked_loss`` (``passes.fused_loss.fuse_loss``, ``kernels/linear_ce.py``),
unit level: a one-device program generated from a hand-written IR text.

The pass finds an LM head (``mm(h, t(w))``) whose logits go only to ``_log_softmax`` and
``nll_loss_forward`` (and their backward, and the head's two backward matmuls) and puts one
``linear_cross_entropy`` op in their place, over chunks of rows, so the (tokens, vocab) logits
never exist. Without a pipeline it computes the gradients in the forward and the backward only
scales them (``linear_cross_entropy_grads``); where the backward does not follow the forward at
once (GPipe) the backward computes the logits again (``linear_cross_entropy_backward``).

The tests check the program's text after the pass, the chunk size, that its loss and gradients
equal the unfused program's on the same inputs (targets ignored, a mean or a summed loss, the
weight's gradient written as its transpose's; gradients in the forward or the logits again),
and that a head the pattern does not cover is left as it was.
"""

from __future__ import annotations

import pytest
import torch

from shardfx.codegen.program import generate, verify_program
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.kernels.linear_ce import (LinearCrossEntropy, LinearCrossEntropyBackward,
                                       LinearCrossEntropyGrads)
from shardfx.mesh import MeshSpec
from shardfx.passes.program import chunked_loss, program_passes
from shardfx.request.options import Options

# 12 tokens, hidden 16, vocabulary 32: two chunks of rows (8, then 4), the last one short.
# proj.weight makes grad_h matter: the head's input gradient flows on into another gradient.
HEAD = """\
graph train Head
  proj_weight: f32[16, 16] = param proj.weight
  lm_head_weight: f32[32, 16] = param lm_head.weight
  x: f32[12, 16] = input args[0]
  target: i64[12] = target targets[0]
  tangent_loss: f32[] = tangent loss
  h: f32[12, 16] = aten.mm.default(x, proj_weight)  # fwd
  t: f32[16, 32] = aten.t.default(lm_head_weight)  # fwd
  logits: f32[12, 32] = aten.mm.default(h, t)  # fwd
  lsm: f32[12, 32] = aten._log_softmax.default(logits, 1, False)  # fwd
  nll: (f32[], f32[]) = aten.nll_loss_forward.default(lsm, target, None, 1, -100)  # fwd
  loss: f32[] = operator.getitem(nll, 0)  # fwd
  total: f32[] = operator.getitem(nll, 1)  # fwd
  g: f32[12, 32] = aten.nll_loss_backward.default(tangent_loss, lsm, target, None, 1, -100, total)  # bwd
  d: f32[12, 32] = aten._log_softmax_backward_data.default(g, lsm, 1, torch.float32)  # bwd
  t_d: f32[32, 12] = aten.t.default(d)  # bwd
  grad_head: f32[32, 16] = aten.mm.default(t_d, h)  # bwd
  t_t: f32[32, 16] = aten.t.default(t)  # bwd
  grad_h: f32[12, 16] = aten.mm.default(d, t_t)  # bwd
  t_x: f32[16, 12] = aten.t.default(x)  # bwd
  grad_proj: f32[16, 16] = aten.mm.default(t_x, grad_h)  # bwd
  output loss loss = loss
  output grad proj.weight = grad_proj
  output grad lm_head.weight = grad_head
"""

FUSED = """\
graph
  proj_weight: f32[16, 16] = param proj.weight
  lm_head_weight: f32[32, 16] = param lm_head.weight
  x: f32[12, 16] = input args[0]
  target: i64[12] = target targets[0]
  tangent_loss: f32[] = tangent loss
  h: f32[12, 16] = aten.mm.default(x, proj_weight)  # fwd
  linear_cross_entropy: (f32[], f32[], f32[12, 16], f32[32, 16]) = \
shardfx.kernels.linear_ce.linear_cross_entropy(h, lm_head_weight, target)  # fwd
  getitem_3: f32[] = operator.getitem(linear_cross_entropy, 0)  # fwd
  getitem_2: f32[] = operator.getitem(linear_cross_entropy, 1)  # fwd
  getitem_1: f32[12, 16] = operator.getitem(linear_cross_entropy, 2)  # fwd
  getitem: f32[32, 16] = operator.getitem(linear_cross_entropy, 3)  # fwd
  linear_cross_entropy_grads: (f32[12, 16], f32[32, 16]) = \
shardfx.kernels.linear_ce.linear_cross_entropy_grads(tangent_loss, getitem_2, getitem_1, getitem)  # bwd
  getitem_5: f32[12, 16] = operator.getitem(linear_cross_entropy_grads, 0)  # bwd
  getitem_4: f32[32, 16] = operator.getitem(linear_cross_entropy_grads, 1)  # bwd
  t_x: f32[16, 12] = aten.t.default(x)  # bwd
  grad_proj: f32[16, 16] = aten.mm.default(t_x, getitem_5)  # bwd
  output loss loss = getitem_3
  output grad proj.weight = grad_proj
  output grad lm_head.weight = getitem_4
"""

# GPipe: every microbatch's forward runs before any backward, so the gradients wait for the
# backward, which computes the logits again from h, the weight and each row's log-sum-exp.
AGAIN = """\
  linear_cross_entropy: (f32[], f32[], f32[12]) = \
shardfx.kernels.linear_ce.linear_cross_entropy(h, lm_head_weight, target)  # fwd
  getitem_2: f32[] = operator.getitem(linear_cross_entropy, 0)  # fwd
  getitem_1: f32[] = operator.getitem(linear_cross_entropy, 1)  # fwd
  getitem: f32[12] = operator.getitem(linear_cross_entropy, 2)  # fwd
  linear_cross_entropy_backward: (f32[12, 16], f32[32, 16]) = \
shardfx.kernels.linear_ce.linear_cross_entropy_backward(tangent_loss, h, lm_head_weight, \
target, getitem_1, getitem)  # bwd
  getitem_4: f32[12, 16] = operator.getitem(linear_cross_entropy_backward, 0)  # bwd
  getitem_3: f32[32, 16] = operator.getitem(linear_cross_entropy_backward, 1)  # bwd
"""


def text(program) -> str:
    return ir_to_text(program.module, people=False)


def inputs() -> list[torch.Tensor]:
    """proj.weight, lm_head.weight, x, target (every third one ignored: -100), the tangent."""
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 32, (12,), generator=g)
    target[::3] = -100
    return [torch.randn(16, 16, generator=g) / 4, torch.randn(32, 16, generator=g) / 4,
            torch.randn(12, 16, generator=g), target, torch.ones(())]


def fused(options: Options, ir_text: str = HEAD):
    """(the unfused program's outputs, the program after ``chunked_loss``, its outputs)."""
    program = generate(text_to_ir(ir_text))
    args = inputs()
    before = program.module(*args)
    program = chunked_loss(program, options)
    verify_program(program)
    return before, program, program.module(*args)


def test_it_runs_first_and_only_when_asked():
    assert program_passes(Options())[0] is chunked_loss
    assert chunked_loss not in program_passes(Options(fused_loss=False))


def test_the_head_and_its_loss_become_one_chunked_op():
    _, program, _ = fused(Options())
    assert text(program) == FUSED
    forward, backward = (n.target for n in program.module.graph.nodes
                         if n.name in ("linear_cross_entropy", "linear_cross_entropy_grads"))
    # 12 tokens in chunks of 8 rows (chunk_rows: the logits of a chunk about tokens x hidden)
    assert forward == LinearCrossEntropy(reduction=1, ignore_index=-100, rows=8, grads=True)
    assert backward == LinearCrossEntropyGrads(1, torch.float32, transposed=False)
    assert program.collectives == ()


VARIANTS = {
    "mean": HEAD,
    "sum": HEAD.replace(", 1, -100", ", 2, -100"),  # reduction="sum"
    # the weight's gradient computed as its transpose's, h.T @ d, then transposed
    "transposed": HEAD.replace(
        "  t_d: f32[32, 12] = aten.t.default(d)  # bwd\n"
        "  grad_head: f32[32, 16] = aten.mm.default(t_d, h)  # bwd\n",
        "  t_h: f32[16, 12] = aten.t.default(h)  # bwd\n"
        "  grad_head_t: f32[16, 32] = aten.mm.default(t_h, d)  # bwd\n"
        "  grad_head: f32[32, 16] = aten.t.default(grad_head_t)  # bwd\n"),
}
SCHEDULES = {"one device": Options(), "gpipe": Options(mesh=MeshSpec.parse("pp=2"),
                                                       schedule="gpipe")}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradients_equal_the_unfused_program(variant, schedule):
    assert (VARIANTS[variant] == HEAD) == (variant == "mean")
    before, program, after = fused(SCHEDULES[schedule], VARIANTS[variant])
    assert "aten._log_softmax" not in text(program) and "linear_cross_entropy(" in text(program)
    backward, = (n.target for n in program.module.graph.nodes
                 if n.name.startswith("linear_cross_entropy_"))
    assert backward.transposed == (variant == "transposed")
    assert [t.shape for t in after] == [(), (16, 16), (32, 16)]
    for want, got in zip(before, after):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gpipe_computes_the_logits_again_in_the_backward():
    _, program, _ = fused(SCHEDULES["gpipe"])
    assert AGAIN in text(program)
    op = next(n.target for n in program.module.graph.nodes
              if n.name == "linear_cross_entropy_backward")
    assert op == LinearCrossEntropyBackward(1, -100, rows=8, transposed=False)


def test_a_head_with_a_bias_is_left_as_it_is():
    """``addmm`` (a bias) is not the pattern: the logits are left materialised."""
    with_bias = HEAD.replace(
        "  x: f32[12, 16] = input args[0]\n",
        "  lm_head_bias: f32[32] = param lm_head.bias\n  x: f32[12, 16] = input args[0]\n",
    ).replace("aten.mm.default(h, t)", "aten.addmm.default(lm_head_bias, h, t)").replace(
        "  output loss loss = loss\n",
        "  grad_bias: f32[32] = aten.sum.dim_IntList(d, [0])  # bwd\n"
        "  output loss loss = loss\n  output grad lm_head.bias = grad_bias\n")
    program = generate(text_to_ir(with_bias))
    unchanged = text(program)
    assert chunked_loss(program, Options()) is program
    assert text(program) == unchanged
    assert "aten.addmm.default(lm_head_bias, h, t)" in unchanged
    assert "aten._log_softmax.default" in unchanged
