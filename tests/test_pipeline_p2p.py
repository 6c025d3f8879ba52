"""The pipeline runner's messages in the order an in-order transport (NCCL) needs, on gloo
(``codegen.steps``, ``schedule.p2p``): values that skip stages (a mask made in stage 0 and
read by every stage), schedules on four ranks, each pair of ranks receiving in the order the
sender sends, all equal to one device."""

from __future__ import annotations

from collections import defaultdict

import torch

import shardfx
from shardfx.schedule.p2p import check_p2p
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches


def _plan(schedule: str, layers: int):
    (x,), (y,) = token_batches(1)[0]
    return shardfx.partition(tiny("llama", layers), (x,), lm_loss, (y,), mesh={"pp": 4},
                             microbatches=4, schedule=schedule)


def test_every_message_of_a_four_stage_llama_is_received_in_sending_order():
    """Planning only: the runner's own messages (every tensor a part sends), checked."""
    program = _plan("1f1b", 4).compiled_stages()
    schedule = program.schedule
    groups = check_p2p(schedule, program.messages)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, mine in enumerate(groups):
        for group in mine:
            for op in group.ops:
                (sent[(rank, op.peer)] if op.send else received[(op.peer, rank)]).append(
                    op.message)
    assert sent == received
    skipping = {(a, b) for a, b in sent if abs(a - b) > 1}
    assert skipping, "stage 0's rotary tables and mask reach stages 2 and 3 directly"
    # the receives the runner posts are these groups', before the actions they belong to
    for rank in range(schedule.ranks):
        steps = program.steps(rank)
        posted = [r.key for s in steps for r in s.receives]
        assert posted == [op.message for g in groups[rank] for op in g.ops if not op.send]


def _train(cases):
    return [compare_training(tiny("llama", layers), token_batches(3), lm_loss,
                             mesh={"pp": 4}, microbatches=4, schedule=schedule).max()
            for schedule, layers in cases]


def test_four_ranks_with_w_actions_and_virtual_stages():
    """1f1b and interleaved-1f1b, whose in-order receives differ most (gpipe's are 1f1b's
    messages in another order; every schedule runs on two ranks in test_pipeline.py)."""
    results = shardfx.launch(_train, [("1f1b", 4), ("interleaved-1f1b", 8)],
                             nprocs=4, timeout=120, deadline=600)
    for errors in results:
        assert max(errors) < 1e-5, errors
