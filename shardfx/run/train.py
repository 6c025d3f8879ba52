"""``shardfx run``: train a model factory on a mesh, as a run configuration says.

    shardfx run examples/nanogpt.py:workload --mesh dp=2,tp=2 --steps 20
    shardfx run --config examples/shakespeare.toml          # every field, from a TOML file
    shardfx run MODULE:FACTORY --steps 100 --save ck        # then --resume ck --steps 200

The configuration (``shardfx.run.config``: flags over a TOML file over defaults) is checked
before any process starts: what can be known without the mesh's processes (the world size
under torchrun, options that need an axis the mesh lacks, a batch the mesh cannot divide, the
data file, the checkpoint to resume, every path the run writes: ``shardfx.run.outputs``) is
an error naming the fix, printed once. Then every rank imports MODULE, seeds torch with
``seed`` and calls FACTORY (so every rank builds the same initial weights), plans what it
returns with ``shardfx.partition`` and trains it with AdamW:

- the learning rate follows ``[lr_schedule]``: linear warmup from ``lr / (warmup + 1)`` to
  ``lr``, then constant, or a cosine or linear decay to ``final_lr * lr`` at the last step
  (``torch.optim.lr_scheduler.LambdaLR``);
- each step takes ``accumulate`` batches (``runner.step_batches``) and clips the global
  gradient norm to ``clip_grad_norm`` (``plan.runner(clip_grad_norm=...)``: over every shard,
  one device's norm);
- batches come from ``shardfx.run.data``: a token file, the factory's ``"batches"``, or synthetic;
- every ``[checkpoint] every`` steps, and after the last, the runner's state is saved as a
  distributed checkpoint (``shardfx.run.checkpoints``: ``step-N/``, the last ``keep`` kept)
  with the data position and the resolved config. ``resume`` continues from one on any mesh:
  with the same config the batches, dropout masks, learning rates and updates are those of an
  uninterrupted run (on the same mesh, the same bits);
- ``init_from`` starts from a Hugging Face checkpoint directory (``runner.load_hf``: each rank
  reads its shards' slices; the factory may build the model on meta), and ``export_hf`` writes
  the trained model as one after the last step (``runner.save_hf``), somewhere the error names
  if the directory can no longer take it (``shardfx.run.outputs.export``). Resumed from a
  checkpoint of the last step, a run with ``export_hf`` trains nothing and exports;
- rank 0 prints the resolved config, the plan, a line per step and a table at the end
  (``shardfx.run.metrics``: loss, lr, gradient norm, step time, tokens/s, TFLOP/s, MFU, each
  rank's peak memory), and writes them to a JSONL file and TensorBoard when asked.

Without torchrun the mesh's processes are spawned (``shardfx.launch``); under torchrun each
process is one rank. ``[metrics] trace``: every rank profiles the last step
(``torch.profiler``); rank 0 writes it as a Chrome trace (a pipeline's ``runner.trace``, else
rank 0's profile) and prints, under the step's line, where each rank's time went: compute,
exposed and issued communication, idle (``shardfx.run.step_trace``), also a ``"trace"`` event in
the JSONL file.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import shardfx
from shardfx.run import checkpoints as run_checkpoints
from shardfx.run import outputs, step_trace
from shardfx.run.choose import choose_mesh
from shardfx.run.config import RunConfig, check_fields
from shardfx.run.data import batches as data_batches
from shardfx.run.data import token_shape
from shardfx.errors import InputError
from shardfx.mesh import MeshSpec
from shardfx.run.metrics import (Progress, Sinks, StepMetrics, check_tensorboard, every_rank,
                             memory, peak_flops)
from shardfx.runtime import hf_load
from shardfx.runtime.checkpoint import check
from shardfx.runtime.launch import check_world, rank, under_torchrun, world_size
from shardfx.runtime.watchdog import arrive
from shardfx.run.job import load_job
from shardfx.run.data import TokenFile

log = logging.getLogger("shardfx.run")


def run(config: RunConfig) -> list[float]:
    """Train as ``config`` says, on every rank of its mesh; rank 0's losses. ``mesh =
    "auto"``: the mesh ``shardfx.search`` chooses for ``devices`` (``run.choose``)."""
    if config.mesh == "auto":
        choose_mesh(config)
    preflight(config)
    size = MeshSpec.parse(config.mesh).size
    if size == 1 and not under_torchrun():
        return train(config)
    return shardfx.launch(train, config, nprocs=size, timeout=300)[0]


# --- checked before any process starts -------------------------------------------------------


def preflight(config: RunConfig) -> None:
    """Everything about ``config`` that can be checked in this process (module docstring);
    resolves ``resume`` to one checkpoint directory."""
    mesh = MeshSpec.parse(config.mesh)
    check_world(mesh.size, where=f"--mesh {config.mesh or '(one device)'}")  # under torchrun
    check_fields(config)  # again: under torchrun no command line checked it first
    check_tensorboard(config.metrics.tensorboard)
    peak_flops(config.metrics.peak_tflops, config.metrics.gpu, config.precision)
    start = 0
    if config.resume:
        config.checkpoint.resume = run_checkpoints.resolve(config.resume)
        start = _resume_meta(config)["step"]  # a checkpoint this run cannot continue: now
    if config.init_from:  # its files and headers, before any process starts
        try:
            hf_load.Checkpoint(config.init_from).close()
        except InputError as e:
            raise InputError(e.cause, where=f"--init-from {config.init_from}", fix=e.fix) from None
    job = load_job(config.spec)
    _check_batch(job, config, mesh)
    outputs.check(config, job.model, start)  # not found unwritable after hours of training
    if config.data.tokens:
        rows, length, dtype = token_shape(job)
        TokenFile(config.data.tokens, rows, length, config.seed, dtype)  # exists, long enough


def _check_batch(job, config: RunConfig, mesh: MeshSpec) -> None:
    """A global batch the mesh cannot divide: its rows over dp (and HSDP's replicas), then over
    microbatches; its sequences into 2*cp chunks."""
    leaves = [t for t in pytree.tree_leaves((job.args, job.targets))
              if isinstance(t, torch.Tensor) and t.dim()]
    if not leaves:
        return
    rows = leaves[0].shape[0]
    dp, m = mesh.axis("dp_replicate") * mesh.axis("dp"), config.parallel.microbatches or 1
    if rows % (dp * m):
        parts = (f"dp={dp}" if mesh.axis("dp_replicate") == 1 else
                 f"dp_replicate x dp={dp}") + (f" x {m} microbatches" if m > 1 else "")
        raise InputError(f"the factory's batch has {rows} rows, which {parts} cannot divide "
                         "evenly", where=f"{config.spec}, args[0].shape[0] on --mesh {mesh}",
                         fix=f"make the batch a multiple of {dp * m} rows, or change the mesh")
    cp = mesh.axis("cp")
    if cp > 1 and leaves[0].dim() >= 2 and leaves[0].shape[1] % (2 * cp):
        length = leaves[0].shape[1]
        raise InputError(f"the factory's sequences have {length} tokens, which cp={cp} cannot "
                         f"split: each rank holds 2 of 2*cp={2 * cp} equal chunks (one from the "
                         "front, one from the back, so causal attention is balanced)",
                         where=f"{config.spec}, args[0].shape[1] on --mesh {mesh}",
                         fix=f"make the sequence a multiple of {2 * cp} tokens, or change cp")


# --- one rank ---------------------------------------------------------------------------------


def train(config: RunConfig) -> list[float]:
    """One rank's part (module docstring): plan, maybe resume, train, save."""
    torch.manual_seed(config.seed)
    job = load_job(config.spec)
    mesh = dict(MeshSpec.parse(config.mesh).axes)
    pipeline = {k: v for k in ("microbatches", "schedule", "virtual_stages")
                if (v := getattr(config.parallel, k)) is not None}
    plan = shardfx.partition(job.model, job.args, job.loss_fn, job.targets, mesh=mesh,
                             shard=config.shard, precision=config.precision, zero=config.zero,
                             kernels=config.kernels,
                             capacity_factor=config.capacity_factor,
                             offload_optimizer=config.offload_optimizer,
                             recompute=config.parallel.recompute, **pipeline)
    if rank() == 0:
        print(f"shardfx run, resolved config:\n{config.to_toml()}")
        print(str(plan).rstrip("\n"))  # what it decided, before it runs
    # contents checked before spawning (preflight), and again as runner.load reads them
    meta = check(config.resume, contents=False) if config.resume else None
    start = meta["step"] if meta else 0
    runner = plan.runner(optimizer=lambda ps: _adamw(ps, config),
                         clip_grad_norm=config.clip_grad_norm or math.inf)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        runner.optimizer, lambda i: lr_factor(config, start + i)) \
        if runner.optimizer is not None else None
    allow = config.checkpoint.allow_nonfinite
    position = int(runner.load(config.resume, allow)["data_position"]) if meta else 0
    if config.init_from:  # each rank reads its shards' slices (runtime.hf_load)
        runner.load_hf(config.init_from, allow)
        if rank() == 0:
            print(f"weights from the Hugging Face checkpoint {config.init_from}")
    data = data_batches(job, config.data.tokens, config.seed, position)
    sinks = Sinks(config.metrics.jsonl, config.metrics.tensorboard, rank() == 0)
    try:
        sinks.event("start", config=config.to_dict(), world_size=world_size())
        if meta:
            if rank() == 0:
                print(f"resumed from {config.resume} at step {start} (data position: batch "
                      f"{position})")
            sinks.event("resume", path=config.resume, step=start, data_position=position)
        losses = _loop(config, plan, runner, schedule, data, start, sinks, job.args)
        if config.export_hf:  # every rank writes its share of the files (runtime.hf_save)
            path, refused = outputs.export(config, runner, config.steps)
            if rank() == 0:
                print(f"Hugging Face checkpoint: {path}/")
            sinks.event("export_hf", path=str(path), step=config.steps,
                        **({"asked": config.export_hf} if refused else {}))
            if refused:  # written, but not where asked: the run says so and fails
                raise refused
        return losses
    finally:
        sinks.close()


def _dropped(runner) -> tuple[int, int]:
    """(pairs dropped, pairs routed) over every MoE layer in the step, the whole batch's."""
    routed = runner.expert_load().values()
    return sum(r.dropped for r in routed), sum(r.pairs for r in routed)


def _adamw(params, config: RunConfig) -> torch.optim.Optimizer:
    o = config.optimizer
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay)


def lr_factor(config: RunConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based) as a fraction of ``lr`` (module docstring)."""
    s = config.lr_schedule
    if step < s.warmup:
        return (step + 1) / (s.warmup + 1)
    if s.decay == "constant":
        return 1.0
    span = max(1, config.steps - s.warmup - 1)
    progress = min(1.0, (step - s.warmup) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if s.decay == "cosine" else 1 - progress
    return s.final_lr + (1 - s.final_lr) * shape


def _loop(config: RunConfig, plan, runner, schedule, data, start: int, sinks: Sinks,
          job_args: tuple) -> list[float]:
    tokens, unit = _tokens(job_args)
    tokens *= config.accumulate
    flops = sum(plan.compute_rows()["whole model"]) * config.accumulate
    peak = peak_flops(config.metrics.peak_tflops, config.metrics.gpu, config.precision)
    losses, records = [], []
    with Progress(config, start, unit) as progress:
        for step in range(start, config.steps):
            arrive(f"step {step + 1}")  # under torchrun, a rank that never gets here is named
            group = [next(data) for _ in range(config.accumulate)]
            last = step == config.steps - 1
            lr = runner.optimizer.param_groups[0]["lr"] if runner.optimizer else config.lr
            t0 = time.perf_counter()
            loss, traced = _traced_step(runner, plan, config, group) \
                if last and config.metrics.trace else (runner.step_batches(group), None)
            value = loss.item()  # waits for the step: the time is the step's
            seconds = time.perf_counter() - t0
            if schedule is not None:
                schedule.step()
            per_device = flops / seconds / world_size()
            m = StepMetrics(step + 1, value, lr, runner.grad_norm, seconds,
                            tokens / seconds, per_device / 1e12,
                            per_device / peak if peak else None,
                            every_rank(memory(plan.device), plan.device),
                            _dropped(runner) if config.capacity_factor else None)
            losses.append(value)
            records.append(m)
            progress.step(m)
            sinks.step(m)
            if traced:  # where each rank's traced step went (shardfx.run.step_trace)
                times = traced()
                progress.note("\n".join(step_trace.lines(times)))
                sinks.event("trace", path=config.metrics.trace, step=step + 1,
                            ranks=[t.as_dict() for t in times])
            if config.save and (last or (config.every and (step + 1) % config.every == 0)):
                path = save_checkpoint(config, runner, step + 1)
                progress.note(f"checkpoint: {path}/ (step {step + 1})")
                sinks.event("checkpoint", path=path, step=step + 1)
        progress.summary(records)
    return losses


def _tokens(args: tuple) -> tuple[int, str]:
    """What a batch holds: the first integer input's elements (token ids), else rows."""
    leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    ids = next((t for t in leaves if not t.is_floating_point() and t.dim()), None)
    if ids is not None:
        return ids.numel(), "tokens/s"
    return (leaves[0].shape[0] if leaves and leaves[0].dim() else 1), "rows/s"


def _traced_step(runner, plan, config: RunConfig, group) -> tuple[torch.Tensor, Callable]:
    """The last step, profiled on every rank (module docstring): its loss, and what to call
    on every rank once the step is timed: it writes the Chrome trace and returns every rank's
    ``StepTime`` (a small all-gather)."""
    with torch.profiler.profile() as prof:
        loss = runner.step_batches(group)
        if loss.device.type == "cuda":  # the kernels the profile counts have run
            torch.cuda.synchronize(loss.device)

    def report() -> list[step_trace.StepTime]:
        mine = step_trace.step_time(prof)
        if rank() == 0:  # checked before the run (shardfx.run.outputs): it can be made
            Path(config.metrics.trace).parent.mkdir(parents=True, exist_ok=True)
        if plan.schedule is not None:
            runner.trace(config.metrics.trace)  # a collective over pp; rank 0 writes
        elif rank() == 0:
            prof.export_chrome_trace(config.metrics.trace)
        if world_size() == 1:
            return [mine]
        times: list = [None] * world_size()
        dist.all_gather_object(times, mine)
        return times

    return loss, report


# --- checkpoints ------------------------------------------------------------------------------


def save_checkpoint(config: RunConfig, runner, step: int) -> str:
    """The runner's state as ``save/step-N`` (``runner.save``: every rank its shards, all or
    nothing), with the data position and the resolved config; then the oldest beyond
    ``keep`` go."""
    path = run_checkpoints.step_dir(config.save, step)
    runner.save(path, data_position=step * config.accumulate, spec=config.spec,
                run_seed=config.seed, run_mesh=config.mesh, run_config=config.to_dict())
    if rank() == 0:
        run_checkpoints.prune(config.save, config.keep)
    if world_size() > 1:
        dist.barrier()  # no rank goes on while an old checkpoint is half deleted
    return path


def _resume_meta(config: RunConfig) -> dict[str, Any]:
    """The checkpoint's meta, checked against this run before any process plans: an incomplete
    checkpoint, or one this run cannot continue, is an InputError naming the fix."""
    where = f"--resume {config.resume}"
    meta = check(config.resume)
    if "data_position" not in meta:
        raise InputError(f"{config.resume} is a shardfx checkpoint, but not one shardfx run "
                         "wrote (no data position)", where=where,
                         fix="resume from a directory written by shardfx run --save")
    if meta["step"] > config.steps or (meta["step"] == config.steps and not config.export_hf):
        raise InputError(f"the checkpoint is at step {meta['step']}, and --steps is "
                         f"{config.steps} in all", where=where,
                         fix=f"ask for more steps than {meta['step']} (or --steps "
                             f"{meta['step']} with --export-hf DIR: export it, no training)")
    if meta.get("run_seed", config.seed) != config.seed:
        log.warning("resuming from %s with --seed %d; it was saved with --seed %d: the batches "
                    "from here on are --seed %d's", config.resume, config.seed,
                    meta["run_seed"], config.seed)
    return meta
