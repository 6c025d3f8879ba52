"""The memory-bound ops of a program as Megatron and Transformer Engine run them: fused.

shardfx's program (``kernels="auto"`` on ATen ops) runs each memory-bound op as its own
kernel: a normalization's casts, squares, means and multiplies, an activation's parts, a
residual add, many of them in fp32 around an fp32 residual stream. Megatron-LM and Transformer
Engine run the same work in a few fused kernels in the compute dtype: LayerNorm / RMSNorm
(apex's FusedLayerNorm, TE's LayerNormLinear), bias-GeLU and SwiGLU (``bias_gelu_fusion``,
``bias_swiglu``), bias-dropout-add, RoPE (``apply_rope_fusion``), the scaled masked softmax and,
in Megatron-core, the cross-entropy (``cross_entropy_loss_fusion``).

The ``fused-elementwise`` technique (``cost.techniques``) prices each chain of memory-bound
ops between two compute-bound ones (``chains``) as one kernel that reads what the chain reads
from outside it and writes what is read after it, once each, every floating tensor in the
compute dtype (``chain_bytes``). Where Megatron runs a chain as two kernels (bias-dropout-add,
then the norm) this moves a little less; where the program orders a matmul inside what
Megatron fuses (SwiGLU's multiply after the up projection) it moves a little more.

This prices Megatron's kernels, not the program's own: ``kernels="triton"``'s fused groups
(``passes.fusion``) are in the program and priced as they are (``node.node_work``).

Requires: a program's graph in program order, ``meta["val"]`` on its nodes.
Ensures:  ``chains``: the chains, in program order; ``chain_bytes``: the bytes one fused
          kernel of a chain moves; ``compute_dtype``: the dtype the program's matmuls run in.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.cost.node import attention_work, is_view, matmul_shape, node_work
from shardfx.cost.techniques import weight_cast
from shardfx.ir import meta as M

aten = torch.ops.aten
# Memory-bound ops a fused kernel does not absorb: gathers and scatters over a table (the
# embedding and its gradient run as their own kernels in Megatron too).
_OWN_KERNEL = {aten.embedding.default, aten.embedding_dense_backward.default}


def chains(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The maximal runs, in program order, of memory-bound ops (``_fusable``) with nothing but
    views and weight casts (``_transparent``) between them.
    Requires: ``nodes`` in program order. Ensures: each op in at most one chain."""
    out: list[list[fx.Node]] = []
    run: list[fx.Node] = []
    for node in nodes:
        if _fusable(node):
            run.append(node)
        elif not _transparent(node) and run:
            out.append(run)
            run = []
    if run:
        out.append(run)
    return out


def chain_bytes(chain: list[fx.Node], dtype: torch.dtype) -> int:
    """Bytes one kernel doing ``chain`` moves: each tensor it reads from outside the chain
    (through views) and each tensor of it read after it, once, floating tensors wider than
    ``dtype`` counted in ``dtype``.
    Requires: ``chain`` from ``chains``. Ensures: each tensor counted once."""
    members = set(chain)
    read: dict[fx.Node, None] = {}
    for node in chain:
        for src in node.all_input_nodes:
            if _base(src) not in members:
                read.setdefault(src)
    written = [n for n in chain if _read_outside(n, members)]
    return sum(_bytes(n, dtype) for n in (*read, *written))


def compute_dtype(nodes: list[fx.Node]) -> torch.dtype | None:
    """The floating dtype of the program's first matmul (None: it has none)."""
    for node in nodes:
        if matmul_shape(node) is not None:
            return node_work(node)[2]
    return None


def _fusable(node: fx.Node) -> bool:
    """A memory-bound op a fused kernel can take in: a call that moves bytes and computes no
    FLOPs torch counts, not a matmul, an attention, a collective or a table lookup."""
    if node.op != "call_function" or _transparent(node) or node.target in _OWN_KERNEL:
        return False
    if matmul_shape(node) is not None or attention_work(node) is not None:
        return False
    if hasattr(node.target, "sends") or hasattr(node.target, "exchanges"):
        return False
    flops, moved, _ = node_work(node)
    return moved > 0 and flops == 0


def _transparent(node: fx.Node) -> bool:
    """A view (it moves nothing) or a weight's cast (``low-precision-weights`` prices it)."""
    return node.op == "call_function" and (is_view(node) or weight_cast(node))


def _base(node: fx.Node) -> fx.Node:
    """The op a value comes from, through views and weight casts."""
    while _transparent(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _read_outside(node: fx.Node, members: set[fx.Node]) -> bool:
    """Whether anything but the chain reads ``node``'s value (through views), the graph's
    output included."""
    users = list(node.users)
    while users:
        user = users.pop()
        if _transparent(user):
            users.extend(user.users)
        elif user not in members:
            return True
    return False


def _bytes(node: fx.Node, dtype: torch.dtype) -> int:
    size = dtype.itemsize
    total = 0
    for v in pytree.tree_leaves(node.meta.get(M.VAL)):
        if isinstance(v, torch.Tensor):
            wide = v.dtype.is_floating_point and v.element_size() > size
            total += v.numel() * (size if wide else v.element_size())
    return total
