"""A pipeline rank's send buffers in the memory model: on gloo each is held to the step's end
(the measured peaks of tests/test_memory.py), on NCCL until the runner finds it completed,
once its receiver has posted the receive (``memory_pipeline.send_release``). The published
runs (bench/published.py) ran on NCCL: 64 microbatches' activations held to the step's end
were half their predicted peak."""

from __future__ import annotations

import torch

import shardfx
from shardfx.cost.optimizer import optimizer_model
from shardfx.estimate.memory_pipeline import pipeline_memory, send_release

from models import lm_loss, tiny, token_batches


def peaks(microbatches: int, transport: str) -> list:
    batches = token_batches(1, batch=2 * microbatches)
    plan = shardfx.partition(tiny("llama", 4), *batches[0][:1], lm_loss, batches[0][1],
                             mesh={"pp": 2}, microbatches=microbatches, schedule="1f1b")
    program = plan.compiled_stages()
    return [pipeline_memory(program, r, True, optimizer_model(plan.options.optimizer),
                            device=torch.device("cpu"), transport=transport)
            for r in range(2)], program


def test_on_nccl_the_held_sends_do_not_grow_with_the_microbatches():
    """gloo: every microbatch's activation (rank 0) and input gradient (rank 1) held to the
    step's end; NCCL: a send is let go once its receiver has posted the receive, so rank 0's
    peak is the same at 4 and at 8 microbatches (1F1B keeps two in flight either way)."""
    gloo4, _ = peaks(4, "gloo")
    gloo8, _ = peaks(8, "gloo")
    nccl4, program = peaks(4, "nccl")
    nccl8, _ = peaks(8, "nccl")
    assert gloo8[0].communication > gloo4[0].communication  # grows with the microbatches
    assert nccl8[0].total == nccl4[0].total, (nccl4[0], nccl8[0])
    for g, n in zip(gloo8, nccl8):
        assert n.total <= g.total
    assert nccl8[0].total < gloo8[0].total
    release = send_release(program, 0)
    sends = [m for a in program.schedule.actions[0] for m, _ in program.messages(a)[0]]
    last = len(program.schedule.actions[0]) - 1
    assert sends and all(m in release for m in sends[:-1])  # all but the last let go early
    assert all(release[m] < last for m in sends[:2])


def test_the_default_transport_is_the_devices():
    """A CPU plan runs on gloo: its estimate is the gloo walk (what tests/test_memory.py
    measures)."""
    (gloo, _), (default, _) = peaks(4, "gloo"), peaks(4, None)
    assert [m.total for m in gloo] == [m.total for m in default]


def test_a_plan_prices_either_transport():
    """``memory_breakdown(transport=)``: each pp rank's walk on that transport, cached apart."""
    batches = token_batches(1, batch=8)
    plan = shardfx.partition(tiny("llama", 4), *batches[0][:1], lm_loss, batches[0][1],
                             mesh={"pp": 2}, microbatches=4, schedule="1f1b")
    nccl, _ = peaks(4, "nccl")
    by_rank = plan.memory_breakdown(transport="nccl")
    assert [by_rank[r].total for r in range(2)] == [m.total for m in nccl]
    assert plan.memory_breakdown() == plan.memory_breakdown(transport="gloo")
