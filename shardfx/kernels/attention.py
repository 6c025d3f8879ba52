"""Fused attention on the device a plan runs on.

shardfx traces every model as on the CPU (``partitioner.capture``), so the IR has one spelling
of ``F.scaled_dot_product_attention`` whatever device the model sits on: the CPU flash kernel
``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
scale) -> (out, logsumexp)`` and its backward. The sharding rules, the causal-mask pass, ring
attention and the cost model know that op. A plan that runs on a GPU has ``place`` swap the
two for ``attention`` and ``attention_backward`` here, which keep the op's contract and pick
the kernel PyTorch's own dispatch would:

    q dtype            mask   head dim        kernel (forward and backward)
    fp16, bf16         none   <= 256, % 8     flash (``_scaled_dot_product_flash_attention``)
    fp16, bf16, fp32   any    % 4             memory-efficient (``..._efficient_attention``)
    else                                      the math below (fp32, the whole score matrix)

Every kernel's ``logsumexp`` is the same quantity, the natural log of each query row's sum of
exp(scaled scores), (B, H, L) in fp32; the memory-efficient kernel's is padded to a multiple
of 32 rows and is returned as a view of its first L. So a backward never depends on which
kernel ran its forward: remat, ring attention's per-block merges and a saved ``logsumexp``
all see the CPU op's shape.

The CPU op takes no dropout (it refuses ``dropout_p > 0``; PyTorch traces attention with
dropout as its math: matmuls, softmax and ``native_dropout``), so neither do these.

``band_mask`` makes an attention's dense mask from its band (``ir.band``: a sliding window,
chunks): ``passes.causal_mask`` puts it where a traced mask was found to be one, so the graph
says what the mask is and still computes it; ring attention reads the band from it and never
makes the mask (``codegen.ring_attention``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from shardfx.ir.band import Band

aten = torch.ops.aten
CPU_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
LSE_ALIGN = 32  # the memory-efficient kernel's logsumexp rows, padded to this
BIAS_ALIGN = 16  # its additive mask's last dimension, likewise


def attention(q, k, v, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask=None,
              scale: float | None = None):
    """``(out, logsumexp)`` as ``CPU_FORWARD`` computes them, on ``q``'s device."""
    if q.device.type == "cpu":
        return CPU_FORWARD(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    kernel = _kernel(q, attn_mask)
    if kernel == "flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal,
                                                                False, scale=scale)
        return out, lse
    if kernel == "efficient":
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, _bias(attn_mask, q, k), True, 0.0, is_causal, scale=scale)
        return out, lse[..., :q.shape[2]]
    return _math_forward(q, k, v, is_causal, attn_mask, scale)


def attention_backward(grad_out, q, k, v, out, lse, dropout_p: float = 0.0,
                       is_causal: bool = False, *, attn_mask=None, scale: float | None = None):
    """``(grad_q, grad_k, grad_v)`` as ``CPU_BACKWARD`` computes them, on ``q``'s device."""
    if q.device.type == "cpu":
        return CPU_BACKWARD(grad_out, q, k, v, out, lse, dropout_p, is_causal,
                            attn_mask=attn_mask, scale=scale)
    kernel = _kernel(q, attn_mask)
    unused = torch.empty(0, dtype=torch.long, device=q.device)  # random state: no dropout
    if kernel == "flash":
        grads = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
            is_causal, unused, unused, scale=scale)
        return tuple(grads[:3])
    if kernel == "efficient":
        rows = lse.shape[-1]
        padded = F.pad(lse, (0, -rows % LSE_ALIGN)).contiguous()
        grads = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, _bias(attn_mask, q, k), out, padded, unused, unused, 0.0,
            [True, True, True, False], is_causal, scale=scale)
        return tuple(grads[:3])
    return _math_backward(grad_out, q, k, v, out, lse, is_causal, attn_mask, scale)


def _kernel(q, attn_mask) -> str:
    """The kernel for these operands, the same for a forward and its backward."""
    head = q.shape[-1]
    if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None \
            and head <= 256 and head % 8 == 0:
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and head % 4 == 0:
        return "efficient"
    return "math"


def _bias(attn_mask, q, k):
    """The additive mask as the memory-efficient kernel takes it: (B, H, L, S), its rows
    aligned (padded past S, then viewed back to S), in q's dtype."""
    if attn_mask is None:
        return None
    mask = attn_mask
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf"))
    mask = mask.to(q.dtype)
    s = mask.shape[-1]
    if s % BIAS_ALIGN or mask.stride(-1) != 1:
        mask = F.pad(mask, (0, -s % BIAS_ALIGN))[..., :s]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _scores(q, k, is_causal, attn_mask, scale):
    """fp32 scaled scores with the mask and the causal triangle applied: (B, H, L, S)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else s + attn_mask.float()
    if is_causal:
        rows, cols = s.shape[-2:]
        above = torch.ones(rows, cols, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s, scale


def _math_forward(q, k, v, is_causal, attn_mask, scale):
    s, _ = _scores(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _math_backward(grad_out, q, k, v, out, lse, is_causal, attn_mask, scale):
    s, scale = _scores(q, k, is_causal, attn_mask, scale)
    p = torch.exp(s - lse.float().unsqueeze(-1))
    go = grad_out.float()
    grad_v = torch.matmul(p.transpose(-2, -1), go)
    dp = torch.matmul(go, v.float().transpose(-2, -1))
    ds = p * (dp - (go * out.float()).sum(-1, keepdim=True))
    grad_q = torch.matmul(ds, k.float()) * scale
    grad_k = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


@torch.library.custom_op("shardfx::band_mask", mutates_args=())
def _band_mask(shape: list[int], *, before: int, after: int, chunk: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """The mask of ``Band.from_args(before, after, chunk)`` over (..., queries, keys) =
    ``shape``, queries and keys at positions 0, 1, ...: True / False where attending is
    allowed / not for a bool ``dtype``, else 0 / -inf (an additive mask)."""
    queries, keys = shape[-2:]
    allowed = Band.from_args(before, after, chunk).allowed(
        torch.arange(queries, device=device), torch.arange(keys, device=device), keys)
    if dtype != torch.bool:
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
            ~allowed, float("-inf"))
    return allowed.expand(shape).contiguous()


@_band_mask.register_fake
def _(shape, *, before, after, chunk, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


BAND_MASK = torch.ops.shardfx.band_mask.default


def band_mask_args(band: Band, shape, dtype: torch.dtype, device: torch.device):
    """(args, kwargs) of ``BAND_MASK`` making ``band``'s mask of ``shape`` and ``dtype``."""
    before, after, chunk = band.args()
    return (list(shape),), dict(before=before, after=after, chunk=chunk, dtype=dtype,
                                device=device)


def band_of(node) -> Band | None:
    """The band of a ``BAND_MASK`` node (an fx node calling it), else None."""
    if getattr(node, "op", None) != "call_function" or node.target is not BAND_MASK:
        return None
    return Band.from_args(node.kwargs["before"], node.kwargs["after"], node.kwargs["chunk"])


def lower(gm: fx.GraphModule, device: torch.device) -> int:
    """On a device other than the CPU, every CPU attention op of ``gm`` becomes ``attention``
    or ``attention_backward``. Returns how many changed.

    Ensures: no node of ``gm`` calls a CPU-only attention kernel; the graph is not recompiled
    (``place`` does it).
    """
    if device.type == "cpu":
        return 0
    swap = {CPU_FORWARD: attention, CPU_BACKWARD: attention_backward}
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in swap:
            node.target = swap[node.target]
            changed += 1
    return changed
