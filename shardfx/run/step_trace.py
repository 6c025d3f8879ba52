"""Where a traced step's time went, per rank: compute, communication, idle.

    step 412 ms: compute 301 (73%), communication 88 exposed of 140 issued, idle 23

``step_time(prof)`` reads a ``torch.profiler`` result of one step on one rank (``shardfx run
--trace``: every rank profiles its last step) and ``classify(intervals)`` does the counting,
on ``Interval`` records a test can build by hand. Every moment of the step's wall time (the
main thread's first op to its last) is counted once, as one of:

- **communication, exposed**: the main thread is inside a communication call (an op named
  ``c10d::*``, ``_c10d_functional::*`` such as ``wait_tensor``, or ``record_param_comms``;
  whatever it calls is part of it), or between ops waiting for a collective: a gap that ends
  with a collective the backend records (``gloo:all_reduce`` on gloo's worker thread,
  ``nccl:*``), as a gap does when ``work.wait()`` (not an op the profiler sees) returns. Of
  the records that end in the gap or up to ``LATE`` (1 ms) after it (gloo's worker wakes the
  waiting thread before it closes its record), the last to end is the one waited for;
- **idle**: a gap that ends with a point-to-point transfer (``gloo:recv``, ``gloo:send``):
  a pipeline stage waiting for a microbatch from its neighbour, or for its neighbour to take
  one: the bubble. Waiting for a slower rank inside a collective is exposed communication (a
  rank cannot tell a slow peer from a slow link), so on an SPMD mesh idle is about 0;
- **compute**: the rest: ops that are not communication (and what they call), and the gaps
  between ops in which nothing finished: the host running the program (Python, dispatch).

Time is counted on the main thread (the one that ran most ops) by a sweep over its intervals,
so nested events (``aten::clone`` inside ``_c10d_functional::all_reduce``, a collective
inside ``Optimizer.step``) are never counted twice: an instant inside any communication
interval is communication, else inside any interval compute.

**Issued** communication is the wall time during which any communication was under way,
overlapped with compute or not: the union of the backend's collective records on every
thread, the main thread's communication calls and its waits for collectives (so exposed is
part of it, and ``issued - exposed`` is what overlapped compute). Point-to-point transfers
are left out: their records span from posting to completion, which measures the peer, not
the link.

On CUDA (a profile with device kernels) the same split is made on the device's timeline
instead, since the host only queues work: compute is the union of non-NCCL kernels, issued
the union of NCCL kernels, exposed the part of issued no compute kernel overlaps, idle the
rest of the wall time (from the first host op to the last kernel): launch gaps, waiting for
data.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable

_COMM_OPS = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms")
_RECORDS = ("gloo:", "nccl:")  # the backend's own records of a transfer (any thread)
_P2P = {"send", "recv", "recv_", "recvAnysource", "isend", "irecv", "batch_isend_irecv"}
DEVICE = "device"  # Interval.thread of a device kernel (on CUDA)
LATE = 1e-3  # a record may end this long after the wait it ended (module docstring)


@dataclass(frozen=True)
class Interval:
    """One profiler event: its name, start and end (seconds), and the thread it ran on
    (``DEVICE`` for a GPU kernel)."""

    name: str
    start: float
    end: float
    thread: object = 0


@dataclass(frozen=True)
class StepTime:
    """One rank's step, in seconds: ``wall = compute + communication + idle``;
    ``communication`` is the exposed part of ``issued`` (module docstring)."""

    wall: float
    compute: float
    communication: float
    idle: float
    issued: float

    @property
    def overlapped(self) -> float:
        """Communication hidden behind compute."""
        return max(0.0, self.issued - self.communication)

    def as_dict(self) -> dict[str, float]:
        return {f"{k}_s": v for k, v in asdict(self).items()}

    def __str__(self) -> str:
        digits = 0 if self.wall >= 0.1 else 1 if self.wall >= 0.01 else 2

        def ms(s: float) -> str:
            return f"{s * 1e3:.{digits}f}"

        share = self.compute / self.wall if self.wall > 0 else 0.0
        return (f"step {ms(self.wall)} ms: compute {ms(self.compute)} ({share:.0%}), "
                f"communication {ms(self.communication)} exposed of {ms(self.issued)} "
                f"issued, idle {ms(self.idle)}")


def kind(name: str) -> str:
    """``"comm"`` (a communication call on the main thread), ``"collective"`` or ``"p2p"``
    (a backend's record of a transfer), or ``"compute"``."""
    if name.startswith(_RECORDS):
        op = name.split(":", 1)[1]
        return "p2p" if op in _P2P else "collective"
    if name.startswith(_COMM_OPS):
        return "comm"
    if name.startswith("nccl"):  # a kernel: ncclDevKernel_AllReduce_..., ncclKernel_...
        return "collective"
    return "compute"


def classify(intervals: Iterable[Interval], main: object | None = None) -> StepTime:
    """Split one rank's step into compute, exposed communication and idle (module docstring).
    ``main``: the thread that ran the step (default: the one with most non-record events)."""
    intervals = [i for i in intervals if i.end >= i.start]
    if any(i.thread == DEVICE for i in intervals):
        return _on_device(intervals)
    records, ops = [], []
    for i in intervals:
        (records if kind(i.name) in ("collective", "p2p") else ops).append(i)
    if main is None:
        counts = Counter(i.thread for i in ops)
        if not counts:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
        main = counts.most_common(1)[0][0]
    ops = [i for i in ops if i.thread == main]
    if not ops:
        return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
    records.sort(key=lambda r: r.end)
    ends = [r.end for r in records]
    compute = comm = idle = 0.0
    waits: list[tuple[float, float]] = []  # main-thread time blocked on communication
    for a, b, state in _sweep(ops):
        if state == "comm":
            comm += b - a
            waits.append((a, b))
        elif state == "compute":
            compute += b - a
        else:  # a gap: what ended in it is what the thread waited for
            k = bisect.bisect_right(ends, b + LATE) - 1  # the last record to end by then
            if k < 0 or ends[k] < a:
                compute += b - a  # nothing ended: the host between ops
            elif kind(records[k].name) == "p2p":
                idle += b - a
            else:
                comm += b - a
                waits.append((a, b))
    start, end = min(i.start for i in ops), max(i.end for i in ops)
    issued = _measure(waits + [(max(r.start, start), min(r.end, end)) for r in records
                               if kind(r.name) == "collective"])
    return StepTime(end - start, compute, comm, idle, issued)


def _sweep(ops: list[Interval]) -> list[tuple[float, float, str]]:
    """The main thread's time, from its first op to its last, as (start, end, state) pieces:
    ``comm`` inside any communication call, else ``compute`` inside any op, else ``gap``."""
    points = []
    for i in ops:
        c = kind(i.name) == "comm"
        points += [(i.start, 1, c), (i.end, -1, c)]
    points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at one instant
    out, active, comms, last = [], 0, 0, points[0][0]
    for t, delta, c in points:
        if t > last:
            state = "comm" if comms else "compute" if active else "gap"
            if out and out[-1][2] == state and out[-1][1] == last:
                out[-1] = (out[-1][0], t, state)
            else:
                out.append((last, t, state))
            last = t
        active += delta
        comms += delta if c else 0
    return out


def _measure(spans: Iterable[tuple[float, float]]) -> float:
    """The length of a union of intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _on_device(intervals: list[Interval]) -> StepTime:
    kernels = [i for i in intervals if i.thread == DEVICE]
    comm = [(k.start, k.end) for k in kernels if kind(k.name) == "collective"]
    work = [(k.start, k.end) for k in kernels if kind(k.name) != "collective"]
    host = [i for i in intervals if i.thread != DEVICE]
    start = min(i.start for i in (host or kernels))
    end = max([k.end for k in kernels] + [i.end for i in host])
    compute, issued = _measure(work), _measure(comm)
    busy = _measure(work + comm)
    exposed = busy - compute
    return StepTime(end - start, compute, exposed, max(0.0, end - start - busy), issued)


def intervals(prof) -> list[Interval]:
    """A ``torch.profiler.profile`` result's events as intervals (seconds); device kernels
    on the thread ``DEVICE``."""
    out = []
    for e in prof.events():
        device = getattr(e.device_type, "name", "CPU") != "CPU"
        out.append(Interval(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6,
                            DEVICE if device else e.thread))
    return out


def step_time(prof) -> StepTime:
    """One rank's traced step, from its ``torch.profiler`` result (module docstring)."""
    return classify(intervals(prof))


def lines(times: list[StepTime]) -> list[str]:
    """One line per rank, as ``shardfx run --trace`` prints them under the step's line."""
    width = len(str(len(times) - 1))
    return [f"  rank {r:>{width}}  {t}" for r, t in enumerate(times)]
