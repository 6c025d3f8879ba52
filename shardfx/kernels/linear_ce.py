"""kernels.linear_ce: the LM head's matmul and cross-entropy, a chunk of rows at a time.

``loss = cross_entropy(h @ w.T, target)`` for ``h`` (tokens, hidden) and ``w`` (vocab,
hidden) materialises the (tokens, vocab) logits, their log-softmax, and in the backward their
gradient: for a 128k vocabulary, the largest activations of a training step. Here the rows go
``rows`` at a time (``chunk_rows``: a chunk's logits about the size of ``h``, as Liger-Kernel
sizes them, but enough rows that a chunk's matmuls outlast its weight traffic on the plan's
device model), so at most one chunk's logits exist. Two ways:

- **gradients in the forward** (``LinearCrossEntropy(grads=True)``, the default where it fits,
  ``passes.fused_loss``): per chunk, ``z = h_c @ w.T`` (the matmul on the vendor library, in
  ``h``'s dtype; fp32 from there on), the log-sum-exp and the target's logit, then at once
  ``softmax - onehot`` and from it this chunk's rows of ``grad_h`` and its share of
  ``grad_w`` (summed over chunks in fp32): the gradients of the *summed* loss, since the
  loss's own gradient (and, under dp, the count of targets over all ranks) is known only in
  the backward. ``LinearCrossEntropyGrads`` then scales them, in place. The head's FLOPs are
  eager's (three matmuls); nothing is recomputed. Saved for the backward: the two gradients
  (``grad_h`` where eager saves ``h``; ``grad_w`` where eager's backward makes it anyway).
  Not in fp16 (the probabilities, unscaled, fall below its normal range: the loss scale must
  come first) nor where the backward does not follow its forward at once (a pipeline's GPipe
  or zero-bubble schedules would hold one ``grad_w`` per microbatch in flight).
- **logits again in the backward** (``LinearCrossEntropyBackward``): the forward saves the
  log-sum-exp per row; the backward computes ``z`` again (the one matmul recomputed, as
  Apple's Cut Cross-Entropy does), ``softmax - onehot`` scaled by the loss's gradient, then
  ``grad_h`` and ``grad_w``.

All are program ops (``passes.fused_loss`` puts them in place of the ATen ops they stand
for), each with the ``workspace`` in bytes it allocates beyond its inputs and outputs, which
the memory model counts (``memory.walk``), and the elements it returns in place (``aliases``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_rows(tokens: int, vocab: int, hidden: int, least: int = 256, model=None,
               dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk, a power of two: a chunk's logits about ``tokens x hidden`` (Liger's
    rule), but at least ``least`` rows, and at least the rows at which a chunk's FLOPs
    outlast its weight traffic on ``model`` (``ridge_rows``: each chunk reads the weight again
    and adds into the weight's gradient), while that leaves 2 chunks or more. Fewer rows make
    the matmuls that sum the weight's gradient slow (K = rows): 2048 tokens, hidden 1024,
    vocabulary 32000 took 5.0 s forward and backward in 64-row chunks, 3.9 s in 256-row
    ones and 3.7 s in one, against eager's 2.9 s (fp32, the 2-core EPYC of bench/, the
    logits computed again in the backward); a pipeline's 64-token microbatch, hidden 768,
    with the gradients in the forward, one thread: 231 ms in 16-row chunks, 155 ms in 32-row
    ones, against eager's 174 ms. On an H100 in bf16 the ridge is 590 rows: Liger's rule
    gives a 128k-vocabulary, hidden-4096 head 256-row chunks, memory-bound; here 1024."""
    liger = math.ceil(tokens / max(1, math.ceil(vocab / max(hidden, 1))))
    floor = min(max(least, ridge_rows(model, dtype) if model else 0), math.ceil(tokens / 2))
    return min(tokens, _pow2(max(liger, floor))) or 1


def chunk_weight_bytes(vocab: int, hidden: int, dtype: torch.dtype, grads: bool = True) -> int:
    """Bytes one chunk moves for the weight, whatever its rows: it reads ``w`` for its logits
    and, with the gradients, again for ``grad_h``, and reads and writes its fp32 share of
    ``grad_w``."""
    size = torch.empty((), dtype=dtype).element_size()
    return vocab * hidden * ((2 * size + 8) if grads else size)


def ridge_rows(model, dtype: torch.dtype) -> int:
    """The fewest rows whose three matmuls (6 x rows x vocab x hidden FLOPs) take as long at
    ``model``'s peak as the chunk's weight traffic (``chunk_weight_bytes``) at its memory
    bandwidth: below it a chunk waits on memory, and chunking costs time."""
    return math.ceil(chunk_weight_bytes(1, 1, dtype) * model.peak(dtype)
                     / (6 * model.memory_bandwidth))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class LinearCrossEntropy:
    """``(loss, total_weight, lse) = op(h, w, target)``: ``nll_loss(log_softmax(h @ w.T),
    target)`` as ATen's ``nll_loss_forward`` returns it (``reduction``: 1 mean, 2 sum;
    ``total_weight``: the targets not ``ignore_index``), and each row's log-sum-exp. With
    ``grads``: ``(loss, total_weight, grad_h, grad_w)`` instead, the gradients of the loss
    summed over the targets (``grad_h`` in ``h``'s dtype, ``grad_w`` in fp32, shaped as ``w``)."""

    reduction: int
    ignore_index: int
    rows: int
    grads: bool = False
    name: str = "linear_cross_entropy"

    @property
    def __name__(self) -> str:  # how the program's code names it
        return self.name

    def __call__(self, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor):
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        picked = torch.empty(n, dtype=torch.float32, device=h.device)
        valid = target != self.ignore_index
        safe = torch.where(valid, target, 0).unsqueeze(1)
        if self.grads:
            grad_h = torch.empty_like(h)
            grad_w = _weight_grad(w, n)
            keep = valid.to(torch.float32).unsqueeze(1)  # 0: an ignored target's row
            minus_one = torch.full((1, 1), -1.0, device=h.device)
        for s in range(0, n, self.rows):
            e = min(n, s + self.rows)
            z = torch.mm(h[s:e], w.t()).float()  # a copy in low precision, z itself in fp32
            m = z.amax(1)
            picked[s:e] = z.gather(1, safe[s:e]).squeeze(1)
            z.sub_(m.unsqueeze(1)).exp_()
            total = z.sum(1)
            torch.log(total, out=lse[s:e]).add_(m)
            if self.grads:  # softmax - onehot, then both gradients from it
                z.div_(total.unsqueeze(1))
                z.scatter_add_(1, safe[s:e], minus_one.expand(e - s, 1)).mul_(keep[s:e])
                _grads_of_chunk(z, h[s:e], w, grad_h[s:e], grad_w, first=s == 0)
            del z  # before the next chunk's: one chunk of logits at a time
        total = valid.sum().to(torch.float32)
        loss = ((lse - picked) * valid).sum()
        if self.reduction == 1:
            loss = loss / total
        return (loss, total, grad_h, grad_w) if self.grads else (loss, total, lse)

    def workspace(self, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> int:
        """Bytes beyond its inputs and outputs: one chunk's logits (fp32, and the matmul's
        own result first when it is in a narrower dtype), and per-row temporaries; with
        ``grads`` in a narrower dtype, the chunk's gradient in it and one share of
        ``grad_w`` before it is added."""
        extra = 0
        if self.grads and h.dtype != torch.float32:
            extra = self.rows * w.shape[0] * h.element_size() + w.numel() * h.element_size()
        return _chunk_bytes(self.rows, h, w) + 6 * h.shape[0] * 4 + extra


def _weight_grad(w: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 sum of ``w``'s gradient over ``n`` rows' chunks: the first chunk writes it
    (no rows: zeros)."""
    make = torch.empty if n else torch.zeros
    return make(w.shape, dtype=torch.float32, device=w.device)


def _grads_of_chunk(d: torch.Tensor, h: torch.Tensor, w: torch.Tensor, grad_h: torch.Tensor,
                    grad_w: torch.Tensor, first: bool) -> None:
    """From ``d``, a chunk's gradient of the logits (fp32), its rows of ``grad_h`` (written)
    and its share of ``grad_w`` (fp32: written by the ``first`` chunk, so it is never
    zero-filled, added by the others), the matmuls in ``h``'s dtype."""
    d = d if h.dtype == torch.float32 else d.to(h.dtype)
    torch.mm(d, w, out=grad_h)
    if h.dtype == torch.float32:
        if first:
            torch.mm(d.t(), h, out=grad_w)
        else:
            grad_w.addmm_(d.t(), h)
    elif first:
        grad_w.copy_(torch.mm(d.t(), h))
    else:
        grad_w.add_(torch.mm(d.t(), h))


@dataclass(frozen=True)
class LinearCrossEntropyGrads:
    """``(grad_h, grad_w) = op(grad_loss, total_weight, grad_h, grad_w)``: the gradients
    ``LinearCrossEntropy(grads=True)`` computed for the summed loss, scaled by the loss's
    gradient (over ``total_weight`` for a mean), ``grad_w`` in ``dtype`` (``transposed``: as
    ``w.T``). ``grad_h`` is scaled in place, and so is an fp32 ``grad_w``."""

    reduction: int
    dtype: torch.dtype
    transposed: bool = False
    name: str = "linear_cross_entropy_grads"

    @property
    def __name__(self) -> str:
        return self.name

    @property
    def aliases(self) -> dict[int, int]:
        """Output index -> the argument it is, updated in place (``cost.values.bases``)."""
        return {0: 2, 1: 3} if self.dtype == torch.float32 else {0: 2}

    def __call__(self, grad: torch.Tensor, total: torch.Tensor, grad_h: torch.Tensor,
                 grad_w: torch.Tensor):
        scale = grad.reshape(()).float()
        if self.reduction == 1:
            scale = scale / total
        grad_h = grad_h.mul_(scale)
        grad_w = grad_w.mul_(scale).to(self.dtype)
        return grad_h, grad_w.t() if self.transposed else grad_w

    def workspace(self, *_) -> int:
        return 0


@dataclass(frozen=True)
class LinearCrossEntropyBackward:
    """``(grad_h, grad_w) = op(grad_loss, h, w, target, total_weight, lse)``: the gradients
    of ``LinearCrossEntropy``'s loss, ``grad_w`` shaped as ``w`` (``transposed``: as
    ``w.T``), both in ``h``'s dtype."""

    reduction: int
    ignore_index: int
    rows: int
    transposed: bool = False
    name: str = "linear_cross_entropy_backward"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                 target: torch.Tensor, total: torch.Tensor, lse: torch.Tensor):
        n = h.shape[0]
        scale = grad.reshape(()).float() / total if self.reduction == 1 else \
            grad.reshape(()).float()
        valid = target != self.ignore_index
        per_row = valid.to(torch.float32) * scale  # 0 for an ignored target
        safe = torch.where(valid, target, 0).unsqueeze(1)
        grad_h = torch.empty_like(h)
        grad_w = _weight_grad(w, n)
        minus_one = torch.full((1, 1), -1.0, device=h.device)
        for s in range(0, n, self.rows):
            e = min(n, s + self.rows)
            z = torch.mm(h[s:e], w.t()).float()  # the logits again
            z.sub_(lse[s:e].unsqueeze(1)).exp_()  # softmax
            z.scatter_add_(1, safe[s:e], minus_one.expand(e - s, 1))  # - onehot
            z.mul_(per_row[s:e].unsqueeze(1))
            _grads_of_chunk(z, h[s:e], w, grad_h[s:e], grad_w, first=s == 0)
            del z  # before the next chunk's
        grad_w = grad_w.to(h.dtype)
        return grad_h, grad_w.t() if self.transposed else grad_w

    def workspace(self, grad, h: torch.Tensor, w: torch.Tensor, *_) -> int:
        """One chunk's logits and their gradient, per-row temporaries, and in a narrower
        dtype the fp32 sum of ``grad_w`` (each chunk's share before it is added takes the
        place ``grad_w`` itself takes at the end)."""
        extra = w.numel() * 4 if h.dtype != torch.float32 else 0
        return _chunk_bytes(self.rows, h, w) + extra + 4 * h.shape[0] * 4


def _chunk_bytes(rows: int, h: torch.Tensor, w: torch.Tensor) -> int:
    logits = rows * w.shape[0]
    return logits * 4 + (logits * h.element_size() if h.dtype != torch.float32 else 0)
