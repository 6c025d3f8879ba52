"""Pipeline schedules as data: one ordered list of actions per rank, with a text form.

An action is one step a rank takes for one (stage, microbatch):

    0F1       stage 0 runs the forward of microbatch 1
    1B0       stage 1 runs the backward of microbatch 0: the whole backward, or only the input
              gradient when the schedule also has W actions (zero-bubble schedules)
    0W2       stage 0 computes the weight gradient of microbatch 2
    2SEND_F1  stage 2 sends microbatch 1's activation to stage 3; 3RECV_F1 receives it
    3SEND_B1  stage 3 sends microbatch 1's input gradient to stage 2; 2RECV_B1 receives it

A `Schedule` holds one such list per rank. Stage s runs on rank s % ranks, so with v stages per
rank (interleaved 1F1B) rank r owns stages r, r + ranks, r + 2 * ranks, ...

Two text forms, both read back by `Schedule.parse`:

    str(schedule)             a grid: one column per rank, one row per time slot, idle slots
                              '-' (see `shardfx.schedule.check.grid`)
    schedule.format_lists()   one line per rank:  rank 0: 0F0 0F1 0B0 0B1

Send/recv actions are optional; `with_communication` adds them to a compute-only schedule.
Whether a schedule deadlocks or fits a memory budget is for `shardfx.schedule.check`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from enum import Enum

from shardfx.errors import ShardfxError


class ScheduleError(ShardfxError, ValueError):
    """A schedule that is malformed, would deadlock, or would exceed its memory budget.

    ``grid`` is the whole schedule printed with the bad spot marked (``>>0F3<<``); the message
    ends with it.
    """

    def __init__(self, cause: str, *, where: str | None = None, fix: str | None = None,
                 grid: str | None = None):
        super().__init__(cause, where=where, fix=fix)
        self.grid = grid
        if grid:
            self.args = (f"{self.args[0]}\n{grid}",)


class Kind(str, Enum):
    F = "F"            # forward
    B = "B"            # backward: all of it, or the input gradient only if the schedule has W
    W = "W"            # weight gradient
    SEND_F = "SEND_F"  # activation to the next stage
    RECV_F = "RECV_F"  # activation from the previous stage
    SEND_B = "SEND_B"  # input gradient to the previous stage
    RECV_B = "RECV_B"  # output gradient from the next stage

    def __repr__(self) -> str:
        return f"Kind.{self.name}"

    @property
    def is_comm(self) -> bool:
        return self in _PEER


# The stage a communication action talks to, as an offset from its own stage.
_PEER = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}
_ACTION = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)")
_ACTION_FIX = "write stage, kind, microbatch: 0F1, 1B0, 0W2, 2SEND_F1, 3RECV_F1, 3SEND_B1, 2RECV_B1"


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` for ``microbatch`` on ``stage``. ``str``: ``0F1``."""

    stage: int
    kind: Kind
    microbatch: int
    peer_stage: int | None = None  # the other end of a SEND/RECV, filled in from ``kind``

    def __post_init__(self):
        kind = Kind(self.kind)
        peer = self.stage + _PEER[kind] if kind.is_comm else None
        object.__setattr__(self, "kind", kind)
        if self.peer_stage is not None and self.peer_stage != peer:
            raise ScheduleError(f"{self} talks to stage {peer}, not stage {self.peer_stage}",
                                fix="leave peer_stage out; it follows from the kind")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"{self} names a negative stage or microbatch",
                                fix="stages and microbatches count from 0")
        if peer is not None and peer < 0:
            raise ScheduleError(f"{self}: stage 0 has no previous stage to talk to",
                                fix="stage 0 receives no activation and sends no input gradient")
        object.__setattr__(self, "peer_stage", peer)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action.parse("0F1") == Action(0, Kind.F, 1)``; the inverse of ``str``."""
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(f"{text!r} is not an action", fix=_ACTION_FIX)
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """One ordered list of actions per rank: ``actions[r]`` is what rank r runs, in order.

    Built from a sequence of lists or a ``{rank: list}`` mapping. ``stages`` and
    ``microbatches`` default to one more than the highest ones named.
    """

    actions: tuple[tuple[Action, ...], ...]
    stages: int = 0
    microbatches: int = 0

    def __post_init__(self):
        lists = self.actions
        if isinstance(lists, Mapping):
            if sorted(lists) != list(range(len(lists))):
                raise ScheduleError(f"ranks {sorted(lists)} are not 0..{len(lists) - 1}",
                                    fix="give every rank from 0 up a list, empty if it is idle")
            lists = [lists[rank] for rank in range(len(lists))]
        lists = tuple(tuple(acts) for acts in lists)
        if not lists:
            raise ScheduleError("a schedule needs at least one rank")
        everything = [a for acts in lists for a in acts]
        object.__setattr__(self, "actions", lists)
        if not self.stages:
            object.__setattr__(self, "stages", max((a.stage + 1 for a in everything), default=0))
        if not self.microbatches:
            highest = max((a.microbatch + 1 for a in everything), default=0)
            object.__setattr__(self, "microbatches", highest)

    @property
    def ranks(self) -> int:
        return len(self.actions)

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``: stage s lives on rank s % ranks."""
        return stage % self.ranks

    @cached_property
    def split_backward(self) -> bool:
        """True when the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind is Kind.W for acts in self.actions for a in acts)

    @cached_property
    def has_communication(self) -> bool:
        return any(a.kind.is_comm for acts in self.actions for a in acts)

    def __str__(self) -> str:
        from shardfx.schedule.check import grid  # check simulates; it imports this module

        return grid(self)

    def format_lists(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 0B0 0B1``."""
        return "\n".join(f"rank {rank}: " + " ".join(map(str, acts))
                         for rank, acts in enumerate(self.actions))

    @classmethod
    def parse(cls, text: str, *, stages: int = 0, microbatches: int = 0) -> Schedule:
        """Read either text form back: the grid ``str`` prints, or ``format_lists``'s lines.

        Marks (``>>0F3<<``) and idle slots (``-``) are ignored; a grid row's label is ignored.
        """
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not lines:
            raise ScheduleError("empty schedule text", fix="one line per rank: 'rank 0: 0F0 0B0'")
        read = _read_lists if _RANK_LINE.match(lines[0][1]) else _read_grid
        return cls(read(lines), stages, microbatches)


_RANK_LINE = re.compile(r"rank\s+(\d+)\s*:(.*)")


def _cell(token: str, n: int) -> Action:
    try:
        return Action.parse(token.removeprefix(">>").removesuffix("<<"))
    except ScheduleError as err:
        raise ScheduleError(err.cause, where=f"line {n}", fix=_ACTION_FIX) from None


def _read_lists(lines: list[tuple[int, str]]) -> list[list[Action]]:
    per_rank = []
    for n, line in lines:
        match = _RANK_LINE.fullmatch(line)
        if match is None or int(match.group(1)) != len(per_rank):
            raise ScheduleError(f"expected 'rank {len(per_rank)}: ...', got {line!r}",
                                where=f"line {n}", fix="one line per rank, ranks in order from 0")
        per_rank.append([_cell(tok, n) for tok in match.group(2).split() if tok != "-"])
    return per_rank


def _read_grid(lines: list[tuple[int, str]]) -> list[list[Action]]:
    (n, header), rows = lines[0], lines[1:]
    ranks = [int(r) for r in re.findall(r"rank\s+(\d+)", header)]
    if not ranks or ranks != list(range(len(ranks))):
        raise ScheduleError(f"expected a grid header 'rank 0  rank 1 ...', got {header!r}",
                            where=f"line {n}", fix="print the schedule with str(schedule)")
    per_rank: list[list[Action]] = [[] for _ in ranks]
    for n, line in rows:
        cells = line.split()[1:]  # the first token labels the row
        if len(cells) != len(ranks):
            raise ScheduleError(f"row has {len(cells)} cells for {len(ranks)} ranks: {line!r}",
                                where=f"line {n}", fix="write '-' for an idle slot")
        for rank, token in enumerate(cells):
            if token != "-":
                per_rank[rank].append(_cell(token, n))
    return per_rank


def with_communication(schedule: Schedule) -> Schedule:
    """The same schedule with sends and receives wherever a stage boundary crosses ranks.

    After each F of a stage whose next stage is on another rank comes a SEND_F, and right
    before the consumer's F its RECV_F; after each B a SEND_B to the previous stage, and right
    before that stage's B its RECV_B. Sends do not block, so this adds no new waits.
    """
    if schedule.has_communication:
        raise ScheduleError("the schedule already has send/recv actions",
                            fix="call with_communication on a compute-only schedule")
    last = schedule.stages - 1

    def crosses(stage: int, other: int) -> bool:
        return 0 <= other <= last and schedule.rank_of(stage) != schedule.rank_of(other)

    per_rank = []
    for acts in schedule.actions:
        out: list[Action] = []
        for a in acts:
            s, i = a.stage, a.microbatch
            before, after = [], []
            if a.kind is Kind.F:
                before = [Action(s, Kind.RECV_F, i)] if crosses(s, s - 1) else []
                after = [Action(s, Kind.SEND_F, i)] if crosses(s, s + 1) else []
            elif a.kind is Kind.B:
                before = [Action(s, Kind.RECV_B, i)] if crosses(s, s + 1) else []
                after = [Action(s, Kind.SEND_B, i)] if crosses(s, s - 1) else []
            out += [*before, a, *after]
        per_rank.append(out)
    return Schedule(per_rank, schedule.stages, schedule.microbatches)

