"""decompose (run by passes/fusion.fuse before it groups ops) on hand-written IR text.

Every fp32 ``native_layer_norm`` over the last dimension becomes its mean, centring, variance,
``rsqrt`` and affine ops, and its backward the input gradient's row ops and, for the weight and
bias gradients, sums over the rows; the readers of each result (``getitem``) read the op that
now computes it, and the new ops take the replaced op's PHASE. A LayerNorm over two dimensions,
or not in fp32, is left as it is. The tests compare the text with the expected one (forward),
check the lines that must change (backward), and run the graph before and after on the same
random inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.passes.decompose import decompose


def _decomposed(text: str) -> fx.GraphModule:
    gm = text_to_ir(text)
    decompose(gm.graph)  # takes a graph, as fuse does
    gm.recompile()
    verify(gm)
    return gm


def _inputs(gm: fx.GraphModule, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n.meta["val"].shape, generator=g).to(n.meta["val"].dtype)
            for n in gm.graph.find_nodes(op="placeholder")]


FORWARD = """\
graph infer LayerNorm
  weight: f32[4] = param weight
  bias: f32[4] = param bias
  x: f32[2, 3, 4] = input args[0]
  native_layer_norm: (f32[2, 3, 4], f32[2, 3, 1], f32[2, 3, 1]) = \
aten.native_layer_norm.default(x, [4], weight, bias, 1e-05)  # fwd
  out: f32[2, 3, 4] = operator.getitem(native_layer_norm, 0)  # fwd
  rstd: f32[2, 3, 1] = operator.getitem(native_layer_norm, 2)  # fwd
  output output out[0] = out
  output output out[1] = rstd
"""
# (x - mean) * rsqrt(mean((x - mean)^2) + eps) * weight + bias; the getitems are gone
FORWARD_DECOMPOSED = """\
graph infer LayerNorm
  weight: f32[4] = param weight
  bias: f32[4] = param bias
  x: f32[2, 3, 4] = input args[0]
  mean_dim: f32[2, 3, 1] = aten.mean.dim(x, [-1], True)  # fwd
  sub_tensor: f32[2, 3, 4] = aten.sub.Tensor(x, mean_dim)  # fwd
  mul_tensor: f32[2, 3, 4] = aten.mul.Tensor(sub_tensor, sub_tensor)  # fwd
  mean_dim_1: f32[2, 3, 1] = aten.mean.dim(mul_tensor, [-1], True)  # fwd
  add_tensor: f32[2, 3, 1] = aten.add.Tensor(mean_dim_1, 1e-05)  # fwd
  rsqrt_default: f32[2, 3, 1] = aten.rsqrt.default(add_tensor)  # fwd
  mul_tensor_1: f32[2, 3, 4] = aten.mul.Tensor(sub_tensor, rsqrt_default)  # fwd
  mul_tensor_2: f32[2, 3, 4] = aten.mul.Tensor(mul_tensor_1, weight)  # fwd
  add_tensor_1: f32[2, 3, 4] = aten.add.Tensor(mul_tensor_2, bias)  # fwd
  output output out[0] = add_tensor_1
  output output out[1] = rsqrt_default
"""


def test_layer_norm_forward():
    gm = _decomposed(FORWARD)
    assert ir_to_text(gm) == FORWARD_DECOMPOSED
    inputs = _inputs(gm)
    for got, want in zip(gm(*inputs), text_to_ir(FORWARD)(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


TRAIN = """\
graph train LayerNorm
  weight: f32[4] = param weight
  bias: f32[4] = param bias
  x: f32[2, 3, 4] = param x
  tangent_loss: f32[] = tangent loss
  native_layer_norm: (f32[2, 3, 4], f32[2, 3, 1], f32[2, 3, 1]) = \
aten.native_layer_norm.default(x, [4], weight, bias, 1e-05)  # fwd
  out: f32[2, 3, 4] = operator.getitem(native_layer_norm, 0)  # fwd
  mean: f32[2, 3, 1] = operator.getitem(native_layer_norm, 1)  # bwd
  rstd: f32[2, 3, 1] = operator.getitem(native_layer_norm, 2)  # bwd
  square: f32[2, 3, 4] = aten.mul.Tensor(out, out)  # fwd
  loss: f32[] = aten.sum.default(square)  # fwd
  expand: f32[2, 3, 4] = aten.expand.default(tangent_loss, [2, 3, 4])  # bwd
  grad_out: f32[2, 3, 4] = aten.mul.Tensor(expand, out)  # bwd
  native_layer_norm_backward: (f32[2, 3, 4], f32[4], f32[4]) = \
aten.native_layer_norm_backward.default(grad_out, x, [4], mean, rstd, weight, bias, \
[True, True, True])  # bwd
  grad_x: f32[2, 3, 4] = operator.getitem(native_layer_norm_backward, 0)  # bwd
  grad_weight: f32[4] = operator.getitem(native_layer_norm_backward, 1)  # bwd
  grad_bias: f32[4] = operator.getitem(native_layer_norm_backward, 2)  # bwd
  output loss loss = loss
  output grad weight = grad_weight
  output grad bias = grad_bias
  output grad x = grad_x
"""


# dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = grad_out * weight,
# xhat = (x - mean) * rstd; dweight = sum(grad_out * xhat), dbias = sum(grad_out) over the rows
BACKWARD_DECOMPOSED = """\
  expand: f32[2, 3, 4] = aten.expand.default(tangent_loss, [2, 3, 4])  # bwd
  grad_out: f32[2, 3, 4] = aten.mul.Tensor(expand, add_tensor_1)  # bwd
  sub_tensor_1: f32[2, 3, 4] = aten.sub.Tensor(x, mean_dim)  # bwd
  mul_tensor_3: f32[2, 3, 4] = aten.mul.Tensor(sub_tensor_1, rsqrt_default)  # bwd
  mul_tensor_4: f32[2, 3, 4] = aten.mul.Tensor(grad_out, weight)  # bwd
  mul_tensor_5: f32[2, 3, 4] = aten.mul.Tensor(mul_tensor_4, mul_tensor_3)  # bwd
  mean_dim_2: f32[2, 3, 1] = aten.mean.dim(mul_tensor_5, [-1], True)  # bwd
  mean_dim_3: f32[2, 3, 1] = aten.mean.dim(mul_tensor_4, [-1], True)  # bwd
  sub_tensor_2: f32[2, 3, 4] = aten.sub.Tensor(mul_tensor_4, mean_dim_3)  # bwd
  mul_tensor_6: f32[2, 3, 4] = aten.mul.Tensor(mul_tensor_3, mean_dim_2)  # bwd
  sub_tensor_3: f32[2, 3, 4] = aten.sub.Tensor(sub_tensor_2, mul_tensor_6)  # bwd
  mul_tensor_7: f32[2, 3, 4] = aten.mul.Tensor(rsqrt_default, sub_tensor_3)  # bwd
  mul_tensor_8: f32[2, 3, 4] = aten.mul.Tensor(grad_out, mul_tensor_3)  # bwd
  sum_dim_int_list: f32[4] = aten.sum.dim_IntList(mul_tensor_8, [0, 1])  # bwd
  sum_dim_int_list_1: f32[4] = aten.sum.dim_IntList(grad_out, [0, 1])  # bwd
  output loss loss = loss
  output grad weight = sum_dim_int_list
  output grad bias = sum_dim_int_list_1
  output grad x = mul_tensor_7
"""


def test_layer_norm_backward():
    gm = _decomposed(TRAIN)
    forward, backward = ir_to_text(gm).split("  expand:")
    # the forward as in test_layer_norm_forward, then the loss reading its result
    assert forward.splitlines()[5:] == FORWARD_DECOMPOSED.splitlines()[4:-2] + [
        "  square: f32[2, 3, 4] = aten.mul.Tensor(add_tensor_1, add_tensor_1)  # fwd",
        "  loss: f32[] = aten.sum.default(square)  # fwd"]
    assert "  expand:" + backward == BACKWARD_DECOMPOSED

    inputs = _inputs(gm, seed=1)
    inputs[3] = torch.ones(())  # the tangent
    names = ("loss", "grad weight", "grad bias", "grad x")
    for name, got, want in zip(names, gm(*inputs), text_to_ir(TRAIN)(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


TWO_DIMS = FORWARD.replace("[4], weight", "[3, 4], weight").replace("f32[4]", "f32[3, 4]") \
    .replace("f32[2, 3, 1]", "f32[2, 1, 1]")  # normalized over (3, 4)
BF16 = FORWARD.replace("f32[", "bf16[")


@pytest.mark.parametrize("text", [TWO_DIMS, BF16], ids=["two-dims", "bf16"])
def test_other_layer_norms_are_left_alone(text):
    assert "native_layer_norm.default(x, [3, 4]" in text or "bf16[2, 3, 4] = input" in text
    assert ir_to_text(_decomposed(text)) == text
