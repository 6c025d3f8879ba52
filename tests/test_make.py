"""``make bench``: every benchmark module it runs exists, and each bench/*.py script is one of
them (a new benchmark is not left out)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def test_make_bench_runs_every_benchmark_as_a_module():
    listed = subprocess.run(["make", "-n", "bench", "-o", ".venv/.installed"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    names = re.search(r"for b in (.*?); do", listed).group(1).split()
    helpers = {"__init__", "common", "timed", "flops", "llama_workload", "row_processes",
               "remat_report", "heldout_families"}  # imported
    # by the benchmarks, not run
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")} - helpers
    assert set(names) == scripts
    assert "-m bench.$b" in listed  # as modules: bench/ is a package its scripts import from
    sys.path.insert(0, str(REPO))
    try:
        assert all(importlib.util.find_spec(f"bench.{n}") is not None for n in names)
    finally:
        sys.path.remove(str(REPO))
