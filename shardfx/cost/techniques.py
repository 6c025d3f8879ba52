"""Techniques a published system used that shardfx's program lacks, and the values and ops
each one changes: what the step model (``estimate.step_time``) and the memory model
(``estimate.memory``) price "with" a technique (``assume=``), so a measured run can be
compared with the program as is and with what the technique would give.

Requires: a program's graph with ``meta["val"]`` and, on its placeholders, ``meta["role"]``.
Ensures:  ``vocabulary``, ``on_vocab`` and ``weight_cast`` name the ops and values a technique
          changes; ``check`` refuses a name that is not in ``TECHNIQUES``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from shardfx.errors import InputError
from shardfx.ir import meta as M

# How a published system ran differently from shardfx's program, priced as if the program
# did the same (``predict_step(plan, assume=...)``, ``plan.memory_breakdown(assume=...)``):
# techniques it lacks, and the kernels of systems measured before the ones it runs existed.
TECHNIQUES = {
    "tp-overlap": "tensor-parallel collectives split into chunks and overlapped with the "
                  "matmul beside them (Transformer Engine's userbuffers): each is hidden but "
                  "for one chunk, or what the matmul cannot cover",
    "grad-reduce-once": "gradient accumulation reduces the gradients over dp (and cp) once, "
                        "in the last pass (Megatron, DDP's no_sync), not in every pass; in a "
                        "pipeline, cp's reduction joins dp's buckets as one dp x cp group "
                        "(Megatron's), not one in each microbatch's weight gradients",
    "param-gather-overlap": "ZeRO's all-gather of the updated parameters runs beside the next "
                            "step's forward (Megatron's overlap_param_gather)",
    "low-precision-weights": "the weights kept in bf16/fp16 (the fp32 master copy in the "
                             "optimizer, Megatron's mixed precision): no cast of each weight in "
                             "every microbatch's forward",
    "vendor-attention": "the vendor's fused attention (cuDNN, through Transformer Engine) in the "
                        "place of PyTorch's flash kernel, at its measured speed",
    "vocab-parallel": "the embedding and LM head split over tp by vocabulary rows (Megatron's "
                      "VocabParallelEmbedding and parallel cross-entropy): each rank computes "
                      "1/tp of every op on a vocabulary-sized dimension, and no vocabulary-sized "
                      "gradient is all-reduced over tp",
    "unfused-attention": "the attention as Megatron computed it before FlashAttention (SC21, "
                         "2022): the score matrices made by batched matmuls and read and "
                         "written by a softmax and a dropout kernel "
                         "(DeviceModel.core_attention_seconds), where the program runs a fused "
                         "flash kernel",
}


def check(assume, where: str) -> tuple[str, ...]:
    """``assume`` as a tuple, every name one of ``TECHNIQUES`` (else ``InputError``, naming
    ``where`` the names came from)."""
    assume = tuple(assume)
    for name in assume:
        if name not in TECHNIQUES:
            raise InputError(f"unknown technique {name!r}", where=where,
                             fix=f"one of {', '.join(TECHNIQUES)}")
    return assume


def vocabulary(graph: fx.Graph) -> int | None:
    """The vocabulary: rows of the weight an embedding op looks up in (None: no embedding)."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        weight = node.args[0].meta.get(M.VAL)
        if isinstance(weight, torch.Tensor):
            return weight.shape[0]
    return None


def on_vocab(node: fx.Node, vocab: int) -> bool:
    """Whether ``node`` reads or writes a tensor with a dimension of ``vocab``: the embedding,
    the LM head, the logits and the loss on them, and their gradients."""
    vals = [node.meta.get(M.VAL), *(a.meta.get(M.VAL) for a in node.all_input_nodes)]
    return any(isinstance(v, torch.Tensor) and vocab in v.shape for v in vals) or \
        type(node.target).__name__.startswith("LinearCrossEntropy")


def weight_cast(node: fx.Node) -> bool:
    """A parameter cast to another dtype (mixed precision's per-microbatch copy)."""
    if node.target is not torch.ops.aten._to_copy.default:
        return False
    src = node.args[0]
    role = src.meta.get(M.ROLE) if isinstance(src, fx.Node) and src.op == "placeholder" else None
    return getattr(role, "kind", None) is M.InputKind.PARAM
