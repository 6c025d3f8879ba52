"""The pipeline's messages as an in-order transport (NCCL) carries them
(``schedule.p2p``): for every generated schedule, each pair of ranks posts its receives in
the order the sender posts its sends, and nothing waits forever; an order that would hang is
a planning error naming the ranks and messages."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from shardfx.schedule import (Schedule, ScheduleError, gpipe, interleaved_1f1b, one_f_one_b,
                              zb_h1)
from shardfx.schedule.p2p import batches, check_p2p


def schedules():
    rng = random.Random(0)
    out = []
    for _ in range(40):
        p, k = rng.randint(2, 4), rng.randint(1, 3)
        m = p * k
        v = rng.randint(2, 3)
        out += [gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), interleaved_1f1b(p, m, v)]
    return out


@pytest.mark.parametrize("schedule", schedules(), ids=lambda s: f"p{s.ranks}-m{s.microbatches}-"
                         f"s{s.stages}-{'split' if s.split_backward else 'whole'}")
def test_every_pair_receives_in_the_order_it_is_sent(schedule):
    groups = check_p2p(schedule)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, mine in enumerate(groups):
        for group in mine:
            for op in group.ops:
                if op.send:
                    sent[(rank, op.peer)].append(op.message)
                else:
                    received[(op.peer, rank)].append(op.message)
    assert sent == received
    assert sent  # a pipeline on two ranks or more sends something


def test_a_cycle_of_receives_is_a_planning_error():
    """Rank 1 runs microbatch 1 first; rank 0 sends it only after microbatch 0's backward,
    which waits for rank 1."""
    schedule = Schedule.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError, match=r"(?s)wait for each other.*rank 1 before 1F1: "
                                            r"recv 0F0 from rank 0, recv 0F1 from rank 0"):
        check_p2p(schedule)


def test_early_receives_follow_the_sender():
    """Interleaved 1F1B on 2 ranks: rank 1 needs 0F2 after rank 0 sent 2F0 and 2F1 to it;
    it receives them first, in rank 0's order."""
    groups = batches(interleaved_1f1b(2, 4, 2))
    recvs = [str(op.message) for g in groups[1] for op in g.ops if not op.send]
    assert recvs[:5] == ["0F0", "0F1", "2F0", "2F1", "0F2"]
