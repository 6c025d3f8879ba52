"""How long the command line takes to answer before it does any work: ``shardfx --help``,
``--version`` and ``run --help``, against ``python -c "import torch"`` (what every command
paid before shardfx loaded torch lazily). Wall and CPU seconds of each process, 7 runs each,
interleaved; goal: ``--help`` <= 1 s wall on an idle machine.

    python -m bench.cli
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import append_results, machine

RUNS = 7
SHARDFX = str(Path(sys.executable).with_name("shardfx"))
COMMANDS = {
    "shardfx --help": [SHARDFX, "--help"],
    "shardfx --version": [SHARDFX, "--version"],
    "shardfx run --help": [SHARDFX, "run", "--help"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def once(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    times = {name: [] for name in COMMANDS}
    for _ in range(RUNS):  # interleaved: load changes hit every command alike
        for name, argv in COMMANDS.items():
            times[name].append(once(argv))
    rows = ["| command | wall min (s) | wall median (s) | CPU median (s) |", "|---|---:|---:|---:|"]
    for name, runs in times.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        rows.append(f"| `{name}` | {min(walls):.3f} | {statistics.median(walls):.3f} | "
                    f"{statistics.median(cpus):.3f} |")
    load = os.getloadavg()[0]
    table = f"{RUNS} runs each, interleaved; load average {load:.2f}\n\n" + "\n".join(rows)
    print(table)
    append_results("cli", table, machine())


if __name__ == "__main__":
    main()
