"""What one op costs: its FLOPs (torch's own per-op formulas, ``torch.utils.flop_counter``,
and ``CPU_ATTENTION_FLOPS`` for CPU flash attention, which torch has no formula for), the bytes
it writes, and whether it is a view (writing none); for the ops whose speed depends on their
shape, the shape: a matmul's (``matmul_shape``), a fused attention's work as its kernel counts
it (``attention_work``); and ``node_work``, an op's FLOPs and bytes moved together (a fused
kernel's, the chunked LM head's). ``passes/estimate_cost`` records the FLOPs on every op;
``DeviceModel.node_seconds`` turns ``node_work`` into time."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardfx.ir import meta as M
from shardfx.ir.band import Band
from shardfx.ir.graph import arg_values
from shardfx.kernels.attention import BAND_MASK, band_of
from shardfx.kernels.linear_ce import (LinearCrossEntropy, LinearCrossEntropyBackward,
                                       chunk_weight_bytes)
from shardfx.kernels.triton import FusedKernel


def _cpu_attention(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# By shapes, as torch.utils.flop_counter.FlopCounterMode(custom_mapping=...) takes them.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def node_flops(node: fx.Node) -> int:
    op = getattr(node.target, "overloadpacket", None)
    attention = CPU_ATTENTION_FLOPS.get(op)
    formula = flop_registry.get(op)
    if attention is None and formula is None:  # most ops: no operands to look at
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get(M.VAL),
                                        (node.args, node.kwargs))
    if attention is not None:
        shapes = pytree.tree_map_only(torch.Tensor, lambda t: t.shape, (args, kwargs))
        return int(attention(*shapes[0], **shapes[1]))
    return int(formula(*args, **kwargs, out_val=node.meta.get(M.VAL)))


def node_bytes(node: fx.Node) -> int:
    """Bytes of the tensors a node produces; views produce none (they alias their input)."""
    if is_view(node):
        return 0
    vals = pytree.tree_leaves(node.meta.get(M.VAL))
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target.__name__ == "getitem"  # an element of a tuple the producer counted
    if node.target in (torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default):
        return _reshape_views(node)  # a view where the strides allow it (a program's reshape)
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _reshape_views(node: fx.Node) -> bool:
    """Whether ``reshape`` returns a view of its input (else a copy, as torch makes when the
    input's strides do not allow one: ZeRO-3's parameter rows split out of a gathered
    ``[dp, n]`` buffer), by the traced values' layouts."""
    src, out = node.args[0], node.meta.get(M.VAL)
    val = src.meta.get(M.VAL) if isinstance(src, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    return _viewable(tuple(val.shape), val.stride(), tuple(out.shape))


@functools.lru_cache(maxsize=4096)
def _viewable(shape: tuple, stride: tuple, into: tuple) -> bool:
    try:
        torch.empty_strided(shape, stride, device="meta").view(into)
        return True
    except RuntimeError:
        return False


aten = torch.ops.aten
# matmul op -> the positions of its two operands
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1),
            aten.baddbmm.default: (1, 2)}
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_RING = ("ring_attention", "ring_attention_backward")  # codegen.ring_attention's op names


def matmul_shape(node: fx.Node) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a GEMM node (mm, addmm, bmm, baddbmm; the chunked LM head of
    ``kernels.linear_ce``: its chunks' shape), else None."""
    if node.op != "call_function":
        return None
    where = _MATMULS.get(node.target)
    if where is not None:
        a, b = (node.args[i].meta.get(M.VAL) for i in where)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        batch = a.shape[0] if a.dim() == 3 else 1
        return batch, a.shape[-2], b.shape[-1], a.shape[-1]
    kind = type(node.target).__name__
    if kind in ("LinearCrossEntropy", "LinearCrossEntropyBackward"):  # (h, w, ...) after grad
        args = node.args if kind == "LinearCrossEntropy" else node.args[1:]
        h, w = (a.meta.get(M.VAL) if isinstance(a, fx.Node) else None for a in args[:2])
        if not (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor)):
            return None
        return 1, min(node.target.rows, h.shape[0]), w.numel() // h.shape[-1], h.shape[-1]
    return None


def attention_work(node: fx.Node) -> tuple[int, int, bool] | None:
    """(FLOPs as the FlashAttention papers count them, keys per query block, backward) of a
    fused attention node, else None: 4·b·h·d per query-key pair computed forward (the pairs
    its band allows: about half under the causal mask), 2.5 times that backward (the scores
    computed again, five matmuls). Ring attention's ops count their own pairs."""
    if node.op != "call_function":
        return None
    if getattr(node.target, "name", None) in _RING and hasattr(node.target, "flops"):
        from shardfx.ir.graph import arg_values  # ir is below cost; the values of its args

        backward = node.target.name == _RING[1]
        q = arg_values(node)[1 if backward else 0]
        return int(node.target.flops(*arg_values(node))), q.shape[2], backward
    shape = attention_shape(node)
    if shape is None:
        return None
    heads, sq, keys, d, backward = shape
    causal = node.args[7 if backward else 4] if len(node.args) > (7 if backward else 4) \
        else node.kwargs.get("is_causal", False)
    mask = node.kwargs.get("attn_mask")
    band = band_of(mask) if isinstance(mask, fx.Node) and mask.target is BAND_MASK else \
        Band.of(bool(causal))
    pairs = band_pairs(band, sq, keys)
    return int(4 * heads * d * pairs * (2.5 if backward else 1)), keys, backward


def attention_shape(node: fx.Node) -> tuple[int, int, int, int, bool] | None:
    """(batch x heads, queries, keys, head dim, backward) of a fused (flash) attention node,
    else None (ring attention's ops: ``attention_work``)."""
    if node.op != "call_function" or node.target not in (_FLASH, _FLASH_BACKWARD):
        return None
    backward = node.target is _FLASH_BACKWARD
    q, k = (node.args[i].meta.get(M.VAL) for i in ((1, 2) if backward else (0, 1)))
    b, h, sq, d = q.shape
    return b * h, sq, k.shape[2], d, backward


@functools.lru_cache(maxsize=256)
def band_pairs(band: Band, queries: int, keys: int) -> int:
    """Query-key pairs ``band`` allows, the queries the last ``queries`` of ``keys``."""
    if band.full:
        return queries * keys
    i = torch.arange(keys - queries, keys)
    return int((band.last(i, keys) - band.first(i) + 1).clamp(min=0).sum())


# --- what an op does --------------------------------------------------------------------------

def node_work(node: fx.Node) -> tuple[int, int, torch.dtype]:
    """(FLOPs, bytes read and written, dtype) of one op. FLOPs: ``COST`` where
    ``estimate_cost`` wrote it (the IR), else torch's formula on the node's values (a
    program's local shapes). Bytes: each tensor input read once and each output written once;
    a view (and a tuple's element) moves nothing; a fused Triton kernel moves what the kernel
    reads and writes, not what its ops would one by one; the chunked LM head and loss
    (``kernels.linear_ce``) moves its inputs and outputs and writes and reads its logits once.
    Collectives and waits are 0 here: their time is ``DeviceModel.collective_seconds``."""
    if node.op != "call_function" or _is_collective(node) or is_view(node):
        return 0, 0, torch.float32
    ins = [_vals(a) for a in node.all_input_nodes]
    outs = _vals(node)
    dtype = next((v.dtype for vs in (*ins, outs) for v in vs if v.dtype.is_floating_point),
                 torch.float32)
    fused = _fused_bytes(node)
    moved = fused if fused is not None else \
        sum(_nbytes(v) for vs in ins for v in vs) + sum(_nbytes(v) for v in outs)
    head = _lm_head(node)
    cost = node.meta.get(M.COST)
    if head is not None:
        flops, logits, weight = head
        moved += 2 * logits + weight
    elif cost is not None:
        flops = cost.flops
    elif hasattr(node.target, "flops"):  # a program op that says (codegen.ring_attention)
        flops = node.target.flops(*arg_values(node))
    else:
        flops = node_flops(node)
    return flops, moved, dtype


def _vals(node: fx.Node) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(node.meta.get(M.VAL)) if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_collective(node: fx.Node) -> bool:
    ns = getattr(node.target, "namespace", None) or getattr(
        getattr(node.target, "_schema", None), "name", "").split("::")[0]
    return ns in ("_c10d_functional", "c10d_functional", "c10d")


def _fused_bytes(node: fx.Node) -> int | None:
    return node.target.group.fused_bytes if isinstance(node.target, FusedKernel) else None


def _lm_head(node: fx.Node) -> tuple[int, int, int] | None:
    """(FLOPs, bytes of fp32 logits, weight bytes beyond one read) of a chunked LM head and
    loss: 2·tokens·hidden·vocab forward, three times that with its gradients (``grads``); a
    backward that computes the logits again and both gradients, three times that too. Each
    chunk reads the weight and adds into its gradient again (``chunk_weight_bytes``): with
    few rows per chunk the head waits on memory (``chunk_rows``)."""
    target = node.target
    if not isinstance(target, (LinearCrossEntropy, LinearCrossEntropyBackward)):
        return None
    args = node.args if isinstance(target, LinearCrossEntropy) else node.args[1:]
    h, w = (a.meta[M.VAL] for a in args[:2])
    tokens, hidden = h.shape[0], h.shape[-1]
    vocab = w.numel() // hidden
    grads = not isinstance(target, LinearCrossEntropy) or target.grads
    chunks = -(-tokens // target.rows)
    per_chunk = chunk_weight_bytes(vocab, hidden, w.dtype, grads)
    once = vocab * hidden * (w.element_size() + (4 if grads else 0))  # its inputs and outputs
    return (2 * tokens * hidden * vocab * (3 if grads else 1), tokens * vocab * 4,
            max(0, chunks * per_chunk - once))
