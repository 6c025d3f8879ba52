"""``shardfx run --trace``: where each rank's traced step went (``shardfx.run.step_trace``).

The counting on hand-built intervals (nested events once, a wait attributed to what ended in
it, a pipeline's wait for its neighbour idle, the device timeline on CUDA), then the trainer
on one device, dp=2 and pp=2: a line per rank under the step's line and a ``"trace"`` event
in the JSONL file, with the numbers each mesh must show."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfx.run.step_trace import DEVICE, Interval, StepTime, classify
from shardfx.run.train import RunConfig, run

REPO = Path(__file__).parents[1]

FACTORY = """
import sys
sys.path.insert(0, {tests!r})
from models import lm_loss, tiny, token_batches

def llama():
    (ids,), (labels,) = token_batches(1, batch=8)[0]  # 8 rows: dp=2 x 2 microbatches
    return {{"model": tiny("llama"), "args": (ids,), "loss_fn": lm_loss, "targets": (labels,)}}
"""


def ms(name: str, start: float, end: float, thread: object = 0) -> Interval:
    return Interval(name, start / 1e3, end / 1e3, thread)


def in_ms(t: StepTime) -> tuple[float, ...]:
    return tuple(round(x * 1e3, 6) for x in (t.wall, t.compute, t.communication, t.idle,
                                             t.issued))


# --- the counting -----------------------------------------------------------------------------


def test_nested_events_count_once_and_a_wait_is_what_ended_in_it():
    t = classify([
        ms("aten::mm", 0, 10), ms("aten::addmm", 1, 9),  # nested compute: 10, not 18
        ms("_c10d_functional::all_reduce", 10, 14),  # a collective call and what it calls
        ms("aten::clone", 10.1, 10.4), ms("c10d::allreduce_", 10.5, 13.5),
        ms("gloo:all_reduce", 11, 20, thread=7),  # gloo's worker: under way until 20
        ms("aten::mul", 14, 18),  # overlaps the collective: 4 ms hidden
        # 18-21: a gap in which the all-reduce ends: the thread waited for it (work.wait())
        ms("_c10d_functional::wait_tensor", 21, 22),
        ms("aten::add", 22, 25),
        # 25-30: a gap in which nothing ends: the host between ops
        ms("Optimizer.step#AdamW.step", 30, 40),  # an annotation with a collective inside
        ms("aten::mul_", 31, 33), ms("c10d::allreduce_", 34, 36),
        ms("gloo:all_reduce", 34.2, 35.8, thread=7),
    ])
    compute = 10 + 4 + 3 + 5 + 8  # mm, mul, add, the host's gap, the optimizer less its 2
    exposed = 4 + 3 + 1 + 2  # the call, the wait between ops, wait_tensor, the nested call
    assert in_ms(t) == (40, compute, exposed, 0, 12 + 2)  # issued: 10-22, 34-36
    assert t.compute + t.communication + t.idle == pytest.approx(t.wall)
    assert t.overlapped == pytest.approx(4e-3)


def test_a_pipeline_waiting_for_its_neighbour_is_idle():
    t = classify([
        ms("aten::mm", 0, 5),
        ms("c10d::recv_", 5, 5.5), ms("gloo:recv", 5.2, 9),  # posted; here at 9
        # 5.5-10: waiting for the microbatch (the receive ends in the gap): the bubble
        ms("aten::mm", 10, 15),
        ms("c10d::send", 15, 15.5), ms("gloo:send", 15.2, 40),  # taken long after: not issued
        ms("aten::mm", 15.5, 20),
        # 20-20.5: a gap in which nothing ends (the send's record ends after the step)
        ms("aten::add", 20.5, 21),
    ], main=0)
    assert in_ms(t) == (21, 5 + 5 + 4.5 + 0.5 + 0.5, 1, 4.5, 1)
    assert t.idle > 0 and t.issued == t.communication


def test_a_record_that_ends_just_after_the_wait_still_counts():
    """gloo's worker wakes the waiting thread before it closes its record: up to 1 ms late."""
    ops = [ms("aten::mm", 0, 5), ms("aten::mm", 8, 10)]
    assert in_ms(classify(ops + [ms("gloo:broadcast", 6, 8.4, thread=3)]))[2] == 3
    assert in_ms(classify(ops + [ms("gloo:broadcast", 6, 9.5, thread=3)]))[2] == 0


def test_on_cuda_the_device_timeline_is_split():
    t = classify([
        ms("aten::mm", -1, 0.5),  # the host launches
        ms("sm80_xmma_gemm_f32", 0, 5, thread=DEVICE),
        ms("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3, 8, thread=DEVICE),
    ])
    assert in_ms(t) == (9, 5, 3, 1, 5)


def test_the_line():
    t = StepTime(0.412, 0.301, 0.088, 0.023, 0.140)
    assert str(t) == ("step 412 ms: compute 301 (73%), communication 88 exposed of 140 issued,"
                      " idle 23")
    assert str(StepTime(0.0123, 0.01, 0.002, 0.0003, 0.004)).startswith("step 12.3 ms: compute"
                                                                        " 10.0 (81%)")


# --- shardfx run --trace ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("factory") / "tiny_llama.py"
    path.write_text(FACTORY.format(tests=str(REPO / "tests")))
    return f"{path}:llama"


def _breakdown(out: str, jsonl: Path, ranks: int) -> list[StepTime]:
    """The per-rank lines under the last step's line, checked against the JSONL event."""
    lines = out.splitlines()
    last = max(i for i, line in enumerate(lines) if re.match(r"step +\d+/\d+ ", line))
    below = lines[last + 1:last + 1 + ranks]
    pattern = (r"  rank (\d+)  step ([\d.]+) ms: compute ([\d.]+) \(\d+%\), communication "
               r"([\d.]+) exposed of ([\d.]+) issued, idle ([\d.]+)$")
    assert all(re.match(pattern, line) for line in below), "\n".join(lines[last - 1:])
    events = [json.loads(line) for line in jsonl.read_text().splitlines()]
    (event,) = [e for e in events if e.get("event") == "trace"]
    steps = [e["step"] for e in events if "loss" in e]
    assert event["step"] == steps[-1] and len(event["ranks"]) == ranks
    times = [StepTime(*(r[f"{k}_s"] for k in ("wall", "compute", "communication", "idle",
                                              "issued"))) for r in event["ranks"]]
    for line, t in zip(below, times):
        rank, wall = re.match(pattern, line).group(1, 2)
        assert f"rank {rank}  {t}" in line and float(wall) == pytest.approx(t.wall * 1e3,
                                                                             rel=0.05)
    for t in times:  # every moment counted once
        assert t.wall > 0 and t.compute > 0
        assert t.compute + t.communication + t.idle == pytest.approx(t.wall, rel=0.1)
        assert t.issued >= t.communication - 1e-9
    return times


def test_one_device_is_all_compute(spec, tmp_path, capsys):
    trace, jsonl = tmp_path / "trace.json", tmp_path / "m.jsonl"
    run(RunConfig.of(spec, "", steps=2, trace=str(trace), jsonl=str(jsonl)))
    (t,) = _breakdown(capsys.readouterr().out, jsonl, 1)
    assert t.communication == t.issued == t.idle == 0
    assert t.compute == pytest.approx(t.wall)
    assert json.loads(trace.read_text())["traceEvents"]  # the Chrome trace, as before


def _cli(spec: str, tmp_path: Path, *flags: str) -> tuple[str, Path, Path]:
    """``shardfx run`` in a process of its own: its ranks print to its stdout (spawned here,
    they would print to wherever this process's fork server's stdout was when it started)."""
    trace, jsonl = tmp_path / "trace.json", tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "shardfx", "run", spec, "--steps", "2",
                           "--trace", str(trace), "--jsonl", str(jsonl), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout, jsonl, trace


def test_data_parallel_communicates(spec, tmp_path):
    out, jsonl, trace = _cli(spec, tmp_path, "--mesh", "dp=2")
    times = _breakdown(out, jsonl, 2)
    assert all(t.issued > 0 and t.communication > 0 for t in times), times
    assert sum(t.idle for t in times) < 0.1 * sum(t.wall for t in times)  # no pipeline
    assert json.loads(trace.read_text())["traceEvents"]


def test_a_pipeline_shows_its_bubble(spec, tmp_path):
    out, jsonl, trace = _cli(spec, tmp_path, "--mesh", "pp=2", "--microbatches", "2")
    times = _breakdown(out, jsonl, 2)
    assert all(t.idle > 0 for t in times), times  # each stage waits for the other
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"0F0", "1B1"} <= names  # the runner's own timeline, as before
