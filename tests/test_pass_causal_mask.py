"""causal_mask on hand-written IR text.

An attention op (CPU flash attention and its backward, as capture leaves
``F.scaled_dot_product_attention``) whose dense mask is computed from constants alone and is the
causal one takes ``is_causal=True`` and no mask, forward and backward, and the mask's ops go; a
mask of zeros (every key allowed) is dropped, the attention left non-causal; a sliding window or
chunks (a band of keys) is made again by one ``shardfx.band_mask`` op before each attention op.
Any other mask is refused with a ``ShardingError`` naming what it is (one made from the model's
inputs, an additive bias, another pattern), and ``MASK`` says so on both attention ops. The
tests check the text after the pass, and that the rewritten graph computes the same loss and
gradients as the masked one.
"""

from __future__ import annotations

import pytest
import torch

from shardfx.errors import ShardingError
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.passes.causal_mask import causal_mask
from shardfx.request.options import Options

INPUTS = """\
graph train Attention
  q: f32[1, 1, 4, 2] = param q
  k: f32[1, 1, 4, 2] = param k
  v: f32[1, 1, 4, 2] = param v
  tangent_loss: f32[] = tangent loss
"""
POSITIONS = "  positions: i64[4] = constant _tensor_constant0 [0, 1, 2, 3]\n"
ATTENTION = """\
  attn: (f32[1, 1, 4, 2], f32[1, 1, 4]) = \
aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v{fwd})
  out: f32[1, 1, 4, 2] = operator.getitem(attn, 0)
  lse: f32[1, 1, 4] = operator.getitem(attn, 1)
  loss: f32[] = aten.sum.default(out)
  expand: f32[1, 1, 4, 2] = aten.expand.default(tangent_loss, [1, 1, 4, 2])
  attn_backward: (f32[1, 1, 4, 2], f32[1, 1, 4, 2], f32[1, 1, 4, 2]) = \
aten._scaled_dot_product_flash_attention_for_cpu_backward.default(expand, q, k, v, out, lse{bwd})
  grad_q: f32[1, 1, 4, 2] = operator.getitem(attn_backward, 0)
  grad_k: f32[1, 1, 4, 2] = operator.getitem(attn_backward, 1)
  grad_v: f32[1, 1, 4, 2] = operator.getitem(attn_backward, 2)
  output loss loss = loss
  output grad q = grad_q
  output grad k = grad_k
  output grad v = grad_v
"""
MASKED = ATTENTION.format(fwd=", attn_mask=mask", bwd=", 0.0, False, attn_mask=mask")

# Hugging Face style: a key later than the query is -inf, from a constant vector of positions.
CAUSAL = """\
  keys: i64[1, 4] = aten.unsqueeze.default(positions, 0)
  queries: i64[4, 1] = aten.unsqueeze.default(positions, 1)
  later: b8[4, 4] = aten.gt.Tensor(keys, queries)
  zeros: f32[4, 4] = aten.zeros.default([4, 4], device=torch.device('cpu'), pin_memory=False)
  mask: f32[4, 4] = aten.masked_fill.Scalar(zeros, later, float('-inf'))
"""
FULL = "  mask: f32[4, 4] = aten.zeros.default([4, 4], device=torch.device('cpu'), " \
       "pin_memory=False)\n"


def _run(gm, seed=0):
    """The graph's loss and gradients on random q, k, v (constants fed their values)."""
    g = torch.Generator().manual_seed(seed)
    feed = {"q": torch.randn(1, 1, 4, 2, generator=g), "k": torch.randn(1, 1, 4, 2, generator=g),
            "v": torch.randn(1, 1, 4, 2, generator=g), "tangent_loss": torch.ones(())}
    args = [n.meta[M.CONSTANT].value if M.CONSTANT in n.meta else feed[n.name]
            for n in gm.graph.find_nodes(op="placeholder")]
    return gm(*args)


def test_causal_mask_becomes_is_causal():
    before = INPUTS + POSITIONS + CAUSAL + MASKED
    gm = causal_mask(text_to_ir(before), Options())
    verify(gm)
    # the mask's ops are gone (the constant input stays: it is an input of the program)
    assert ir_to_text(gm) == INPUTS + POSITIONS + ATTENTION.format(fwd=", 0.0, True",
                                                                   bwd=", 0.0, True")
    want, got = _run(text_to_ir(before)), _run(gm)
    for name, w, g in zip(("loss", "grad q", "grad k", "grad v"), want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)
    # the mask mattered: attending to every key computes another loss
    unmasked = _run(causal_mask(text_to_ir(INPUTS + FULL + MASKED), Options()))
    assert not torch.allclose(unmasked[0], want[0])


def test_mask_allowing_every_key_is_dropped_not_made_causal():
    before = INPUTS + FULL + MASKED
    gm = causal_mask(text_to_ir(before), Options())
    verify(gm)
    assert ir_to_text(gm) == INPUTS + ATTENTION.format(fwd=", 0.0, False", bwd=", 0.0, False")
    for w, g in zip(_run(text_to_ir(before)), _run(gm)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


WINDOW = CAUSAL.replace("  zeros:", """\
  back: i64[4, 4] = aten.sub.Tensor(queries, keys)
  far: b8[4, 4] = aten.ge.Scalar(back, 2)
  blocked: b8[4, 4] = aten.bitwise_or.Tensor(later, far)
  zeros:""").replace("(zeros, later,", "(zeros, blocked,")
# Llama 4's chunks of 2: a key in another chunk is blocked too.
CHUNKS = WINDOW.replace("""\
  back: i64[4, 4] = aten.sub.Tensor(queries, keys)
  far: b8[4, 4] = aten.ge.Scalar(back, 2)""", """\
  key_chunk: i64[1, 4] = aten.floor_divide.default(keys, 2)
  query_chunk: i64[4, 1] = aten.floor_divide.default(queries, 2)
  far: b8[4, 4] = aten.ne.Tensor(key_chunk, query_chunk)""")
BAND_MASK = "  band_mask{n}: f32[4, 4] = shardfx.band_mask.default([4, 4], {band}, " \
            "dtype=torch.float32, device=torch.device('cpu'))\n"


@pytest.mark.parametrize("body, band", [
    (WINDOW, "before=1, after=0, chunk=-1"),
    (CHUNKS, "before=-1, after=0, chunk=2"),
], ids=["window", "chunks"])
def test_a_band_is_made_by_band_mask_before_each_attention(body, band):
    before = INPUTS + POSITIONS + body + MASKED
    gm = causal_mask(text_to_ir(before), Options())
    verify(gm)
    fwd, bwd = (BAND_MASK.format(n=n, band=band) for n in ("", "_1"))
    want = INPUTS + POSITIONS + MASKED.replace("  attn:", fwd + "  attn:").replace(
        "  attn_backward:", bwd + "  attn_backward:").replace(
        "attn_mask=mask)\n  grad_q", "attn_mask=band_mask_1)\n  grad_q").replace(
        "attn_mask=mask", "attn_mask=band_mask")
    assert ir_to_text(gm) == want
    assert ir_to_text(text_to_ir(want)) == want  # the op parses back
    for name, w, g in zip(("loss", "grad q", "grad k", "grad v"), _run(text_to_ir(before)),
                          _run(gm)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


# Masks ring attention cannot run: each is refused, saying what it is.
STRIDED = CAUSAL.replace("  zeros:", """\
  apart: i64[4, 4] = aten.sub.Tensor(queries, keys)
  odd: i64[4, 4] = aten.remainder.Scalar(apart, 2)
  far: b8[4, 4] = aten.eq.Scalar(odd, 1)
  blocked: b8[4, 4] = aten.bitwise_or.Tensor(later, far)
  zeros:""").replace("(zeros, later,", "(zeros, blocked,")
FROM_INPUT = "  mask: f32[4, 4] = input args[0]\n"
BIAS = CAUSAL.replace("float('-inf')", "-10000.0")  # a large finite value is not -inf


@pytest.mark.parametrize("body, kind, says", [
    (POSITIONS + STRIDED, "other", "a (4, 4) pattern that is not a band of keys"),
    (FROM_INPUT, "input", "computed from the model's inputs"),
    (POSITIONS + BIAS, "other", "an additive bias (values other than 0 and -inf)"),
], ids=["every-other-key", "input", "bias"])
def test_other_masks_are_refused_naming_them(body, kind, says):
    gm = text_to_ir(INPUTS + body + MASKED)
    with pytest.raises(ShardingError) as e:
        causal_mask(gm, Options())
    assert says in str(e.value) and "ring attention" in str(e.value)
    marked = {n.name: n.meta[M.MASK].kind for n in gm.graph.nodes if M.MASK in n.meta}
    assert marked == {"attn": kind, "attn_backward": kind}
    assert "attn_mask=mask" in ir_to_text(gm)  # the graph is left masked


def test_attention_without_a_mask_is_unchanged():
    text = INPUTS + ATTENTION.format(fwd="", bwd=", 0.0, False")
    assert ir_to_text(causal_mask(text_to_ir(text), Options())) == text


def test_a_mask_seen_in_another_graph_is_not_run_again_unless_its_constants_differ(
        monkeypatch):
    """Every plan of one model (a search makes hundreds) has the same mask: it is classified
    once. The same ops on other constants are another mask: classified again, and read right
    (positions reversed: each query attends to itself and the keys after it, a band, not the
    causal mask)."""
    import shardfx.passes.causal_mask as pass_module  # noqa: the module's _classify is counted

    runs = []
    classify = pass_module._classify
    monkeypatch.setattr(pass_module, "_classify", lambda mask: runs.append(1) or classify(mask))
    monkeypatch.setattr(pass_module, "_ANSWERS", {})
    before = INPUTS + POSITIONS + CAUSAL + MASKED
    for _ in range(2):
        gm = causal_mask(text_to_ir(before), Options())
    assert len(runs) == 1 and "True" in ir_to_text(gm)
    reversed_ = before.replace("[0, 1, 2, 3]", "[3, 2, 1, 0]")
    text = ir_to_text(causal_mask(text_to_ir(reversed_), Options()))
    assert len(runs) == 2 and "band_mask" in text and "True" not in text
