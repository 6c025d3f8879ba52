"""Shared by the benchmarks: what machine this is, and appending a table to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def append_results(name: str, table: str, where: str) -> None:
    date = datetime.date.today().isoformat()
    with RESULTS.open("a") as f:
        f.write(f"\n## {name} — {date}\n\nMachine: {where}\n\n{table}\n")


def alternate(contestants: dict, warmup: int, steps: int) -> tuple[dict, dict]:
    """On every rank: each contestant's step in turn, ``warmup`` untimed rounds then ``steps``
    timed, barriers around each step. Returns the step times (seconds) and the last results."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in contestants}
    results = {}
    for i in range(warmup + steps):
        for name, step in contestants.items():
            dist.barrier()
            start = time.perf_counter()
            results[name] = step()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times, results
