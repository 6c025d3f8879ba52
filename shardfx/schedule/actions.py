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
from dataclasses import dataclass
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
ACTION_FIX = "write stage, kind, microbatch: 0F1, 1B0, 0W2, 2SEND_F1, 3RECV_F1, 3SEND_B1, 2RECV_B1"


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
            raise ScheduleError(f"{text!r} is not an action", fix=ACTION_FIX)
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))


