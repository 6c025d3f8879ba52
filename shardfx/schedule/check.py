"""Run a schedule's action lists on paper before launching them.

`simulate` plays every rank's list in order, as the runtime does: an action starts as soon as
its rank is free and what it needs has finished (s = stage, i = microbatch):

    sF i       (s-1)F i, or sRECV_F i when the schedule has send/recv and s-1 is on another rank
    sB i       sF i, and (s+1)B i (or sRECV_B i likewise) unless s is the last stage
    sW i       sB i
    sSEND_F i  sF i;    sRECV_F i  (s-1)SEND_F i
    sSEND_B i  sB i;    sRECV_B i  (s+1)SEND_B i

Sends do not wait for their receive (they are isends); receives wait for their send. When no
rank can go on and some have actions left, the schedule deadlocks: `ScheduleError` names each
stuck rank, its blocked action and what that waits for, and prints the grid with them marked.

Memory (`in_flight`): per rank, the activations alive, in units of one stage's activations for
one microbatch. An F adds one; the B frees it, or, when the backward is split, the W does (the
weight gradient still reads the saved layer inputs). Only a rank's own order matters, not time.

Bubble (`bubble_fraction`): idle time over compute time, summed over ranks, against the
makespan. That is Megatron-LM's definition (bubble time over ideal time), so 1F1B's is (p-1)/m,
and `shardfx.schedule.generate.formula_bubble` gives the published forms in the same terms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardfx.schedule.actions import Action, Kind, ScheduleError

if TYPE_CHECKING:
    from shardfx.schedule.lists import Schedule

COMPUTE = (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True)
class Costs:
    """How long each kind of action takes, in any one unit."""

    forward: float = 1.0
    backward: float = 2.0  # one stage's whole backward for one microbatch
    weight: float = 1.0    # its weight-gradient part: a split B takes backward - weight
    comm: float = 0.0      # each SEND and RECV

    def of(self, action: Action, split: bool) -> float:
        kind = action.kind
        if kind is Kind.F:
            return self.forward
        if kind is Kind.B:
            return self.backward - self.weight if split else self.backward
        return self.weight if kind is Kind.W else self.comm


@dataclass(frozen=True)
class Span:
    rank: int
    index: int  # position in the rank's list
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """When each action of ``schedule`` ran, in each rank's order, ranks in turn."""

    schedule: Schedule
    spans: tuple[Span, ...]

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    def compute(self, rank: int | None = None) -> float:
        """Time spent in F, B and W (on ``rank``, or on all ranks)."""
        return sum(s.end - s.start for s in self.spans
                   if s.action.kind in COMPUTE and rank in (None, s.rank))


def simulate(schedule: Schedule, costs: Costs | Callable[[Action], float] | None = None, *,
             send_early: bool = False,
             transfer: Callable[[Action], float | None] | None = None) -> Timeline:
    """Start and end of every action; ``ScheduleError`` if the schedule deadlocks.

    ``send_early``: in a schedule without W actions, a B's input gradient leaves once its own
    part (``costs.backward - costs.weight``) is done, before the weight gradient, as shardfx's
    runner sends it; the published formulas wait for the whole backward.
    ``transfer``: how long what an action makes takes to reach another rank; an action that
    needs it there starts that much later (the sender goes on at once: an isend)."""
    early = None
    if send_early and not schedule.split_backward:
        if not isinstance(costs, Costs | None):
            raise ScheduleError("send_early needs Costs (how much of B is the weight gradient)",
                                where="simulate(..., send_early=True)",
                                fix="pass Costs(forward, backward, weight)")
        c = costs or Costs()
        early = c.backward - c.weight
    spans, stuck = _run(schedule, _durations(schedule, costs), early, transfer)
    if stuck:
        raise _deadlock(schedule, stuck)
    return Timeline(schedule, tuple(spans))


def check(schedule: Schedule, max_in_flight: int | None = None) -> Timeline:
    """Reject a schedule the runtime could not finish, before launch.

    Every (stage, kind, microbatch) must run exactly once, on the rank that owns its stage; the
    lists must not deadlock; no rank may hold more than ``max_in_flight`` activations.
    Returns the timeline under default `Costs`.
    """
    _check_actions(schedule)
    timeline = simulate(schedule)
    if max_in_flight is not None:
        for rank, counts in in_flight(schedule).items():
            for index, count in enumerate(counts):
                if count > max_in_flight:
                    action = schedule.actions[rank][index]
                    raise ScheduleError(
                        f"rank {rank} holds {count} microbatches' activations after {action}, "
                        f"over the budget of {max_in_flight}",
                        where=f"rank {rank}, action {index} ({action})",
                        fix="start fewer forwards before the first backward (1F1B keeps at most "
                            "p in flight), or raise the budget",
                        grid=grid(schedule, {(rank, index)}))
    return timeline


def in_flight(schedule: Schedule) -> dict[int, list[int]]:
    """Per rank, the activations alive after each of its actions (see the module docstring)."""
    frees = Kind.W if schedule.split_backward else Kind.B
    counts = {}
    for rank, acts in enumerate(schedule.actions):
        alive, after = 0, []
        for a in acts:
            alive += (a.kind is Kind.F) - (a.kind is frees)
            after.append(alive)
        counts[rank] = after
    return counts


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    return {rank: max(counts, default=0) for rank, counts in in_flight(schedule).items()}


def bubble_fraction(run: Timeline | Schedule, costs: Costs | None = None, *,
                    send_early: bool = False) -> float:
    """Idle over compute time, summed over ranks: (ranks * makespan - compute) / compute."""
    timeline = run if isinstance(run, Timeline) else simulate(run, costs, send_early=send_early)
    compute = timeline.compute()
    return (timeline.schedule.ranks * timeline.makespan - compute) / compute


def grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """The schedule as a grid: one column per rank, one row per slot, every action one slot
    wide (as torch's ``_format_pipeline_order`` and the Zero Bubble paper draw them), idle
    slots ``-``. ``marks`` are (rank, index) pairs shown as ``>>0F3<<``. If the schedule
    deadlocks, the actions that never ran follow in rows labelled ``stuck``.
    """
    marks = set(marks)
    spans, stuck = _run(schedule, lambda a: 1.0)
    slots = int(max((s.end for s in spans), default=0))
    rows = [[str(n)] + ["-"] * schedule.ranks for n in range(slots)]
    for s in spans:
        rows[int(s.start)][s.rank + 1] = _cell(s.action, (s.rank, s.index) in marks)
    left = {rank: list(range(index, len(schedule.actions[rank]))) for rank, index, _, _ in stuck}
    for n in range(max(map(len, left.values()), default=0)):
        rows.append(["stuck"] + ["-"] * schedule.ranks)
        for rank, indices in left.items():
            if n < len(indices):
                rows[-1][rank + 1] = _cell(schedule.actions[rank][indices[n]],
                                           (rank, indices[n]) in marks)
    header = [""] + [f"rank {r}" for r in range(schedule.ranks)]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if c == 0 else cell.ljust(w)
                               for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in [header, *rows])


def _cell(action: Action, marked: bool) -> str:
    return f">>{action}<<" if marked else str(action)


def _needs(schedule: Schedule, a: Action) -> list[Action]:
    """The actions ``a`` waits for (the table in the module docstring)."""
    s, i, last = a.stage, a.microbatch, schedule.stages - 1
    comm = schedule.has_communication

    def from_(other: int, compute: Kind, recv: Kind) -> Action:
        if comm and schedule.rank_of(other) != schedule.rank_of(s):
            return Action(s, recv, i)
        return Action(other, compute, i)

    if a.kind is Kind.F:
        return [from_(s - 1, Kind.F, Kind.RECV_F)] if s > 0 else []
    if a.kind is Kind.B:
        return [Action(s, Kind.F, i)] + ([from_(s + 1, Kind.B, Kind.RECV_B)] if s < last else [])
    if a.kind in (Kind.W, Kind.SEND_B):
        return [Action(s, Kind.B, i)]
    if a.kind is Kind.SEND_F:
        return [Action(s, Kind.F, i)]
    if a.kind is Kind.RECV_F:
        return [Action(s - 1, Kind.SEND_F, i)]
    return [Action(s + 1, Kind.SEND_B, i)]  # RECV_B


def _run(schedule: Schedule, duration: Callable[[Action], float], early: float | None = None,
         transfer: Callable[[Action], float | None] | None = None):
    """Play the lists; returns the spans that ran and, per stuck rank, (rank, index, action,
    unmet needs). ``early``: a B's input gradient is ready this long after it starts;
    ``transfer``: what an action makes reaches another rank this long after it is ready."""
    position, clock = [0] * schedule.ranks, [0.0] * schedule.ranks
    end: dict[Action, float] = {}
    sent: dict[Action, float] = {}  # when a B's input gradient is ready, if before its end
    spans: list[Span] = []
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedule.actions):
            while position[rank] < len(acts):
                a = acts[position[rank]]
                needs = _needs(schedule, a)
                if any(n not in end for n in needs):
                    break
                start = max([clock[rank], *((sent.get(n, end[n]) if n.stage != a.stage or
                                             a.kind is Kind.SEND_B else end[n])
                                            + _away(schedule, transfer, n, a) for n in needs)])
                clock[rank] = end[a] = start + duration(a)
                if early is not None and a.kind is Kind.B:
                    sent[a] = start + early
                spans.append(Span(rank, position[rank], a, start, clock[rank]))
                position[rank] += 1
                progress = True
    spans.sort(key=lambda s: (s.rank, s.index))
    stuck = [(rank, position[rank], acts[position[rank]],
              [n for n in _needs(schedule, acts[position[rank]]) if n not in end])
             for rank, acts in enumerate(schedule.actions) if position[rank] < len(acts)]
    return spans, stuck


def _away(schedule: Schedule, transfer, need: Action, a: Action) -> float:
    """The time ``need``'s output takes to reach ``a``'s rank (0 on the same rank)."""
    if transfer is None or schedule.rank_of(need.stage) == schedule.rank_of(a.stage):
        return 0.0
    return transfer(need) or 0.0


def _durations(schedule: Schedule, costs) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    costs, split = costs or Costs(), schedule.split_backward
    return lambda a: costs.of(a, split)


def _where(schedule: Schedule, action: Action) -> str:
    """Where ``action`` is in the lists: 'rank 1, action 4', or that no rank runs it."""
    for rank, acts in enumerate(schedule.actions):
        if action in acts:
            return f"rank {rank}, action {acts.index(action)}"
    return "which no rank runs"


def _deadlock(schedule: Schedule, stuck) -> ScheduleError:
    waits = [f"rank {rank} is blocked at {a} (action {index}), waiting for "
             + ", ".join(f"{n} ({_where(schedule, n)})" for n in needs)
             for rank, index, a, needs in stuck]
    return ScheduleError(
        f"the schedule deadlocks: no rank can go on, and {len(stuck)} ranks have actions left",
        where="\n         ".join(waits),
        fix="move each blocked action after what it waits for, or what it waits for earlier",
        grid=grid(schedule, {(rank, index) for rank, index, _, _ in stuck}))


def _expected(schedule: Schedule) -> list[Action]:
    """Every action a complete schedule runs once."""
    kinds = [Kind.F, Kind.B] + [Kind.W] * schedule.split_backward
    stages, microbatches = range(schedule.stages), range(schedule.microbatches)
    expected = [Action(s, k, i) for s in stages for k in kinds for i in microbatches]
    if schedule.has_communication:  # a SEND and a RECV each way at each boundary between ranks
        cuts = [s for s in stages[:-1] if schedule.rank_of(s) != schedule.rank_of(s + 1)]
        expected += [Action(s + side, k, i) for s in cuts for i in microbatches for side, k in
                     ((0, Kind.SEND_F), (1, Kind.RECV_F), (1, Kind.SEND_B), (0, Kind.RECV_B))]
    return expected


def _misplaced(schedule: Schedule, rank: int, a: Action) -> str | None:
    """Why ``a`` cannot be on ``rank``, or None."""
    if a.stage >= schedule.stages:
        return f"the schedule has {schedule.stages} stages"
    if a.microbatch >= schedule.microbatches:
        return f"the schedule has {schedule.microbatches} microbatches"
    if schedule.rank_of(a.stage) != rank:
        return f"stage {a.stage} lives on rank {schedule.rank_of(a.stage)}"
    if a.kind.is_comm and (a.peer_stage >= schedule.stages
                           or schedule.rank_of(a.peer_stage) == rank):
        return f"stage {a.stage} has no neighbour {a.peer_stage} on another rank"
    return None


def _check_actions(schedule: Schedule) -> None:
    """Each action on its stage's rank, within the schedule's stages, exactly once; none missing."""
    seen: dict[Action, tuple[int, int]] = {}
    for rank, acts in enumerate(schedule.actions):
        for index, a in enumerate(acts):
            problem = _misplaced(schedule, rank, a)
            if problem is None and a in seen:
                problem = f"it already ran as action {seen[a][1]} on rank {seen[a][0]}"
            if problem:
                raise ScheduleError(f"rank {rank} runs {a}, but {problem}",
                                    where=f"rank {rank}, action {index} ({a})",
                                    fix="each stage's actions run once, on rank stage % ranks",
                                    grid=grid(schedule, {(rank, index), seen.get(a, (rank, index))}))
            seen[a] = (rank, index)
    missing = [a for a in _expected(schedule) if a not in seen]
    if missing:
        shown = " ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(
            f"{len(missing)} of the schedule's actions are missing: {shown}",
            where=f"rank {schedule.rank_of(missing[0].stage)} should run {missing[0]}",
            fix="run F and B (and W, if any W is there) of every stage and microbatch once; with "
                "send/recv, one SEND and one RECV per microbatch at each boundary between ranks",
            grid=grid(schedule))
