"""shardfx.launch and the DeviceMesh built from a MeshSpec, on real local processes (gloo).

Functions run on the ranks are pickled by reference, so they live at the top of this file.
Failure tests also check the clock: a failed or stuck run must come back in seconds, not hang.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import shardfx
from shardfx.errors import InputError, MeshError, ShardfxError
from shardfx.mesh import MeshSpec
from shardfx.runtime.launch import LaunchError, _communication_error, launch, rank, world_size
from shardfx.runtime.outcomes import CONSEQUENCE_S, Outcome, first_failure, results
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


def raise_while_rank_0_reduces() -> None:
    if rank() == 1:
        time.sleep(0.5)  # let rank 0 get into the all_reduce
        raise ValueError("bad shard 7")
    dist.all_reduce(torch.ones(1))  # fails when rank 1's connections close


def abort_on_rank_1() -> None:
    if rank() == 1:
        os.abort()  # SIGABRT, as glibc raises on a corrupted heap
    time.sleep(30)


def stall_on_rank_1() -> None:
    if rank() == 1:
        time.sleep(60)  # never joins the collective
    dist.all_reduce(torch.ones(1))


def sleep_forever() -> None:
    time.sleep(60)


def sleep_then_return(seconds: float) -> int:
    time.sleep(seconds)
    return rank()


def threads() -> int:
    return torch.get_num_threads()


def print_pid_and_sleep() -> None:
    # to the launcher's stdout (the fork server's), in one write: ranks write at once
    os.write(sys.stdout.fileno(), f"started {os.getpid()}\n".encode())
    time.sleep(60)


def mesh_2x2() -> tuple[dict[str, int], tuple[str, ...], str, list[float]]:
    mesh = device_mesh(MeshSpec.parse("dp=2,tp=2"))
    with pytest.raises(MeshError) as wrong:
        device_mesh("dp=2")
    timeouts = [mesh.get_group(axis)._get_backend(torch.device("cpu")).options._timeout
                for axis in ("dp", "tp")]
    return coordinate(mesh), mesh.mesh_dim_names, str(wrong.value), [
        t.total_seconds() for t in timeouts]


def mesh_of(spec: str) -> dict[str, int]:
    return coordinate(device_mesh(spec))


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    """Start the ranks' fork server once (it imports torch and shardfx: seconds on a busy
    machine), so that the tests timing a failed run time the run."""
    launch(whoami, "warm-up", nprocs=1)


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


def test_a_native_crash_writes_the_ranks_python_stack():
    """A rank a signal kills has no Python traceback to send: it writes every thread's Python
    stack to its stderr first (faulthandler), so the crash says where the rank was."""
    code = ("import sys; sys.path.insert(0, 'tests'); import shardfx; "
            "from test_launch import abort_on_rank_1; shardfx.launch(abort_on_rank_1, nprocs=2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode != 0
    assert "rank 1 was killed by signal SIGABRT" in done.stderr, done.stderr[-2000:]
    assert "Fatal Python error: Aborted" in done.stderr
    assert 'in abort_on_rank_1' in done.stderr  # the frame the rank died in


_NO_MAIN_GUARD = """\
import shardfx


def work():
    return 1


print(shardfx.launch(work, nprocs=2, timeout=30, deadline=60))
"""


def test_a_script_that_launches_at_import_time_is_told_to_guard_the_call(tmp_path):
    """Each rank imports the main module as it starts: without a main guard the script would
    launch again in every rank. The error says so, where, and how to fix it, not "exited with
    code 1" with a guess at a native crash."""
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_MAIN_GUARD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    err = done.stderr
    assert f"LaunchError: {script} calls shardfx.launch at import time" in err, err[-3000:]
    assert "finished its bootstrapping phase" in err  # multiprocessing's own words, named
    assert f"where: {script}:8; shardfx.launch('work', nprocs=2)" in err
    assert 'fix:   put the call under if __name__ == "__main__":' in err
    assert "exited with code" not in err and "RuntimeError" not in err


def test_a_rank_that_exits_while_starting_is_told_from_a_crash():
    """A rank that exits before fn runs (the main module or fn cannot be imported there) is
    not blamed on a native crash or the out-of-memory killer."""
    with pytest.raises(LaunchError) as err:
        results([Outcome("exited", exitcode=1, at=1.0), Outcome("exited", exitcode=1, at=2.0)],
                 {}, "shardfx.launch('f', nprocs=2)", math.inf, 60.0, [False, False])
    assert "while its process was starting, before fn ran" in err.value.fix
    assert "out-of-memory" not in err.value.fix


def test_rank_dying_during_a_collective_is_blamed_not_the_survivor():
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(die_while_rank_0_reduces, nprocs=2, timeout=5)
    assert time.monotonic() - start < 5
    # rank 0's "connection closed" is the consequence: gloo failed it, not the launcher
    assert err.value.rank == 1 and err.value.cause.startswith("rank 1 exited with code 1")
    assert "rank 0 raised RuntimeError" in err.value.where


def test_rank_raising_during_a_peers_collective_is_blamed_not_the_peer():
    with pytest.raises(LaunchError) as err:
        launch(raise_while_rank_0_reduces, nprocs=2, timeout=5)
    assert err.value.rank == 1 and err.value.cause == "rank 1 raised ValueError: bad shard 7"
    assert "in raise_while_rank_0_reduces" in err.value.traceback
    assert "rank 0 raised RuntimeError" in err.value.where


def outcome(at: float, kind: str = "raised", communication: bool = False) -> Outcome:
    return Outcome(kind, at=at, communication=communication, exitcode=1)


def test_first_failure_is_first_by_time_with_communication_errors_as_consequences():
    ok = Outcome("ok")
    assert first_failure([outcome(5.0), outcome(4.0), ok]) == 1  # by time, not by rank
    # a peer's "connection closed" stamped before the launcher saw rank 1 exit
    assert first_failure([outcome(4.0, communication=True), outcome(4.3, "exited")]) == 1
    # ... but not a failure that came well after it: the communication error came first
    late = 4.0 + CONSEQUENCE_S + 1
    assert first_failure([outcome(4.0, communication=True), outcome(late)]) == 0
    # only communication errors (a rank hung): the first to time out
    assert first_failure([None, outcome(4.2, communication=True),
                           outcome(4.1, communication=True)]) == 2


def test_communication_errors_are_told_from_others():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:4242.")
    assert _communication_error(gloo) and _communication_error(dist.DistBackendError("nccl"))
    assert not _communication_error(ValueError("bad shard 7"))
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("step failed") from e
    except ValueError as e:
        assert _communication_error(e)  # raised from one


def test_collective_timeout_fails_the_waiting_rank_and_names_the_stuck_one():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 0 raised") as err:
        launch(stall_on_rank_1, nprocs=2, timeout=2, deadline=30)  # a regression fails, not hangs
    assert time.monotonic() - start < 10
    assert "rank 1 was killed while still running" in err.value.where
    assert err.value.running == [1] and "in stall_on_rank_1" in err.value.stacks[1]
    assert "rank(s) 1 still ran" in err.value.fix


def test_deadline_kills_a_run_that_never_ends():
    """(A deadline of 5 s: on a loaded 2-core machine a rank can take over 1 s to import torch
    and join the group, and its stack is then not yet in sleep_forever.)"""
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"timed out: ranks \[0, 1\] still running") as err:
        launch(sleep_forever, nprocs=2, deadline=5)
    assert time.monotonic() - start < 10
    assert "in sleep_forever" in err.value.stacks[0] and "in sleep_forever" in str(err.value)


def test_no_deadline_by_default():
    """A healthy run may take longer than any multiple of the collective timeout."""
    assert launch(sleep_then_return, 2.5, nprocs=2, timeout=1) == [0, 1]


# ---- threads ------------------------------------------------------------------------------------


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("nprocs", [1, 2])
def test_ranks_share_the_cores(nprocs, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch(threads, nprocs=nprocs) == [max(1, cores() // nprocs)] * nprocs


def test_thread_count_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch(threads, nprocs=2) == [3, 3]
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    torch.set_num_threads(before + 2)
    try:
        assert launch(threads, nprocs=2) == [before + 2] * 2
    finally:
        torch.set_num_threads(before)


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
def test_ranks_exit_when_the_launcher_dies():
    """The ranks say they started on the launcher's stdout; once it is killed, they exit (all
    holders of that pipe gone: it reads as end of file)."""
    code = "import shardfx, test_launch as t; shardfx.launch(t.print_pid_and_sleep, nprocs=2)"
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(__file__),
                                stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        for line in launcher.stdout:  # however long a busy machine takes (a failed start: EOF)
            pids += [int(line.split()[1])] if line.startswith("started ") else []
            if len(pids) == 2:
                break
        assert len(pids) == 2, "ranks did not start"
    finally:
        launcher.kill()
        launcher.wait()
    ended = threading.Thread(target=launcher.stdout.read, daemon=True)
    ended.start()
    ended.join(60)  # only a failure waits this long
    assert not any(running(pid) for pid in pids), f"ranks {pids} outlived their launcher"


# ---- under torchrun: run in process -------------------------------------------------------------


def test_under_torchrun_runs_in_process_without_spawning(monkeypatch):
    from shardfx.runtime.launch import _free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launch(whoami, "here", nprocs=1) == [(0, 1, "here")]
    assert not dist.is_initialized()  # the group launch made is gone again
    with pytest.raises(InputError, match="needs 2 processes, but torchrun started 1"):
        launch(whoami, "here", nprocs=2)  # said before any process group is made


_NO_WORKERS_LEFT = """
import glob, torch, torch.distributed as dist, shardfx

def step():
    import shardfx.api  # what planning imports: torch._dynamo, and what keeps a group alive
    t = torch.ones(4)
    dist.all_gather_object([None], t)
    return float(t.sum())

assert shardfx.launch(step, nprocs=1) == [4.0]
print(sorted(open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names from /proc")
def test_under_torchrun_no_gloo_worker_outlives_launch():
    """A gloo worker left at exit can abort the process once its work is done (launch's
    ``_destroy_groups``): after launch returns, no worker thread is left."""
    from shardfx.runtime.launch import _free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    run = subprocess.run([sys.executable, "-c", _NO_WORKERS_LEFT], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    threads = run.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads


# ---- device mesh --------------------------------------------------------------------------------


def test_device_mesh_2x2_coordinates_and_wrong_size_and_timeouts():
    results = launch(mesh_2x2, nprocs=4, timeout=7)
    coords = [c for c, _, _, _ in results]
    assert coords == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1},
                      {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert results[0][1] == ("dp", "tp")
    assert "mesh dp=2 needs 2 processes, this run has 4" in results[0][2]
    # the dp and tp groups wait as long as the default group, not torch's 30 minutes
    assert all(timeouts == [7.0, 7.0] for *_, timeouts in results)


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


def rank_0_returns_first() -> int:
    """Rank 0 is done at once; rank 1 still reads the rendezvous store (which rank 0's process
    hosts) half a second later, as it does while making a process group."""
    if dist.get_rank() == 1:
        time.sleep(0.5)
        store = dist.distributed_c10d._get_default_store()
        store.set("late", "1")
        return int(store.get("late"))
    return 0


def test_rank_0_keeps_the_store_until_every_rank_is_done():
    assert launch(rank_0_returns_first, nprocs=2) == [0, 1]


def draw() -> list[int]:
    return torch.randint(0, 1000, (4,)).tolist()


def test_ranks_start_from_the_same_rng_state_and_shardfx_loaded():
    """Ranks fork from a server that imported shardfx.api (torch and shardfx's parts): each
    starts with them loaded, and from the server's RNG state, so a batch drawn before seeding
    is the same on every rank (the README's checkpoint example relies on it)."""
    first, second = launch(draw, nprocs=2)
    assert first == second


def _preloaded() -> bool:
    return "transformers.models.llama.modeling_llama" in sys.modules


def test_ranks_start_with_the_modules_the_fork_server_preloaded():
    """``SHARDFX_PRELOAD`` (tests/conftest.py names Hugging Face's model files): each rank
    forks with them imported, this module imports none of them."""
    assert "transformers.models.llama.modeling_llama" in os.environ["SHARDFX_PRELOAD"]
    assert shardfx.launch(_preloaded, nprocs=2) == [True, True]


def _collector() -> tuple[int, int, bool]:
    """The objects frozen out of the collector, those it still tracks, and whether a cycle
    this rank makes and drops is still collected."""
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    return gc.get_freeze_count(), len(gc.get_objects()), gone() is None


def test_a_rank_collects_only_what_it_made():
    """Each rank freezes what it inherited (torch, shardfx, the preloaded models: never
    garbage) out of the collector as it starts: the full collection at its end walked every
    one of them, touching and copying each page from the fork server (0.34-0.77 s a rank,
    the longest part of a launch; now a millisecond). A cycle the rank makes is still freed."""
    for frozen, tracked, collected in launch(_collector, nprocs=2):
        assert collected
        assert frozen > 5 * tracked, (frozen, tracked)


def trace_a_plan() -> int:
    """Plan and step a tiny nanoGPT on dp=2: torch.fx's interpreter makes a tqdm bar while
    tracing it."""
    from models import lm_loss, tiny, token_batches

    (ids,), (labels,) = token_batches(1)[0]
    plan = shardfx.partition(tiny("nanogpt"), (ids,), lm_loss, (labels,), mesh={"dp": 2})
    plan.runner(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).step((ids,), (labels,))
    return dist.get_rank()


def test_a_clean_launch_leaves_no_leaked_semaphore_warning(tmp_path):
    """tqdm's process-shared lock, made while ranks trace, made Python's resource tracker warn
    "There appear to be N leaked semaphore objects" after every launch whose function lives in
    the user's script (make demo's too)."""
    script = tmp_path / "train.py"
    script.write_text(f"import sys; sys.path.insert(0, {TESTS!r})\n" + _TRACE_IN_MAIN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("[0, 1]"), done.stderr[-2000:]
    assert "leaked semaphore" not in done.stderr, done.stderr[-2000:]


TESTS = os.path.dirname(os.path.abspath(__file__))
_TRACE_IN_MAIN = """\
import shardfx


def work():
    from test_launch import trace_a_plan
    return trace_a_plan()


if __name__ == "__main__":
    print(shardfx.launch(work, nprocs=2))
"""


def plan_for_two_devices() -> None:
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    shardfx.partition(model, (x,), torch.nn.functional.mse_loss, (y,), mesh={"dp": 2}).runner()


def test_the_same_error_on_every_rank_is_said_once_without_a_traceback():
    """A plan for 2 devices run on 4 processes: every rank meets the same MeshError; the
    launch says it once, with its fix, and no traceback from inside shardfx."""
    with pytest.raises(LaunchError) as err:
        launch(plan_for_two_devices, nprocs=4, timeout=60)
    text = str(err.value)
    assert text.startswith("every rank raised MeshError: mesh dp=2 needs 2 processes, "
                           "this run has 4"), text
    assert "shardfx.launch(..., nprocs=2)" in text and "plan for a mesh of 4 devices" in text
    assert "Traceback" not in text and "rank 3" not in text
