"""Shared by the benchmarks: what machine this is, appending a table to RESULTS.md, racing
step functions, and checking that a training graph really has its backward."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import time
from pathlib import Path

import torch
import torch.fx as fx

from shardfx.ir import meta as M

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


def timed(fn) -> float:
    """Seconds ``fn()`` takes, garbage collected first (the previous run's graphs are large)."""
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(contestants: dict, warmup: int, steps: int,
              first: dict | None = None) -> tuple[dict, dict]:
    """On every rank: each contestant's step in turn, ``warmup`` untimed rounds then ``steps``
    timed, barriers around each step (none in a process without a process group). Returns the
    step times (seconds) and the last results; ``first`` gets each contestant's first step's
    time (a compiled contestant's compile time is in it)."""
    import torch.distributed as dist

    barrier = dist.barrier if dist.is_available() and dist.is_initialized() else lambda: None
    times: dict[str, list[float]] = {k: [] for k in contestants}
    results = {}
    for i in range(warmup + steps):
        for name, step in contestants.items():
            barrier()
            start = time.perf_counter()
            results[name] = step()
            barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
            elif i == 0 and first is not None:
                first[name] = time.perf_counter() - start
    return times, results


def clocked(step, cpu: list, losses: list):
    """``step``, with its process CPU time (``time.process_time``: every thread of this
    process) appended to ``cpu`` and its loss (``.item()``) to ``losses``."""
    def run():
        start = time.process_time()
        loss = step()
        cpu.append(time.process_time() - start)
        losses.append(loss.item())
        return loss

    return run


def count(params: int) -> str:
    """A parameter count as people say it: 13.0 B, 52.4 M."""
    return f"{params / 1e9:.1f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"


def mesh_label(mesh: dict[str, int]) -> str:
    """``{"dp": 8, "tp": 8}`` -> ``dp=8×tp=8``."""
    return "×".join(f"{name}={size}" for name, size in mesh.items())


def gradients(gm: fx.GraphModule) -> int:
    """How many parameter gradients a captured or planned graph returns (its ``OUTPUTS`` roles
    of kind ``GRAD``)."""
    roles = gm.graph.output_node().meta[M.OUTPUTS]
    return len({r.name for r in roles if r.kind is M.OutputKind.GRAD})


def check_backward(gm: fx.GraphModule, model: torch.nn.Module, what: str) -> int:
    """The number of gradients ``gm`` returns; fails the benchmark loudly unless it is one per
    trainable parameter of ``model`` (a forward-only graph would time the wrong thing)."""
    want = sum(p.requires_grad for p in model.parameters())  # tied parameters counted once
    got = gradients(gm)
    if got != want:
        raise SystemExit(f"{what}: {got} gradient outputs for {want} trainable parameters; "
                         "the backward is missing, so this would time a forward-only graph")
    return got


def program_nodes(plan) -> int:
    """Nodes of a plan's per-device program: the one SPMD program, or the sum over the stage
    parts (F, B, W of every stage) of a pipelined one."""
    if plan.program is not None:
        return len(plan.program.module.graph.nodes)
    return sum(len(part.graph.nodes) for part in plan.stage_program.children())


def capture_path(plan) -> str:
    """How the plan traced the model: each repeated block once and stamped, or the whole
    model (``plan.capture_path``)."""
    return plan.capture_path


def cuda_peak(fn) -> tuple[int, int]:
    """(bytes allocated before, the most allocated during) one call of ``fn`` on the GPU."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return before, torch.cuda.max_memory_allocated()
