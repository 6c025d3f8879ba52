"""What one op costs: its FLOPs (torch's own per-op formulas, ``torch.utils.flop_counter``,
and ``CPU_ATTENTION_FLOPS`` for CPU flash attention, which torch has no formula for), the bytes
it writes, and whether it is a view (writing none). ``passes/estimate_cost`` records them on
every op; ``DeviceModel.node_seconds`` turns them into time."""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardfx.ir import meta as M


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
