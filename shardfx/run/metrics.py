"""What ``shardfx run`` reports per step: a line on rank 0, a JSON line, TensorBoard scalars.

    step  40/300  loss 2.4513  lr 2.97e-04  gnorm 0.812  212.4 ms  19,284 tok/s
                  0.31 TFLOP/s  MFU 1.6%  mem 0.61 GiB max (rank 2)

- step time: wall time of the optimizer step on rank 0, all accumulated batches included,
  waited for (the loss is read back);
- tokens/s: the step's tokens (the first integer input's elements, times ``accumulate``) per
  second, the whole mesh together; rows/s for a model without token ids;
- TFLOP/s: the model's FLOPs of the step (the plan's estimate, forward and backward, without
  recomputation: ``plan.compute_rows()``), per second, per device; MFU: that over one device's
  peak (``[metrics] peak_tflops``, or a ``gpu`` preset for the run's precision: dense tensor
  throughput from the vendors' data sheets, fp32 without TF32);
- memory: each rank's peak so far (CUDA's peak allocated, or the process's peak resident size
  on a CPU), gathered on every step (a few bytes per rank); the line shows the largest.

``[metrics] jsonl`` appends one object per step (the keys above, ``memory_bytes`` per rank)
and events (``{"event": "start", "config": ...}``, ``"resume"``, ``"checkpoint"``) to a file
that ``examples/plot_metrics.py`` draws; ``[metrics] tensorboard`` writes the same scalars
with ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardfx.errors import InputError
from shardfx.kernels.device import collective_device
from shardfx.mesh import MeshSpec
from shardfx.runtime.launch import rank

# one device's peak TFLOP/s, dense, by precision (data sheets; SXM parts)
PEAK_TFLOPS = {
    "h100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "h200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "l4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
}


def peak_flops(peak_tflops: float | None, gpu: str | None, precision: str) -> float | None:
    """One device's peak FLOP/s for MFU, from the config; None when neither is given."""
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise InputError(f"peak_tflops is {peak_tflops}", where="[metrics] peak_tflops",
                             fix="one device's peak TFLOP/s, a positive number")
        return peak_tflops * 1e12
    if gpu is None:
        return None
    preset = PEAK_TFLOPS.get(gpu.lower())
    if preset is None:
        raise InputError(f"no peak FLOP/s preset for the GPU {gpu!r}", where="[metrics] gpu",
                         fix=f"one of {', '.join(PEAK_TFLOPS)}, or give peak_tflops")
    return preset[precision] * 1e12


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    tokens_per_s: float
    tflops: float
    mfu: float | None
    memory_bytes: list[int] = field(default_factory=list)
    dropped: tuple[int, int] | None = None  # MoE with a capacity: (pairs dropped, routed)

    def line(self, steps: int, unit: str) -> str:
        width = len(str(steps))
        worst = max(range(len(self.memory_bytes)), key=self.memory_bytes.__getitem__)
        parts = [f"step {self.step:>{width}}/{steps}", f"loss {self.loss:.6f}",
                 f"lr {self.lr:.3g}"]
        if self.grad_norm is not None:
            parts.append(f"gnorm {self.grad_norm:.4g}")
        parts += [f"{self.step_time_s * 1e3:8.1f} ms", f"{self.tokens_per_s:>10,.0f} {unit}",
                  f"{self.tflops:.3g} TFLOP/s"]
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        if self.dropped is not None:
            parts.append(f"dropped {self.dropped[0]}/{self.dropped[1]}")
        where = f" (rank {worst})" if len(self.memory_bytes) > 1 else ""
        parts.append(f"mem {self.memory_bytes[worst] / 2**30:.2f} GiB{where}")
        return "  ".join(parts)


def memory(device: torch.device) -> int:
    """This process's peak memory so far (module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def every_rank(value: int, device: torch.device) -> list[int]:
    """``value`` of every rank, on every rank (one small all-gather)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]

    mine = torch.tensor([value], dtype=torch.int64, device=collective_device())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


class Sinks:
    """Rank 0's JSONL file and TensorBoard writer (nothing on other ranks)."""

    def __init__(self, jsonl: str | None, tensorboard: str | None, on: bool):
        self.file = self.writer = None
        if not on:
            return
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(jsonl, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard)

    def event(self, name: str, **values: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"event": name, "time": time.time(), **values}) + "\n")
            self.file.flush()

    def step(self, m: StepMetrics) -> None:
        if self.file is not None:
            self.file.write(json.dumps(asdict(m)) + "\n")
            self.file.flush()
        if self.writer is not None:
            for key, value in asdict(m).items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, m.step)
            self.writer.add_scalar("train/memory_max_bytes", max(m.memory_bytes), m.step)
            if m.dropped is not None:
                self.writer.add_scalar("train/moe_dropped", m.dropped[0], m.step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def check_tensorboard(directory: str | None) -> None:
    """Before any process starts: a TensorBoard directory needs the package."""
    if directory is None:
        return
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise InputError("TensorBoard logging needs the tensorboard package, which is not "
                         "installed", where=f"[metrics] tensorboard = {directory!r}",
                         fix="pip install tensorboard, or log to a JSONL file "
                             "([metrics] jsonl) and plot it with examples/plot_metrics.py")


compiling = logging.getLogger("shardfx.compile")  # runtime.lowered: one line per region compiled


class _Notes(logging.Handler):
    """Log records printed above the progress bar."""

    def __init__(self, progress: "Progress"):
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.note(f"compile: {record.getMessage()}")


class Progress:
    """A progress bar, one line per step and a table at the end on rank 0 (``rich``)."""

    def __init__(self, config, start: int, unit: str):
        self.config, self.start, self.unit, self.on = config, start, unit, rank() == 0
        self.mesh = str(MeshSpec.parse(config.mesh))  # "dp=2,tp=2", "1 device"
        self.bar = None
        self._compiles = _Notes(self)

    def __enter__(self) -> "Progress":
        if self.on:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                                MofNCompleteColumn(), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task(f"training {self.config.spec} on {self.mesh}",
                                          total=self.config.steps, completed=self.start)
            compiling.addHandler(self._compiles)  # kernels="compiled": each region's compile
            compiling.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            compiling.removeHandler(self._compiles)
            self.bar.stop()

    def step(self, m: StepMetrics) -> None:
        if self.on:
            self.bar.console.print(m.line(self.config.steps, self.unit), highlight=False,
                                   soft_wrap=True)
            self.bar.update(self.task, completed=m.step)

    def note(self, text: str) -> None:
        if self.on:
            self.bar.console.print(text, highlight=False, soft_wrap=True)

    def summary(self, records: list[StepMetrics]) -> None:
        if not self.on or not records:
            return
        import statistics

        from rich.table import Table

        median = statistics.median(r.step_time_s for r in records)
        table = Table(title=f"shardfx run: {self.config.spec} on {self.mesh}",
                      title_justify="left")
        for col in ("steps", "first loss", "last loss", "median step", self.unit, "TFLOP/s",
                    "MFU", "peak memory"):
            table.add_column(col, justify="right")
        best = statistics.median(r.tokens_per_s for r in records)
        mfu = statistics.median(r.mfu for r in records) if records[0].mfu is not None else None
        table.add_row(f"{records[0].step}-{records[-1].step}", f"{records[0].loss:.6f}",
                      f"{records[-1].loss:.6f}", f"{median * 1e3:.1f} ms", f"{best:,.0f}",
                      f"{statistics.median(r.tflops for r in records):.3g}",
                      "-" if mfu is None else f"{mfu:.1%}",
                      f"{max(records[-1].memory_bytes) / 2**30:.2f} GiB")
        self.bar.console.print(table)
