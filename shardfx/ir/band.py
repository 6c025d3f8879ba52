"""The band of keys each query of an attention attends to: causal, full, a sliding window,
chunks.

The masks models build let query i attend to one run of keys, ``first(i) .. last(i)``, both
ends non-decreasing in i. Three numbers say which run:

    pattern                           before   after   chunk   first(i)          last(i)
    full attention (BERT)             None     None    None    0                 T-1
    causal (Llama, GPT-2)             None     0       None    0                 i
    sliding window of W (Mistral)     W-1      0       None    i-W+1             i
    chunks of C (Llama 4)             None     0       C       C*floor(i/C)      i
    both, as Gemma's local layers     W-1      0       C       the larger one    i
    symmetric window |i-j| <= W       W        W       None    i-W               i+W

``Band(before, after, chunk)``: key j is allowed for query i iff j >= i - before (when set),
j <= i + after (when set), and both are in the same chunk of ``chunk`` positions (when set).
Every query attends at least to its own key. ``passes.causal_mask`` finds the band a traced
mask is (``fit``); ``kernels.attention.band_mask`` makes the mask again from it; ring
attention (``codegen.ring_blocks``) cuts it into the blocks each rank computes and skips
the ones it leaves empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch

NONE = -1  # how an op's argument spells "not set" (``kernels.attention.band_mask``)


@dataclass(frozen=True)
class Band:
    """Which keys each query attends to (the module docstring); None: no limit that way."""

    before: int | None = None  # keys before its own a query may attend
    after: int | None = None  # keys after its own (0: causal)
    chunk: int | None = None  # attention stays within chunks of this many positions

    @staticmethod
    def of(is_causal: bool) -> Band:
        return CAUSAL if is_causal else FULL

    @staticmethod
    def from_args(before: int, after: int, chunk: int) -> Band:
        """The band of an op's arguments (``NONE`` for not set)."""
        return Band(*(None if v == NONE else v for v in (before, after, chunk)))

    def args(self) -> tuple[int, int, int]:
        return tuple(NONE if v is None else v for v in (self.before, self.after, self.chunk))

    def first(self, i):
        """The first key query position ``i`` attends to (an int, or a tensor of them)."""
        out = i * 0
        if self.before is not None:
            out = _max(out, i - self.before)
        if self.chunk is not None:
            out = _max(out, i - i % self.chunk)
        return out

    def last(self, i, length: int):
        """The last key query position ``i`` attends to, of ``length`` keys."""
        out = i * 0 + length - 1
        if self.after is not None:
            out = _min(out, i + self.after)
        if self.chunk is not None:
            out = _min(out, i - i % self.chunk + self.chunk - 1)
        return out

    def allowed(self, queries: torch.Tensor, keys: torch.Tensor, length: int) -> torch.Tensor:
        """(len(queries), len(keys)) bool: where each query (a position) may attend each key."""
        q = queries.unsqueeze(1)
        return (keys >= self.first(q)) & (keys <= self.last(q, length))

    @property
    def causal(self) -> bool:
        """Exactly the causal mask."""
        return self == CAUSAL

    @property
    def full(self) -> bool:
        """No mask at all."""
        return self == FULL

    def __str__(self) -> str:
        if self.full or self.causal:
            return "full attention" if self.full else "causal attention"
        parts = []
        if self.before is not None and self.after == 0:
            parts.append(f"a sliding window of {self.before + 1} keys (its own and the "
                         f"{self.before} before it)")
        elif self.before is not None or self.after not in (None, 0):
            side = [f"{'all' if n is None else n} {w}"
                    for n, w in ((self.before, "before"), (self.after, "after"))]
            parts.append(f"a window of {' and '.join(side)} its own key")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk} positions" +
                         (", causal within each" if self.after == 0 else ""))
        return "; ".join(parts)

    @staticmethod
    def fit(first: torch.Tensor, last: torch.Tensor) -> Band | None:
        """The simplest band whose ``first``/``last`` are these (one entry per query of a
        square mask, queries and keys at the same positions), or None."""
        length = len(first)
        i = torch.arange(length)
        if not bool(((first <= i) & (i <= last)).all()):
            return None  # a query that may not attend its own key
        starts = (first == i) & (i > 0)
        chunk = int(i[starts][0]) if bool(starts.any()) else None
        befores = (None, int((i - first).max()))
        afters = (None, int((last - i).max()))
        for before, after, c in sorted(product(befores, afters, (None, chunk)),
                                       key=lambda b: sum(v is not None for v in b)):
            band = Band(before, after, c)
            if torch.equal(band.first(i), first) and torch.equal(band.last(i, length), last):
                return band
        return None


def _max(a, b):
    return torch.maximum(a, b) if isinstance(a, torch.Tensor) else max(a, b)


def _min(a, b):
    return torch.minimum(a, b) if isinstance(a, torch.Tensor) else min(a, b)


FULL = Band()
CAUSAL = Band(after=0)
