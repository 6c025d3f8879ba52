"""codegen.ring_attention: attention over a sequence split on the ``cp`` mesh axis, as a ring.

Context parallelism splits every activation's sequence over the ``cp`` ranks. Everything but
attention works on its own tokens; attention needs the keys and values of others. Ring
Attention (Liu et al. 2023) goes round the ring of cp ranks: at step s rank r attends to the
keys and values of rank r - s, received while it computes the step before (the next step's
exchange is posted before this step's compute), and merges each block's result into its own
by the log-sum-exp (the online softmax):

    lse = logaddexp(lse, lse_b);  out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse)

Each rank holds two chunks of the sequence, one from the front and one from the back
(``cp_layout``), so with the causal mask every rank does the same work: its own block, and
half of every other. What a step computes and moves comes from the band of keys each query
attends to (``ir.band``: causal, full, a sliding window, chunks) and is worked out by
``codegen.ring_blocks``: only the rows of a block some query needs travel (of a rank before
it, causal attention needs the front chunk only), a step no rank needs is not taken (a
window narrower than a chunk needs the two neighbours' edges, not cp - 1 blocks), and each
step is a few kernel calls over runs of rows and keys -- without a mask, causal on the
diagonal, or with the band's mask at a window's edge -- none of them over a fully masked row.

The backward goes round again with the forward's (global) output and log-sum-exp: each
block's gradients of q, k and v are exact from those (the flash backward's P = exp(s - lse)
and D = rowsum(dO o O)); dq stays, and the gradients of the keys and values received at a
step go back to the rank they came from while the next step computes.

``RingAttention`` and ``RingAttentionBackward`` are program ops in the place of the CPU flash
attention op and its backward (``codegen.spmd`` emits them where the rule split q, k and v on
the sequence over ``cp``: ``rules.attention``), called with the cp group's name and this
rank's coordinate, program inputs like every collective's. The p2p runs on the cp group; a
call's attention is the plan's device's kernel (``kernels.attention``). Each op's ``flops``,
``sends`` and ``workspace`` (what the memory model counts beyond its inputs and outputs) are
the busiest rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import Shard

from shardfx.codegen import ring_blocks as rb
from shardfx.errors import PassError, ShardingError, user_line
from shardfx.ir import cp_layout, meta as M
from shardfx.ir.band import Band
from shardfx.kernels.attention import attention, attention_backward, band_of

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _ring(group: str) -> tuple[dist.ProcessGroup, list[int]]:
    pg = dist.distributed_c10d._resolve_process_group(group)
    return pg, dist.get_process_group_ranks(pg)


def _rows(t: torch.Tensor, runs: tuple[rb.Rows, rb.Rows]) -> torch.Tensor:
    """Rows ``runs`` of ``t``'s front and back chunks (dim 2), one after the other: ``t``
    itself when that is all of it."""
    c = t.shape[2] // 2
    (a, b), (d, e) = runs
    if (a, b, d, e) == (0, c, 0, c):
        return t
    return torch.cat([t[:, :, a:b], t[:, :, c + d:c + e]], dim=2)


def _add_rows(t: torch.Tensor, runs: tuple[rb.Rows, rb.Rows], rows: torch.Tensor) -> None:
    """``t``'s rows ``runs`` (as ``_rows``) += ``rows``."""
    c = t.shape[2] // 2
    (a, b), (d, e) = runs
    t[:, :, a:b].add_(rows[:, :, :b - a])
    t[:, :, c + d:c + e].add_(rows[:, :, b - a:])


class _Exchange:
    """One step's p2p: rows ``send`` of each of ``tensors`` to the rank ``shift`` ahead, and as
    many as the rank ``shift`` behind sends us (``received`` rows) into new dense buffers,
    once ``wait`` returns. ``back``: the other way round (gradients going home). A side with
    no rows posts nothing; its peer, which computes the same ``ring_blocks`` steps, knows."""

    def __init__(self, pg, ranks: list[int], coord: int, shift: int, tensors: list[torch.Tensor],
                 send: tuple[rb.Rows, rb.Rows] | None, received: int, back: bool = False):
        n = len(ranks)
        to, frm = (coord - shift) % n, (coord + shift) % n
        if not back:
            to, frm = frm, to
        sent = [t if send is None else _rows(t, send) for t in tensors]
        sent = [t if t.is_contiguous() else t.contiguous() for t in sent]
        self._copies = [d for d, t in zip(sent, tensors) if d is not t]
        self.bufs = [t.new_empty((*t.shape[:2], received, *t.shape[3:])) for t in tensors]
        ops = [dist.P2POp(dist.isend, d, ranks[to], pg) for d in sent if d.shape[2]]
        ops += [dist.P2POp(dist.irecv, b, ranks[frm], pg) for b in self.bufs if received]
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[torch.Tensor]:
        """The received buffers. The dense copies made to send go now: the process group's
        thread holds a finished send's tensor a while (as ``runtime.released`` says)."""
        for w in self._works:
            w.wait()
        for c in self._copies:
            c.untyped_storage().resize_(0)
        self._works, self._copies = [], []
        return self.bufs


def _merge(out, lse, out_b, lse_b) -> None:
    """Fold one call's attention (``out_b``, ``lse_b``) into the running ``out`` and ``lse``
    (fp32 views, updated in place) by the log-sum-exp."""
    total = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    out.add_(out_b.float() * torch.exp(lse_b - total).unsqueeze(-1))
    lse.copy_(total)


def _free(*bufs: torch.Tensor) -> None:
    """Received blocks, read for the last time: freed now, not when the process group's
    thread lets go of its receive."""
    for b in bufs:
        b.untyped_storage().resize_(0)


def _kernel_args(call: rb.Call, band: Band, length: int, q: torch.Tensor) -> dict:
    """How a call runs: causal, or with the band's mask over its rows and keys."""
    mask = rb.mask(call, band, length, q.dtype, q.device) if call.kind == rb.MASKED else None
    return dict(is_causal=call.kind == rb.CAUSAL, attn_mask=mask)


@dataclass(frozen=True)
class _Ring:
    """What both ring ops share: the band, the scale, the ring's size, and the schedule."""

    band: Band
    scale: float | None
    size: int  # ranks on cp

    @property
    def __name__(self) -> str:
        return self.name

    def steps(self, q, coord: int) -> tuple[rb.Step, ...]:
        return rb.schedule(coord, self.size, q.shape[2] // 2, self.band)

    def walk(self, q, k, v, group: str, coord: int):
        """Each of this rank's steps with its key/value block: its own, then each received,
        the next step's exchange posted before a step is computed (the caller's work between
        two yields), a received block freed once computed."""
        pg, ranks = _ring(group)
        steps = self.steps(q, coord)
        block, coming = (k, v), None
        for i, step in enumerate(steps):
            if coming is not None:
                block = coming.wait()
            if i + 1 < len(steps):
                after = steps[i + 1]
                coming = _Exchange(pg, ranks, coord, after.shift, [k, v], after.send,
                                   after.received)
            yield step, block
            if i:
                _free(*block)

    def _all_steps(self, q) -> list[tuple[rb.Step, ...]]:
        return [self.steps(q, r) for r in range(self.size)]

    def _row_bytes(self, *tensors) -> int:
        """Bytes of one sequence row of each of ``tensors`` (B, H, rows, D), together."""
        return sum(t.numel() // t.shape[2] * t.element_size() for t in tensors)

    def _per_step(self, q, count) -> list[int]:
        """``count(step)`` of each step taken after the first, the busiest rank's."""
        every = self._all_steps(q)
        return [max(count(steps[i]) for steps in every) for i in range(1, len(every[0]))]

    def _pairs(self, q) -> int:
        return rb.flops_pairs(self.size, q.shape[2] // 2, self.band)


@dataclass(frozen=True)
class RingAttention(_Ring):
    """``(out, lse) = op(q, k, v, group, coord)``: the flash op's outputs for this rank's
    queries over every rank's keys and values (``q, k, v``: (B, H, T/cp, D) local blocks)
    attended as ``band`` says."""

    name: str = "ring_attention"

    def __call__(self, q, k, v, group: str, coord: int):
        lse_shape = q.shape[:-1]
        if is_fake(q) or q.device.type == "meta":
            return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)
        length = q.shape[2] * self.size
        out = torch.zeros_like(q, dtype=torch.float32)  # q's layout, as the flash op's output
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
        for step, (k_b, v_b) in self.walk(q, k, v, group, coord):
            for call in step.calls:
                (r0, r1), (k0, k1) = call.rows, call.keys
                out_c, lse_c = attention(q[:, :, r0:r1], k_b[:, :, k0:k1], v_b[:, :, k0:k1],
                                         0.0, scale=self.scale,
                                         **_kernel_args(call, self.band, length, q))
                _merge(out[:, :, r0:r1], lse[:, :, r0:r1], out_c, lse_c)
        return out.to(q.dtype), lse

    def flops(self, q, k, v, *_) -> int:
        """Two matmuls per query-key pair computed (``ring_blocks.Call.size``)."""
        b, h, _, d = q.shape
        return int(4 * b * h * d * self._pairs(q))

    def sends(self, q, k, v, *_) -> list[int]:
        """Bytes of each message: the rows of keys and values sent at each step."""
        row = self._row_bytes(k, v)
        return [rows * row for rows in self._per_step(q, lambda s: s.sent)]

    def workspace(self, q, k, v, *_) -> int:
        """The block received and the next one on its way, the rows sent (a copy, unless
        the whole block), and the fp32 output accumulator with one call's output."""
        row = self._row_bytes(k, v)
        got = max([0, *self._per_step(q, lambda s: s.received)])
        sent = max([0, *self._per_step(q, lambda s: 0 if s.sent == q.shape[2] else s.sent)])
        return (2 * got + sent) * row + 2 * q.numel() * 4


@dataclass(frozen=True)
class RingAttentionBackward(_Ring):
    """``(dq, dk, dv) = op(grad_out, q, k, v, out, lse, group, coord)``, the gradients of
    ``RingAttention`` for this rank's blocks."""

    name: str = "ring_attention_backward"

    def __call__(self, grad_out, q, k, v, out, lse, group: str, coord: int):
        if is_fake(q) or q.device.type == "meta":  # the layouts the ring returns (below)
            dense = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v)]
            return torch.empty_like(q), *dense
        pg, ranks = _ring(group)
        length = q.shape[2] * self.size
        dq = torch.zeros_like(q, dtype=torch.float32)  # q's layout; dk and dv come dense
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        home = None  # the gradients of the step before, on their way back
        for step, (k_b, v_b) in self.walk(q, k, v, group, coord):
            dk_b, dv_b = (dk, dv) if not step.shift else (
                torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k_b, v_b))
            for call in step.calls:
                (r0, r1), (k0, k1) = call.rows, call.keys
                grads = attention_backward(
                    grad_out[:, :, r0:r1], q[:, :, r0:r1], k_b[:, :, k0:k1], v_b[:, :, k0:k1],
                    out[:, :, r0:r1], lse[:, :, r0:r1].contiguous(), 0.0, scale=self.scale,
                    **_kernel_args(call, self.band, length, q))
                dq[:, :, r0:r1].add_(grads[0])
                dk_b[:, :, k0:k1].add_(grads[1])
                dv_b[:, :, k0:k1].add_(grads[2])
                del grads
            if step.shift:
                self._arrived(home, dk, dv)
                home = _Exchange(pg, ranks, coord, step.shift, [dk_b, dv_b], None, step.sent,
                                 back=True), step.send
        self._arrived(home, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def _arrived(home, dk, dv) -> None:
        """Add the gradients of our rows that came back from a step (``home``: its exchange
        and the rows it was about) into ``dk`` and ``dv``."""
        if home is None:
            return
        exchange, runs = home
        got = exchange.wait()
        if got[0].shape[2]:
            _add_rows(dk, runs, got[0])
            _add_rows(dv, runs, got[1])
            _free(*got)

    def flops(self, grad_out, q, k, v, *_) -> int:
        """Five matmuls per query-key pair computed (the flash backward's)."""
        b, h, _, d = q.shape
        return int(10 * b * h * d * self._pairs(q))

    def sends(self, grad_out, q, k, v, *_) -> list[int]:
        """At each step the rows of keys and values sent, then the fp32 gradients of those
        received, sent back."""
        kv, grads = self._row_bytes(k, v), self._row_bytes(k, v) // max(1, k.element_size()) * 4
        return [rows * kv for rows in self._per_step(q, lambda s: s.sent)] + \
            [rows * grads for rows in self._per_step(q, lambda s: s.received)]

    def workspace(self, grad_out, q, k, v, *_) -> int:
        """While a step computes: one call's gradients of q, k and v, the block received and
        the next on its way, the rows sent (a copy), its fp32 gradients, and those of the
        step before coming home."""
        kv = self._row_bytes(k, v)
        grads = kv // max(1, k.element_size()) * 4
        got = max([0, *self._per_step(q, lambda s: s.received)])
        sent = max([0, *self._per_step(q, lambda s: s.sent)])
        return q.numel() * q.element_size() + kv * q.shape[2] + (2 * got + sent) * kv + \
            got * grads + sent * grads


def ring_op(node: fx.Node, inputs: tuple, mesh: list, args: tuple, kwargs: dict):
    """(op, local args, kwargs) running ``node`` (the CPU flash attention op or its backward)
    as ring attention where its rule split q on the sequence (dim 2) over ``cp``
    (``inputs``: the placements of its operands; ``mesh``: the program's ``MeshInputs``);
    None elsewhere. Its band: causal or full, or that of its mask, which ``passes.causal_mask``
    made with ``band_mask`` (the ring never makes it: ``drop_unread_masks``). Attention the
    ring cannot compute on a cp mesh (another mask, dropout) is an error naming the op."""
    if node.target not in (FLASH, FLASH_BACKWARD):
        return None
    cp = next((m for m in mesh if m.axis == "cp" and m.size > 1), None)
    if cp is None:
        return None
    backward = node.target is FLASH_BACKWARD
    names = [a.name for a in node.target._schema.arguments]
    given = dict(zip(names, args)) | dict(kwargs)
    where = f"{node.name} ({user_line(node.meta.get('stack_trace')) or 'attention'})"
    band = Band.of(bool(given.get("is_causal", False)))
    if node.kwargs.get("attn_mask") is not None:
        band = band_of(_made_from(node.kwargs["attn_mask"]))
        if band is None or given.get("is_causal", False):
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
    op = kind(band, given.get("scale"), cp.size)
    tensors = ("grad_out", "query", "key", "value", "out", "logsumexp") if backward else \
        ("query", "key", "value")
    return op, (*(given[t] for t in tensors), cp.group, cp.coord), {}


# Ops between a made mask and the attention reading it that keep its entries: a cast to the
# attention's dtype (``passes.mixed_precision``), views.
_KEEPING = {torch.ops.aten._to_copy.default, torch.ops.aten.alias.default,
            torch.ops.aten.view.default, torch.ops.aten.expand.default,
            torch.ops.aten.clone.default, torch.ops.prims.convert_element_type.default}


def _made_from(mask: fx.Node) -> fx.Node:
    """The op ``mask``'s entries come from, past casts and views."""
    while mask.op == "call_function" and mask.target in _KEEPING:
        mask = mask.args[0]
    return mask


def drop_unread_masks(graph: fx.Graph) -> None:
    """The masks ``band_mask`` makes (and their casts) that no op reads, gone from a program:
    those of the attention ring ops took the place of."""
    made = {}  # in graph order, read backwards: a cast goes before the mask it casts
    for node in graph.nodes:
        if band_of(node) is not None or (node.op == "call_function" and node.target in _KEEPING
                                         and node.args[0] in made):
            made[node] = None
    for node in reversed(made):
        if not node.users:
            graph.erase_node(node)


def mask_refusal(node: fx.Node) -> ShardingError:
    """The error for an attention op whose mask ring attention cannot run: the mask
    ``passes.causal_mask`` saw on it (``MASK``) and a fix that applies to that mask."""
    seen = node.meta.get(M.MASK) or M.AttentionMask("other", "of a pattern not checked")
    fix = {"input": "when no sequence is padded, call the model without attention_mask (its "
                    "attention is then causal or full, which cp runs); otherwise drop the cp "
                    "axis"}
    return ShardingError(
        f"this attention has a dense mask, {seen.detail}: ring attention (the cp axis) "
        "computes attention to a band of keys only (causal, full, a sliding window, chunks)",
        where=f"{node.name} ({user_line(node.meta.get('stack_trace')) or 'attention'})",
        fix=fix.get(seen.kind, "drop the cp axis, or mask a band of keys"))
