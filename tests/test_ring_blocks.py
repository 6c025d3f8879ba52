"""ring_blocks: each rank's steps of ring attention for a band of keys (causal, full, sliding
windows, chunks), checked by counting: every (query, key) pair the band allows is computed in
exactly one call of one step, no call computes a pair the band forbids without a mask, no row
of a masked call is fully masked, a rank receives exactly what its source sends, and a window
narrower than a chunk is two small messages from the neighbours, not cp - 1 blocks."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardfx.codegen.ring_blocks import (CAUSAL, FULL, MASKED, chunks_of, flops_pairs,
                                         schedule)
from shardfx.ir.band import Band

BANDS = [Band(), Band(after=0), Band(before=0, after=0), Band(before=2, after=0),
         Band(before=4, after=0), Band(before=9, after=0), Band(after=0, chunk=3),
         Band(after=0, chunk=4), Band(after=0, chunk=8), Band(before=2, after=0, chunk=5),
         Band(before=2, after=2), Band(before=1, after=3, chunk=6), Band(chunk=4)]


def _positions(step, src: int, n: int, c: int) -> list[int]:
    """The sequence position of each row of the step's key block."""
    out = []
    for g, (lo, hi) in zip(chunks_of(src, n), step.recv):
        out += range(g * c + lo, g * c + hi)
    return out


def _covered(coord: int, n: int, c: int, band: Band, rows: int | None) -> torch.Tensor:
    length = 2 * n * c
    count = torch.zeros(length, length, dtype=torch.long)
    query = [p for g in chunks_of(coord, n) for p in range(g * c, (g + 1) * c)]
    for step in schedule(coord, n, c, band, rows):
        keys = _positions(step, (coord - step.shift) % n, n, c)
        for call in step.calls:
            q = torch.tensor(query[call.rows[0]:call.rows[1]])
            k = torch.tensor(keys[call.keys[0]:call.keys[1]])
            assert (int(q[0]), int(k[0])) == call.at
            allowed = band.allowed(q, k, length)
            if call.kind == FULL:
                assert allowed.all(), call
            elif call.kind == CAUSAL:
                assert torch.equal(q, k), call
                assert torch.equal(allowed, torch.ones_like(allowed).tril()), call
            else:
                assert call.kind == MASKED and allowed.any(1).all(), call
            count[q.unsqueeze(1), k] += allowed.long()
    return count


@pytest.mark.parametrize("n,c", [(2, 1), (2, 4), (3, 3), (4, 5)])
def test_every_allowed_pair_is_computed_once(n, c):
    """Every band, with query rows cut per call as the band asks and into runs of 2."""
    length = 2 * n * c
    for band, rows in itertools.product(BANDS, (None, 2)):
        count = sum(_covered(r, n, c, band, rows) for r in range(n))
        want = band.allowed(torch.arange(length), torch.arange(length), length).long()
        assert torch.equal(count, want), (band, rows, count - want)


@pytest.mark.parametrize("n,c", [(2, 4), (3, 3), (4, 5)])
def test_what_a_rank_receives_is_what_its_source_sends(n, c):
    for band in BANDS:
        steps = {r: schedule(r, n, c, band) for r in range(n)}
        assert len({tuple(s.shift for s in ss) for ss in steps.values()}) == 1
        for r, ss in steps.items():
            for i, step in enumerate(ss):
                assert step.send == steps[(r + step.shift) % n][i].recv


def test_a_narrow_window_takes_two_small_messages():
    """cp=4, chunks of 16, a window of 4 keys: each rank receives the last 3 rows of a
    chunk from each neighbour (r - 1: the chunk before its front one; r + 1: the chunk before
    its back one), at shifts 1 and 3; nothing at shift 2. Causal attention receives a whole
    block or its front half at every shift."""
    window = Band(before=3, after=0)
    steps = schedule(1, 4, 16, window)
    assert [s.shift for s in steps] == [0, 1, 3]
    assert [s.received for s in steps] == [0, 3, 3]
    assert steps[1].recv == ((13, 16), (0, 0)) and steps[2].recv == ((0, 0), (13, 16))
    causal = schedule(1, 4, 16, Band(after=0))
    assert [s.received for s in causal] == [0, 16, 32, 32]
    # the work: a window does each query's 4 keys (and a causal call's masked half)
    assert flops_pairs(4, 16, window) < flops_pairs(4, 16, Band(after=0)) / 3


def test_causal_attention_is_the_same_work_on_every_rank():
    """Causal: each rank's own block is three calls of c x c (the fourth is empty), every
    other block two: the same on every rank, where a contiguous split would give the last
    rank cp times the first's."""
    for n, c in ((2, 4), (4, 3)):
        work = {sum(call.size for s in schedule(r, n, c, Band(after=0)) for call in s.calls)
                for r in range(n)}
        assert work == {(3 + 2 * (n - 1)) * c * c}
