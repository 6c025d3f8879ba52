"""codegen.ring_blocks: what each rank of ring attention computes at each step, and which keys
it receives and sends, for any band of keys a query attends to (``ir.band``).

The layout (``ir.cp_layout``): n cp ranks, a sequence of 2n chunks of c positions, rank r
holding chunks r and 2n-1-r (its local rows 0..c-1 and c..2c-1). Ring attention goes in steps:
at step ``shift`` s, rank r attends to keys of rank r - s, which it receives (its own at s = 0),
and sends rank r + s the keys that rank needs of its own two chunks. Each query attends to one
run of keys (``Band.first(i) .. Band.last(i)``), so what a rank needs of another's chunk is one
run of its rows (``Rows``), and only that travels:

    causal         of a rank before it: its front chunk; after it: both chunks, which only its
                   own back chunk's queries see (half a block of work each, as the layout means)
    window W < c   the last W-1 rows of one chunk of each neighbour (r - 1 and r + 1), nothing
                   of the others: 2 small messages, not cp - 1 blocks
    chunks of C    the rows of the same chunk of C positions

A step no rank needs anything at is not taken; a rank that needs nothing of its source at a
step receives nothing, and the source, which knows it, sends nothing.

Each step's attention is a list of kernel calls (``Call``), each a run of query rows against a
run of keys within one chunk, of three kinds: ``FULL`` (no mask), ``CAUSAL`` (the kernel's
``is_causal``: rows and keys at the same positions) and ``MASKED`` (the band's dense mask over
those rows and keys: a window's edge). A run of query rows is cut where a chunk of the band
starts, and into runs of about a quarter of a window where the band has one (``rows_per_call``),
and its keys where the edge, the keys every row sees, and the diagonal meet, so a window costs
calls of about its width, not of the chunk's. Every call's rows are trimmed to those that see
at least one of its keys and its keys to those seen: no row of a call is fully masked (the
kernels' results for such a row differ), and a call with no such row is not made. Every
allowed (query, key) pair is in exactly one call of one step (tests/test_ring_blocks.py).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from shardfx.ir.band import Band

FULL, CAUSAL, MASKED = "full", "causal", "masked"
MIN_ROWS = 128  # a banded call's query rows, at least (where the chunk has as many)
Rows = tuple[int, int]  # [start, stop)
NOTHING: Rows = (0, 0)


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows ``rows`` (local) against rows ``keys`` of the step's key
    block (the own block's local rows; else the received buffer's), at positions ``at``
    (the first query's and the first key's in the sequence: where a mask is made from)."""

    rows: Rows
    keys: Rows
    kind: str
    at: tuple[int, int]

    @property
    def size(self) -> int:
        """Query-key pairs the kernel computes (a causal call's masked half included, as
        the FLOP counts of the flash kernel do)."""
        return (self.rows[1] - self.rows[0]) * (self.keys[1] - self.keys[0])


@dataclass(frozen=True)
class Step:
    """One step of the ring for one rank: receive ``recv`` of the rank ``shift`` before (rows
    of its front and back chunks, chunk-local), send ``send`` of ours to the rank ``shift``
    after, compute ``calls``. Shift 0: the own block, nothing sent."""

    shift: int
    recv: tuple[Rows, Rows]
    send: tuple[Rows, Rows]
    calls: tuple[Call, ...]

    @property
    def received(self) -> int:
        return sum(b - a for a, b in self.recv) if self.shift else 0

    @property
    def sent(self) -> int:
        return sum(b - a for a, b in self.send) if self.shift else 0


def chunks_of(rank: int, n: int) -> tuple[int, int]:
    """The sequence chunks rank ``rank`` holds, front and back (``ir.cp_layout``)."""
    return rank, 2 * n - 1 - rank


@functools.lru_cache(maxsize=256)
def schedule(coord: int, n: int, c: int, band: Band, rows: int | None = None
             ) -> tuple[Step, ...]:
    """Rank ``coord``'s steps of the ring over n ranks with chunks of c positions, for
    ``band``; ``rows``: query rows per call (default ``rows_per_call``)."""
    rows = rows or rows_per_call(band, c)
    shifts = [s for s in range(1, n) if any(
        _needs((r + s) % n, r, n, c, band) != (NOTHING, NOTHING) for r in range(n))]
    steps = []
    for s in [0, *shifts]:
        src = (coord - s) % n
        recv = ((0, c), (0, c)) if s == 0 else _needs(coord, src, n, c, band)
        send = ((0, c), (0, c)) if s == 0 else _needs((coord + s) % n, coord, n, c, band)
        steps.append(Step(s, recv, send, _calls(coord, src, recv, n, c, band, rows)))
    return tuple(steps)


def rows_per_call(band: Band, c: int) -> int:
    """Query rows per call: a chunk's for a band without a window before (causal, full,
    chunks), else about a quarter of the window (at least ``MIN_ROWS``)."""
    if band.before is None:
        return c
    return min(c, max(MIN_ROWS, (band.before + 1) // 4))


def _needs(dst: int, src: int, n: int, c: int, band: Band) -> tuple[Rows, Rows]:
    """Rows of each of ``src``'s chunks (chunk-local) that ``dst``'s queries attend to."""
    length = 2 * n * c
    out = []
    for g in chunks_of(src, n):
        lo, hi = c, 0
        for a in chunks_of(dst, n):
            start = max(band.first(a * c), g * c)
            stop = min(band.last((a + 1) * c - 1, length) + 1, (g + 1) * c)
            if start < stop:
                lo, hi = min(lo, start - g * c), max(hi, stop - g * c)
        out.append((lo, hi) if lo < hi else NOTHING)
    return tuple(out)


def _calls(dst: int, src: int, recv: tuple[Rows, Rows], n: int, c: int, band: Band,
           rows: int) -> tuple[Call, ...]:
    """The kernel calls of ``dst``'s queries over the key block received from ``src``."""
    length = 2 * n * c
    keys, at = [], 0  # (first position, rows of the block) of each received run
    for g, (lo, hi) in zip(chunks_of(src, n), recv):
        keys.append((g * c + lo, (at, at + hi - lo)))
        at += hi - lo
    calls = []
    for local, a in enumerate(chunks_of(dst, n)):
        for start in _row_starts(a * c, (a + 1) * c, band, rows):
            stop = min((a + 1) * c, _next_row_start(start, band, rows))
            for position, (k0, k1) in keys:
                for piece in _pieces(start, stop, position, position + k1 - k0, band, length):
                    call = _call(*piece, band, length)
                    if call is not None:
                        (r0, r1), (p0, p1), kind = call
                        base = local * c - a * c
                        calls.append(Call((base + r0, base + r1),
                                          (k0 + p0 - position, k0 + p1 - position), kind,
                                          (r0, p0)))
    return tuple(calls)


def _row_starts(start: int, stop: int, band: Band, rows: int):
    while start < stop:
        yield start
        start = _next_row_start(start, band, rows)


def _next_row_start(start: int, band: Band, rows: int) -> int:
    """Where the run of query rows from ``start`` ends: after ``rows`` rows, or where a chunk
    of the band begins, whichever is first."""
    stop = start + rows
    if band.chunk is not None:
        stop = min(stop, start - start % band.chunk + band.chunk)
    return stop


def _pieces(r0: int, r1: int, k0: int, k1: int, band: Band, length: int):
    """The runs of keys ``k0 .. k1`` cut where rows ``r0 .. r1`` change how they see them:
    where the keys every row sees begin and end, and where the diagonal (keys at the rows'
    positions) begins and ends; a window's edges fall between."""
    every = band.first(r1 - 1), band.last(r0, length) + 1  # every row sees the keys between
    cuts = {k0, k1, r0, r1, *(p for p in every if not r0 < p < r1)}  # the diagonal stays whole
    cuts = sorted(p for p in cuts if k0 <= p <= k1)
    for a, b in zip(cuts, cuts[1:]):
        yield r0, r1, a, b


def _call(r0: int, r1: int, k0: int, k1: int, band: Band, length: int):
    """Rows ``r0 .. r1`` against keys ``k0 .. k1`` (positions), trimmed to the rows that see
    any of the keys and the keys any of them sees, and how to compute them; None if no row
    sees any key. The rows that see any of the keys are one run, as both ends of the keys a
    row sees are non-decreasing; so are the keys they see."""
    rows = range(r0, r1)
    lo = r0 + bisect.bisect_left(rows, True, key=lambda i: band.last(i, length) >= k0)
    hi = r0 + bisect.bisect_left(rows, True, key=lambda i: band.first(i) >= k1)
    if lo >= hi:
        return None
    k0, k1 = max(k0, band.first(lo)), min(k1, band.last(hi - 1, length) + 1)
    every = band.first(hi - 1) <= k0  # every row sees the first key
    if every and band.last(lo, length) >= k1 - 1:
        return (lo, hi), (k0, k1), FULL
    if every and (lo, hi) == (k0, k1) and band.after == 0:
        return (lo, hi), (k0, k1), CAUSAL
    return (lo, hi), (k0, k1), MASKED


def mask(call: Call, band: Band, length: int, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """The additive mask (0 / -inf, ``dtype``) of a ``MASKED`` call: (rows, keys)."""
    (r0, r1), (k0, k1) = call.rows, call.keys
    q, k = call.at
    allowed = band.allowed(torch.arange(q, q + r1 - r0, device=device),
                           torch.arange(k, k + k1 - k0, device=device), length)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, float("-inf"))


def flops_pairs(n: int, c: int, band: Band) -> int:
    """Query-key pairs the busiest rank computes (``Call.size`` summed over its steps)."""
    return max(sum(call.size for step in schedule(r, n, c, band) for call in step.calls)
               for r in range(n))
