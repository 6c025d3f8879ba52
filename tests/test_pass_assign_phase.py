"""assign_phase on hand-written IR text.

The pass marks every op ``fwd`` or ``bwd``: forward is what a forward output (the loss, a model
output, a buffer update) needs; everything else -- whatever reads the tangent, and ops only
feeding gradients, such as a transpose of the input read by the weight-gradient matmul -- is
backward. It writes metadata only (PHASE), so the tests compare the text after the pass with
the text expected, line for line; the graph's ops and operands must come out unchanged.
"""

from __future__ import annotations

import pytest

from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.passes.assign_phase import assign_phase
from shardfx.request.options import Options

# A linear layer with a squared-error loss, a running statistic (a buffer update, which is
# forward though the loss does not read it) and a transpose of x only the backward reads.
EXPECTED = """\
graph train Tiny
  w: f32[4, 3] = param w
  running: f32[3] = buffer running
  x: f32[2, 4] = input args[0]
  y: f32[2, 3] = target targets[0]
  tangent_loss: f32[] = tangent loss
  mm: f32[2, 3] = aten.mm.default(x, w)  # fwd
  batch_mean: f32[3] = aten.mean.dim(mm, [0])  # fwd
  new_running: f32[3] = aten.add.Tensor(running, batch_mean)  # fwd
  sub: f32[2, 3] = aten.sub.Tensor(mm, y)  # fwd
  pow_1: f32[2, 3] = aten.pow.Tensor_Scalar(sub, 2)  # fwd
  loss: f32[] = aten.sum.default(pow_1)  # fwd
  mul: f32[2, 3] = aten.mul.Tensor(sub, 2.0)  # bwd
  grad_mm: f32[2, 3] = aten.mul.Tensor(mul, tangent_loss)  # bwd
  t: f32[4, 2] = aten.t.default(x)  # bwd
  grad_w: f32[4, 3] = aten.mm.default(t, grad_mm)  # bwd
  output loss loss = loss
  output buffer_update running = new_running
  output grad w = grad_w
"""


def _with_notes(text: str, note: str | None) -> str:
    """``text`` with every op's ``# fwd``/``# bwd`` dropped (``note`` None) or replaced."""
    lines = []
    for line in text.splitlines():
        line = line.split("  # ")[0]
        if note is not None and " = aten." in line:
            line += f"  # {note}"
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("given", [None, "bwd", "fwd"], ids=["unmarked", "all-bwd", "all-fwd"])
def test_phases_of_a_training_graph(given):
    """From no phases, or from wrong ones (the pass recomputes them all), the text after the
    pass is the expected one: the loss's ancestors and the buffer update's are fwd, the rest
    bwd."""
    gm = text_to_ir(_with_notes(EXPECTED, given))
    out = assign_phase(gm, Options())
    verify(out)
    assert ir_to_text(out) == EXPECTED
    phases = {n.name: n.meta[M.PHASE] for n in out.graph.nodes if n.op == "call_function"}
    assert phases["t"] is M.Phase.BACKWARD and phases["sub"] is M.Phase.FORWARD
    assert all(M.PHASE not in n.meta for n in out.graph.find_nodes(op="placeholder"))


def test_inference_graph_is_all_forward_and_dead_ops_are_backward():
    """An inference graph's outputs are forward outputs; an op no output needs is not forward
    (the pass has only two phases: it is marked bwd)."""
    text = """\
graph infer Tiny
  w: f32[4, 3] = param w
  x: f32[2, 4] = input args[0]
  mm: f32[2, 3] = aten.mm.default(x, w)
  relu: f32[2, 3] = aten.relu.default(mm)
  unread: f32[2, 3] = aten.neg.default(mm)
  output output out[0] = relu
"""
    out = assign_phase(text_to_ir(text), Options())
    verify(out)
    after = ir_to_text(out).splitlines()
    assert after[3:6] == ["  mm: f32[2, 3] = aten.mm.default(x, w)  # fwd",
                          "  relu: f32[2, 3] = aten.relu.default(mm)  # fwd",
                          "  unread: f32[2, 3] = aten.neg.default(mm)  # bwd"]
