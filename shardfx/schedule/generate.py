"""The standard pipeline schedules, generated as compute-only action lists.

Each generator takes p ranks and m microbatches and returns a `Schedule` of F/B (and W) actions;
`with_communication` adds the sends and receives. ``str()`` of each is the published figure,
redrawn with every action one slot wide:

    gpipe(p, m)                all forwards, then all backwards in microbatch order (GPipe,
                               Huang et al. 2019; Megatron-LM, Narayanan et al. 2021, fig. 3)
    one_f_one_b(p, m)          PipeDream-flush / Megatron 1F1B (Narayanan et al., fig. 4 top):
                               rank r runs p-1-r warm-up forwards, then one forward and one
                               backward at a time, then the backwards left; p in flight at most
                               (``in_flight=k``: k, the warm-up cut to k-1 forwards)
    interleaved_1f1b(p, m, v)  Megatron's interleaved 1F1B (fig. 4 bottom): v stages per rank
                               (stage s on rank s % p), microbatches through the chunks in
                               groups of p, (v-1)p + 2(p-1-r) warm-up forwards
    zb_h1(p, m)                Zero Bubble H1 (Qi et al. 2023, fig. 3): 1F1B with the backward
                               split into B (input gradient) and W (weight gradient); rank r
                               holds back its Ws by r backwards, so they fill the tail bubble and
                               every rank keeps p microbatches in flight, as 1F1B's rank 0

m < p is allowed for gpipe, one_f_one_b and zb_h1: the warm-up is cut to m forwards and the
pipeline never fills (correct, but 1F1B's bubble (p-1)/m is then 1 or more). interleaved_1f1b needs m % p == 0, as
Megatron does: its microbatch groups of p must come out even.

`formula_bubble` gives each schedule's published bubble, to hold simulated or measured ones to.
"""

from __future__ import annotations

from collections.abc import Callable

from shardfx.schedule.actions import Action, Kind, ScheduleError
from shardfx.schedule.lists import Schedule
from shardfx.schedule.check import Costs

Slot = tuple[int, int]  # (stage, microbatch)


def gpipe(p: int, m: int) -> Schedule:
    """Every rank: F of all m microbatches, then B of all m. m microbatches in flight."""
    _check_sizes("gpipe", p, m)
    return Schedule([[Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in range(m)]
                     for r in range(p)], p, m)


def one_f_one_b(p: int, m: int, in_flight: int | None = None) -> Schedule:
    """PipeDream-flush 1F1B: warm-up forwards, one forward one backward, then cool-down.

    ``in_flight`` k caps every rank at k microbatches in flight (its warm-up at k - 1
    forwards): less memory, a longer fill (k = 1 runs the microbatches one at a time)."""
    cap = p if in_flight is None else in_flight
    _check_sizes("1f1b", p, m, in_flight=cap)
    return Schedule([_one_f_one_b(m, min(p - 1 - r, m, cap - 1), lambda k, r=r: (r, k),
                                  lambda k, r=r: (r, k)) for r in range(p)], p, m)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v stages per rank; stage s on rank s % p."""
    _check_sizes("interleaved-1f1b", p, m, v)
    if v < 2:
        raise ScheduleError(f"interleaved 1F1B needs v >= 2 stages per rank, got v={v}",
                            where="interleaved_1f1b(p, m, v)", fix="for v=1 use one_f_one_b(p, m)")
    if m % p:
        raise ScheduleError(f"interleaved 1F1B needs the microbatches to divide into groups of "
                            f"p: m={m} is not a multiple of p={p}",
                            where="interleaved_1f1b(p, m, v)",
                            fix=f"use m={m + (-m) % p} microbatches, or one_f_one_b")

    def slot(rank: int, k: int, backward: bool) -> Slot:
        # The k-th forward (backward) of a rank: groups of p microbatches go through the
        # rank's chunks in turn, first to last for forwards and last to first for backwards.
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk * p + rank, (k // (p * v)) * p + k % p

    per_rank = []
    for r in range(p):
        # Megatron's warm-up: the last rank fills its other chunks first ((v-1) p forwards),
        # each rank before it two more, so its first backward arrives as its forwards run out.
        warmup = min((v - 1) * p + 2 * (p - 1 - r), m * v)
        per_rank.append(_one_f_one_b(m * v, warmup, lambda k, r=r: slot(r, k, False),
                                     lambda k, r=r: slot(r, k, True)))
    return Schedule(per_rank, p * v, m)


def zb_h1(p: int, m: int) -> Schedule:
    """Zero Bubble H1: 1F1B order with B split into B and W, rank r's Ws held back by r."""
    _check_sizes("zero-bubble", p, m)
    per_rank = []
    for r in range(p):
        warmup = min(p - 1 - r, m)  # 1F1B's; the W delay (r if m >= p) keeps p in flight
        per_rank.append(_one_f_one_b(m, warmup, lambda k, r=r: (r, k), lambda k, r=r: (r, k),
                                     weight_delay=p - 1 - warmup))
    return Schedule(per_rank, p, m)


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Inference: every rank runs its stages' forwards, microbatch by microbatch (stage s on rank
    s % p). Each list follows one global order (microbatch, then stage), so none deadlocks."""
    _check_sizes("forward_only", p, m, v)
    return Schedule([[Action(s, Kind.F, i) for i in range(m) for s in range(r, p * v, p)]
                     for r in range(p)], p * v, m)


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b, "zero-bubble": zb_h1,
}


def generate(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (gpipe | 1f1b | interleaved-1f1b | zero-bubble)."""
    if name not in GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}", fix=f"use one of {', '.join(GENERATORS)}")
    if v != 1 and name != "interleaved-1f1b":
        raise ScheduleError(f"{name} has one stage per rank, got v={v}",
                            fix="use interleaved-1f1b for several stages per rank")
    return interleaved_1f1b(p, m, v) if name == "interleaved-1f1b" else GENERATORS[name](p, m)


def formula_bubble(name: str, p: int, m: int, v: int = 1, costs: Costs | None = None, *,
                   send_early: bool = False) -> float:
    """The published bubble of each schedule, in `check.bubble_fraction`'s terms (idle time over
    compute time), for comparison with what `simulate` or a measured run gives.

    gpipe, 1f1b        (p-1)/m, whatever the costs (Narayanan et al. 2021, section 2.2)
    interleaved-1f1b   (p-1)/(v m), m a multiple of p (ibid., section 2.2.1)
    zero-bubble        (p-1)(F + B - W) / (m (F + B + W)) with B the input-gradient part (Qi et
                       al. 2023, section 2.1): (p-1)/(3m) at F = B = W. Exact for m >= p and
                       W <= min(F, B); a heavier W no longer fits the bubbles it is meant to fill.

    ``send_early`` (see `simulate`): the input gradient leaves a B before its weight gradient is
    computed, so each bubble on the critical path is F + B - W long instead of F + B; the first
    three shrink by (F + B - W) / (F + B) (2/3 at F = W = B/2), as shardfx's runner gives them.
    The zero-bubble schedule already runs W apart, and is unchanged.
    """
    c = costs or Costs()
    if name in ("gpipe", "1f1b", "interleaved-1f1b"):
        early = (c.forward + c.backward - c.weight) / (c.forward + c.backward) if send_early else 1
        return (p - 1) / ((v if name == "interleaved-1f1b" else 1) * m) * early
    if name == "zero-bubble":
        b = c.backward - c.weight
        if c.weight > min(c.forward, b):
            raise ScheduleError(
                f"ZB-H1's bubble formula assumes W <= min(F, B); got F={c.forward}, B={b}, "
                f"W={c.weight}", where="formula_bubble('zero-bubble', costs=...)",
                fix="compare with simulate(schedule, costs) instead: it holds for any costs")
        return (p - 1) * (c.forward + b - c.weight) / (m * (c.forward + b + c.weight))
    raise ScheduleError(f"no bubble formula for schedule {name!r}",
                        fix=f"use one of {', '.join(GENERATORS)}")


def _one_f_one_b(total: int, warmup: int, forward: Callable[[int], Slot],
                 backward: Callable[[int], Slot], weight_delay: int | None = None) -> list[Action]:
    """One rank's 1F1B order: ``warmup`` forwards, then a forward and a backward at a time,
    then the backwards left. ``forward(k)``/``backward(k)`` place the rank's k-th of each.

    With ``weight_delay`` d the backward is split: the k-th B is followed by the W of the
    (k-d)-th backward, and the Ws still owed come last.
    """
    ops = [_act(Kind.F, forward(k)) for k in range(warmup)]
    for k in range(total):
        if warmup + k < total:
            ops.append(_act(Kind.F, forward(warmup + k)))
        ops.append(_act(Kind.B, backward(k)))
        if weight_delay is not None and k >= weight_delay:
            ops.append(_act(Kind.W, backward(k - weight_delay)))
    if weight_delay is not None:
        ops += [_act(Kind.W, backward(k)) for k in range(max(0, total - weight_delay), total)]
    return ops


def _act(kind: Kind, slot: Slot) -> Action:
    stage, microbatch = slot
    return Action(stage, kind, microbatch)


def _check_sizes(name: str, p: int, m: int, v: int = 1, in_flight: int = 1) -> None:
    for label, value in (("p (ranks)", p), ("m (microbatches)", m), ("v (stages per rank)", v),
                         ("in_flight", in_flight)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}",
                                where=f"{name} schedule", fix="pass whole numbers >= 1")
