"""codegen.ring_attention: attention over a sequence split on the ``cp`` mesh axis, as a ring.

Context parallelism splits every activation's sequence over the ``cp`` ranks. Everything but
attention works on its own tokens; attention needs every key and value. Ring Attention (Liu et
al. 2023) passes the key/value blocks around the ring of cp ranks: at step i rank r holds the
block of rank ``(r - i) mod cp``, computes its queries' attention to it while the block moves
on to rank r + 1 (its send and the next block's receive posted before the compute), and
merges the block's result into its own by the log-sum-exp (the online softmax):

    lse = logaddexp(lse, lse_b);  out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse)

Each rank holds two chunks of the sequence, one from the front and one from the back
(``cp_layout``), so with the causal mask every rank does the same work: its own block is
causal attention over its tokens, a block from an earlier rank is attended by every query but
only its front chunk of keys is not in the future, and a block from a later rank by the back
chunk of queries only -- half a block each, where a contiguous split would leave the last rank
cp whole blocks and the first one. The backward goes round the ring again with the forward's
(global) output and log-sum-exp: each block's gradients of q, k and v are exact from those (the
flash backward's P = exp(s - lse) and D = rowsum(dO o O)); dq stays, and a block's dk and dv
follow it one step behind, so the rank holding it next adds its share while the block after
is on its way; they are home after one more step.

``RingAttention`` and ``RingAttentionBackward`` are program ops in the place of the CPU flash
attention op and its backward (``codegen.spmd`` emits them where the rule split q, k and v on
the sequence over ``cp``: ``rules.attention``), called with the cp group's name and this
rank's coordinate, program inputs like every collective's. The p2p runs on the cp group; a
block's attention is the CPU flash kernel itself. Each op's ``workspace`` is what the memory
model counts beyond its inputs and outputs (``memory.walk``): the blocks in flight and the
fp32 accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import Shard

from shardfx.errors import PassError, ShardingError, user_line
from shardfx.kernels.attention import attention, attention_backward  # the plan's device's kernel
from shardfx.ir import cp_layout, meta as M

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _ring(group: str) -> tuple[dist.ProcessGroup, list[int]]:
    pg = dist.distributed_c10d._resolve_process_group(group)
    return pg, dist.get_process_group_ranks(pg)


class _Passing:
    """``tensors`` sent to the next rank of the ring and the previous rank's received into new
    dense buffers (``bufs``), once ``wait`` returns."""

    def __init__(self, pg, ranks: list[int], coord: int, tensors: list[torch.Tensor],
                 sent_are_ours: bool = False):
        """``sent_are_ours``: ``tensors`` are read by no one after the send (freed by ``wait``
        as the dense copies are)."""
        n = len(ranks)
        self.bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        dense = [t.contiguous() for t in tensors]
        self._copies = dense if sent_are_ours else \
            [d for d, t in zip(dense, tensors) if d is not t]
        ops = [dist.P2POp(dist.isend, d, ranks[(coord + 1) % n], pg) for d in dense]
        ops += [dist.P2POp(dist.irecv, b, ranks[(coord - 1) % n], pg) for b in self.bufs]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """The received buffers. The dense copies made to send go now (and the sent tensors,
        if ours): the process group's thread holds a finished send's tensor a while (as
        ``runtime.released`` says)."""
        for w in self._works:
            w.wait()
        for c in self._copies:
            c.untyped_storage().resize_(0)
        self._works, self._copies = [], []
        return self.bufs


def _blocks(coord: int, size: int, causal: bool):
    """(step, which part) for each block rank ``coord`` attends to: its queries and keys are
    chunks (coord, 2n-1-coord) of the sequence (``cp_layout``), so with the causal mask its own
    block is causal attention over its tokens, a block from an earlier rank is attended by
    every query in its front chunk only (keys ``FRONT``), and one from a later rank by the
    queries of the back chunk only (``BACK``); without the mask every block whole (``ALL``)."""
    for i in range(size):
        src = (coord - i) % size
        yield i, (ALL if not causal else OWN if src == coord else FRONT if src < coord else BACK)


ALL, OWN, FRONT, BACK = "all", "own", "front", "back"


def _pieces(part: str, queries: tuple, keys: tuple) -> tuple[list, list]:
    """The rows of a block's attention: ``queries`` are values indexed like q on dim 2 (the
    output, the log-sum-exp, their gradients), ``keys`` like k (v, the gradients of both);
    ``BACK`` reads the back half of the queries, ``FRONT`` the front half of the keys."""
    half = queries[0].shape[2] // 2
    if part == BACK:
        queries = [t[:, :, half:] for t in queries]
    if part == FRONT:
        keys = [t[:, :, :half] for t in keys]
    return list(queries), list(keys)


def _merge(out, lse, out_b, lse_b) -> None:
    """Fold one block's attention (``out_b``, ``lse_b``) into the running ``out`` and ``lse``
    (fp32 views, updated in place) by the log-sum-exp."""
    total = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    out.add_(out_b.float() * torch.exp(lse_b - total).unsqueeze(-1))
    lse.copy_(total)


def _free_received(*bufs: torch.Tensor) -> None:
    """The last blocks received, read for the last time: freed now, not when the process
    group's thread lets go of its receive."""
    for b in bufs:
        b.untyped_storage().resize_(0)


@dataclass(frozen=True)
class RingAttention:
    """``(out, lse) = op(q, k, v, group, coord)``: the flash op's outputs for this rank's
    queries over every rank's keys and values (``q, k, v``: (B, H, T/cp, D) local blocks)."""

    causal: bool
    scale: float | None
    size: int  # ranks on cp
    name: str = "ring_attention"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, q, k, v, group: str, coord: int):
        lse_shape = q.shape[:-1]
        if is_fake(q) or q.device.type == "meta":
            return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)
        pg, ranks = _ring(group)
        out = torch.zeros_like(q, dtype=torch.float32)  # q's layout, as the flash op's output
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
        for i, part in _blocks(coord, self.size, self.causal):
            if i + 1 < self.size:
                passing = _Passing(pg, ranks, coord, [k, v])
            (q_b, out_r, lse_r), (k_b, v_b) = _pieces(part, (q, out, lse), (k, v))
            out_b, lse_b = attention(q_b, k_b, v_b, 0.0, part == OWN, scale=self.scale)
            _merge(out_r, lse_r, out_b, lse_b)
            if i + 1 < self.size:
                k, v = passing.wait()
        if self.size > 1:
            _free_received(k, v)
        return out.to(q.dtype), lse

    def blocks(self) -> float:
        """Blocks each rank attends to (causal: its own, as a whole one, and half of each
        other: the flash kernel skips the masked half of its own)."""
        return (self.size + 1) / 2 if self.causal else self.size

    def flops(self, q, k, v, *_) -> int:
        """Two matmuls per block, (T/cp x D) by (D x T/cp), over the blocks attended."""
        b, h, t, d = q.shape
        return int(4 * b * h * t * k.shape[2] * d * self.blocks())

    def sends(self, q, k, v, *_) -> list[int]:
        """Bytes of each message this rank sends: the key/value block, cp - 1 times."""
        return [k.numel() * k.element_size() + v.numel() * v.element_size()] * (self.size - 1)

    def workspace(self, q, k, v, *_) -> int:
        """The next key/value block and the fp32 output accumulator with one block's output."""
        kv = 2 * (k.numel() * k.element_size() + v.numel() * v.element_size())
        return kv + 2 * q.numel() * 4


@dataclass(frozen=True)
class RingAttentionBackward:
    """``(dq, dk, dv) = op(grad_out, q, k, v, out, lse, group, coord)``, the gradients of
    ``RingAttention`` for this rank's blocks."""

    causal: bool
    scale: float | None
    size: int
    name: str = "ring_attention_backward"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, grad_out, q, k, v, out, lse, group: str, coord: int):
        if is_fake(q) or q.device.type == "meta":  # the layouts the ring returns (below)
            dense = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v)]
            return torch.empty_like(q), *dense
        pg, ranks = _ring(group)
        dq = torch.zeros_like(q, dtype=torch.float32)  # q's layout; dk and dv come dense
        incoming = None  # the gradients so far of the block held next, on their way here
        for i, part in _blocks(coord, self.size, self.causal):
            last = i + 1 == self.size
            if not last:  # the block moves on while its gradients here are computed
                passing = _Passing(pg, ranks, coord, [k, v])
            (go_b, q_b, out_b, lse_b, dq_r), (k_b, v_b) = _pieces(
                part, (grad_out, q, out, lse, dq), (k, v))
            dq_b, dk_b, dv_b = attention_backward(go_b, q_b, k_b, v_b, out_b, lse_b.contiguous(),
                                                  0.0, part == OWN, scale=self.scale)
            dq_r.add_(dq_b)
            if incoming is None:
                dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
                dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            else:  # from the ranks that held the block before
                dk, dv = incoming.wait()
            _, (dk_r, dv_r) = _pieces(part, (q,), (dk, dv))
            dk_r.add_(dk_b)
            dv_r.add_(dv_b)
            del dq_b, dk_b, dv_b
            if self.size > 1:  # on to the next holder; after the last step, home
                incoming = _Passing(pg, ranks, coord, [dk, dv], sent_are_ours=True)
            if not last:
                k, v = passing.wait()
        if self.size > 1:
            dk, dv = incoming.wait()  # this rank's own block's, from every rank
            _free_received(k, v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def flops(self, grad_out, q, k, v, *_) -> int:
        """Five matmuls per block (the flash backward's), over the blocks attended."""
        b, h, t, d = q.shape
        return int(10 * b * h * t * k.shape[2] * d * RingAttention.blocks(self))

    def sends(self, grad_out, q, k, v, *_) -> list[int]:
        """The block cp - 1 times, and its fp32 gradients cp times (the last one home)."""
        kv = k.numel() * k.element_size() + v.numel() * v.element_size()
        grads = (k.numel() + v.numel()) * 4
        return [kv] * (self.size - 1) + [grads] * self.size

    def workspace(self, grad_out, q, k, v, *_) -> int:
        """While a block's gradients are computed: the block's own gradients of q, k and v,
        the next block received, the dense copies of k and v sent (the program's are views),
        and two sets of fp32 gradients of a block: those coming in, those going out."""
        kv = k.numel() * k.element_size() + v.numel() * v.element_size()
        grads = (k.numel() + v.numel()) * 4
        return q.numel() * q.element_size() + kv + (kv + grads) + kv + grads


def ring_op(node: fx.Node, inputs: tuple, mesh: list, args: tuple, kwargs: dict):
    """(op, local args, kwargs) running ``node`` (the CPU flash attention op or its backward)
    as ring attention where its rule split q on the sequence (dim 2) over ``cp``
    (``inputs``: the placements of its operands; ``mesh``: the program's ``MeshInputs``);
    None elsewhere. Attention the ring cannot compute on a cp mesh (a mask, dropout) is an
    error naming the op."""
    if node.target not in (FLASH, FLASH_BACKWARD):
        return None
    cp = next((m for m in mesh if m.axis == "cp" and m.size > 1), None)
    if cp is None:
        return None
    backward = node.target is FLASH_BACKWARD
    names = [a.name for a in node.target._schema.arguments]
    given = dict(zip(names, args)) | dict(kwargs)
    where = f"{node.name} ({user_line(node.meta.get('stack_trace')) or 'attention'})"
    if given.get("attn_mask") is not None:
        raise mask_refusal(node)
    if given.get("dropout_p", 0.0):
        raise ShardingError(
            f"this attention has dropout_p={given['dropout_p']}: ring attention (the cp axis) "
            "draws no dropout", where=where,
            fix="set the attention dropout to 0 (attention_dropout, attn_pdrop), or drop cp")
    axes = [m.axis for m in mesh]
    q_at = 1 if backward else 0
    split = [(axes[i], p) for i, p in enumerate(inputs[q_at]) if isinstance(p, Shard)
             and p.dim == 2]
    if not split:
        return None
    if len(split) != 1 or split[0][0] != cp.axis or not cp_layout.chunked(split[0][1]):
        raise PassError(f"attention {node.name} is split on its sequence over "
                        f"{', '.join(f'{a} ({M.placements_str((p,))})' for a, p in split)}: "
                        "only cp's chunks (C) run it as a ring",
                        where=node.format_node(), fix="this is a shardfx bug; report it")
    kind = RingAttentionBackward if backward else RingAttention
    op = kind(bool(given.get("is_causal", False)), given.get("scale"), cp.size)
    tensors = ("grad_out", "query", "key", "value", "out", "logsumexp") if backward else \
        ("query", "key", "value")
    return op, (*(given[t] for t in tensors), cp.group, cp.coord), {}


def mask_refusal(node: fx.Node) -> ShardingError:
    """The error for an attention op whose mask ring attention cannot run: the mask
    ``passes.causal_mask`` saw on it (``MASK``) and a fix that applies to that mask."""
    seen = node.meta.get(M.MASK) or M.AttentionMask("other", "of a pattern not checked")
    fix = {"input": "when no sequence is padded, call the model without attention_mask (its "
                    "attention is then causal or full, which cp runs); otherwise drop the cp "
                    "axis",
           "window": "ring attention has no sliding window yet: drop the cp axis, or train "
                     "with full causal attention (the config's sliding_window=None)"}
    return ShardingError(
        f"this attention has a dense mask, {seen.detail}: ring attention (the cp axis) "
        "computes causal or full attention only",
        where=f"{node.name} ({user_line(node.meta.get('stack_trace')) or 'attention'})",
        fix=fix.get(seen.kind, "drop the cp axis, or attend causally or to every key"))
