"""A pipeline schedule: one ordered list of actions (``actions.Action``) per rank, and its two
text forms (``str``: the grid ``check.grid`` lays out by simulating it; ``format_lists``: one
line per rank), both read back by ``Schedule.parse``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from shardfx.schedule.actions import ACTION_FIX, Action, Kind, ScheduleError
from shardfx.schedule.check import grid


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
        raise ScheduleError(err.cause, where=f"line {n}", fix=ACTION_FIX) from None


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
