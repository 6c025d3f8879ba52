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
  Megatron runs the model so (``Float16Module``: the module cast to bf16/fp16, its first
  stage's inputs too; ``--fp32-residual-connection`` off by default), so what the program
  computes in fp32 only because its weights are fp32 is in the compute dtype as well: the
  residual stream, the norms' outputs, the activations saved and sent between stages and
  their gradients (``low_precision``: an fp32 value all of whose floating inputs are so);
  the casts mixed precision made between the two, and their gradients, make nothing. The
  model's own upcasts (``logits.float()``, a norm's ``to(float32)``) stay fp32, and so do the
  parameters' gradients.
- **vocab-parallel**: Megatron's VocabParallelEmbedding, its column-parallel LM head and its
  vocab-parallel cross-entropy split every tensor with a vocabulary-sized dimension over tp
  (megatron/core/tensor_parallel/layers.py, cross_entropy.py): the embedding and head weights,
  their gradients and optimizer state, the logits and the loss's tensors on them count 1/tp.
- **optimizer-over-dp-cp**: Megatron's distributed optimizer shards its state (the fp32 main
  parameters and Adam's moments) over the data-parallel group with context parallel, dp x cp
  ranks (``parallel_state.get_data_parallel_group(with_context_parallel=True)``; the "12/d" of
  dist_optimizer.md with d = dp x cp), where shardfx's ZeRO shards it over dp.

- **embedding-grad-once**: Megatron keeps a pipeline's tied word embedding as a second copy
  on the last stage (a parameter there, stepped by its optimizer as the first stage's is) and
  all-reduces the two copies' gradients once a step, after the last microbatch
  (megatron/core/models/common/language_module/language_module.py,
  ``setup_embeddings_and_output_layer``; ``finalize_model_grads``'
  ``_allreduce_word_embedding_grads``). The last stage accumulates its contribution in its
  own fp32 main gradient and steps its own optimizer state for it, where the program sends
  each microbatch's to the first stage (a message held until it completes, a receive buffer
  there).

Techniques of time only (tp-overlap, grad-reduce-once, param-gather-overlap, vendor-attention,
unfused-attention, fused-elementwise, p2p-scatter-gather) leave memory as the program holds
it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from shardfx.cost.optimizer import optimizer_state
from shardfx.cost.values import bases, tensor_bytes, value_bytes
from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.ir.graph import phases

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
    "embedding-grad-once": "a pipeline's tied embedding kept as a copy on the last stage, its "
                           "gradient accumulated there and all-reduced with the first stage's "
                           "once a step (Megatron's embedding group), where the program sends "
                           "every microbatch's contribution to the first stage: its memory "
                           "only",
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
    tied_copy: bool = False  # embedding-grad-once: a copy of a tied weight on the last stage
    low: dict = field(default_factory=dict, compare=False, repr=False)  # graph -> its
    #   low_precision (values in the compute dtype, casts that make nothing), once each

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
        """ZeRO's layout of a parameter's rows over dp, of its shape as one rank holds it."""
        return layout and M.ZeroShard(self.shape(layout.shape), layout.dp)

    def state(self, stepped: list) -> list:
        """What the optimizer keeps state for, of ``stepped`` (ZeRO's rows over dp): each
        one's rows over cp as well (optimizer-over-dp-cp). Megatron's gradient buffer stays
        whole (dist_optimizer.md: 4 bytes a parameter), so the gradients the program holds,
        ZeRO's rows over dp, are left as they are."""
        if self.cp == 1:
            return stepped
        return [torch.empty(M.ZeroShard(tuple(t.shape), self.cp).shard_shape, dtype=t.dtype,
                            device="meta") for t in stepped]

    def optimizer(self, stepped: list, model) -> int:
        """Bytes of the optimizer's state for ``stepped`` (``model``: its ``OptimizerModel``),
        the fp32 main copy included."""
        kept = self.state(stepped)
        return optimizer_state(kept, model) + self.master(kept)

    def master(self, stepped: list) -> int:
        """Bytes of the fp32 main copy of what the optimizer steps (low-precision-weights)."""
        return 0 if self.weights is None else sum(4 * t.numel() for t in stepped)

    def value(self, node: fx.Node) -> int:
        """The storage a program's value owns (``value_bytes``), as one rank holds it: with
        the weights in the compute dtype, a cast mixed precision made none, and an fp32 value
        ``low_precision`` finds the compute dtype's bytes."""
        nbytes = self.split(value_bytes(node), node.meta.get(M.VAL))
        if self.weights is None or not nbytes:
            return nbytes
        low, elided = self.lows(node.graph)
        if node in elided:
            return 0
        return self.narrow(nbytes, node) if node in low else nbytes

    def narrow(self, nbytes: int, node: fx.Node) -> int:
        """``nbytes`` of an fp32 ``node`` as the compute dtype's."""
        if node.meta[M.VAL].dtype != torch.float32:
            return nbytes
        return nbytes * self.weights.itemsize // 4

    def lows(self, graph: fx.Graph, inputs=None, keep: frozenset = frozenset()) -> tuple:
        """``graph``'s ``low_precision``, found once (``inputs``, ``keep``: its arguments, the
        first time; None: a whole program's, its parameters' gradients kept)."""
        if graph not in self.low:
            if inputs is None:
                inputs, keep = _is_param, parameter_gradients(graph)
            self.low[graph] = low_precision(graph, self.weights, inputs, keep)
        return self.low[graph]

    def output(self, graph: fx.Graph, index: int) -> int:
        """Bytes of output ``index`` of ``graph`` (a pipeline part's) as a message carries it
        (its own tensor; in the compute dtype where ``low_precision`` finds it so)."""
        node = graph.output_node().args[0][index]
        nbytes = self.bytes(node.meta.get(M.VAL))
        if self.weights is None:
            return nbytes
        low, elided = self.lows(graph)
        return self.narrow(nbytes, node) if node in low or node in elided else nbytes

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
                  cp=cp if "optimizer-over-dp-cp" in assume and zero else 1,
                  tied_copy="embedding-grad-once" in assume)


def _is_param(node: fx.Node) -> bool:
    role = node.meta.get(M.ROLE)
    return getattr(role, "kind", None) is M.InputKind.PARAM


def parameter_gradients(graph: fx.Graph) -> frozenset[fx.Node]:
    """The values ``graph`` returns as a parameter's gradient, and the storages they view."""
    out = graph.output_node()
    grads = {v for v, r in zip(out.args[0], out.meta.get(M.OUTPUTS, ()))
             if isinstance(v, fx.Node) and r.kind is M.OutputKind.GRAD}
    base = bases(graph)
    return frozenset(grads | {base.get(v, v) for v in grads})


def low_precision(graph: fx.Graph, compute: torch.dtype, inputs, keep: frozenset
                  ) -> tuple[frozenset, frozenset]:
    """With the weights in ``compute`` (low-precision-weights, module docstring): the fp32
    values of ``graph`` that are in ``compute`` (every floating input of theirs is: a weight,
    a value in ``compute``, or one found so; ``inputs(placeholder)`` says which placeholders
    are), and the casts that make nothing (a cast of such a value that mixed precision made:
    to ``compute`` in any phase, or to fp32 outside the forward, the gradient of one). The
    model's own upcasts in the forward stay fp32, as does every value of ``keep`` (the
    parameters' gradients)."""
    phase = phases(graph)
    low, elided = set(), set()

    def is_low(node: fx.Node) -> bool:
        return node in low or node.meta[M.VAL].dtype == compute

    for node in graph.nodes:
        val = node.meta.get(M.VAL)
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor) and val.is_floating_point() and inputs(node):
                low.add(node)
            continue
        src = node.args[0] if node.op == "call_function" and node.target is \
            operator.getitem else node  # an element: its op's inputs
        floats = [a for a in getattr(src, "all_input_nodes", ())
                  if isinstance(a.meta.get(M.VAL), torch.Tensor)
                  and a.meta[M.VAL].is_floating_point()]
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or not floats \
                or node in keep or not all(map(is_low, floats)):
            continue
        if node.target is torch.ops.aten._to_copy.default:
            if val.dtype == compute or phase[node] is not M.Phase.FORWARD:
                elided.add(node)  # mixed precision's cast, or its gradient
                low.add(node)
            continue  # else the model's own upcast: fp32
        if val.dtype == torch.float32:
            low.add(node)
    return frozenset(low), frozenset(elided)
