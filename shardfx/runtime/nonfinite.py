"""Weights that are not finite, refused where a run would start from them.

A run that diverged saves NaN weights as faithfully as good ones, and a checkpoint damaged
before its checksum was taken (a conversion script, a bad cast to fp16) holds Inf: loaded
without a word, the first loss is NaN and the cause is a guess. ``runner.load`` and
``runner.load_hf`` therefore look at every floating-point value they filled — the model's
parameters and the optimizer's state; a buffer may hold ``-inf`` on purpose (a mask) — and,
where any is NaN or infinite, raise one ``InputError`` on every rank naming the tensors.
``allow_nonfinite=True`` loads them on purpose (to inspect a diverged run).

The ranks agree: each looks at what it holds, then they gather the names (one small
collective), so every rank raises the same error and none goes on to a step whose collectives
its peers never reach. The runner then holds the checkpoint's values: load another before
stepping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardfx.errors import InputError

ALLOW = "allow_nonfinite=True"


def kinds(t: torch.Tensor) -> frozenset[str]:
    """Which of "NaN" and "Inf" ``t`` holds (empty when every value is finite, or it is not
    floating point). The common answer, all finite, costs one reduction and no temporary
    (``torch.isfinite`` makes ``abs(t)``, a copy of the tensor: a rank made its shards one
    whole tensor at a time, and must not hold two); only a tensor that fails it is looked at
    again, a chunk at a time."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0 or t.is_meta:
        return frozenset()
    flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
    low, high = torch.aminmax(flat)  # NaN propagates; an Inf is an end
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return frozenset()
    chunks = flat.split(_CHUNK)
    return frozenset(k for k, test in (("NaN", torch.isnan), ("Inf", torch.isinf))
                     if any(bool(test(c).any()) for c in chunks))


_CHUNK = 1 << 20  # values per isnan/isinf of a tensor found not finite


def refuse(found: dict[str, frozenset[str]], source: str, where: str, fix: str) -> None:
    """Raise on every rank when any rank ``found`` tensors that are not finite (name -> the
    kinds it holds). Requires: every rank calls it together."""
    every = _gathered({k: sorted(v) for k, v in found.items() if v})
    if not every:
        return
    names = sorted(every)
    shown = ", ".join(f"{n} ({' and '.join(every[n])})" for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    raise InputError(f"{source} holds values that are not finite in {len(names)} tensors: "
                     f"{shown}{more}; training from them would give a NaN loss", where=where,
                     fix=f"{fix}; to load it anyway on purpose, pass {ALLOW}")


def found_in(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, frozenset[str]]:
    """name -> kinds, for the tensors of ``named`` that are not finite."""
    out: dict[str, frozenset[str]] = {}
    for name, t in named:
        if k := kinds(t):
            out[name] = out.get(name, frozenset()) | k
    return out


def _gathered(mine: dict[str, list[str]]) -> dict[str, list[str]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, set[str]] = {}
    for theirs in every:
        for name, k in theirs.items():
            out.setdefault(name, set()).update(k)
    return {name: sorted(k) for name, k in out.items()}
