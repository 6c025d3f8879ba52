"""Faults on every mesh shape: one rank raises, exits, or hangs just before a training step.

The run must end within the collective timeout of the fault (plus slack for a busy machine),
under shardfx.launch and under torchrun, and the report must name the rank at fault: its
exception or exit code heads the LaunchError; a rank that hangs is the one named as still
running, with its stack, while its peers' collectives time out.

A compile is not a fault: a rank that compiles its regions (``kernels="compiled"``) for longer
than the collective timeout holds its peers up without failing them, and trains as the ATen
program does; a rank that dies or hangs while compiling still ends the run (``runtime.mesh.
while_compiling``).

Run as a script under torchrun, this file runs one faulty training run:
``python -m torch.distributed.run --nproc-per-node 4 tests/test_faults.py dp=2,tp=2 hang DIR``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import shardfx
from shardfx.mesh import MeshSpec
from shardfx.runtime.launch import LaunchError, launch
from shardfx.runtime.outcomes import GRACE_S

TIMEOUT = 5.0  # seconds a collective may wait
SLACK = 15.0  # start-up of a new process group and a loaded 2-core machine
FAULTS = ("raise", "exit", "hang")
X, Y = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))  # alike on every rank
# partition() options per mesh. debug=False: in debug mode every step starts by comparing the
# ranks' batches over the default group, which would meet the fault before the mesh's groups do.
PLANS = {
    "dp=2": dict(mesh={"dp": 2}, debug=False),
    "dp=2,tp=2": dict(mesh={"dp": 2, "tp": 2}, debug=False,  # a tp all-reduce, then dp ones
                      shard={"0.weight": [Replicate(), Shard(0)], "0.bias": [Replicate(), Shard(0)],
                             "2.weight": [Replicate(), Shard(1)]}),
    "pp=2": dict(mesh={"pp": 2}, microbatches=2, debug=False),
}

# ---- run on the ranks ---------------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def faulty_run(mesh: str, fault: str, folder: str) -> None:
    """Plan, one healthy step, then the last rank faults just before the second step's first
    collective and writes down when."""
    plan = shardfx.partition(mlp(), (X,), F.mse_loss, (Y,), **PLANS[mesh])
    # Planning takes each rank its own time on a busy machine, longer than TIMEOUT at worst.
    dist.monitored_barrier(timeout=timedelta(seconds=120))
    runner = plan.runner(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    runner.step((X,), (Y,))
    if dist.get_rank() == dist.get_world_size() - 1:
        Path(folder, "fault").write_text(repr(time.time()))
        inject(fault)
    runner.step((X,), (Y,))


def inject(fault: str) -> None:
    if fault == "raise":
        raise ValueError("bad batch")
    if fault == "exit":
        os._exit(3)  # a crash, as a killed or out-of-memory process would
    time.sleep(600)  # stopped outside any collective, its peers inside one


def seconds_since_fault(folder: Path, output: str = "") -> float:
    assert (folder / "fault").exists(), f"the run failed before the fault:\n{output[-3000:]}"
    return time.time() - float((folder / "fault").read_text())


# ---- under shardfx.launch -----------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mesh", list(PLANS), ids=lambda m: m.replace("=", "").replace(",", "x"))
def test_fault_ends_the_run_within_the_timeout_and_names_the_rank(mesh, fault, tmp_path):
    nprocs = MeshSpec.parse(mesh).size
    bad = nprocs - 1
    with pytest.raises(LaunchError) as info:  # deadline: a missing timeout fails, not hangs
        launch(faulty_run, mesh, fault, str(tmp_path), nprocs=nprocs, timeout=TIMEOUT,
               deadline=120)
    took, err = seconds_since_fault(tmp_path), info.value
    print(f"{mesh} {fault}: launch ended {took:.1f} s after the fault")
    if fault == "hang":  # the peers' collectives time out; the stuck rank is named
        assert took < TIMEOUT + GRACE_S + SLACK, str(err)
        assert err.rank != bad and "Timed out" in err.cause, str(err)
        assert bad in err.running and "in inject" in err.stacks[bad], str(err)
        assert f"rank {bad} was killed while still running" in err.where
    else:
        assert took < SLACK, str(err)
        assert err.rank == bad, str(err)
        if fault == "raise":
            assert err.cause == f"rank {bad} raised ValueError: bad batch"
            assert "in inject" in err.traceback
        else:
            assert err.exitcode == 3 and err.cause.startswith(f"rank {bad} exited with code 3")


# ---- while a rank compiles ----------------------------------------------------------------------


def slow_compile(seconds: float, then: str = "") -> None:
    """In this rank: its first region compile waits ``seconds`` first (then, with ``then``,
    it faults: "exit" or "hang")."""
    from shardfx.runtime import lowered

    compile_ = lowered._Code._compile

    def slow(self, args):
        lowered._Code._compile = compile_  # the first compile only
        time.sleep(seconds)
        if then:
            inject(then)
        return compile_(self, args)

    lowered._Code._compile = slow


def compiled_and_aten(delay: float) -> tuple:
    """dp=2: three steps of the compiled plan, the last rank's first compile ``delay`` s
    slow, and of the ATen plan; both plans' losses and weights, and every group's timeout
    after the compiled steps."""
    from shardfx.runtime.mesh import collective_timeout
    from torch.distributed.distributed_c10d import _world

    plans = [shardfx.partition(mlp(), (X,), F.mse_loss, (Y,), kernels=k, **PLANS["dp=2"])
             for k in ("compiled", "aten")]
    dist.monitored_barrier(timeout=timedelta(seconds=120))  # planning's pace is its own
    if dist.get_rank() == dist.get_world_size() - 1:
        slow_compile(delay)
    out = []
    for plan in plans:
        runner = plan.runner(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        losses = torch.stack([runner.step((X,), (Y,)) for _ in range(3)])
        out.append((losses, runner.state_dict()))
        if len(out) == 1:
            timeouts = {collective_timeout(g).total_seconds() for g in list(_world.pg_map)}
    return out, timeouts


def test_a_compile_slower_than_the_timeout_on_one_rank_fails_no_collective():
    """The last rank's first region compile takes twice the collective timeout while its
    peer waits in the step's gradient all-reduce: the run completes, equal to the ATen
    program's, and every group waits its own timeout again after the compiling step."""
    for (compiled, aten), timeouts in launch(compiled_and_aten, 2 * TIMEOUT, nprocs=2,
                                             timeout=TIMEOUT, deadline=300):
        assert timeouts == {TIMEOUT}
        torch.testing.assert_close(compiled[0], aten[0], rtol=1e-5, atol=0)
        for name, value in aten[1].items():
            torch.testing.assert_close(compiled[1][name], value, rtol=1e-5, atol=1e-7)


def faulty_compile(fault: str, folder: str) -> None:
    """dp=2, compiled: the last rank faults in its first region compile, a second after
    starting it (its peer is compiling or already waits for it)."""
    plan = shardfx.partition(mlp(), (X,), F.mse_loss, (Y,), kernels="compiled",
                             **PLANS["dp=2"])
    dist.monitored_barrier(timeout=timedelta(seconds=120))
    runner = plan.runner(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    if dist.get_rank() == dist.get_world_size() - 1:
        Path(folder, "fault").write_text(repr(time.time() + 1))
        slow_compile(1.0, then=fault)
    runner.step((X,), (Y,))


@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_a_rank_that_dies_or_hangs_while_compiling_still_ends_the_run(fault, tmp_path):
    """Held for a compile, a collective still fails: at once when the compiling rank dies,
    after ``compile_timeout`` (not never) when it hangs, naming it with its stack."""
    compile_timeout = 2 * TIMEOUT
    with pytest.raises(LaunchError) as info:
        launch(faulty_compile, fault, str(tmp_path), nprocs=2, timeout=TIMEOUT,
               compile_timeout=compile_timeout, deadline=300)
    took, err = seconds_since_fault(tmp_path), info.value
    print(f"{fault} while compiling: launch ended {took:.1f} s after the fault")
    if fault == "exit":
        assert took < SLACK and err.rank == 1 and err.exitcode == 3, str(err)
    else:  # its peer's collective waited compile_timeout (its own compile time after the fault)
        assert f"Timed out waiting {compile_timeout * 1000:.0f}ms" in err.cause, str(err)
        assert err.rank == 0 and took < compile_timeout + GRACE_S + 2 * SLACK, str(err)
        assert 1 in err.running and "in slow" in err.stacks[1], str(err)


# ---- under torchrun -----------------------------------------------------------------------------


def test_hang_under_torchrun_times_out_the_tp_group(tmp_path):
    """torchrun starts the ranks, shardfx.launch only runs fn: the timeout it gives the default
    group must reach the mesh's dp and tp groups too, or the hung rank's tp peer waits 30 min."""
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", __file__,
         "dp=2,tp=2", "hang", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = run.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        run.terminate()  # torchrun stops its ranks (each in a session of its own) on SIGTERM
        output, _ = run.communicate(timeout=60)
    took = seconds_since_fault(tmp_path, output)
    print(f"torchrun dp=2,tp=2 hang: ended {took:.1f} s after the fault")
    # torchrun then sees a rank exit and stops the rest: seconds more on a busy machine
    assert run.returncode != 0 and took < TIMEOUT + 2 * SLACK, output[-3000:]
    assert f"Timed out waiting {TIMEOUT * 1000:.0f}ms" in output, output[-3000:]


if __name__ == "__main__":  # one rank of a torchrun job
    mesh, fault, folder = sys.argv[1:]
    launch(faulty_run, mesh, fault, folder, nprocs=MeshSpec.parse(mesh).size, timeout=TIMEOUT)
