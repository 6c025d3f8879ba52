"""``shardfx run``: train a model factory on a mesh from the command line.

    shardfx run examples/nanogpt.py:workload --mesh dp=2,tp=2 --steps 20
    shardfx run examples/nanogpt.py:workload --mesh pp=2 --microbatches 4 --schedule zero-bubble
    shardfx run MODULE:FACTORY --steps 100 --save ckpt      # then --resume ckpt --steps 200

Every rank imports MODULE, seeds torch with ``--seed`` and calls FACTORY (so every rank builds
the same initial weights), plans what it returns with ``shardfx.partition`` and trains it with
AdamW for ``--steps`` steps in all. Without torchrun it spawns the mesh's processes itself
(``shardfx.launch``); under torchrun each process is one rank.

Data: the factory's ``"batches"`` (an iterable of ``(args, targets)``) when it returns one,
else synthetic batches shaped like its example: integer tensors drawn uniformly below the
example's largest value + 1 (token ids), floating tensors from a normal distribution; batch
``i`` comes from a generator seeded with ``(seed, i)``, the same on every rank.

Rank 0 prints one line per step (loss, step time, tokens or rows per second, memory: CUDA's
peak allocated, or the process's peak resident size on a CPU) under a progress bar, and a table
at the end.

Checkpoints: ``--save DIR`` writes, after the last step, the runner's state as a distributed
checkpoint (``runner.save``: each rank its shards of the model and the optimizer's state, the
step, the loss scaler, the dropout stream, the data position; all or nothing: a run killed
while saving leaves the previous checkpoint). ``--resume DIR`` checks it before any process
plans (an incomplete one is refused, naming why) and continues from its step on any mesh (the
shards are re-cut: ``runtime.saving``): with the same ``--seed`` the batches, dropout masks and
updates are those of an uninterrupted run, so on the same mesh the losses are the same bits,
and on another the same within rounding. A different ``--lr`` is used from there on (a
warning says so).

``--trace FILE``: the last step as a Chrome trace: a pipeline's ``runner.trace`` (every rank's
actions), else ``torch.profiler`` on rank 0.
"""

from __future__ import annotations

import itertools
import logging
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import shardfx
from shardfx.errors import InputError
from shardfx.mesh import MeshSpec
from shardfx.runtime.launch import rank, under_torchrun, world_size

log = logging.getLogger("shardfx.run")


@dataclass(frozen=True)
class RunConfig:
    spec: str
    mesh: str
    steps: int
    lr: float = 3e-4
    seed: int = 0
    precision: str = "fp32"
    pipeline: tuple = ()  # (name, value) of microbatches, schedule, virtual_stages given
    zero: int = 0  # ZeRO stage over dp (partition(..., zero=))
    save: str | None = None
    resume: str | None = None
    trace: str | None = None


def run(config: RunConfig) -> list[float]:
    """Train as ``config`` says, on every rank of its mesh; rank 0's losses."""
    if config.resume:
        _resume_meta(config)  # a checkpoint this run cannot continue is said before spawning
    size = MeshSpec.parse(config.mesh).size
    if size == 1 and not under_torchrun():
        return train(config)
    return shardfx.launch(train, config, nprocs=size, timeout=300)[0]


def train(config: RunConfig) -> list[float]:
    """One rank's part (module docstring): plan, maybe resume, train, maybe save."""
    from shardfx.cli import load_job

    torch.manual_seed(config.seed)
    job = load_job(config.spec)
    mesh = dict(MeshSpec.parse(config.mesh).axes)
    plan = shardfx.partition(job.model, job.args, job.loss_fn, job.targets, mesh=mesh,
                             precision=config.precision, zero=config.zero,
                             **dict(config.pipeline))
    if rank() == 0:
        print(str(plan).rstrip("\n"))  # what it decided, before it runs
    runner = plan.runner(optimizer=lambda ps: torch.optim.AdamW(ps, lr=config.lr))
    start = load_checkpoint(config, runner) if config.resume else 0
    batches = _data(job, config.seed, start)
    tokens = _tokens(job.args)
    losses, times = [], []
    with _Progress(config, start) as progress:
        for step in range(start, config.steps):
            args, targets = next(batches)
            last = step == config.steps - 1
            t0 = time.perf_counter()
            loss = _traced_step(runner, plan, config, args, targets) if last and config.trace \
                else runner.step(args, targets)
            value = loss.item()  # waits for the step: the time is the step's
            times.append(time.perf_counter() - t0)
            losses.append(value)
            progress.step(step, value, times[-1], tokens[0] / times[-1], tokens[1],
                          _memory(plan.device))
        progress.summary(losses, times, tokens, _memory(plan.device))
    if config.save:
        save_checkpoint(config, runner, config.steps)
    return losses


# --- data -----------------------------------------------------------------------------------


def _data(job, seed: int, start: int) -> Iterator[tuple[tuple, tuple]]:
    """The batches from ``start`` on: the factory's, or synthetic ones (module docstring)."""
    if getattr(job, "batches", None) is not None:
        yield from itertools.islice(job.batches, start, None)  # the resumed run's from start
        raise InputError("the factory's batches ran out before the last step", where="batches",
                         fix="give as many batches as --steps (or an endless iterator)")
    step = start
    while True:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        yield tuple(_like(t, gen) for t in job.args), tuple(_like(t, gen) for t in job.targets)
        step += 1


def _like(t: Any, gen: torch.Generator) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)
    if t.dtype == torch.bool:
        return t.clone()
    high = max(int(t.max()) + 1, 1) if t.numel() else 1
    return torch.randint(0, high, t.shape, generator=gen, dtype=t.dtype)


def _tokens(args: tuple) -> tuple[int, str]:
    """What a step processes: the first integer input's elements (token ids), else rows."""
    leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    ids = next((t for t in leaves if not t.is_floating_point() and t.dim()), None)
    if ids is not None:
        return ids.numel(), "tokens/s"
    return (leaves[0].shape[0] if leaves and leaves[0].dim() else 1), "rows/s"


def _memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"


def _traced_step(runner, plan, config: RunConfig, args, targets) -> torch.Tensor:
    """The last step, traced (module docstring)."""
    if plan.schedule is not None:
        loss = runner.step(args, targets)
        runner.trace(config.trace)
        return loss
    if rank() != 0:
        return runner.step(args, targets)
    with torch.profiler.profile() as prof:
        loss = runner.step(args, targets)
    prof.export_chrome_trace(config.trace)
    return loss


# --- checkpoints ----------------------------------------------------------------------------


def save_checkpoint(config: RunConfig, runner, step: int) -> None:
    """``config.save``: the runner's state as a distributed checkpoint (``runner.save``: every
    rank its shards, all or nothing), with the data position and the run's settings."""
    runner.save(config.save, data_position=step, spec=config.spec, run_seed=config.seed,
                run_mesh=config.mesh)


def load_checkpoint(config: RunConfig, runner) -> int:
    """Load ``config.resume`` into ``runner`` (saved on any mesh); returns the step it was
    saved at, where the data resumes."""
    return int(runner.load(config.resume)["data_position"])


def _resume_meta(config: RunConfig) -> dict[str, Any]:
    """The checkpoint's meta, checked against this run before any process plans: an incomplete
    checkpoint, or one this run cannot continue, is an InputError naming the fix."""
    from shardfx.runtime.checkpoint import check

    where = f"--resume {config.resume}"
    meta = check(config.resume)
    if "data_position" not in meta:
        raise InputError(f"{config.resume} is a shardfx checkpoint, but not one shardfx run "
                         "wrote (no data position)", where=where,
                         fix="resume from a directory written by shardfx run --save")
    if meta["data_position"] >= config.steps:
        raise InputError(f"the checkpoint is at step {meta['data_position']}, and --steps is "
                         f"{config.steps} in all", where=where,
                         fix=f"ask for more steps than {meta['data_position']}")
    if meta.get("run_seed", config.seed) != config.seed:
        log.warning("resuming from %s with --seed %d; it was saved with --seed %d: the batches "
                    "from here on are --seed %d's", config.resume, config.seed,
                    meta["run_seed"], config.seed)
    return meta


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# --- what rank 0 prints ---------------------------------------------------------------------


class _Progress:
    """A progress bar and one line per step on rank 0 (``rich``); nothing on the others."""

    def __init__(self, config: RunConfig, start: int):
        self.config, self.start, self.on = config, start, rank() == 0
        self.mesh = str(MeshSpec.parse(config.mesh))  # "dp=2,tp=2", "1 device"
        self.bar = None

    def __enter__(self) -> "_Progress":
        if self.on:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                                MofNCompleteColumn(), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task(f"training {self.config.spec} on {self.mesh}",
                                          total=self.config.steps, completed=self.start)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def step(self, step: int, loss: float, seconds: float, rate: float, unit: str,
             memory: tuple[float, str]) -> None:
        if not self.on:
            return
        self.bar.console.print(
            f"step {step + 1:>{len(str(self.config.steps))}}/{self.config.steps}  "
            f"loss {loss:.6f}  {seconds * 1e3:8.1f} ms  {rate:>10,.0f} {unit}  "
            f"{memory[1]} {memory[0] / 2**30:.2f} GiB")
        self.bar.update(self.task, completed=step + 1)

    def summary(self, losses: list[float], times: list[float], tokens: tuple[int, str],
                memory: tuple[float, str]) -> None:
        if not self.on or not losses:
            return
        from rich.table import Table

        median = statistics.median(times)
        table = Table(title=f"shardfx run: {self.config.spec} on {self.mesh}",
                      title_justify="left")
        for col in ("steps", "first loss", "last loss", "median step", tokens[1], memory[1]):
            table.add_column(col, justify="right")
        table.add_row(f"{self.start + 1}-{self.start + len(losses)}", f"{losses[0]:.6f}",
                      f"{losses[-1]:.6f}", f"{median * 1e3:.1f} ms",
                      f"{tokens[0] / median:,.0f}", f"{memory[0] / 2**30:.2f} GiB")
        self.bar.console.print(table)
        if self.config.save:
            self.bar.console.print(f"checkpoint: {self.config.save}/ (step {self.config.steps})")

