"""estimate_cost on hand-written IR text.

The pass writes ``COST`` (FLOPs, bytes made) on every op: a matmul costs ``2*m*n*k`` FLOPs,
other ops none (memory-bound: their cost is the bytes they write), and a view writes no bytes.
It is metadata only. ``ir_to_text`` shows the cost after ``|`` on each op line (its default,
``people=True``; ``-`` for a view); ``people=False`` leaves that part out, and the parser
ignores it. The tests check the text with costs, the values from the shapes, and the dtype's
size in the bytes.
"""

from __future__ import annotations

from shardfx.cost.device_model import GRAPH_KEY, PRESETS
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.request.options import Options

LINEAR = """\
graph train Linear
  w: f32[32, 16] = param w
  x: f32[8, 16] = input args[0]
  tangent_loss: f32[] = tangent loss
  t: f32[16, 32] = aten.t.default(w)  # fwd
  mm: f32[8, 32] = aten.mm.default(x, t)  # fwd
  relu: f32[8, 32] = aten.relu.default(mm)  # fwd
  view: f32[2, 4, 32] = aten.view.default(relu, [2, 4, 32])  # fwd
  loss: f32[] = aten.sum.default(view)  # fwd
  expand: f32[8, 32] = aten.expand.default(tangent_loss, [8, 32])  # bwd
  grad_relu: f32[8, 32] = aten.threshold_backward.default(expand, relu, 0)  # bwd
  t_1: f32[32, 8] = aten.t.default(grad_relu)  # bwd
  grad_w: f32[32, 16] = aten.mm.default(t_1, x)  # bwd
  output loss loss = loss
  output grad w = grad_w
"""

# mm: 2 * 8 * 32 * 16 = 8192 FLOPs, 8 * 32 fp32 = 1 KiB; grad_w: 2 * 32 * 16 * 8 FLOPs, 2 KiB;
# t, view, expand: views, no bytes ("-"); relu, threshold_backward: bytes only; the sum: 4 B.
WITH_COSTS = """\
graph train Linear
  w: f32[32, 16] = param w
  x: f32[8, 16] = input args[0]
  tangent_loss: f32[] = tangent loss
  t: f32[16, 32] = aten.t.default(w)  # fwd | -
  mm: f32[8, 32] = aten.mm.default(x, t)  # fwd | 8.19 KFLOP 1.0 KiB
  relu: f32[8, 32] = aten.relu.default(mm)  # fwd | 1.0 KiB
  view: f32[2, 4, 32] = aten.view.default(relu, [2, 4, 32])  # fwd | -
  loss: f32[] = aten.sum.default(view)  # fwd | 4 B
  expand: f32[8, 32] = aten.expand.default(tangent_loss, [8, 32])  # bwd | -
  grad_relu: f32[8, 32] = aten.threshold_backward.default(expand, relu, 0)  # bwd | 1.0 KiB
  t_1: f32[32, 8] = aten.t.default(grad_relu)  # bwd | -
  grad_w: f32[32, 16] = aten.mm.default(t_1, x)  # bwd | 8.19 KFLOP 2.0 KiB
  output loss loss = loss
  output grad w = grad_w
"""


def test_costs_in_the_text():
    gm = estimate_cost(text_to_ir(LINEAR), Options())
    verify(gm)
    assert ir_to_text(gm) == WITH_COSTS  # people=True is the default
    assert ir_to_text(gm, people=True) == WITH_COSTS
    assert ir_to_text(gm, people=False) == LINEAR  # without the part after |
    assert ir_to_text(text_to_ir(WITH_COSTS), people=False) == LINEAR  # which parse ignores
    assert gm.meta[GRAPH_KEY] == PRESETS["cpu"]  # the device model later passes time with


def test_costs_from_the_shapes():
    gm = estimate_cost(text_to_ir(LINEAR), Options())
    cost = {n.name: n.meta[M.COST] for n in gm.graph.nodes if n.op == "call_function"}
    assert set(cost) == {n.name for n in gm.graph.nodes if n.op == "call_function"}
    assert cost["mm"] == M.NodeCost(flops=2 * 8 * 32 * 16, out_bytes=8 * 32 * 4)
    assert cost["grad_w"] == M.NodeCost(flops=2 * 32 * 16 * 8, out_bytes=32 * 16 * 4)
    for view in ("t", "view", "expand", "t_1"):
        assert cost[view] == M.NodeCost(0, 0), view
    assert cost["relu"] == cost["grad_relu"] == M.NodeCost(0, 8 * 32 * 4)
    assert cost["loss"] == M.NodeCost(0, 4)


def test_batched_matmul_and_bf16_bytes():
    """bmm: 2 * batch * m * n * k; a bf16 result is 2 bytes an element."""
    text = """\
graph infer Bmm
  a: bf16[2, 3, 5] = input args[0]
  b: bf16[2, 5, 7] = input args[1]
  bmm: bf16[2, 3, 7] = aten.bmm.default(a, b)  # fwd
  output output out[0] = bmm
"""
    gm = estimate_cost(text_to_ir(text), Options())
    (bmm,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert bmm.meta[M.COST] == M.NodeCost(flops=2 * 2 * 3 * 7 * 5, out_bytes=2 * 3 * 7 * 2)
    assert "  bmm: bf16[2, 3, 7] = aten.bmm.default(a, b)  # fwd | 420 FLOP 84 B" in \
        ir_to_text(gm).splitlines()
