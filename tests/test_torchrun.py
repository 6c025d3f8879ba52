"""Under torchrun: a world size that does not match the mesh is one message, and a rank that
stops before a collective is named, as ``shardfx.launch`` names one in the runs it spawns.

The end-to-end tests run real torchrun jobs of two processes (each well under 30 s: start-up,
then a 5 s collective timeout); the verdict's wording is tested on records alone (``judge``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardfx.errors import InputError
from shardfx.runtime import launch as launch_module
from shardfx.runtime.launch import check_world, record_for_torchrun
from shardfx.runtime.watchdog import Arrival, Ending, judge

ROOT = Path(__file__).parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]

# A worker: every rank runs `work` through shardfx.launch, as shardfx.run.train does under torchrun.
# Rank 1 sleeps in step 3, before arriving there ("before") or after ("after").
WORKER = textwrap.dedent('''
    import sys, time
    import torch, torch.distributed as dist
    import shardfx
    from shardfx.runtime.watchdog import arrive

    def work(sleep):
        t = torch.ones(1)
        for step in range(1, 4):
            if step == 3 and sleep == "before" and dist.get_rank() == 1:
                time.sleep(600)
            arrive(f"step {step}")
            if step == 3 and sleep == "after" and dist.get_rank() == 1:
                time.sleep(600)
            dist.all_reduce(t)
        return t.item()

    if __name__ == "__main__":
        sleep, nprocs = sys.argv[1], int(sys.argv[2])
        print(shardfx.launch(work, sleep, nprocs=nprocs, timeout=5))
''')


def torchrun(tmp_path: Path, *args: str) -> tuple[int, str, float]:
    """Run the worker under torchrun with ``args``: exit code, output, seconds taken."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    start = time.monotonic()
    run = subprocess.run([*TORCHRUN, str(worker), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120, cwd=ROOT)
    return run.returncode, run.stdout, time.monotonic() - start


# ---- the world size does not match the mesh -----------------------------------------------------


def test_world_size_mismatch_is_one_message(tmp_path):
    code, out, took = torchrun(tmp_path, "none", "4")
    said = "InputError: the mesh needs 4 processes, but torchrun started 2"
    # rank 0's traceback and torchrun's summary of it; rank 1, stopped by torchrun, says nothing
    assert code != 0 and out.count(said) == 2, out
    assert "fix:   start torchrun with --nproc-per-node 4, or pass nprocs=2" in out, out
    root_cause = out[out.index("Root Cause"):]
    assert f"traceback : {said}" in root_cause and "rank      : 0" in root_cause, out
    assert "gloo" not in out and len(out.splitlines()) < 70, out  # torchrun prints ~45
    print(f"world size mismatch: {len(out.splitlines())} lines in {took:.1f} s")


def test_the_command_line_says_it_in_its_own_terms():
    run = subprocess.run(
        [*TORCHRUN, "-m", "shardfx", "run", "examples/nanogpt.py:workload", "--mesh", "dp=4",
         "--steps", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=120, cwd=ROOT)
    lines = run.stdout.splitlines()
    print(f"torchrun --nproc-per-node 2 -m shardfx run ... --mesh dp=4: {len(lines)} lines")
    assert run.returncode != 0, run.stdout
    said = "the mesh needs 4 processes, but torchrun started 2"
    assert run.stdout.count(f"shardfx run: error: {said}") == 1, run.stdout  # rank 0 alone
    assert "--nproc-per-node 4" in run.stdout and "Traceback" in run.stdout  # torchrun's own
    assert len(lines) < 60, run.stdout


def test_check_world(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(var, raising=False)
    check_world(4, "--mesh dp=4")  # not under torchrun: nothing to check
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_world(2, "--mesh dp=2")
    with pytest.raises(InputError) as err:
        check_world(4, "--mesh dp=4")
    assert err.value.cause == "the mesh needs 4 processes, but torchrun started 2"
    assert err.value.where == "--mesh dp=4"
    assert err.value.fix == ("start torchrun with --nproc-per-node 4, or give a --mesh of 2 "
                             "devices, e.g. --mesh dp=2")
    monkeypatch.setenv("WORLD_SIZE", "16")  # two nodes of 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(launch_module, "HEAD_START_S", 0.0)
    with pytest.raises(InputError, match="--nnodes x --nproc-per-node = 4 processes "
                       r"\(now 2 x 8\), or pass nprocs=16"):
        check_world(4, "shardfx.launch", instead="pass nprocs=16")


def test_torchrun_summary_shows_the_recorded_message(monkeypatch, tmp_path):
    """record_for_torchrun writes the error file as torchrun reads it: its summary shows our
    message where it would say "To enable traceback see: ..."."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_for_torchrun(InputError("the mesh needs 4 processes", where="--mesh dp=4",
                                   fix="start torchrun with --nproc-per-node 4"))
    assert "timestamp" in json.loads(path.read_text())["message"]["extraInfo"]
    summary = str(ChildFailedError("job", {0: ProcessFailure(0, 1, 1, str(path))}))
    assert ("traceback : InputError: the mesh needs 4 processes\n"
            "    where: --mesh dp=4\n"
            "    fix:   start torchrun with --nproc-per-node 4") in summary, summary


# ---- a rank stops before a collective -----------------------------------------------------------


@pytest.mark.parametrize("sleep", ["before", "after"])
def test_a_rank_that_stops_is_named(tmp_path, sleep):
    code, out, took = torchrun(tmp_path, sleep, "2")
    print(f"rank 1 asleep {sleep} arriving at step 3: named in {took:.1f} s")
    assert code != 0 and took < 60, out
    if sleep == "before":
        said = ("rank 1 never reached step 3, where rank 0 waited in a collective: it last "
                "arrived at step 2, ")
    else:
        said = ("rank 1 never reached the collective that rank 0 waited in after step 3: it "
                "arrived at step 3 ")
    assert said in out and "and is still running (its stack is below)" in out, out
    assert "Timed out waiting 5000ms" in out, out  # rank 0's collective, under the verdict
    root_cause = out[out.index("Root Cause"):]
    assert f"traceback : LaunchError: {said}" in root_cause, out
    # rank 1's stack, taken while it slept in `work`
    assert "stack of rank 1, still running" in root_cause and '.py", line' in root_cause, out
    assert "in work" in root_cause.split("stack of rank 1")[1], out


# ---- the verdict, from records ------------------------------------------------------------------

NOW = 100.0


def test_judge_names_a_rank_behind_the_others():
    ended = {0: Ending("collective", 3, "step 3", "RuntimeError: timed out"),
             2: Ending("collective", 3, "step 3", "RuntimeError: timed out"),
             3: Ending("collective", 2, "step 2", "RuntimeError: timed out")}
    arrived = {r: Arrival(3, 90.0, "step 3") for r in (0, 2)} | {1: Arrival(2, 80.0, "step 2")}
    verdict = judge(4, ended, arrived, {1: None}, NOW, timeout=5)
    assert verdict.cause == (
        "rank 1 never reached step 3, where ranks 0, 2 waited in a collective: it last "
        "arrived at step 2, 20.0 s ago, and its process has ended; rank 3 waited in a "
        "collective after step 2")
    assert verdict.fix.startswith("see rank 1's output: os._exit")


def test_judge_names_a_rank_that_raised():
    ended = {0: Ending("collective", 3, "step 3", "RuntimeError: connection closed"),
             1: Ending("raised", 3, "step 3", "ValueError: bad batch")}
    verdict = judge(2, ended, {}, {}, NOW, timeout=5)
    assert verdict.cause == "rank 1 raised ValueError: bad batch (it last arrived at step 3)"
    assert verdict.fix == "see rank 1's traceback in its output"


def test_judge_when_every_rank_failed_in_a_collective():
    ended = {0: Ending("collective", 3, "step 3", "x"), 1: Ending("collective", 4, "step 4", "x")}
    verdict = judge(2, ended, {}, {}, NOW, timeout=5)
    assert verdict.cause.startswith(
        "every rank's collective failed, none waited for a missing rank (rank 0 waited in a "
        "collective after step 3, rank 1 after step 4)")


def test_judge_names_a_rank_on_another_host_and_one_that_never_arrived():
    ended = {0: Ending("collective", 1, "the start of train", "x")}
    arrived = {0: Arrival(1, 99.0, "the start of train"), 1: Arrival(1, 98.5,
                                                                       "the start of train")}
    verdict = judge(3, ended, arrived, {}, NOW, timeout=5)
    assert verdict.cause == (
        "rank 1 never reached the collective that rank 0 waited in after the start of train: "
        "it arrived at the start of train 1.5 s ago; rank 2 never arrived anywhere: it did "
        "not start fn")
    assert "py-spy dump" in verdict.fix and verdict.fix.endswith("after the timeout (5 s)")
