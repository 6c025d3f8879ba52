"""Benchmark rows, each in a process of its own (``python -m MODULE FLAGS --row=SPEC
--out=FILE``): each starts from the same seeded weights, no row's memory (the allocator's,
torch.compile's caches) is left to the next, and a row the kernel kills (the machine is
shared) is run once more, then reported as not run. With ``resume`` every finished row is
appended to that JSON-lines file and a row already there (same spec and flags) is read back,
not run: a stopped run goes on where it stopped. bench/remat.py uses it."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable


def load() -> str:
    """The load average (1/5/15 min) as a benchmark records it."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


class RowProcesses:
    """``rows(spec)``: the row ``spec`` names (a JSON-able dict), from the process
    ``python -m module *flags --row=SPEC --out=FILE`` (which writes the row as JSON to FILE).
    ``name_of(spec)`` names it in progress lines; ``not_run(spec, why)`` is the row of one
    that did not run."""

    def __init__(self, module: str, flags: list[str], resume: str | None,
                 name_of: Callable[[dict], str], not_run: Callable[[dict, str], dict]):
        self.module, self.flags, self.resume = module, flags, resume
        self.name_of, self.not_run = name_of, not_run
        self.cached: dict[str, dict] = {}
        if resume and os.path.exists(resume):
            with open(resume) as f:
                for line in f:
                    entry = json.loads(line)
                    self.cached[entry["key"]] = entry["row"]
        self.child_cpu = 0.0  # CPU seconds of the rows' processes

    def key(self, spec: dict) -> str:
        return json.dumps([spec, self.flags], sort_keys=True)

    def __call__(self, spec: dict) -> dict:
        name, key = self.name_of(spec), self.key(spec)
        if key in self.cached:
            print(f"{name}: read back from {self.resume}", file=sys.stderr, flush=True)
            return self.cached[key]
        t0 = time.perf_counter()
        row, why, attempt = None, "", 0
        for attempt in (1, 2):
            code, text = self._child(spec)
            if code == 0 and text:
                row = json.loads(text)
                break
            why = (f"its process was killed by signal {-code}" if code < 0 else
                   f"its process exited with {code}")
            if code == -9:
                why += " (SIGKILL: out of memory on this shared machine?)"
            print(f"{name}: attempt {attempt}: {why}", file=sys.stderr, flush=True)
            if code > 0:  # an error of its own: running it again would repeat it
                break
        if row is None:
            row = self.not_run(spec, why)
        else:
            if attempt > 1 and "notes" in row:
                row["notes"].append("ran on the second attempt: the first process was killed")
            if self.resume:
                with open(self.resume, "a") as f:
                    f.write(json.dumps(dict(key=key, row=row)) + "\n")
        print(f"{name}: {time.perf_counter() - t0:.1f} s (load {load()})", file=sys.stderr,
              flush=True)
        return row

    def _child(self, spec: dict) -> tuple[int, str]:
        """The row's process: its exit status and what it wrote."""
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = subprocess.run([sys.executable, "-m", self.module, *self.flags,
                                   f"--row={json.dumps(spec)}", f"--out={out.name}"])
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            self.child_cpu += (after.ru_utime + after.ru_stime) - \
                (before.ru_utime + before.ru_stime)
            return done.returncode, Path(out.name).read_text()
