"""p2p: the pipeline's stage-to-stage messages as an in-order transport (NCCL) carries them.

Gloo matches a message to its receive by tag, so the pipeline runner may post every receive
of a step at once, in any order. NCCL matches by order: per pair of ranks and direction, the
k-th send one rank posts meets the k-th receive the other posts, and operations queued on one
communicator run one after the other. The protocol modelled here is the one that transport
needs:

    before each action, a rank posts the sends of what its previous action made, then the
    receives the action needs, each preceded by those of the messages its sender sends this
    rank before it (received early, held until their action); it waits for the receives, then
    computes; after its last action, it posts its last sends, and waits for every send.

(The pipeline runner posts each group's receives one action earlier, while it computes the
action before. Posting waits for nothing: the receives meet the same sends in the same order,
and a rank waits where the model says, so the check below holds for it too.)

Sends travel on a communicator of their own per direction (one group per ordered pair of
ranks), so a send the receiver has not reached yet holds up neither the sender's compute nor
its receives: with one shared queue, interleaved 1F1B on 2 ranks and 4 microbatches hangs
(rank 0 sends 2B0 while rank 1 sends 3B1, each before it receives the other's).

``batches`` writes each rank's groups; ``check_p2p`` plays them with in-order matching and
raises ``ScheduleError`` on a receive that would take another message's data (a mismatch)
or on receives that wait for each other (a hang), naming the ranks, the messages and the
action, with the grid marked: a planning error, never a hang at run time.

A message here is by default what one action sends the next stage (``messages_out``,
``messages_in``); the pipeline runner passes its own, every tensor one part sends another
rank (``codegen.steps``), since a value may also skip stages (a mask made in stage 0 and
read by every stage) and an action may send several.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

from shardfx.schedule.actions import Action, Kind, ScheduleError
from shardfx.schedule.lists import Schedule
from shardfx.schedule.check import grid


@dataclass(frozen=True)
class Message:
    """What ``stage`` made for microbatch ``microbatch``: its activation (F) for the next
    stage, or its input gradient (B) for the previous one."""

    kind: Kind  # F or B
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


@dataclass(frozen=True)
class Op:
    send: bool
    peer: int
    message: Hashable  # a Message, or the runner's (part, output, microbatch)

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.message} {'to' if self.send else 'from'} rank {self.peer}"


@dataclass
class Batch:
    """One group a rank posts and waits for: before ``action`` (None: after its last)."""

    action: Action | None
    index: int  # the action's place in the rank's list (its length for the last group)
    ops: list[Op] = field(default_factory=list)


def messages_out(schedule: Schedule, a: Action) -> list[tuple[Message, int]]:
    """What ``a`` sends, with the rank it goes to."""
    s, last, here = a.stage, schedule.stages - 1, schedule.rank_of(a.stage)
    if a.kind is Kind.F and s < last and schedule.rank_of(s + 1) != here:
        return [(Message(Kind.F, s, a.microbatch), schedule.rank_of(s + 1))]
    if a.kind is Kind.B and s > 0 and schedule.rank_of(s - 1) != here:
        return [(Message(Kind.B, s, a.microbatch), schedule.rank_of(s - 1))]
    return []


def messages_in(schedule: Schedule, a: Action) -> list[tuple[Message, int]]:
    """What ``a`` receives, with the rank it comes from."""
    s, last, here = a.stage, schedule.stages - 1, schedule.rank_of(a.stage)
    if a.kind is Kind.F and s > 0 and schedule.rank_of(s - 1) != here:
        return [(Message(Kind.F, s - 1, a.microbatch), schedule.rank_of(s - 1))]
    if a.kind is Kind.B and s < last and schedule.rank_of(s + 1) != here:
        return [(Message(Kind.B, s + 1, a.microbatch), schedule.rank_of(s + 1))]
    return []


Messages = Callable[[Action], tuple[list[tuple[Hashable, int]], list[tuple[Hashable, int]]]]


def stage_messages(schedule: Schedule) -> Messages:
    """What each action sends and receives when only neighbouring stages talk."""
    return lambda a: (messages_out(schedule, a), messages_in(schedule, a))


def batches(schedule: Schedule, messages: Messages | None = None) -> list[list[Batch]]:
    """Each rank's groups, in the order it posts them (the module docstring). A receive
    goes in the sender's order: where an action needs a message its sender sent after
    others to this rank, those are received first (early, into buffers of their own).
    ``messages(action)``: what it sends and what it receives, each as (message, peer rank),
    in the order it posts them (default: ``stage_messages``)."""
    messages = messages or stage_messages(schedule)
    order: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> sends, in order
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            for m, peer in messages(a)[0]:
                order[(rank, peer)].append(m)
    out = []
    for rank, acts in enumerate(schedule.actions):
        mine, pending = [], []
        taken: dict[int, int] = defaultdict(int)  # src -> messages from it received so far
        for i, a in enumerate(acts):
            ops = [Op(True, peer, m) for m, peer in pending]
            for m, src in messages(a)[1]:
                sent = order[(src, rank)]
                if m not in sent:
                    raise ScheduleError(
                        f"rank {rank} waits before {a} for {m} from rank {src}, which never "
                        "sends it", where="shardfx.schedule.p2p.batches",
                        fix="every message an action reads is one its sender sends to its rank")
                upto = sent.index(m) + 1  # <= taken[src] if it came early: nothing to post
                ops += [Op(False, src, x) for x in sent[taken[src]:upto]]
                taken[src] = max(taken[src], upto)
            if ops:
                mine.append(Batch(a, i, ops))
            pending = messages(a)[0]
        if pending:
            mine.append(Batch(None, len(acts), [Op(True, peer, m) for m, peer in pending]))
        out.append(mine)
    return out


def check_p2p(schedule: Schedule, messages: Messages | None = None) -> list[list[Batch]]:
    """Play every rank's groups with in-order matching per (sender, receiver) pair; returns
    the groups, or raises ScheduleError on a mismatch or a hang (module docstring)."""
    groups = batches(schedule, messages)
    at = [0] * schedule.ranks  # the group each rank is in
    sends: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> posted, unmet
    recvs: dict[tuple[int, int], deque] = defaultdict(deque)
    unmet: dict[int, int] = {}  # rank -> ops of its current group not met yet
    posted = [False] * schedule.ranks

    def post(rank: int) -> None:
        group = groups[rank][at[rank]]
        for op in group.ops:
            key = (rank, op.peer) if op.send else (op.peer, rank)
            (sends if op.send else recvs)[key].append((rank, op))
        unmet[rank] = sum(not op.send for op in group.ops)  # sends never hold a rank up
        posted[rank] = True

    progress = True
    while progress:
        progress = False
        for rank in range(schedule.ranks):
            if at[rank] < len(groups[rank]) and not posted[rank]:
                post(rank)
                progress = True
        for key in list(sends):
            while sends[key] and recvs[key]:
                (src, send), (dst, recv) = sends[key].popleft(), recvs[key].popleft()
                if send.message != recv.message:
                    g = groups[dst][at[dst]]
                    raise ScheduleError(
                        f"rank {dst} would receive {send.message} from rank {src} where it "
                        f"waits for {recv.message}: an in-order transport (NCCL) pairs the "
                        f"{src} -> {dst} messages in the order they are posted",
                        where=f"rank {dst}, before {g.action}",
                        fix="order the schedule so that each rank consumes what another sends "
                            "it in the order it is sent",
                        grid=grid(schedule, [(dst, g.index)] if g.action else []))
                unmet[dst] -= 1
                progress = True
        for rank in range(schedule.ranks):
            if posted[rank] and unmet[rank] == 0:
                at[rank] += 1
                posted[rank] = False
                progress = True
    stuck = [r for r in range(schedule.ranks) if at[r] < len(groups[r])]
    unsent = [op for queue in sends.values() for _, op in queue]  # sent, never received
    if unsent and not stuck:
        raise ScheduleError(f"{len(unsent)} messages sent and never received, the first "
                            f"{unsent[0]}", where="shardfx.schedule.p2p.check_p2p",
                            fix="every action's inputs from another rank are a message of it")
    if stuck:
        lines = [f"rank {r} before {groups[r][at[r]].action or 'the end'}: "
                 + ", ".join(map(str, groups[r][at[r]].ops)) for r in stuck]
        raise ScheduleError(
            "the stage-to-stage receives wait for each other (an in-order transport would "
            "hang):\n  " + "\n  ".join(lines),
            where="shardfx.schedule.p2p.check_p2p",
            fix="reorder the schedule's actions so that no two ranks each wait for the "
                "other's later message",
            grid=grid(schedule, [(r, groups[r][at[r]].index) for r in stuck
                                 if groups[r][at[r]].action is not None]))
    return groups
