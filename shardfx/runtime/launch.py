"""Run a function on N local processes, one rank each, joined by ``torch.distributed``.

    results = shardfx.launch(train, config, nprocs=4)   # [rank 0's result, ..., rank 3's]

The one-machine stand-in for ``torchrun``. Each rank is a clean process (see ``_context``), joins
the default process group (env:// rendezvous on a free localhost port; gloo on CPU, NCCL when
each rank can have its own GPU), runs ``fn(*args)`` (``fn`` defined at module level: it is
pickled) and sends its pickled result back on its own pipe. The parent waits on every rank's
pipe and exit sentinel at once, so nothing can hang:

- the first rank to fail (raise, or exit without a result) is reported in a ``LaunchError`` with
  its traceback or exit code; the others get ``GRACE_S`` seconds to finish and are then killed;
- ``timeout`` bounds every collective, and ``deadline`` (default ``2 * timeout``) bounds the
  whole run: past it every rank is killed and ``LaunchError("timed out ...")`` is raised;
- a rank whose parent dies exits too, so no process is left behind.

Under torchrun (``RANK`` and ``WORLD_SIZE`` set, or the process group already initialized),
``launch`` spawns nothing: it runs ``fn(*args)`` once in this process, initializing the process
group from the environment if needed (and destroying it after), and returns every rank's result
gathered with ``all_gather_object``. An exception in ``fn`` propagates unchanged; torchrun stops
the other ranks.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardfx.errors import ShardfxError

GRACE_S = 2.0  # how long the other ranks may run on after the first one fails
KILL_WAIT_S = 1.0  # between SIGTERM and SIGKILL


class LaunchError(ShardfxError):
    """A rank failed (``rank``: the first; its ``exitcode`` or ``traceback``), or time ran out."""

    def __init__(self, cause: str, *, where: str | None = None, fix: str | None = None,
                 rank: int | None = None, exitcode: int | None = None, tb: str | None = None):
        super().__init__(cause, where=where, fix=fix)
        self.rank, self.exitcode, self.traceback = rank, exitcode, tb
        if tb:
            self.args = (f"{self.args[0]}\n\ntraceback of rank {rank}:\n{tb.rstrip()}",)


def rank() -> int:
    """This process's rank in the default process group; 0 when torch.distributed is not up."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The default process group's size; 1 when torch.distributed is not up."""
    return dist.get_world_size() if _initialized() else 1


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def launch(fn: Callable[..., Any], *args: Any, nprocs: int, backend: str | None = None,
           timeout: float = 60.0, deadline: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` ranks; return their results in rank order.

    ``backend``: None picks NCCL when CUDA has a GPU per rank, else gloo. ``timeout``: seconds any
    collective may wait. ``deadline``: seconds the whole run may take (``math.inf``: no limit).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a positive int, got {nprocs!r}",
                          where="shardfx.launch(..., nprocs=...)", fix="e.g. nprocs=4")
    if _initialized() or {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        return _run_in_process(fn, args, nprocs, backend, timeout)  # under torchrun
    where = f"shardfx.launch({getattr(fn, '__qualname__', fn)!r}, nprocs={nprocs})"
    backend = backend or _default_backend(nprocs)
    deadline = 2 * timeout if deadline is None else deadline
    ctx = _context()
    port = _free_port()
    procs, pipes, outcomes = [], [], []
    try:
        for r in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"shardfx-rank{r}", args=(
                r, nprocs, port, backend, timeout, fn, args, writer, dict(os.environ)))
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise LaunchError(f"cannot send fn and its args to the ranks: {e}", where=where,
                                  fix="define fn at module level; pass picklable args") from e
            finally:
                writer.close()  # the rank holds the only write end: its exit reads as EOF here
            procs.append(proc)
            pipes.append(reader)
        outcomes = _collect(procs, pipes, time.monotonic() + deadline)
    finally:
        _stop(procs, [r for r, o in enumerate(outcomes) if o is not None])
    return _results(outcomes, where, deadline, timeout)


@dataclass(frozen=True)
class _Outcome:
    """How one rank ended: "ok" (value), "raised" (summary, tb) or "exited" (exitcode)."""

    kind: str
    value: Any = None
    summary: str = ""
    tb: str = ""
    exitcode: int | None = None

    def __str__(self) -> str:  # "returned", "raised ValueError: ...", "exited with code 3"
        if self.kind != "exited":
            return "returned" if self.kind == "ok" else "raised " + self.summary.splitlines()[0]
        if self.exitcode is not None and self.exitcode < 0:
            name = signal.Signals(-self.exitcode).name
            return f"was killed by signal {name} (exit code {self.exitcode})"
        return f"exited with code {self.exitcode}"


def _collect(procs: list, pipes: list[Connection], end: float) -> list[_Outcome | None]:
    """Wait for every rank's outcome; after the first failure, for GRACE_S more at most."""
    outcomes: list[_Outcome | None] = [None] * len(procs)
    stop_at = end
    while None in outcomes and (left := stop_at - time.monotonic()) > 0:
        waiting = {}
        for r, outcome in enumerate(outcomes):
            if outcome is None:
                waiting[pipes[r]] = waiting[procs[r].sentinel] = r
        for ready in wait(list(waiting), timeout=min(left, 60.0)):  # deadline may be inf
            r = waiting[ready]
            if outcomes[r] is None:
                outcomes[r] = _read_outcome(pipes[r], procs[r])
                if outcomes[r].kind != "ok" and stop_at == end:
                    stop_at = min(end, time.monotonic() + GRACE_S)
    return outcomes


def _read_outcome(pipe: Connection, proc) -> _Outcome:
    """The message a rank sent, or how it exited when it sent none."""
    try:
        if pipe.poll():
            kind, *rest = pickle.loads(pipe.recv_bytes())
            return _Outcome("ok", value=rest[0]) if kind == "ok" else _Outcome(kind, None, *rest)
    except EOFError:
        pass  # died without a message: fall through to the exit code
    except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be unpickled here
        return _Outcome("raised", summary=f"its result cannot be unpickled: {e!r}",
                        tb=traceback.format_exc())
    proc.join(KILL_WAIT_S)
    return _Outcome("exited", exitcode=proc.exitcode)


def _results(outcomes: list[_Outcome | None], where: str, deadline: float, timeout: float):
    """The ranks' values in order, or the LaunchError for the first rank that failed."""
    failed = [r for r, o in enumerate(outcomes) if o is not None and o.kind != "ok"]
    if not failed and None not in outcomes:
        return [o.value for o in outcomes]
    if not failed:
        running = [r for r, o in enumerate(outcomes) if o is None]
        done = [f"rank {r} {o}" for r, o in enumerate(outcomes) if o is not None]
        raise LaunchError(
            f"timed out: ranks {running} still running after the {deadline:g} s deadline; "
            "they were killed", where="; ".join([where, *done]),
            fix=f"look for a rank stuck outside a collective (collectives fail after "
            f"timeout={timeout:g} s); for long runs pass a larger deadline=")
    r, o = failed[0], outcomes[failed[0]]
    where = "; ".join([where, *(f"rank {i} {other or 'was killed'}"
                                for i, other in enumerate(outcomes) if i != r)])
    if o.kind == "raised":
        raise LaunchError(f"rank {r} {o}", where=where, rank=r, tb=o.tb,
                          fix=f"see rank {r}'s traceback below")
    raise LaunchError(f"rank {r} {o} without returning a result",
                      where=where, rank=r, exitcode=o.exitcode,
                      fix=f"see rank {r}'s output above: os._exit, a native crash or the "
                      "out-of-memory killer end a process without a Python traceback")


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


def _worker(r: int, nprocs: int, port: int, backend: str, timeout: float,
            fn: Callable[..., Any], args: tuple, pipe: Connection, env: dict[str, str]) -> None:
    """One rank: join the process group, run fn, send ("ok", value) or ("raised", ...) back."""
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    os.environ.clear()
    os.environ.update(env)  # the launcher's environment now, not the fork server's at its start
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nprocs))
    try:
        if backend == "nccl":
            torch.cuda.set_device(r)
        dist.init_process_group(backend, init_method="env://", rank=r, world_size=nprocs,
                                timeout=timedelta(seconds=timeout))
        value = fn(*args)
        try:
            message = pickle.dumps(("ok", value))
        except Exception as e:  # noqa: BLE001
            raise LaunchError(f"rank {r}'s result cannot be pickled: {e}",
                              fix="return plain data, tensors or picklable objects") from e
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
        tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next)  # from fn down
        message = pickle.dumps(("raised", f"{type(e).__name__}: {e}", "".join(tb)))
    pipe.send_bytes(message)
    pipe.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _context():
    """Ranks fork from a fork server, a clean process that imported shardfx (and torch) once.

    Like "spawn", a rank inherits none of the caller's threads, CUDA state or modules; unlike
    spawn, it starts in ~0.1 s, not the ~4 s of importing torch and shardfx afresh. Ranks get the
    caller's os.environ as of the launch; modules read theirs when the server started.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["shardfx"])
    return ctx


def _exit_with_parent() -> None:
    """In a rank: exit as soon as the launching process is gone (no orphans)."""
    parent = parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def _run_in_process(fn, args, nprocs: int, backend: str | None, timeout: float) -> list[Any]:
    """Under torchrun: run fn once here and gather every rank's result."""
    owned = not dist.is_initialized()
    if owned:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        backend = backend or _default_backend(local)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        if dist.get_world_size() != nprocs:
            raise LaunchError(
                f"launch asked for nprocs={nprocs}, but this process is already one of "
                f"{dist.get_world_size()} ranks", where="shardfx.launch under torchrun",
                fix="pass nprocs equal to the torchrun world size, or call fn directly")
        results: list[Any] = [None] * nprocs
        dist.all_gather_object(results, fn(*args))
        return results
    finally:
        if owned:
            dist.destroy_process_group()


def _default_backend(nprocs: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= nprocs else "gloo"


def _free_port() -> int:
    """A localhost port nobody listens on now (the OS picks it when we bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
