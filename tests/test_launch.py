"""shardfx.launch and the DeviceMesh built from a MeshSpec, on real local processes (gloo).

Functions run on the ranks are pickled by reference, so they live at the top of this file.
Failure tests also check the clock: a failed or stuck run must come back in seconds, not hang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import shardfx
from shardfx.errors import MeshError, ShardfxError
from shardfx.mesh import MeshSpec
from shardfx.runtime.launch import LaunchError, launch, rank, world_size
from shardfx.runtime.mesh import coordinate, device_mesh

# ---- run on the ranks ---------------------------------------------------------------------------


def whoami(tag: str) -> tuple[int, int, str]:
    return rank(), world_size(), tag


def sum_of_ranks() -> torch.Tensor:
    t = torch.tensor([rank() + 1.0])
    dist.all_reduce(t)  # 1 + 2 + ... + world
    return t


def rank_1_fails(how: str, pid_file: str) -> None:
    """Rank 0 writes its pid and sleeps outside any collective: only the launcher can stop it.
    Rank 1 fails once rank 0 is asleep (not while rank 0 may still be connecting to it)."""
    if rank() == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    if how == "raise":
        raise ValueError("bad shard 7")
    os._exit(3)


def die_while_rank_0_reduces() -> None:
    if rank() == 1:
        time.sleep(0.5)  # let rank 0 get into the all_reduce
        os._exit(1)
    dist.all_reduce(torch.ones(1))  # would wait for rank 1 forever


def stall_on_rank_1() -> None:
    if rank() == 1:
        time.sleep(60)  # never joins the collective
    dist.all_reduce(torch.ones(1))


def sleep_forever() -> None:
    time.sleep(60)


def write_pid_and_sleep(folder: str) -> None:
    with open(os.path.join(folder, f"pid{rank()}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def mesh_2x2() -> tuple[dict[str, int], tuple[str, ...], str]:
    mesh = device_mesh(MeshSpec.parse("dp=2,tp=2"))
    with pytest.raises(MeshError) as wrong:
        device_mesh("dp=2")
    return coordinate(mesh), mesh.mesh_dim_names, str(wrong.value)


def mesh_of(spec: str) -> dict[str, int]:
    return coordinate(device_mesh(spec))


# ---- results ------------------------------------------------------------------------------------


def test_results_come_back_in_rank_order():
    assert launch(whoami, "x", nprocs=2) == [(0, 2, "x"), (1, 2, "x")]


def test_all_reduce_sums_over_four_ranks():
    results = launch(sum_of_ranks, nprocs=4)
    assert [t.item() for t in results] == [10.0] * 4


def test_launch_is_exported():
    assert shardfx.launch is launch and issubclass(shardfx.LaunchError, ShardfxError)


# ---- failures -----------------------------------------------------------------------------------


def assert_killed(pid_file) -> None:
    with pytest.raises(ProcessLookupError):  # no orphan left sleeping
        os.kill(int(pid_file.read_text()), 0)


def test_rank_that_raises_names_rank_and_traceback_and_stops_the_others(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(rank_1_fails, "raise", str(tmp_path / "pid"), nprocs=2)
    assert time.monotonic() - start < 8
    msg = str(err.value)
    assert "rank 1 raised ValueError: bad shard 7" in msg
    assert "in rank_1_fails" in msg  # rank 1's traceback
    assert "rank 0 was killed" in msg
    assert err.value.rank == 1 and "ValueError" in err.value.traceback
    assert_killed(tmp_path / "pid")


def test_rank_that_exits_without_raising_is_reported_with_its_exit_code(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 exited with code 3") as err:
        launch(rank_1_fails, "exit", str(tmp_path / "pid"), nprocs=2)
    assert time.monotonic() - start < 8
    assert err.value.rank == 1 and err.value.exitcode == 3
    assert_killed(tmp_path / "pid")


def test_rank_dying_during_a_collective_fails_the_survivor():
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(die_while_rank_0_reduces, nprocs=2, timeout=5)
    assert time.monotonic() - start < 5
    # Both are reported (which one first is a race): gloo failed rank 0, not the launcher.
    assert "rank 1 exited with code 1" in str(err.value)
    assert "rank 0 raised" in str(err.value)


def test_collective_timeout_fails_the_waiting_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 0 raised") as err:
        launch(stall_on_rank_1, nprocs=2, timeout=2, deadline=30)
    assert time.monotonic() - start < 10
    assert "rank 1 was killed" in str(err.value)


def test_deadline_kills_a_run_that_never_ends():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"timed out: ranks \[0, 1\] still running"):
        launch(sleep_forever, nprocs=2, deadline=1)
    assert time.monotonic() - start < 6


def test_fn_that_cannot_be_pickled_is_refused():
    with pytest.raises(LaunchError, match="module level"):
        launch(lambda: 1, nprocs=2)


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_exit_when_the_launcher_dies(tmp_path):
    code = "import sys, shardfx, test_launch as t; " \
           "shardfx.launch(t.write_pid_and_sleep, sys.argv[1], nprocs=2)"
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                                cwd=os.path.dirname(__file__))
    try:
        pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
        end = time.monotonic() + 30
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert time.monotonic() < end and launcher.poll() is None, "ranks did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pid_files]
    finally:
        launcher.kill()
        launcher.wait()
    end = time.monotonic() + 5
    while any(running(pid) for pid in pids):
        assert time.monotonic() < end, f"ranks {pids} outlived their launcher"
        time.sleep(0.05)


# ---- under torchrun: run in process -------------------------------------------------------------


def test_under_torchrun_runs_in_process_without_spawning(monkeypatch):
    from shardfx.runtime.launch import _free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launch(whoami, "here", nprocs=1) == [(0, 1, "here")]
    assert not dist.is_initialized()  # the group launch made is gone again
    with pytest.raises(LaunchError, match="nprocs=2.*one of 1 ranks"):
        launch(whoami, "here", nprocs=2)


# ---- device mesh --------------------------------------------------------------------------------


def test_device_mesh_2x2_coordinates_and_wrong_size():
    results = launch(mesh_2x2, nprocs=4)
    coords = [c for c, _, _ in results]
    assert coords == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1},
                      {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert results[0][1] == ("dp", "tp")
    assert "mesh dp=2 needs 2 processes, this run has 4" in results[0][2]


def test_device_mesh_too_big_for_the_run():
    with pytest.raises(LaunchError) as err:
        launch(mesh_of, "dp=2,tp=2", nprocs=2)
    msg = str(err.value)
    assert "MeshError: mesh dp=2,tp=2 needs 4 processes, this run has 2" in msg
    assert "torchrun --nproc-per-node 4 or shardfx.launch(..., nprocs=4)" in msg


def test_device_mesh_of_one_device_has_a_dp_axis():
    assert launch(mesh_of, {}, nprocs=1) == [{"dp": 0}]


def test_device_mesh_needs_torch_distributed():
    with pytest.raises(MeshError, match="not initialized") as err:
        device_mesh("tp=2")
    assert "shardfx.launch(..., nprocs=2)" in str(err.value)
