"""Run a function on N local processes, one rank each, joined by ``torch.distributed``.

    results = shardfx.launch(train, config, nprocs=4)   # [rank 0's result, ..., rank 3's]

The one-machine stand-in for ``torchrun``. Each rank is a clean process (see ``_context``), joins
the default process group (env:// rendezvous on a free localhost port; gloo on CPU, NCCL when
each rank can have its own GPU), runs ``fn(*args)`` (``fn`` defined at module level: it is
pickled) and sends its pickled result back on its own pipe. The parent waits on every rank's
pipe and exit sentinel at once, so nothing can hang:

- ``timeout`` bounds every collective, of the default group and of every group shardfx creates
  (the mesh's dp, tp and pp groups inherit it, see ``runtime.mesh``): a rank that crashes or
  stops outside a collective fails its peers' collectives within ``timeout``; in a runner's
  call that compiles (``kernels="compiled"``), ``compile_timeout`` does instead, so a peer's
  compile never counts against ``timeout`` (``runtime.mesh.while_compiling``);
- the first rank to fail, by the time it failed, is reported in a ``LaunchError`` with its
  traceback or exit code (a rank that a native crash kills, SIGSEGV or SIGABRT, first writes
  every thread's Python stack to its stderr; a communication error gives way to a failure of
  another kind just after it: it is that failure seen from a peer, see ``first_failure``);
  the others get ``GRACE_S`` seconds to finish; those still running then are named, with their
  Python stacks, and killed;
- ``deadline`` (default: none) bounds the whole run: past it every rank is killed and
  ``LaunchError("timed out ...")`` is raised;
- a rank whose parent dies exits too, so no process is left behind;
- a script that calls ``launch`` at import time, with no ``if __name__ == "__main__":`` guard,
  would launch again in every rank (each imports the main module anew as it starts): the rank
  exits at once with ``IMPORT_TIME_EXIT`` and the launcher raises a ``LaunchError`` that says
  so (``_launched_at_import``), not multiprocessing's bootstrapping error from every rank.

Each rank runs ``max(1, cores // nprocs)`` intra-op threads, so the ranks do not oversubscribe
the machine, unless the user chose a count (``_set_threads``).

Under torchrun (``RANK`` and ``WORLD_SIZE`` set, or the process group already initialized),
``launch`` spawns nothing: it runs ``fn(*args)`` once in this process, initializing the process
group from the environment with ``timeout`` if needed (and destroying it after), and returns
every rank's result gathered with ``all_gather_object``. Before any process group is made,
``check_world`` compares torchrun's world size with ``nprocs``. An exception in ``fn``
propagates; torchrun stops the other ranks. A communication error, though, becomes a
``LaunchError`` naming the rank(s) the collective waited for, with where each last arrived
and, on this host, its stack (``runtime.watchdog``), as a spawned run's report does. A
ShardfxError's message is what torchrun's summary shows for the rank (``record_for_torchrun``).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import math
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import parent_process
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardfx.errors import InputError, ShardfxError
from shardfx.runtime import watchdog
from shardfx.runtime.mesh import COMPILE_TIMEOUT_S, set_compile_timeout
from shardfx.runtime.outcomes import KILL_WAIT_S, LaunchError, Outcome, collect, results
from shardfx.runtime.watchdog import STACK_SIGNAL, read_stacks

HEAD_START_S = 10.0  # under torchrun, how long the first rank has to report an error alone
# (its start-up can lag the others by seconds on a loaded machine: 3 s let both ranks print)
IMPORT_TIME_EXIT = 86  # a rank's exit code when starting it re-ran a script's launch call
RANK_NAME = "shardfx-rank"  # a rank's process name: RANK_NAME + its rank


def rank() -> int:
    """This process's rank in the default process group; 0 when torch.distributed is not up."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The default process group's size; 1 when torch.distributed is not up."""
    return dist.get_world_size() if _initialized() else 1


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def under_torchrun() -> bool:
    """Whether this process is already one rank of a job: torchrun's ``RANK`` and
    ``WORLD_SIZE`` are set, or the default process group is up."""
    return _initialized() or {"RANK", "WORLD_SIZE"} <= os.environ.keys()


def launch(fn: Callable[..., Any], *args: Any, nprocs: int, backend: str | None = None,
           timeout: float = 60.0, deadline: float | None = None,
           compile_timeout: float = COMPILE_TIMEOUT_S) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` ranks; return their results in rank order.

    ``backend``: None picks NCCL when CUDA has a GPU per rank, else gloo. ``timeout``: seconds any
    collective may wait, in every group. ``deadline``: seconds the whole run may take, start-up
    included (None: no limit; a hang inside a collective already ends after ``timeout``).
    ``compile_timeout``: seconds a collective may wait in a runner's call that compiles (a
    compiled plan's first step: a peer may still be compiling), when longer than ``timeout``.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive int, got {nprocs!r}",
                          where="shardfx.launch(..., nprocs=...)", fix="e.g. nprocs=4")
    where = f"shardfx.launch({getattr(fn, '__qualname__', fn)!r}, nprocs={nprocs})"
    _check_not_starting(where)
    if under_torchrun():
        return _run_in_process(fn, args, nprocs, backend, timeout, compile_timeout)
    backend = backend or _default_backend(nprocs)
    deadline = math.inf if deadline is None else deadline
    ctx = _context()
    port = _free_port()
    procs, pipes, outcomes, stacks = [], [], [], {}
    with tempfile.TemporaryDirectory(prefix="shardfx-launch-") as folder:
        try:
            for r in range(nprocs):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, name=f"{RANK_NAME}{r}", args=(
                    r, nprocs, port, backend, (timeout, compile_timeout),
                    torch.get_num_threads(), fn, args,
                    writer, _stack_file(folder, r), dict(os.environ)))
                try:
                    proc.start()
                except (pickle.PicklingError, AttributeError, TypeError) as e:
                    raise LaunchError(f"cannot send fn and its args to the ranks: {e}",
                                      where=where,
                                      fix="define fn at module level; pass picklable args") from e
                finally:
                    writer.close()  # the rank holds the only write end: its exit reads as EOF
                procs.append(proc)
                pipes.append(reader)
            outcomes = collect(procs, pipes, time.monotonic() + deadline)
            stacks = _stacks(procs, outcomes, folder)
            started = [os.path.exists(_stack_file(folder, r)) for r in range(nprocs)]
        finally:
            _stop(procs, [r for r, o in enumerate(outcomes) if o is not None])
    _launched_at_import(outcomes, started, where)
    return results(outcomes, stacks, where, deadline, timeout, started)


def _check_not_starting(where: str) -> None:
    """``launch`` called in a process multiprocessing is still starting: the process is
    importing the launching script as its main module, and the script launches at import time.
    A rank of ours exits at once with IMPORT_TIME_EXIT, which its launcher explains
    (``_launched_at_import``); any other process raises the error itself."""
    current = mp.current_process()
    if not getattr(current, "_inheriting", False):  # set by multiprocessing while it starts
        return
    if current.name.startswith(RANK_NAME):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(IMPORT_TIME_EXIT)
    raise _import_time_error(where)


def _launched_at_import(outcomes: list[Outcome | None], started: list[bool],
                        where: str) -> None:
    """A rank that exited with IMPORT_TIME_EXIT before reaching ``_worker``: the script
    launches at import time (``_check_not_starting``)."""
    if any(o is not None and o.kind == "exited" and o.exitcode == IMPORT_TIME_EXIT
           and not started[r] for r, o in enumerate(outcomes)):
        raise _import_time_error(where)


def _import_time_error(where: str) -> LaunchError:
    """The script launches at import time: named with the line of the main module that led to
    the call, when this process has it on its stack."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "the main module"
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    line = f"{script}:{frame.f_lineno}" if frame is not None else script
    return LaunchError(
        f"{script} calls shardfx.launch at import time: every rank's process imports the main "
        "module again as it starts, so each rank would launch again (multiprocessing's "
        "\"An attempt has been made to start a new process before the current process has "
        "finished its bootstrapping phase\"); the ranks stopped", where=f"{line}; {where}",
        fix='put the call under if __name__ == "__main__": (with whatever only the launching '
            "process should run), so the ranks import the script without launching")


def _stacks(procs: list, outcomes: list[Outcome | None], folder: str) -> dict[int, str]:
    """The Python stacks of the ranks still running (no outcome yet), which each writes to its
    stack file when sent STACK_SIGNAL; the launcher's own watch thread is left out."""
    running = [r for r, o in enumerate(outcomes) if o is None and procs[r].is_alive()]
    for r in running:
        os.kill(procs[r].pid, STACK_SIGNAL)
    return read_stacks({r: Path(_stack_file(folder, r)) for r in running}, below="_worker")


def _stop(procs: list, answered: list[int]) -> None:
    """Give ranks that answered a moment to exit on their own; SIGTERM, then SIGKILL, the rest."""
    end = time.monotonic() + KILL_WAIT_S
    for r in answered:
        procs[r].join(max(0.0, end - time.monotonic()))
    for signal_them in ("terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        for proc in alive:
            getattr(proc, signal_them)()
        for proc in alive:
            proc.join(KILL_WAIT_S)


def _worker(r: int, nprocs: int, port: int, backend: str, timeouts: tuple[float, float],
            launcher_threads: int, fn: Callable[..., Any], args: tuple, pipe: Connection,
            stack_file: str, env: dict[str, str]) -> None:
    """One rank: join the process group, run fn, send ("ok", value) or ("raised", ...) back.

    First, what the rank inherited from the fork server (torch, shardfx, the preloaded
    modules: never garbage) leaves the cyclic collector for good (``gc.freeze``): a full
    collection then walks only what the rank made. Walking every inherited object touches,
    and so copies from the server, each page they are on: the collection at a rank's end
    (``_destroy_groups``) took 0.34-0.77 s, most of a 2- or 4-rank launch's time; now 1 ms.
    Cycles the rank makes are still collected."""
    gc.freeze()
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    stacks = open(stack_file, "w")  # noqa: SIM115 - open for the life of the rank
    stacks.write(f"main thread 0x{threading.get_ident():016x}\n")  # as faulthandler writes ids
    stacks.flush()
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack
    os.environ.clear()
    os.environ.update(env)  # the launcher's environment now, not the fork server's at its start
    timeout, compile_timeout = timeouts  # of a collective, of one in a call that compiles
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nprocs))
    try:
        _set_threads(nprocs, launcher_threads)
        _no_process_locks()
        gpu = _gpu(backend, r)
        dist.init_process_group(backend, init_method="env://", rank=r, world_size=nprocs,
                                timeout=timedelta(seconds=timeout), device_id=gpu)
        set_compile_timeout(compile_timeout)
        value = fn(*args)
        try:
            message = pickle.dumps(("ok", value))
        except Exception as e:  # noqa: BLE001
            raise LaunchError(f"rank {r}'s result cannot be pickled: {e}",
                              fix="return plain data, tensors or picklable objects") from e
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
        at = time.time()  # first: peers may fail from this rank's failure any moment now
        tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next)  # from fn down
        message = pickle.dumps(("raised", f"{type(e).__name__}: {e}", "".join(tb), at,
                                _communication_error(e)))
    pipe.send_bytes(message)
    pipe.close()
    if dist.is_initialized():
        _leave_together(nprocs, timeout)
        _destroy_groups()


def _no_process_locks() -> None:
    """In a rank: tqdm's write lock without its multiprocessing half. torch.fx's interpreter
    makes a (disabled) tqdm bar while tracing, whose first use creates a process-shared
    semaphore for bars printed from several processes; a rank prints none, and the semaphore,
    never unlinked, made Python's resource tracker warn of "leaked semaphore objects" at the
    end of every launch."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None  # create_mp_lock() keeps it: the thread lock only


def _import_before_groups() -> None:
    """Import what planning imports before the default group exists. Some of torch's modules
    (``torch.distributed.nn.functional``, which ``torch._dynamo`` brings) keep the default
    group as a default argument when imported after it is made: it then outlives
    ``destroy_process_group``, and so do gloo's worker threads (``_destroy_groups``)."""
    import torch._dynamo  # noqa: F401 - planning's tracer: brings torch.distributed.nn.functional
    import torch.distributed.tensor  # noqa: F401 - the sharding rules planning asks


def _destroy_groups() -> None:
    """Destroy every process group and free them now, while the interpreter runs.

    A gloo worker thread drops its reference to a finished collective a moment after the
    caller's ``wait`` returns; if that is the last reference to a tensor Python made, it takes
    the GIL to free it. Should the interpreter be finalizing by then, taking the GIL ends the
    thread inside a C++ frame that may not unwind, and the process aborts ("terminate called
    without an active exception") after its work is done. A group freed here joins its
    workers first (with the GIL released), so none is left when the interpreter exits. Cyclic
    garbage (a plan's mesh) can hold a group: collected here too.
    """
    dist.destroy_process_group()
    gc.collect()


def _leave_together(nprocs: int, timeout: float) -> None:
    """Rank 0 hosts the rendezvous store that every process group is made through: it stays
    until every rank is done with it, or ``timeout``. (A rank still making a group, the
    pipeline's pair groups say, when rank 0 returns early fails with "Connection reset by
    peer".) Each rank counts itself done in the store; one that died never does, and the
    launcher stops rank 0 once it has every outcome."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("shardfx/done", 1)
        if dist.get_rank() == 0:
            end = time.monotonic() + timeout
            while store.add("shardfx/done", 0) < nprocs and time.monotonic() < end:
                time.sleep(0.01)
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
        pass


def _communication_error(e: BaseException | None) -> bool:
    """Whether ``e``, or an exception it was raised from, is a collective's or a connection's
    failure: torch.distributed's own errors (NCCL, the store), or gloo's (RuntimeErrors whose
    message names gloo's source, e.g. "[.../gloo/transport/tcp/pair.cc:553] Connection closed
    by peer")."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, dist.DistError) or "gloo/" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _set_threads(nprocs: int, launcher_threads: int) -> None:
    """Share the cores: ``max(1, cores // nprocs)`` intra-op threads per rank, unless the user
    chose a count, which every rank then gets: ``OMP_NUM_THREADS`` in the environment, or
    ``torch.set_num_threads`` called in the launching process (this rank starts with torch's
    default count for the machine, so a launcher whose count differs has set it). A call to
    ``torch.set_num_threads`` in ``fn`` comes later and wins."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp is not None:
        if omp.isdigit() and int(omp) > 0:  # the fork server may have started without it
            torch.set_num_threads(int(omp))
    elif launcher_threads != torch.get_num_threads():
        torch.set_num_threads(launcher_threads)
    else:
        torch.set_num_threads(max(1, _cores() // nprocs))


def _cores() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _stack_file(folder: str, r: int) -> str:
    return os.path.join(folder, f"rank{r}.stack")


def _context():
    """Ranks fork from a fork server, a clean process that imported shardfx (and torch) once.

    Like "spawn", a rank inherits none of the caller's threads, CUDA state or modules; unlike
    spawn, it starts in ~0.1 s, not the ~4 s of importing torch and shardfx afresh (``shardfx``
    loads its parts on first use: the server imports ``shardfx.api``, which brings them). Ranks
    get the caller's os.environ as of the launch; modules read theirs when the server started.
    Every rank starts from the server's torch RNG state, so ranks that draw a batch with
    ``torch.randint`` before seeding draw the same one. ``SHARDFX_PRELOAD`` (module names,
    comma-separated), read when the server starts, names more modules it imports once: the
    code every rank would import again (Hugging Face's model files take 1-2 s a rank).
    """
    ctx = mp.get_context("forkserver")
    extra = [m.strip() for m in os.environ.get("SHARDFX_PRELOAD", "").split(",") if m.strip()]
    ctx.set_forkserver_preload(["shardfx", "shardfx.api", *extra])
    return ctx


def _exit_with_parent() -> None:
    """In a rank: exit as soon as the launching process is gone (no orphans)."""
    parent = parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def _run_in_process(fn, args, nprocs: int, backend: str | None, timeout: float,
                    compile_timeout: float) -> list[Any]:
    """Under torchrun: run fn once here and gather every rank's result (module docstring)."""
    name = getattr(fn, "__qualname__", repr(fn))
    where = f"shardfx.launch({name!r}, nprocs={nprocs}) under torchrun"
    check_world(nprocs, where, instead=f"pass nprocs={_torchrun_world()}")
    owned = not dist.is_initialized()
    if owned:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        backend = backend or _default_backend(local)
        gpu = _gpu(backend, int(os.environ.get("LOCAL_RANK", 0)))
        _import_before_groups()
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout), device_id=gpu)
    set_compile_timeout(compile_timeout)
    try:
        with watchdog.watch(below="_run_in_process"):
            try:
                watchdog.arrive(f"the start of {name}")
                value = fn(*args)
                watchdog.arrive(f"the end of {name}")
                results: list[Any] = [None] * nprocs
                dist.all_gather_object(results, value)
            except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
                _fail(e, where, timeout)
                raise
        return results
    finally:
        if owned:
            _destroy_groups()


def _fail(e: BaseException, where: str, timeout: float) -> None:
    """Under torchrun, as fn ends with ``e``: record it (``watchdog.ending``); a communication
    error becomes a LaunchError naming the ranks this one waited for, when the watchdog can
    tell; a ShardfxError goes to torchrun's summary (``record_for_torchrun``)."""
    communication = _communication_error(e)
    verdict = watchdog.ending(e, communication, timeout)
    if verdict is not None:
        summary = (f"{type(e).__name__}: {e}".splitlines() or [""])[0]
        error = LaunchError(verdict.cause, where=f"{where}; rank {rank()}'s collective: "
                            f"{summary}", fix=verdict.fix, stacks=verdict.stacks)
        if not verdict.first:  # a peer says it already: torchrun stops this rank meanwhile
            time.sleep(HEAD_START_S)
        record_for_torchrun(error)
        raise error from e
    if isinstance(e, ShardfxError):
        record_for_torchrun(e)


def check_world(mesh_size: int, where: str, *, instead: str | None = None) -> None:
    """Under torchrun, raise an InputError unless its world size (``WORLD_SIZE``, or the
    default process group's size) is ``mesh_size``; outside torchrun, nothing.

    Call it before any process group is made: a mismatch is then one message, with the fix in
    the command line's terms, not a rendezvous or collective failing on every rank.
    ``where``: what asked for ``mesh_size`` (e.g. "--mesh dp=4"); ``instead``: the other fix
    than resizing the torchrun job (default: a --mesh of that size). The message goes to
    torchrun's summary (``record_for_torchrun``). Every rank raises it, local rank 0 at once
    and the others HEAD_START_S later: torchrun stops them when rank 0 fails, so the message
    is printed once per node, not once per rank.
    """
    if not under_torchrun():
        return
    world = _torchrun_world()
    if world == mesh_size:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local)
    start = (f"start torchrun with --nproc-per-node {mesh_size}" if nodes == 1 else
             f"start torchrun with --nnodes x --nproc-per-node = {mesh_size} processes "
             f"(now {nodes} x {local})")
    instead = instead or f"give a --mesh of {world} devices, e.g. --mesh dp={world}"
    processes = "process" if mesh_size == 1 else "processes"
    error = InputError(f"the mesh needs {mesh_size} {processes}, but torchrun started {world}",
                       where=where, fix=f"{start}, or {instead}")
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        time.sleep(HEAD_START_S)  # torchrun stops this rank once local rank 0 has failed
    record_for_torchrun(error)
    raise error


def _torchrun_world() -> int:
    return dist.get_world_size() if _initialized() else int(os.environ["WORLD_SIZE"])


def record_for_torchrun(e: BaseException) -> None:
    """Under torchrun, make ``e``'s message what torchrun's summary of this rank's failure
    shows (instead of "To enable traceback see: ..."): write it to the error file torchrun
    reads, ``TORCHELASTIC_ERROR_FILE``, as ``torch.distributed.elastic``'s ``@record`` does,
    without the traceback. An exception recorded later replaces it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = {"message": f"{type(e).__name__}: {e}",
               "extraInfo": {"timestamp": str(int(time.time()))}}
    try:
        Path(path).write_text(json.dumps({"message": message}))
    except OSError:
        pass  # torchrun's summary then says "To enable traceback see: ..."


def _gpu(backend: str, local_rank: int) -> torch.device | None:
    """Under NCCL, this process's GPU (``cuda:LOCAL_RANK``), made current and bound to the
    process group (its communicators start at once, on the right device); else None."""
    if "nccl" not in backend:
        return None
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _default_backend(nprocs: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= nprocs else "gloo"


def _free_port() -> int:
    """A localhost port nobody listens on now (the OS picks it when we bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
