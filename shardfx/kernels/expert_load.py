"""What the routers did in the last step: tokens per expert and tokens dropped, per layer.

Each mixture-of-experts layer's forward records, on the rank that runs it, how many of its
tokens' (token, slot) pairs chose each expert and how many a capacity dropped (``record``, from
``kernels.expert_compute.forward``). A runner's step starts a new record (``start``) and keeps what the
step recorded (``stepped``): that rank's tokens, summed over microbatches and accumulated
batches. ``runner.expert_load()`` sums them over the ranks that split the batch (``over_batch``).
Both leave what they return on the plan, for ``print(plan)`` and ``plan.html``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from shardfx.kernels.device import collective_device


@dataclass
class Routed:
    """One layer's routing in a step: pairs per expert (before any is dropped), pairs dropped
    by the capacity (0 without one), and the capacity per expert and batch slice (0: none)."""

    tokens: list[int] = field(default_factory=list)
    dropped: int = 0
    capacity: int = 0

    @property
    def pairs(self) -> int:
        return sum(self.tokens)

    def __str__(self) -> str:
        drops = f", {self.dropped} of {self.pairs} dropped (capacity {self.capacity})" \
            if self.capacity else ""
        return f"tokens per expert {self.tokens}{drops}"


BATCH_SPLIT = ("dp_replicate", "dp", "cp", "ep")  # mesh axes whose ranks route different tokens
_STEP: dict[str, Routed] = {}


def start() -> None:
    """A step begins: forget the last one's routing."""
    _STEP.clear()


def record(layer: str, counts: torch.Tensor, dropped: int, capacity: int) -> None:
    """Layer ``layer`` routed ``counts[e]`` pairs to expert e and dropped ``dropped``."""
    r = _STEP.setdefault(layer, Routed([0] * counts.numel()))
    r.tokens = [a + b for a, b in zip(r.tokens, counts.tolist())]
    r.dropped += dropped
    r.capacity = capacity


def taken() -> dict[str, Routed]:
    """This step's routing so far, by layer."""
    return {k: Routed(list(v.tokens), v.dropped, v.capacity) for k, v in _STEP.items()}


def stepped(plan) -> dict[str, Routed]:
    """The step just run's routing (this rank's), also left on ``plan`` for ``print(plan)``."""
    routed = taken()
    if routed:
        plan.routing = ("this rank's tokens", routed)
    return routed


def over_batch(plan, routed: dict[str, Routed], groups: list) -> dict[str, Routed]:
    """``summed``, also left on ``plan`` for ``print(plan)``."""
    out = summed(routed, groups)
    if out:
        plan.routing = ("the whole batch", out)
    return out


def summed(routed: dict[str, Routed], groups: list) -> dict[str, Routed]:
    """``routed`` (one rank's) summed over the process ``groups`` that split the batch: every
    rank of each group calls it, with the same layers (the same pipeline stage)."""
    layers = sorted(routed)
    if not layers or not groups:
        return routed

    flat = torch.tensor([n for k in layers for n in (*routed[k].tokens, routed[k].dropped)],
                        dtype=torch.int64, device=collective_device())
    for group in groups:
        torch.distributed.all_reduce(flat, group=group)
    values, out = flat.tolist(), {}
    for k in layers:
        n = len(routed[k].tokens)
        out[k], values = Routed(values[:n], values[n], routed[k].capacity), values[n + 1:]
    return out

