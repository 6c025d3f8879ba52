"""Under torchrun, name the rank that a failed collective waited for.

    arrive("step 12")   # on every rank, at the same points of the program: one store write

``shardfx.launch`` spawning its own ranks sees all of them: when one stops outside a collective
(asleep, in an endless loop, dead), its peers' collectives time out and the launcher names the
rank still running, with its stack. Under torchrun each process sees only itself, and torchrun
blames the first rank whose collective timed out. So, while ``watch`` is open (``launch`` opens
it around fn under torchrun), each rank leaves a record in the job's store (the default process
group's: under torchrun the agent's TCPStore, which outlives every rank) and a rank whose
collective fails reads the others':

- ``arrive(label)``: this rank's count of arrivals, the label and the time; one ``set`` (about
  10 us to a TCPStore on this host), no collective. ``shardfx.run.train`` arrives once per step
  ("step 12"), ``launch`` at the start and at the end of fn.
- ``ending(error, communication, timeout)``: how this rank ends (its collective failed, or it
  raised) and where (its last label). After a communication error it waits a little
  (``_wait_s``) for its peers' endings and returns the ``Verdict`` (``judge``): the ranks its
  collective waited for are those that never failed in one, named with where they last
  arrived, e.g.

      rank 1 never reached step 3, where ranks 0, 2, 3 waited in a collective: it last arrived
      at step 2, 7.1 s ago, and is still running (its stack is below)

  A rank on this host that is still running is asked for its Python stack: ``watch`` has
  faulthandler write it, on ``STACK_SIGNAL``, to a file only the rank holds open (unlinked at
  once, so a killed rank leaves none behind), which a peer reads through ``/proc``.

Every store operation of a verdict runs on a helper thread bounded in time: a store that no
longer answers gives no verdict (the collective's own error stands), never a hang.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import signal
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

STACK_SIGNAL = signal.SIGUSR1  # asks a rank still running for its Python stack
STACK_WAIT_S = 0.5  # how long a rank gets to write its stack
_PREFIX = "shardfx/watchdog"


@dataclass(frozen=True)
class Arrival:
    """A rank's last ``arrive``: its ``count``-th, at ``at`` (``time.time()``)."""

    count: int
    at: float
    label: str


@dataclass(frozen=True)
class Ending:
    """How a rank ended: ``collective`` (a collective or connection failed) or ``raised``
    (``summary``: the exception's first line), after its ``count``-th arrival, at ``label``."""

    kind: str
    count: int
    label: str
    summary: str


@dataclass(frozen=True)
class Verdict:
    """What the ranks did when a collective failed: ``cause`` names the ranks it waited for,
    ``fix`` says where to look, ``stacks`` (by rank) of those still running on this host;
    ``first``: this rank gave the job's first verdict (the others' repeat it)."""

    cause: str
    fix: str
    stacks: dict[int, str]
    first: bool = True


@dataclass
class _Watch:
    store: dist.Store
    rank: int
    world: int
    below: str  # the frame of launch that calls fn: stacks are cut there
    scope: str  # the prefix of this launch's keys
    arrival: Arrival = Arrival(0, 0.0, "its start")

    def key(self, name: str) -> str:
        return f"{self.scope}/{name}"


_watch: _Watch | None = None
_launches = 0  # how many watches this process opened: every rank opens as many (SPMD)


def arrive(label: str) -> None:
    """Record that this rank reached ``label`` (e.g. "step 12"): one store write, nothing while
    no ``watch`` is open (a single process, or ranks ``shardfx.launch`` spawned itself)."""
    w = _watch
    if w is None:
        return
    w.arrival = Arrival(w.arrival.count + 1, time.time(), label)
    try:
        w.store.set(w.key(f"arrived/{w.rank}"),
                    json.dumps([w.arrival.count, w.arrival.at, label]))
    except RuntimeError:  # the store is gone: the next collective says so
        pass


@contextmanager
def watch(below: str) -> Iterator[None]:
    """Keep records for a verdict while open; needs the default process group. ``below``: the
    name of the function that runs fn (a stack is cut at its frame)."""
    global _watch, _launches
    _launches += 1
    w = _Watch(dist.distributed_c10d._get_default_store(), dist.get_rank(),
               dist.get_world_size(), below, scope=f"{_PREFIX}/{_launches}")
    stacks = _listen_for_stack()
    try:
        w.store.set(w.key(f"process/{w.rank}"), json.dumps(
            [socket.gethostname(), os.getpid(), stacks.fileno() if stacks else None]))
        _watch = w
        yield
    finally:
        _watch = None
        if stacks is not None:
            faulthandler.unregister(STACK_SIGNAL)
            stacks.close()


def ending(error: BaseException, communication: bool, timeout: float) -> Verdict | None:
    """Record how this rank ends (``error``; ``communication``: a collective's or connection's
    failure); after a communication error, the verdict on the ranks (module docstring), or None
    when there is none to give (no ``watch`` open, a single rank, or the store is gone).

    The first rank to ask judges and publishes its verdict; the others read it: one rank
    reads every rank's records, not all of them."""
    w = _watch
    if w is None:
        return None
    summary = (f"{type(error).__name__}: {error}".splitlines() or [""])[0]
    record = [("collective" if communication else "raised"), w.arrival.count, w.arrival.label,
              summary]
    wait_s = _wait_s(timeout)
    limit = wait_s + 2 * STACK_WAIT_S + 5.0
    found: list[Verdict | None] = []

    def record_and_judge() -> None:
        try:
            w.store.append(w.key("endings"), json.dumps([w.rank, *record]) + "\n")
            if not communication or w.world == 1:
                found.append(None)
            elif w.store.add(w.key("judges"), 1) == 1:
                verdict = _judge_job(w, timeout, wait_s)
                w.store.set(w.key("verdict"), json.dumps([verdict.cause, verdict.fix,
                                                          verdict.stacks]))
                found.append(verdict)
            else:
                w.store.wait([w.key("verdict")], timedelta(seconds=limit))
                cause, fix, stacks = json.loads(w.store.get(w.key("verdict")))
                found.append(Verdict(cause, fix, {int(r): s for r, s in stacks.items()},
                                     first=False))
        except RuntimeError:  # the store is gone, or no verdict came
            found.append(None)

    helper = threading.Thread(target=record_and_judge, name="shardfx-watchdog", daemon=True)
    helper.start()
    helper.join(limit)
    return found[0] if found else None


def _wait_s(timeout: float) -> float:
    """How long a rank whose collective failed waits for its peers' endings: ranks that wait
    in the same collective entered it at about the same time, so theirs fail within moments."""
    return min(max(2.0, timeout / 10), 10.0)


def _judge_job(w: _Watch, timeout: float, wait_s: float) -> Verdict:
    """Read every rank's records (waiting up to ``wait_s`` for their endings) and judge."""
    end = time.monotonic() + wait_s
    while True:
        lines = w.store.get(w.key("endings")).decode().splitlines()
        ended = {r: Ending(*rest) for r, *rest in map(json.loads, lines)}
        if len(ended) == w.world or time.monotonic() > end:
            break
        time.sleep(0.1)
    arrived, running = {}, {}
    for r in range(w.world):
        if w.store.check([w.key(f"arrived/{r}")]):
            arrived[r] = Arrival(*json.loads(w.store.get(w.key(f"arrived/{r}"))))
        if r not in ended and w.store.check([w.key(f"process/{r}")]):
            host, pid, fd = json.loads(w.store.get(w.key(f"process/{r}")))
            if host == socket.gethostname():
                running[r] = (pid, fd) if _alive(pid) else None
    verdict = judge(w.world, ended, arrived, running, time.time(), timeout)
    stuck = {r: running[r] for r in sorted(running) if running[r]}
    return Verdict(verdict.cause, verdict.fix, _ask_stacks(stuck, w.below))


def judge(world: int, ended: dict[int, Ending], arrived: dict[int, Arrival],
          running: dict[int, object], now: float, timeout: float) -> Verdict:
    """The verdict on a job from its ranks' records: ``ended`` (by rank: the endings recorded),
    ``arrived`` (last arrivals), ``running`` (ranks on this host: a truthy value while the
    process is alive, None once it is gone; others are not in it); ``now``: ``time.time()``.

    The ranks a failed collective waited for are those that did not fail in one: they raised,
    or left no ending at all (stuck, or dead). Those ``waiting`` at the furthest arrival are
    named as the ones the others waited for; a rank behind them never reached their label.
    """
    waiting = {r: e for r, e in ended.items() if e.kind == "collective"}
    raised = {r: e for r, e in ended.items() if e.kind == "raised"}
    silent = [r for r in range(world) if r not in ended]
    if not silent and not raised:
        return Verdict(
            f"every rank's collective failed, none waited for a missing rank ({_waits(waiting)})"
            ": the ranks called different collectives (one skipped or added one), or a "
            "connection broke", fix="compare the collectives the ranks call there "
            "(TORCH_DISTRIBUTED_DEBUG=DETAIL checks that they match)", stacks={})
    furthest = max(waiting.values(), key=lambda e: e.count) if waiting else None
    if furthest:
        at = sorted(r for r, e in waiting.items() if e.count == furthest.count)
        others, collectives = _ranks(at), "collective" if len(at) == 1 else "collectives"
    parts, fixes = [], []
    for r in sorted(raised):
        parts.append(f"rank {r} raised {raised[r].summary} (it last arrived at "
                     f"{raised[r].label})")
        fixes.append(f"see rank {r}'s traceback in its output")
    for r in silent:
        a = arrived.get(r)
        if a is None:
            part = f"rank {r} never arrived anywhere: it did not start fn"
        elif furthest and a.count == furthest.count:
            part = (f"rank {r} never reached the {collectives} that {others} waited in after "
                    f"{a.label}: it arrived at {a.label} {now - a.at:.1f} s ago")
        elif furthest and a.count < furthest.count:
            part = (f"rank {r} never reached {furthest.label}, where {others} waited in a "
                    f"collective: it last arrived at {a.label}, {now - a.at:.1f} s ago")
        else:
            part = (f"rank {r} did not fail in a collective: it last arrived at {a.label}, "
                    f"{now - a.at:.1f} s ago")
        if running.get(r):
            part += ", and is still running (its stack is below)"
            fixes.append(f"see where rank {r} is stuck in its stack below")
        elif r in running:
            part += ", and its process has ended"
            fixes.append(f"see rank {r}'s output: os._exit, a native crash or the "
                         "out-of-memory killer end a process without a Python traceback")
        else:
            fixes.append(f"see what rank {r} is doing on its host (py-spy dump --pid PID)")
        parts.append(part)
    behind = {r: e for r, e in waiting.items() if furthest and e.count < furthest.count}
    if behind:
        parts.append(_waits(behind))
    fix = "; ".join(fixes)
    if silent:
        fix += (". A rank that stops outside a collective makes its peers' collectives fail "
                f"after the timeout ({timeout:g} s)")
    return Verdict("; ".join(parts), fix, stacks={})


def _waits(waiting: dict[int, Ending]) -> str:
    """"ranks 0, 2 waited in a collective after step 3, rank 3 after step 4"."""
    by_label: dict[str, list[int]] = {}
    for r in sorted(waiting):
        by_label.setdefault(waiting[r].label, []).append(r)
    return ", ".join(f"{_ranks(rs)} {'waited in a collective ' if i == 0 else ''}after {label}"
                     for i, (label, rs) in enumerate(by_label.items()))


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _read(Path(f"/proc/{pid}/stat")).split(") ")[-1].startswith("Z")  # a zombie


# --- stacks ----------------------------------------------------------------------------------


def _listen_for_stack():
    """A file, unlinked at once, that faulthandler writes this process's stack to on
    STACK_SIGNAL (after a first line naming the main thread); None where there is no /proc
    to read it through, or STACK_SIGNAL already has a handler."""
    if not Path("/proc/self/fd").is_dir() or signal.getsignal(STACK_SIGNAL) != signal.SIG_DFL:
        return None
    fd, path = tempfile.mkstemp(prefix="shardfx-stack-")
    os.unlink(path)
    stacks = os.fdopen(fd, "w")
    stacks.write(f"main thread 0x{threading.get_ident():016x}\n")  # as faulthandler writes ids
    stacks.flush()
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    return stacks


def _ask_stacks(ranks: dict[int, tuple[int, int | None]], below: str) -> dict[int, str]:
    """The Python stacks of ``ranks`` (rank: (pid, fd of its stack file)) on this host."""
    paths = {}
    for r, (pid, fd) in ranks.items():
        if fd is not None:
            try:
                os.kill(pid, STACK_SIGNAL)
                paths[r] = Path(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
    return read_stacks(paths, below)


def read_stacks(paths: dict[int, Path], below: str) -> dict[int, str]:
    """Each rank's main-thread stack from its stack file (``paths``, by rank), which it was
    just asked to write: waits up to STACK_WAIT_S for them."""
    end = time.monotonic() + STACK_WAIT_S
    stacks = {}
    for r, path in paths.items():
        while _read(path).count("\n") < 2 and time.monotonic() < end:  # the id line, no dump
            time.sleep(0.01)
        time.sleep(0.05)  # let the rank finish writing
        stacks[r] = main_stack(_read(path), below)
    return stacks


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def main_stack(dump: str, below: str) -> str:
    """The main thread's frames down to the function ``below`` (left out), from a stack file:
    its main thread's id, then faulthandler's dump of every thread (most recent call first)."""
    ident, _, threads = dump.partition("\n")
    ident = ident.removeprefix("main thread ")
    for thread in threads.split("\n\n"):
        header, _, frames = thread.partition("\n")
        if ident and ident in header:
            return "\n".join(itertools.takewhile(lambda line: not line.endswith(f" in {below}"),
                                                 frames.splitlines()))
    return "(none: the rank did not write its stack)"
