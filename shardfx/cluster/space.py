"""The space ``shardfx.search`` ranks: every way to run one optimizer step of a global batch on
``devices`` devices that the model allows.

A candidate fixes what users of Megatron, NeMo and TorchTitan choose by hand:

- the mesh: ``devices`` factored into dp_replicate x dp x pp x cp x tp x ep (``shardfx.mesh``'s
  axes, in its order);
- the micro-batch: its rows (``mbs``), hence the microbatches of a step, ``batch / (dp x ep x
  mbs)`` (a pipeline's microbatches, or without pp, accumulation: ``partition``'s
  ``microbatches``);
- with pp, the schedule (1F1B, interleaved 1F1B and its virtual stages, zero bubble);
- the ZeRO stage over dp (and HSDP: ZeRO within dp, replicas across dp_replicate);
- the recompute policy (``auto.recompute``: none, selective, full).

What a model allows (``Shape``): tp divides the attention heads and the key-value heads (each
tp rank holds whole heads, as Megatron splits them) and stays within a node; cp splits the
sequence into 2 x cp chunks (the load-balanced ring); pp is at most one block a stage, and with
virtual stages every rank holds the same number of blocks; ep divides the experts (a model
without experts has none); dp x ep x mbs divides the batch, and a pipeline has at least as many
microbatches as stages. Axes a user fixes (``fixed``: ``{"tp": 8}``) are taken as given.

Requires: nothing of torch; ``Shape`` from the captured model (``search.shape``).
Ensures:  ``candidates`` yields each candidate once, every one of them a valid ``partition``
          request for the model (its ``options()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Iterator

from shardfx.mesh import AXES

SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")
VIRTUAL = (2, 4)  # virtual stages per rank tried with interleaved 1F1B


@dataclass(frozen=True)
class Shape:
    """What the model and the batch allow (``search.shape`` reads them off the capture)."""

    layers: int  # blocks of its repeated list (1 where it has none)
    heads: int  # attention heads (0: no attention)
    kv_heads: int  # key-value heads (= heads without grouped-query attention)
    experts: int = 0  # experts of a mixture-of-experts layer (0: none)
    seq: int = 1  # tokens a sequence
    batch: int = 1  # sequences of one optimizer step (the global batch)
    per_node: int = 8  # devices of a node: tp stays within one


@dataclass(frozen=True)
class Candidate:
    """One way to run a step: ``partition``'s options (``options()``)."""

    mesh: tuple[tuple[str, int], ...]  # (axis, size) in shardfx.mesh.AXES order, sizes > 1
    mbs: int  # rows of a microbatch
    microbatches: int  # microbatches of one step (a pipeline's, or accumulated)
    zero: int = 0
    recompute: str = "none"
    schedule: str | None = None  # with pp
    virtual_stages: int = 1

    def axis(self, name: str) -> int:
        return dict(self.mesh).get(name, 1)

    def options(self) -> dict:
        """``shardfx.partition``'s keyword arguments for this candidate."""
        out = dict(mesh=dict(self.mesh), microbatches=self.microbatches, zero=self.zero,
                   recompute=self.recompute)
        if self.schedule is not None:
            out.update(schedule=self.schedule, virtual_stages=self.virtual_stages)
        out["shard"] = "megatron"  # heads over tp; the batch over dp, the sequence over cp
        return out

    def __str__(self) -> str:
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh) or "1 device"
        parts = [mesh, f"{self.microbatches} microbatch{'es' if self.microbatches > 1 else ''}"
                 f" of {self.mbs}"]
        if self.schedule is not None:
            parts.append(self.schedule + (f" (v={self.virtual_stages})"
                                          if self.virtual_stages > 1 else ""))
        if self.zero:
            parts.append(f"zero={self.zero}")
        parts.append(f"recompute={self.recompute}")
        return ", ".join(parts)


def candidates(devices: int, shape: Shape, fixed: dict[str, int] | None = None
               ) -> Iterator[Candidate]:
    """Every candidate for ``devices`` devices (module docstring), each once."""
    fixed = dict(fixed or {})
    for sizes in factorizations(devices, len(AXES)):
        axes = dict(zip(AXES, sizes))
        if any(axes[a] != n for a, n in fixed.items()) or not _allowed(axes, shape):
            continue
        mesh = tuple((a, n) for a, n in axes.items() if n > 1)
        rows = shape.batch // (axes["dp_replicate"] * axes["dp"] * axes["ep"])
        for mbs in divisors(rows):
            m = rows // mbs
            if axes["pp"] > 1 and m < axes["pp"]:
                continue
            for zero, schedule, recompute in product(_zero_stages(axes),
                                                     _schedules(axes, shape, m), RECOMPUTE):
                name, v = schedule if schedule is not None else (None, 1)
                yield Candidate(mesh, mbs, m, zero, recompute, name, v)


def _allowed(axes: dict[str, int], shape: Shape) -> bool:
    tp, cp, pp, ep = axes["tp"], axes["cp"], axes["pp"], axes["ep"]
    rows = axes["dp_replicate"] * axes["dp"] * ep
    if shape.batch % rows:
        return False
    if tp > 1 and (tp > shape.per_node or not shape.heads or shape.heads % tp
                   or shape.kv_heads % tp):
        return False
    if cp > 1 and (not shape.heads or shape.seq % (2 * cp)):
        return False
    if pp > shape.layers:
        return False
    if ep > 1 and (not shape.experts or shape.experts % ep):
        return False
    if axes["dp_replicate"] > 1 and (axes["dp"] == 1 or pp > 1):
        return False  # HSDP: replicas of a ZeRO group; not with a pipeline
    return True


def _zero_stages(axes: dict[str, int]) -> tuple[int, ...]:
    if axes["dp"] == 1:
        return (0,)
    if axes["dp_replicate"] > 1:
        return (1, 2, 3)  # HSDP shards within dp
    return (0, 1, 2) if axes["pp"] > 1 else (0, 1, 2, 3)


def _schedules(axes: dict[str, int], shape: Shape, m: int) -> list:
    """(name, virtual stages) pairs, or [None] without pp."""
    p = axes["pp"]
    if p == 1:
        return [None]
    out: list = [("1f1b", 1), ("zero-bubble", 1)]
    for v in VIRTUAL:
        if shape.layers % (p * v) == 0 and m % p == 0:
            out.append(("interleaved-1f1b", v))
    return out


def factorizations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every ordered k-tuple of positive whole numbers whose product is ``n``."""
    if k == 1:
        yield (n,)
        return
    for d in divisors(n):
        for rest in factorizations(n // d, k - 1):
            yield (d, *rest)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
