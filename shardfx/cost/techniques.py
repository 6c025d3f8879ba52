"""Techniques a published system used that shardfx's program lacks, and the values and ops
each one changes: what the step model (``estimate.step_time``) and the memory model
(``estimate.memory``, ``estimate.memory_pipeline``) price "with" a technique (``assume=``), so
a measured run can be compared with the program as is and with what the technique gives.

Requires: a program's graph with ``meta["val"]`` and, on its placeholders, ``meta["role"]``.
Ensures:  ``vocabulary``, ``on_vocab`` and ``weight_cast`` name the ops and values a technique
          changes; ``check`` refuses a name that is not in ``TECHNIQUES``; ``Sizing`` is the
          bytes the memory model counts for a value or a piece of state with them.

What each technique changes in memory (``Sizing``), as the published system holds it:

- **low-precision-weights**: Megatron's mixed precision keeps each parameter in the compute
  dtype (2 B an element in bf16/fp16), an fp32 "main" copy of it in the optimizer (4 B an
  element it steps, beside Adam's two fp32 moments) and fp32 "main" gradients, accumulated
  across microbatches (4 B: as the program's gradients already are). The weight is already in
  the compute dtype, so the program's cast of it in every microbatch's forward makes nothing
  (0 bytes), nor does the copy of it saved for the backward. Source: Megatron-LM's
  docs/source/api-guide/dist_optimizer.md (18 bytes a parameter without the distributed
  optimizer: bf16 param 2, fp32 grad 4, fp32 main param 4, Adam 8; 6 + 12/d with it).
- **vocab-parallel**: Megatron's VocabParallelEmbedding, its column-parallel LM head and its
  vocab-parallel cross-entropy split every tensor with a vocabulary-sized dimension over tp
  (megatron/core/tensor_parallel/layers.py, cross_entropy.py): the embedding and head weights,
  their gradients and optimizer state, the logits and the loss's tensors on them count 1/tp.
- **optimizer-over-dp-cp**: Megatron's distributed optimizer shards its state (the fp32 main
  parameters and Adam's moments) over the data-parallel group with context parallel, dp x cp
  ranks (``parallel_state.get_data_parallel_group(with_context_parallel=True)``; the "12/d" of
  dist_optimizer.md with d = dp x cp), where shardfx's ZeRO shards it over dp.

Techniques of time only (tp-overlap, grad-reduce-once, param-gather-overlap, vendor-attention,
unfused-attention, fused-elementwise, p2p-scatter-gather) leave memory as the program holds
it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from shardfx.cost.values import tensor_bytes, value_bytes
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
    "optimizer-over-dp-cp": "Megatron's distributed optimizer shards its state over dp x cp "
                            "(the data-parallel group with context parallel), where ZeRO "
                            "shards it over dp: its memory only",
    "fused-elementwise": "the memory-bound ops between two matmuls run as one fused kernel in "
                         "the compute dtype (Megatron's and Transformer Engine's fused norms, "
                         "bias-GeLU / SwiGLU, bias-dropout-add, RoPE, cross-entropy), where the "
                         "program runs ATen ops one by one, many in fp32 (cost.elementwise)",
    "p2p-scatter-gather": "a pipeline's messages, whole on each tp rank without sequence "
                          "parallelism, sent 1/tp through each tp rank's own port and "
                          "all-gathered over tp by the receivers (Megatron's scatter/gather, "
                          "Narayanan et al. SC21 sec. 4.1)",
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
    return any(vocab_sized(v, vocab) for v in vals) or \
        type(node.target).__name__.startswith("LinearCrossEntropy")


def vocab_sized(val, vocab: int) -> bool:
    """Is ``val`` a tensor with a dimension of ``vocab``?"""
    return isinstance(val, torch.Tensor) and vocab in val.shape


def weight_cast(node: fx.Node) -> bool:
    """A parameter cast to another dtype (mixed precision's per-microbatch copy)."""
    if node.target is not torch.ops.aten._to_copy.default:
        return False
    src = node.args[0]
    role = src.meta.get(M.ROLE) if isinstance(src, fx.Node) and src.op == "placeholder" else None
    return getattr(role, "kind", None) is M.InputKind.PARAM


@dataclass(frozen=True)
class Sizing:
    """The bytes the memory model counts for a value or a piece of state: the program as it
    is (``Sizing()``), or with the techniques ``sizing`` was given (module docstring)."""

    weights: torch.dtype | None = None  # low-precision-weights: the dtype weights are kept in
    vocab: int | None = None  # vocab-parallel: the vocabulary, split over tp ranks
    tp: int = 1
    cp: int = 1  # optimizer-over-dp-cp: ZeRO's rows split over cp ranks as well

    def shape(self, shape) -> tuple[int, ...]:
        """``shape`` as one rank holds it: a vocabulary-sized dimension's share of tp."""
        return tuple(d // self.tp if self.vocab and d == self.vocab else d for d in shape)

    def tensor(self, val: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A meta tensor of ``val``'s shape as one rank holds it, in ``dtype`` (None: its own)."""
        return torch.empty(self.shape(val.shape), dtype=dtype or val.dtype, device="meta")

    def weight(self, val: torch.Tensor) -> torch.Tensor:
        """A parameter as the device holds it: in ``weights``' dtype where it is floating."""
        low = self.weights if self.weights is not None and val.is_floating_point() else None
        return self.tensor(val, low)

    def layout(self, layout: M.ZeroShard | None) -> M.ZeroShard | None:
        """ZeRO's layout of a parameter's optimizer rows: over dp x cp ranks, of its shape as
        one rank holds it."""
        return layout and M.ZeroShard(self.shape(layout.shape), layout.dp * self.cp)

    def master(self, stepped: list) -> int:
        """Bytes of the fp32 main copy of what the optimizer steps (low-precision-weights)."""
        return 0 if self.weights is None else sum(4 * t.numel() for t in stepped)

    def value(self, node: fx.Node) -> int:
        """The storage a program's value owns (``value_bytes``), as one rank holds it: a
        weight's cast none where the weight already is in the compute dtype."""
        if self.weights is not None and weight_cast(node):
            return 0
        return self.split(value_bytes(node), node.meta.get(M.VAL))

    def split(self, nbytes: int, val) -> int:
        """``nbytes`` of ``val``: a vocabulary-sized tensor's share of tp."""
        return nbytes // self.tp if self.vocab and vocab_sized(val, self.vocab) else nbytes

    def bytes(self, val) -> int:
        """A tensor's own bytes (a message's, a copy's) as one rank holds it."""
        return self.split(tensor_bytes(val), val)


def sizing(assume, graph: fx.Graph, compute: torch.dtype, tp: int, cp: int,
           zero: int) -> Sizing:
    """The ``Sizing`` of ``assume``'s techniques for a plan whose IR is ``graph`` (its
    vocabulary), computing in ``compute`` on a mesh of ``tp`` and ``cp`` ranks under ZeRO
    stage ``zero``. A technique the plan has no use for (vocab-parallel without tp, the
    optimizer over dp x cp without ZeRO or cp, low precision in fp32) changes nothing."""
    assume = check(assume, "memory_breakdown(assume=...)")
    low = "low-precision-weights" in assume and compute != torch.float32
    split = "vocab-parallel" in assume and tp > 1
    return Sizing(weights=compute if low else None,
                  vocab=vocabulary(graph) if split else None, tp=tp if split else 1,
                  cp=cp if "optimizer-over-dp-cp" in assume and zero else 1)
