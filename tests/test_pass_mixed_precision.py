"""mixed_precision (with experts_router) on hand-written IR text.

Under bf16 the matmul-class ops read their fp32 operands through ``_to_copy`` casts and compute
in bf16; the numerically sensitive ops (``pow``, sums, softmax) stay fp32; the others follow
their operands' dtypes; graph outputs leave in their traced dtypes (gradients fp32). A
mixture-of-experts router's matmuls, forward and backward, stay fp32 (``experts_router``) while
the experts compute in bf16 and their routing weights stay fp32. Under fp32 nothing changes.
The tests compare the text after the pass with the expected one (or the lines that must
change), and run both graphs: the bf16 one equals an eager bf16 computation exactly and the
fp32 one within bf16's rounding.
"""

from __future__ import annotations

import re

import torch

from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.passes.mixed_precision import mixed_precision
from shardfx.request.options import Options
from shardfx.request.precision import Precision

BF16 = Options(precision=Precision("bf16"))

LINEAR = """\
graph train Tiny
  w: f32[4, 3] = param w
  x: f32[2, 4] = input args[0]
  y: f32[2, 3] = target targets[0]
  tangent_loss: f32[] = tangent loss
  mm: f32[2, 3] = aten.mm.default(x, w)  # fwd
  sub: f32[2, 3] = aten.sub.Tensor(mm, y)  # fwd
  pow_1: f32[2, 3] = aten.pow.Tensor_Scalar(sub, 2)  # fwd
  loss: f32[] = aten.sum.default(pow_1)  # fwd
  mul: f32[2, 3] = aten.mul.Tensor(sub, 2.0)  # bwd
  grad_mm: f32[2, 3] = aten.mul.Tensor(mul, tangent_loss)  # bwd
  t: f32[4, 2] = aten.t.default(x)  # bwd
  grad_w: f32[4, 3] = aten.mm.default(t, grad_mm)  # bwd
  output loss loss = loss
  output grad w = grad_w
"""

# x and w are cast once each, and the backward's transpose of x is taken of x's bf16 copy
# (a view of a cast value is the cast's view); sub promotes bf16 - fp32 to fp32; pow and the sum
# stay fp32; the gradient is cast back to fp32 where it is made. The traced transpose ``t`` is
# left in place, unread (the pass does not remove dead code).
LINEAR_BF16 = """\
graph train Tiny
  w: f32[4, 3] = param w
  x: f32[2, 4] = input args[0]
  y: f32[2, 3] = target targets[0]
  tangent_loss: f32[] = tangent loss
  _to_copy_default: bf16[2, 4] = aten._to_copy.default(x, dtype=torch.bfloat16)  # fwd
  _to_copy_default_1: bf16[4, 3] = aten._to_copy.default(w, dtype=torch.bfloat16)  # fwd
  mm: bf16[2, 3] = aten.mm.default(_to_copy_default, _to_copy_default_1)  # fwd
  sub: f32[2, 3] = aten.sub.Tensor(mm, y)  # fwd
  pow_1: f32[2, 3] = aten.pow.Tensor_Scalar(sub, 2)  # fwd
  loss: f32[] = aten.sum.default(pow_1)  # fwd
  mul: f32[2, 3] = aten.mul.Tensor(sub, 2.0)  # bwd
  grad_mm: f32[2, 3] = aten.mul.Tensor(mul, tangent_loss)  # bwd
  t_default: bf16[4, 2] = aten.t.default(_to_copy_default)  # bwd
  _to_copy_default_2: bf16[2, 3] = aten._to_copy.default(grad_mm, dtype=torch.bfloat16)  # bwd
  grad_w: bf16[4, 3] = aten.mm.default(t_default, _to_copy_default_2)  # bwd
  _to_copy_default_3: f32[4, 3] = aten._to_copy.default(grad_w, dtype=torch.float32)  # bwd
  output loss loss = loss
  output grad w = _to_copy_default_3
"""


def _close_in_bf16(got, want, name=""):
    """Equal to bf16's rounding (8 bits of mantissa), relative to the tensor's largest value:
    a sum of rounded products may cancel to an element far smaller than its terms."""
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()),
                               msg=name or None)


def _data(seed: int, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def test_bf16_casts_the_matmuls_and_keeps_the_rest():
    gm = mixed_precision(text_to_ir(LINEAR), BF16)
    verify(gm)
    assert ir_to_text(gm) == LINEAR_BF16
    report = gm.meta[M.PRECISION]
    assert (report.low, report.full, report.casts) == (2, 2, 4)

    w, x, y = _data(0, (4, 3), (2, 4), (2, 3))
    loss, grad_w = gm(w, x, y, torch.ones(()))
    assert (loss.dtype, grad_w.dtype) == (torch.float32, torch.float32)
    # exactly autocast's arithmetic, written eagerly
    xb, wb = x.bfloat16(), w.bfloat16()
    sub = (xb @ wb).float() - y
    assert torch.equal(loss, sub.pow(2).sum())
    assert torch.equal(grad_w, (xb.t() @ (sub * 2.0).bfloat16()).float())
    # and the fp32 graph's numbers to bf16's rounding, but not bit for bit
    want_loss, want_grad = text_to_ir(LINEAR)(w, x, y, torch.ones(()))
    _close_in_bf16(loss, want_loss)
    _close_in_bf16(grad_w, want_grad)
    assert not torch.equal(grad_w, want_grad)


def test_fp32_leaves_the_graph_as_it_is():
    gm = mixed_precision(text_to_ir(LINEAR), Options(precision=Precision("fp32")))
    assert ir_to_text(gm) == LINEAR
    assert M.PRECISION not in gm.meta


# the experts' form after their tensors: act, gated, interleaved, alpha, limit, offset,
# transposed, score_before, capacity, layer (``kernels.expert_compute.Form``)
FORM = "'silu', True, False, 1.0, 0.0, 0.0, False, False, 0.0, 'moe'"
MOE = """\
graph train Moe
  w_in: f32[2, 6, 4] = param w_in
  w_out: f32[2, 4, 3] = param w_out
  router_weight: f32[2, 4] = param router.weight
  x: f32[3, 4] = input args[0]
  tangent_loss: f32[] = tangent loss
  t: f32[4, 2] = aten.t.default(router_weight)
  mm: f32[3, 2] = aten.mm.default(x, t)
  _softmax: f32[3, 2] = aten._softmax.default(mm, -1, False)
  topk: (f32[3, 1], i64[3, 1]) = aten.topk.default(_softmax, 1)
  weights: f32[3, 1] = operator.getitem(topk, 0)
  index: i64[3, 1] = operator.getitem(topk, 1)
  experts: (f32[3, 4], f32[3, 4], f32[3, 6], f32[3, 4]) = shardfx.experts.default(\
x, index, weights, w_in, w_out, None, None, 'silu', True, False, 1.0, 0.0, 0.0, False, False, \
0.0, 'moe')
  y: f32[3, 4] = operator.getitem(experts, 0)
  xd: f32[3, 4] = operator.getitem(experts, 1)
  h: f32[3, 6] = operator.getitem(experts, 2)
  zs: f32[3, 4] = operator.getitem(experts, 3)
  loss: f32[] = aten.sum.default(y)
  expand: f32[3, 4] = aten.expand.default(tangent_loss, [3, 4])
  experts_backward: (f32[3, 4], f32[3, 1], f32[2, 6, 4], f32[2, 4, 3], f32[0], f32[0]) = \
shardfx.experts_backward.default(expand, x, index, weights, w_in, w_out, xd, h, zs, None, None, \
'silu', True, False, 1.0, 0.0, 0.0, False, False, 0.0, 'moe')
  grad_weights: f32[3, 1] = operator.getitem(experts_backward, 1)
  grad_w_in: f32[2, 6, 4] = operator.getitem(experts_backward, 2)
  grad_w_out: f32[2, 4, 3] = operator.getitem(experts_backward, 3)
  new_zeros: f32[3, 2] = aten.new_zeros.default(grad_weights, [3, 2])
  scatter: f32[3, 2] = aten.scatter.src(new_zeros, -1, index, grad_weights)
  grad_probs: f32[3, 2] = aten._softmax_backward_data.default(scatter, _softmax, -1, \
torch.float32)
  t_1: f32[2, 3] = aten.t.default(grad_probs)
  grad_router: f32[2, 4] = aten.mm.default(t_1, x)
  output loss loss = loss
  output grad w_in = grad_w_in
  output grad w_out = grad_w_out
  output grad router.weight = grad_router
"""


def _line(text: str, name: str) -> str:
    """The line defining ``name``, without its notes."""
    (line,) = re.findall(rf"^  {name}: (.*?)(?:  # .*)?$", text, re.M)
    return line


def test_router_matmuls_stay_fp32_and_the_experts_compute_in_bf16():
    gm = mixed_precision(text_to_ir(MOE), BF16)
    verify(gm)
    text = ir_to_text(gm)
    # the router, forward and backward: fp32, reading x itself
    assert _line(text, "mm") == "f32[3, 2] = aten.mm.default(x, t)"
    assert _line(text, "_softmax") == "f32[3, 2] = aten._softmax.default(mm, -1, False)"
    assert _line(text, "grad_router") == "f32[2, 4] = aten.mm.default(t_1, x)"
    # the experts: bf16 tokens and weights, the routing weights as the router made them (fp32)
    x16, w_in16, w_out16 = (re.search(rf"^  (\w+): bf16\[{shape}\] = aten\._to_copy\.default"
                                      rf"\({name}, dtype=torch\.bfloat16\)", text, re.M)[1]
                            for name, shape in (("x", "3, 4"), ("w_in", "2, 6, 4"),
                                                ("w_out", "2, 4, 3")))
    assert _line(text, "experts") == (
        f"(bf16[3, 4], bf16[3, 4], bf16[3, 6], bf16[3, 4]) = shardfx.experts.default({x16}, "
        f"index, weights, {w_in16}, {w_out16}, None, None, {FORM})")
    assert _line(text, "experts_backward").startswith(
        "(bf16[3, 4], f32[3, 1], bf16[2, 6, 4], bf16[2, 4, 3], bf16[0], bf16[0]) = "
        "shardfx.experts_backward.default(")
    # the incoming gradient: the tangent cast to bf16, then expanded
    tangent16 = re.search(r"^  (\w+): bf16\[\] = aten\._to_copy\.default\(tangent_loss, "
                          r"dtype=torch\.bfloat16\)", text, re.M)[1]
    grad16 = re.search(rf"^  (\w+): bf16\[3, 4\] = aten\.expand\.default\({tangent16}, "
                       rf"\[3, 4\]\)", text, re.M)[1]
    assert _line(text, "experts_backward").endswith(
        f".default({grad16}, {x16}, index, weights, {w_in16}, {w_out16}, xd, h, zs, None, "
        f"None, {FORM})")
    # the loss sums the bf16 output accumulating in fp32; the gradients leave in fp32
    assert _line(text, "loss") == "f32[] = aten.sum.default(y, dtype=torch.float32)"
    for name, shape in (("w_in", "2, 6, 4"), ("w_out", "2, 4, 3")):
        out = re.search(rf"^  output grad {name} = (\w+)$", text, re.M)[1]
        assert _line(text, out) == \
            f"f32[{shape}] = aten._to_copy.default(grad_{name}, dtype=torch.float32)"
    assert gm.meta[M.PRECISION].routers == 2 and gm.meta[M.PRECISION].low == 2

    inputs = [*_data(1, (2, 6, 4), (2, 4, 3), (2, 4), (3, 4)), torch.ones(())]
    got, want = gm(*inputs), text_to_ir(MOE)(*inputs)
    for name, g, w in zip(("loss", "grad w_in", "grad w_out", "grad router"), got, want):
        assert g.dtype == torch.float32, name
        _close_in_bf16(g, w, name)
    assert not torch.equal(got[1], want[1])  # the experts did compute in bf16
