"""How a launch ended: each rank's outcome (a value, an exception, an exit without one), read from
its pipe as it comes, and the one ``LaunchError`` that names the first rank that failed (a
failure caused by another rank's is its consequence, not its cause) with the stacks of the ranks
still running."""

from __future__ import annotations

import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from shardfx.errors import ShardfxError

KILL_WAIT_S = 1.0  # between SIGTERM and SIGKILL
GRACE_S = 2.0  # how long the other ranks may run on after the first one fails


CONSEQUENCE_S = 1.0  # a communication error this long before another failure is its consequence


class LaunchError(ShardfxError):
    """A rank failed (``rank``: the first; its ``exitcode`` or ``traceback``), or time ran out.

    ``stacks``: the Python stack of each rank still running when the launcher stopped it,
    by rank (``running``: those ranks).
    """

    def __init__(self, cause: str, *, where: str | None = None, fix: str | None = None,
                 rank: int | None = None, exitcode: int | None = None, tb: str | None = None,
                 stacks: dict[int, str] | None = None):
        super().__init__(cause, where=where, fix=fix)
        self.rank, self.exitcode, self.traceback = rank, exitcode, tb
        self.stacks = stacks or {}
        self.running = sorted(self.stacks)
        parts = [self.args[0]]
        if tb:
            parts.append(f"traceback of rank {rank}:\n{tb.rstrip()}")
        parts += [f"stack of rank {r}, still running (most recent call first):\n{s.rstrip()}"
                  for r, s in sorted(self.stacks.items())]
        self.args = ("\n\n".join(parts),)


@dataclass(frozen=True)
class Outcome:
    """How one rank ended: "ok" (value), "raised" (summary, tb) or "exited" (exitcode).

    ``at``: when it failed (``time.time()``: the rank's clock as it caught the exception, or the
    launcher's as it saw the rank exit); ``communication``: the failure is a collective's or a
    connection's (see ``_communication_error``).
    """

    kind: str
    value: Any = None
    summary: str = ""
    tb: str = ""
    exitcode: int | None = None
    at: float = 0.0
    communication: bool = False

    def __str__(self) -> str:  # "returned", "raised ValueError: ...", "exited with code 3"
        if self.kind != "exited":
            return "returned" if self.kind == "ok" else "raised " + self.summary.splitlines()[0]
        if self.exitcode is not None and self.exitcode < 0:
            name = signal.Signals(-self.exitcode).name
            return f"was killed by signal {name} (exit code {self.exitcode})"
        return f"exited with code {self.exitcode}"


def collect(procs: list, pipes: list[Connection], end: float) -> list[Outcome | None]:
    """Wait for every rank's outcome; after the first failure, for GRACE_S more at most."""
    outcomes: list[Outcome | None] = [None] * len(procs)
    stop_at = end
    while None in outcomes and (left := stop_at - time.monotonic()) > 0:
        waiting = {}
        for r, outcome in enumerate(outcomes):
            if outcome is None:
                waiting[pipes[r]] = waiting[procs[r].sentinel] = r
        ready = wait(list(waiting), timeout=min(left, 60.0))  # deadline may be inf
        seen_at = time.time()
        for r in sorted({waiting[x] for x in ready}):
            outcomes[r] = read_outcome(pipes[r], procs[r], seen_at)
            if outcomes[r].kind != "ok" and stop_at == end:
                stop_at = min(end, time.monotonic() + GRACE_S)
    return outcomes


def read_outcome(pipe: Connection, proc, seen_at: float) -> Outcome:
    """The message a rank sent, or how it exited (seen at ``seen_at``) when it sent none."""
    try:
        if pipe.poll():
            kind, *rest = pickle.loads(pipe.recv_bytes())
            if kind == "ok":
                return Outcome("ok", value=rest[0])
            summary, tb, at, communication = rest
            return Outcome("raised", summary=summary, tb=tb, at=at, communication=communication)
    except EOFError:
        pass  # died without a message: fall through to the exit code
    except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be unpickled here
        return Outcome("raised", summary=f"its result cannot be unpickled: {e!r}",
                        tb=traceback.format_exc(), at=seen_at)
    proc.join(KILL_WAIT_S)
    return Outcome("exited", exitcode=proc.exitcode, at=seen_at)


def first_failure(outcomes: list[Outcome | None]) -> int:
    """The rank that failed first, by the time it failed.

    A rank's crash or exception reaches its peers as communication errors (connection closed,
    collective timed out), and those can be stamped first: before the launcher sees a crashed
    rank exit, or before an exception that unwinds through code using collectives reaches its
    rank's handler. So a first failure that is a communication error gives way to another
    rank's failure of another kind up to CONSEQUENCE_S later.
    """
    failed = sorted((o.at, r) for r, o in enumerate(outcomes) if o is not None and o.kind != "ok")
    first_at, first = failed[0]
    if outcomes[first].communication:
        for at, r in failed:
            if at - first_at <= CONSEQUENCE_S and not outcomes[r].communication:
                return r
    return first


def same_shardfx_error(outcomes: list[Outcome | None]) -> str | None:
    """The summary every rank raised, when it is one and the same shardfx error (bad input
    every rank met alike: a mesh that does not match nprocs, a plan that cannot be made):
    said once, with its own where and fix, without tracebacks from inside shardfx."""
    summaries = {o.summary if o is not None and o.kind == "raised" else None for o in outcomes}
    if len(summaries) != 1 or None in summaries:
        return None
    summary = summaries.pop()
    name = summary.split(":", 1)[0]
    return summary if name in error_names(ShardfxError) else None


def error_names(cls: type) -> set[str]:
    return {cls.__name__, *(n for sub in cls.__subclasses__() for n in error_names(sub))}


def results(outcomes: list[Outcome | None], stacks: dict[int, str], where: str,
             deadline: float, timeout: float, started: list[bool]):
    """The ranks' values in order, or the LaunchError for the first rank that failed
    (``started``: by rank, whether it got as far as ``_worker``)."""
    failed = [r for r, o in enumerate(outcomes) if o is not None and o.kind != "ok"]
    if not failed and None not in outcomes:
        return [o.value for o in outcomes]
    if not failed:
        running = [r for r, o in enumerate(outcomes) if o is None]
        done = [f"rank {r} {o}" for r, o in enumerate(outcomes) if o is not None]
        raise LaunchError(
            f"timed out: ranks {running} still running after the {deadline:g} s deadline; "
            "they were killed", where="; ".join([where, *done]), stacks=stacks,
            fix=f"look for a rank stuck outside a collective (collectives fail after "
            f"timeout={timeout:g} s; their stacks are below); for long runs pass a larger "
            "deadline=")
    if same := same_shardfx_error(outcomes):
        raise LaunchError(f"every rank raised {same}", where=where)
    r = first_failure(outcomes)
    o = outcomes[r]
    where = "; ".join([where, *(f"rank {i} {other or 'was killed while still running'}"
                                for i, other in enumerate(outcomes) if i != r)])
    fix = f"see rank {r}'s traceback below" if o.kind == "raised" else (
        f"see rank {r}'s output above: os._exit, a native crash or the out-of-memory killer "
        "end a process without a Python traceback")
    if o.kind == "exited" and not started[r]:
        fix = (f"see rank {r}'s output above: it exited while its process was starting, "
               "before fn ran: importing the main module again or unpickling fn and its args "
               "failed there (define fn in a module the ranks can import)")
    if stacks and o.communication:
        running = ", ".join(map(str, sorted(stacks)))
        fix = (f"rank(s) {running} still ran {GRACE_S:g} s after rank {r}'s collective failed: "
               "a rank that stops outside a collective makes its peers' collectives time out; "
               "see the stacks below")
    if o.kind == "raised":
        raise LaunchError(f"rank {r} {o}", where=where, fix=fix, rank=r, tb=o.tb, stacks=stacks)
    raise LaunchError(f"rank {r} {o} without returning a result", where=where, fix=fix, rank=r,
                      exitcode=o.exitcode, stacks=stacks)
