"""What ``shardfx.search`` returns: the candidates that fit, ranked, and why the first wins.

Requires: priced candidates (``compose.price``); the finalists planned in full.
Ensures:  ``Searched[i]`` is the i-th fastest candidate that fits, its figures the whole plan's
          where it was planned (a finalist), else the composed price's; ``print`` shows the
          top candidates and what separates the first from the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from shardfx.cluster.compose import Price
from shardfx.cluster.space import Candidate

SHOWN = 10  # candidates ``print`` lists


@dataclass
class Ranked:
    """One candidate: its options, its price and, once planned, its plan's own figures.

    ``predicted_step`` is seconds of one optimizer step; ``tokens_per_s`` tokens/s per device;
    ``mfu`` the model's FLOPs (``driver.flops_per_token``: PaLM's 6N + 12 L H s a token) over
    the step's seconds x devices x the device model's peak at the compute dtype; ``memory``
    the peak bytes of the fullest device."""

    candidate: Candidate
    price: Price
    devices: int
    tokens: int  # tokens of one optimizer step
    peak: float  # tokens/s of one device at its peak FLOP/s (driver.flops_per_token)
    make: Callable[[Candidate], object] = field(repr=False)
    planned: object = None  # the plan's PredictedStep (a finalist)
    planned_memory: float | None = None

    @property
    def predicted_step(self) -> float:
        return self.planned.total if self.planned is not None else self.price.step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.predicted_step * self.devices)

    @property
    def mfu(self) -> float:
        return self.tokens_per_s / self.peak

    @property
    def memory(self) -> float:
        return self.planned_memory if self.planned_memory is not None else self.price.memory

    @property
    def agreement(self) -> float | None:
        """The composed price over the plan's predicted step, less one (a finalist)."""
        return None if self.planned is None else self.price.step / self.planned.total - 1

    def parts(self) -> dict[str, float]:
        """Seconds of the step by what spends them: the plan's where planned."""
        s = self.planned
        if s is None:
            p = self.price
            return {"compute": p.compute, "communication not hidden": p.exposed,
                    "pipeline bubble": p.bubble}
        return {"compute": s.compute, "communication not hidden": s.waiting,
                "pipeline bubble": s.idle}

    def plan(self):
        """``shardfx.partition`` of the model with this candidate's options."""
        return self.make(self.candidate)

    def __str__(self) -> str:
        return (f"{self.candidate}: {_time(self.predicted_step)} a step, "
                f"{self.tokens_per_s:,.0f} tokens/s per device, MFU {self.mfu:.1%}, "
                f"{self.memory / 1e9:.3g} GB")


@dataclass
class Searched:
    """The candidates that fit ``budget``, fastest first (``search``'s result)."""

    ranked: list[Ranked]
    devices: int
    budget: float
    considered: int  # candidates priced
    over: int  # of them, over the budget
    plans: int  # shallow plans the prices came from
    seconds: float  # CPU seconds of the search
    refused: dict[str, str] = field(default_factory=dict)  # finalist -> why it did not plan
    bounded: int = 0  # candidates not priced: no faster than one that fits, whatever they cost

    def __getitem__(self, i: int) -> Ranked:
        return self.ranked[i]

    def __len__(self) -> int:
        return len(self.ranked)

    def __iter__(self):
        return iter(self.ranked)

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    def plan(self):
        """The first candidate's plan."""
        return self.best.plan()

    def __str__(self) -> str:
        lines = [f"search: {self.devices} devices, {self.considered} candidates priced from "
                 f"{self.plans} shallow plans in {self.seconds:.1f} s CPU"
                 + (f" ({self.bounded} more recomputing: bounded by a faster one that fits)"
                    if self.bounded else "") + "; "
                 + (f"{len(self.ranked)} fit {self.budget / 1e9:.3g} GB, {self.over} over"
                    if self.budget < float("inf") else "no memory limit (the device model "
                    "states none)"),
                 "", "| # | candidate | step | tokens/s/device | MFU | memory GB | price vs "
                 "plan |", "|---:|---|---:|---:|---:|---:|---:|"]
        for i, r in enumerate(self.ranked[:SHOWN]):
            agree = "" if r.agreement is None else f"{r.agreement:+.1%}"
            lines.append(f"| {i + 1} | {r.candidate} | {_time(r.predicted_step)} | "
                         f"{r.tokens_per_s:,.0f} | {r.mfu:.1%} | {r.memory / 1e9:.3g} | {agree} |")
        lines += ["", "step, memory: the plan's own for the candidates planned in full (price vs "
                  "plan filled), else the composed price", why(self.ranked)]
        lines += [f"not planned: {c} ({reason})" for c, reason in self.refused.items()]
        return "\n".join(lines)


def why(ranked: list[Ranked]) -> str:
    """Why the first candidate wins: what its step spends less on than the next one's."""
    if not ranked:
        return "no candidate fits"
    first = ranked[0]
    if len(ranked) == 1:
        return f"first: {first.candidate}, the only candidate that fits"
    second = ranked[1]
    a, b = first.parts(), second.parts()
    parts = {name: (a[name], b[name]) for name in a}
    name, (x, y) = max(parts.items(), key=lambda kv: kv[1][1] - kv[1][0])
    gain = second.predicted_step / first.predicted_step - 1
    return (f"first: {first.candidate}, {gain:.1%} faster than {second.candidate}: "
            f"its {name} is {_time(x)} against {_time(y)}; "
            + ", ".join(f"{n} {_time(p)} vs {_time(q)}" for n, (p, q) in parts.items()
                        if n != name))


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e3), ("us", 1e6)):
        if seconds * scale >= 1:
            return f"{seconds * scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"
