"""Where ``shardfx run`` gets its batches: a file of token ids, the factory's own batches, or
synthetic ones. Batch ``i`` is the i-th global batch of the run (``accumulate`` of them per
step); a resumed run starts at the checkpoint's data position, so it sees the batches the
uninterrupted run would have.

A token file is the common layout of tokenized text: a flat array of token ids, a raw
``.bin`` of uint16 (nanoGPT's ``np.memmap(path, dtype=np.uint16)``) or a ``.npy``. It is
memory-mapped, never loaded: a batch reads its rows' windows alone. The file is cut into
windows of ``T + 1`` tokens at multiples of ``T`` (the inputs and, shifted by one, the
targets); each epoch visits every window once, in an order drawn from ``(seed, epoch)``, and
batch ``i`` takes the windows ``i*B .. i*B + B - 1`` of that sequence. Every rank reads the
global batch's windows (``B * (T + 1) * 2`` bytes) and the runner cuts its dp rows, as for any
batch: the ranks are checked to agree on the first step.

The factory's example fixes the shapes: a token file needs one integer input of shape
``(B, T)`` and, for targets, one integer tensor of the same shape (``examples/nanogpt.py``).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator

import torch

from shardfx.errors import InputError

WHERE = "[data] tokens (--tokens)"


class TokenFile:
    """The batches of a token file (module docstring)."""

    def __init__(self, path: str, rows: int, length: int, seed: int, dtype: torch.dtype):
        import numpy as np

        p = Path(path)
        if not p.is_file():
            raise InputError(f"no token file {path!r}", where=WHERE,
                             fix="tokenize a text first (python examples/prepare_text.py) and "
                                 "give the .bin it writes")
        tokens = np.load(p, mmap_mode="r") if p.suffix == ".npy" else \
            np.memmap(p, dtype=np.uint16, mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InputError(f"{path} holds a {tokens.ndim}-d array of {tokens.dtype}, not a "
                             "flat array of token ids", where=WHERE,
                             fix="save the token ids as one flat integer array")
        self.tokens, self.rows, self.length, self.seed, self.dtype = tokens, rows, length, seed, dtype
        self.windows = (len(tokens) - 1) // length
        if self.windows < rows:
            raise InputError(f"{path} has {len(tokens)} tokens: {self.windows} windows of "
                             f"{length} + 1, fewer than a batch's {rows} rows", where=WHERE,
                             fix="train on a longer text, or a smaller batch")
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(self.windows, generator=g))
        return self._epoch[1]

    def batch(self, index: int) -> tuple[tuple, tuple]:
        """Global batch ``index``: ((inputs,), (targets,)), each (B, T)."""
        import numpy as np

        starts = []
        for k in range(index * self.rows, (index + 1) * self.rows):
            epoch, at = divmod(k, self.windows)
            starts.append(int(self._order(epoch)[at]) * self.length)
        rows = np.stack([np.asarray(self.tokens[s:s + self.length + 1], dtype=np.int64)
                         for s in starts])
        block = torch.from_numpy(rows).to(self.dtype)
        return (block[:, :-1].contiguous(),), (block[:, 1:].contiguous(),)

    def __iter__(self) -> Iterator[tuple[tuple, tuple]]:
        return (self.batch(i) for i in itertools.count())


def token_shape(job, where: str = WHERE) -> tuple[int, int, torch.dtype]:
    """(B, T, dtype) of the factory's token ids, checked for a token file (module docstring)."""
    ints = [t for t in job.args if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    targets = [t for t in job.targets if isinstance(t, torch.Tensor)]
    if len(job.args) != 1 or len(ints) != 1 or ints[0].dim() != 2 or len(targets) != 1 \
            or targets[0].shape != ints[0].shape or targets[0].is_floating_point():
        raise InputError("a token file feeds a language model: the factory's args must be one "
                         "(B, T) tensor of token ids and its targets one (B, T) tensor of "
                         "the next tokens", where=where,
                         fix='return {"model": ..., "args": (idx,), "loss_fn": ..., '
                             '"targets": (next_idx,)}, or train without a token file')
    return ints[0].shape[0], ints[0].shape[1], ints[0].dtype


def batches(job, tokens: str | None, seed: int, start: int) -> Iterator[tuple[tuple, tuple]]:
    """The run's batches from batch ``start`` on: the token file's, the factory's, or
    synthetic ones shaped like the example (integer tensors drawn below the example's largest
    value + 1, floating ones from a normal distribution; batch ``i`` from ``(seed, i)``)."""
    if tokens is not None:
        rows, length, dtype = token_shape(job)
        source = TokenFile(tokens, rows, length, seed, dtype)
        return (source.batch(i) for i in itertools.count(start))
    if getattr(job, "batches", None) is not None:
        return _factory(job.batches, start)
    return _synthetic(job, seed, start)


def _factory(given, start: int) -> Iterator[tuple[tuple, tuple]]:
    yield from itertools.islice(given, start, None)  # a resumed run's from its position
    raise InputError("the factory's batches ran out before the last step", where="batches",
                     fix="give as many batches as steps x accumulate (or an endless iterator)")


def _synthetic(job, seed: int, start: int) -> Iterator[tuple[tuple, tuple]]:
    for index in itertools.count(start):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        yield tuple(_like(t, gen) for t in job.args), tuple(_like(t, gen) for t in job.targets)


def _like(t: Any, gen: torch.Generator) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)
    if t.dtype == torch.bool:
        return t.clone()
    high = max(int(t.max()) + 1, 1) if t.numel() else 1
    return torch.randint(0, high, t.shape, generator=gen, dtype=t.dtype)
