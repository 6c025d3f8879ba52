"""Step time: one training step of shardfx against the tool a user would otherwise pick, on
Hugging Face Llamas, on one device, on dp=2×tp=2 and on a 2-stage 1F1B pipeline.

Models: ``LlamaForCausalLM`` from a config, seeded random weights (no download), fp32, untied
LM head (``bench.spmd.llama``): "58M" (8 layers, hidden 512, 8 heads, 8 KV heads,
intermediate 1408, vocab 32000: 58.5 M parameters) and "136M" (12 layers, hidden 768, 12 heads,
12 KV heads, intermediate 2112, vocab 32000: 135.9 M); the counts are printed. Data: one
seeded global batch of 8 sequences of 65 tokens; the inputs are the first 64, the targets the
next token at each position (the last 64), and the loss is the LM's next-token cross entropy
on the logits, ``F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())``
(``bench.spmd.loss_fn``). AdamW, lr 1e-3, torch's fused kernel in every row (torchtitan's
default; shardfx's runner picks it for an AdamW left unset, ``cost.optimizer.fused_step``,
and the for-loop torch itself picks on CPU takes 4.0x its time, ``bench/optimizer.py``): the
races time the programs, not the optimizers. Every contestant starts from the same weights (a
model of its own, built from the same seed) and trains on the same batch, so their losses
after the last step should agree to rounding: each row's relative difference to the peer's is
printed (a large one is a finding).

Three races, each its contestants alternating step by step in the same process(es)
(``bench.common.alternate``: ``--warmup`` untimed rounds, then ``--steps`` timed, barriers
around each step in the multi-process races):

1. one device (a spawned process of its own, 1 intra-op thread: with torch's default 2 on
   this shared 2-core machine, another job's load made OpenMP's threads wait on each other
   and a 58M step went from 0.9 s to 11 s, in wall and CPU time alike): eager PyTorch
   (``loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=True)``, the peer)
   against ``shardfx.partition`` with its defaults and with the other ``fused_loss`` setting
   (see below).
2. dp=2 × tp=2 on 4 gloo processes, 1 intra-op thread each: ``partition(...,
   mesh={"dp": 2, "tp": 2}, shard="megatron")`` against PyTorch's own TP + DDP
   (``bench.spmd.peer``: ``parallelize_module`` with ColwiseParallel on q/k/v/gate/up and
   RowwiseParallel on o/down over ``mesh["tp"]``, then ``DistributedDataParallel(model,
   device_mesh=mesh["dp"])``); global batch 8 x 64, each peer rank feeds its dp slice (4 x 64)
   and all-reduces its slice's loss over dp in the step, so both return the global loss.
3. pp=2, 1F1B, 8 microbatches of 1 x 64 tokens, on 2 gloo processes, 1 thread each:
   ``partition(..., mesh={"pp": 2}, schedule="1f1b", microbatches=8)`` with its defaults and
   with the other ``fused_loss`` setting, against ``torch.distributed.pipelining.Schedule1F1B``
   (``scale_grads=True``: the mean microbatch loss's gradients, as shardfx) over manual
   ``PipelineStage`` modules: stage 0 the embedding and the first k decoder layers, stage 1
   the other layers, the final norm and the LM head, where k is the cut shardfx's default plan
   chose (both run the same split). The peer's stages call the HF decoder layers with the
   model's rotary embeddings and no mask (SDPA's causal path, as ``LlamaModel`` does without
   padding); the last stage's losses are broadcast in the step so every rank returns the loss.

Compiled contestants, in every race: shardfx with ``kernels="compiled"`` (each program's
regions lowered by Inductor, ``runtime.lowered``) against what a user compiles without it:
``torch.compile`` of each decoder layer (as torchtitan compiles each TransformerBlock: in race
2 between TP and DDP, in race 3 inside each pipeline stage) and, on one device, of the whole
model. Every row reports its first step's wall time, the compile's included, with Inductor's
on-disk cache empty: each race and size starts a folder of its own (``bench/compile.py`` times
a full one).

The other ``fused_loss`` setting: ``fused_loss=False`` (the head's ATen ops) where the default
plan fused the LM head with its cross entropy (``plan.fused_losses()``), ``fused_loss=True``
(the chunked head, its matmul recomputed in the backward) where it did not; the notes say
which the defaults did. The shardfx sources (``shardfx/**/*.py``) are hashed at the start and
the end of the run: a warning is printed and appended if they changed while it ran (every
rank imports them afresh, so the races would have timed different code).

Reported per race and model: min and median step wall time (multi-process: rank 0's, barrier
to barrier, i.e. the slowest rank's step) and CPU time (``time.process_time`` around the step
alone, every thread of the process, gloo's included; multi-process: per step the MAX over the
ranks, then min and median over the steps), the ratio of medians shardfx / peer for each, and
the loss the last step returned. The pipeline race also gives each rank's median CPU time
(rank 1 holds the LM head and the loss) and, for the shardfx rows, each stage's median F and
B action time from ``runner.timeline()`` of the last step. ``--profile`` adds one more step
of every contestant under torch.profiler (rank 0; in the pipeline race every rank) and prints
its top ops by self CPU time (not appended).

    python -m bench.step [--quick] [--sizes 58M,136M] [--races 1,2,3] [--warmup 2]
                         [--steps 10] [--profile] [--json PATH]
                         [--no-append]

Prints a table per race and appends them to bench/RESULTS.md with the machine, load average
and date (not with ``--quick``: a tiny Llama, 3 timed steps, for smoke tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardfx
from bench.common import alternate, append_results, clocked, count, machine
from bench.pipeline import per_stage
from bench.spmd import llama, loss_fn, peer, train_step
from shardfx.ir import meta as M
from shardfx.schedule import Action, Kind

warnings.filterwarnings("ignore")

SIZES = {
    "58M": dict(layers=8, hidden=512, heads=8, kv=8, inter=1408, vocab=32000),
    "136M": dict(layers=12, hidden=768, heads=12, kv=12, inter=2112, vocab=32000),
}
QUICK = {"tiny": dict(layers=4, hidden=64, heads=4, kv=4, inter=128, vocab=512)}
BATCH, SEQ = 8, 64  # global batch; the pipeline's 8 microbatches are 1 x 64 each
MICRO = 8
LR = 1e-3
PEER = "peer"
RACES = {  # race -> title, the peer's row, the shardfx rows' prefix
    "1": ("one device", "eager PyTorch (peer)", "shardfx "),
    "2": ("dp=2×tp=2, 4 gloo processes", "PyTorch TP (parallelize_module) + DDP (peer)",
          "shardfx mesh dp=2×tp=2, shard=megatron, "),
    "3": ("pp=2, 1F1B, 8 microbatches, 2 gloo processes",
          "torch.distributed.pipelining Schedule1F1B (peer)", "shardfx mesh pp=2, 1f1b, "),
}


def label(race_key: str, name: str) -> str:
    """A contestant's row: the peer, ``shardfx`` (its defaults) or ``shardfx fused_loss=X``."""
    _, peer_row, prefix = RACES[race_key]
    if name == PEER:
        return peer_row
    if name.startswith("torch.compile"):
        return name + " (compiled peer)"
    return prefix + ("defaults" if name == "shardfx" else name.split(" ", 1)[1])


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, fused=True)


def data(vocab: int, b: int = BATCH, s: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """One seeded batch: ``b`` sequences of ``s`` + 1 tokens; inputs the first ``s``, targets
    the next token at each position."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def planned(size: dict, x, y, options: dict, other: bool) -> list[tuple[str, object, float]]:
    """shardfx's plan of a seeded Llama with its defaults (and ``options``), and with
    ``other`` the plan with the other ``fused_loss`` setting: False where the defaults fused
    the LM head with the loss, True where they did not. (name, plan, seconds planning) each."""
    plans = []
    for fused in (None, "other") if other else (None,):
        extra = {} if fused is None else {"fused_loss": not plans[0][1].fused_losses()}
        start = time.perf_counter()
        plan = shardfx.partition(llama(**size), (x,), loss_fn, (y,), **options, **extra)
        name = "shardfx" if fused is None else f"shardfx fused_loss={extra['fused_loss']}"
        plans.append((name, plan, time.perf_counter() - start))
    return plans


def head(plan) -> str:
    """Whether ``plan`` fused its LM head with the loss (``plan.fused_losses()``)."""
    fused = plan.fused_losses()
    return ("LM head fused with the loss (" + ", ".join(
        f"{f.weight} in {f.chunks} chunks of {f.rows} rows" for f in fused) + ")") if fused \
        else "LM head not fused (ATen ops)"


def params_of(size: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in llama(**size).parameters())


# --- timing, on every rank ----------------------------------------------------------------------


def race(contestants: dict, warmup: int, steps: int, profile: bool) -> dict:
    """Alternate the contestants' steps; their wall times, CPU times and losses. In a process
    group the CPU times are every rank's (``cpu_ranks[k][rank][step]``), gathered to all."""
    cpu = {k: [] for k in contestants}
    losses = {k: [] for k in contestants}
    steps_ = {k: clocked(f, cpu[k], losses[k]) for k, f in contestants.items()}
    first: dict[str, float] = {}
    times, _ = alternate(steps_, warmup, steps, first)
    cpu = {k: v[warmup:] for k, v in cpu.items()}
    if dist.is_initialized():
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, cpu)
        cpu_ranks = {k: [r[k] for r in ranks] for k in contestants}
    else:
        cpu_ranks = {k: [v] for k, v in cpu.items()}
    out = dict(times=times, cpu_ranks=cpu_ranks, losses={k: v[-1] for k, v in losses.items()},
               first=first, profiles={})
    if profile:
        out["profiles"] = {k: top_ops(f) for k, f in contestants.items()}
    return out


def top_ops(step, n: int = 12) -> str:
    """One more step under torch.profiler: its wall time and the ``n`` ops with the most self
    CPU time (with barriers around it in a process group)."""
    if dist.is_initialized():
        dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    if dist.is_initialized():
        dist.barrier()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    aten = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e3
    total = sum(e.self_cpu_time_total for e in events) / 1e3
    rows = [f"{wall * 1e3:.0f} ms wall profiled; self CPU of all ops {total:.0f} ms, of aten:: "
            f"ops {aten:.0f} ms", "", "| op | calls | self CPU (ms) |", "|---|---:|---:|"]
    rows += [f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} |" for e in events[:n]]
    return "\n".join(rows)


# --- race 1: one device ---------------------------------------------------------------------------


def one_device(size: dict, warmup: int, steps: int, profile: bool) -> dict:
    torch.set_num_threads(1)  # see the module docstring
    x, y = data(size["vocab"])
    model = llama(**size)
    contestants, notes = {PEER: train_step(model, adamw(model.parameters()), x, y)}, []
    contestants.update(compiled_peers(size, x, y))
    plans = planned(size, x, y, {}, other=True)
    plans += [("shardfx kernels=compiled", plan, seconds)
              for _, plan, seconds in planned(size, x, y, {"kernels": "compiled"}, other=False)]
    for name, plan, seconds in plans:
        notes.append(f"{label('1', name)}: partition {seconds:.1f} s; {head(plan)}")
        runner = plan.runner(optimizer=adamw)
        contestants[name] = lambda runner=runner: runner.step((x,), (y,))
    out = race(contestants, warmup, steps, profile)
    out["notes"] = notes
    return out


def compiled_peers(size: dict, x, y) -> dict:
    """What a user compiles without shardfx: ``torch.compile`` of each decoder layer, as
    torchtitan compiles each TransformerBlock, and of the whole model; each with AdamW, the
    backward through the compiled code (its first step compiles)."""
    out = {}
    for name in ("torch.compile per block", "torch.compile"):
        model = llama(**size)
        if name.endswith("per block"):
            for layer in model.model.layers:
                layer.compile()
            forward = model
        else:
            forward = torch.compile(model)
        out[name] = train_step(forward, adamw(model.parameters()), x, y)
    return out


# --- race 2: dp=2 x tp=2 --------------------------------------------------------------------------


def dp_tp(size: dict, warmup: int, steps: int, profile: bool) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # 4 ranks on 2 cores: one intra-op thread each, for both
    x, y = data(size["vocab"])
    options = dict(mesh={"dp": 2, "tp": 2}, shard="megatron")
    contestants, notes = {}, []
    for kernels in ("auto", "compiled"):
        [(_, plan, seconds)] = planned(size, x, y, dict(options, kernels=kernels), other=False)
        name = "shardfx" if kernels == "auto" else "shardfx kernels=compiled"
        runner = plan.runner(optimizer=adamw)
        notes.append(f"{label('2', name)}: partition {seconds:.1f} s (rank 0); {head(plan)}")
        contestants[name] = lambda runner=runner: runner.step((x,), (y,))
        del plan
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    xs, ys = x.chunk(2)[dp.get_local_rank()], y.chunk(2)[dp.get_local_rank()]
    peers = {}
    for name, compiled in ((PEER, False), ("torch.compile per block, TP + DDP", True)):
        model = peer(llama(**size), mesh, compiled)
        sliced = train_step(model, adamw(model.parameters()), xs, ys)

        def peer_step(sliced=sliced):
            loss = sliced()
            dist.all_reduce(loss, group=dp.get_group())  # the dp slices' means, summed
            return loss / 2

        peers[name] = peer_step
    out = race({**peers, **contestants}, warmup, steps, profile)
    out["notes"] = notes
    return out if dist.get_rank() == 0 else None


# --- race 3: pp=2, 1F1B ---------------------------------------------------------------------------


class FirstStage(nn.Module):
    """The embedding and decoder layers ``[0, cut)`` of a ``LlamaForCausalLM``."""

    def __init__(self, lm, cut: int):
        super().__init__()
        self.embed_tokens = lm.model.embed_tokens
        self.layers = nn.ModuleList(lm.model.layers[:cut])
        self.rotary_emb = lm.model.rotary_emb

    def forward(self, ids):
        h = self.embed_tokens(ids)
        return run_layers(self.layers, self.rotary_emb, h)


class LastStage(nn.Module):
    """Decoder layers ``[cut, n)``, the final norm and the LM head: the logits."""

    def __init__(self, lm, cut: int):
        super().__init__()
        self.layers = nn.ModuleList(lm.model.layers[cut:])
        self.rotary_emb = lm.model.rotary_emb
        self.norm = lm.model.norm
        self.lm_head = lm.lm_head

    def forward(self, h):
        return self.lm_head(self.norm(run_layers(self.layers, self.rotary_emb, h)))


def run_layers(layers, rotary, h):
    """HF decoder layers as ``LlamaModel.forward`` runs them with no cache and no padding: the
    rotary embeddings of positions 0..s-1 and no mask (SDPA's causal path)."""
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    emb = rotary(h, position_ids=positions)
    for layer in layers:
        h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=emb)
    return h


def logits_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def cut_of(plan) -> int:
    """The first decoder layer of stage 1 in a 2-stage plan."""
    first = None
    for node in plan.ir.graph.find_nodes(op="placeholder"):
        role = node.meta.get(M.ROLE)
        if role is None or role.kind is not M.InputKind.PARAM or node.meta.get(M.STAGE) != 1:
            continue
        parts = role.name.split(".")
        if parts[:2] == ["model", "layers"]:
            first = int(parts[2]) if first is None else min(first, int(parts[2]))
    return first


def pipelined(size: dict, warmup: int, steps: int, profile: bool) -> dict | None:
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    x, y = data(size["vocab"])
    rank = dist.get_rank()
    contestants, runners, cuts, notes = {}, {}, {}, []
    options = dict(mesh={"pp": 2}, schedule="1f1b", microbatches=MICRO)
    plans = planned(size, x, y, options, other=True)
    plans += [("shardfx kernels=compiled", plan, seconds) for _, plan, seconds
              in planned(size, x, y, dict(options, kernels="compiled"), other=False)]
    for name, plan, seconds in plans:
        cuts[name] = cut_of(plan)
        notes.append(f"{label('3', name)}: partition {seconds:.1f} s (rank 0); {head(plan)}; "
                     f"stage 1 starts at model.layers.{cuts[name]}; schedule "
                     f"{len(plan.schedule.actions[0])} actions per rank")
        runner = runners[name] = plan.runner(optimizer=adamw)
        contestants[name] = lambda runner=runner: runner.step((x,), (y,))
        del plan
    cut = cuts["shardfx"]
    peers = {}
    for name in (PEER, "torch.compile per block, Schedule1F1B"):
        lm = llama(**size)
        module = FirstStage(lm, cut) if rank == 0 else LastStage(lm, cut)
        del lm
        if name != PEER:  # each decoder layer compiled, as torchtitan does under pipelining
            for layer in module.layers:
                layer.compile()
        stage = pipelining.PipelineStage(module, rank, 2, torch.device("cpu"))
        pipe = pipelining.Schedule1F1B(stage, MICRO, loss_fn=logits_loss, scale_grads=True)
        opt = adamw(module.parameters())

        def peer_step(pipe=pipe, opt=opt):
            losses: list = []
            pipe.step(x) if rank == 0 else pipe.step(target=y, losses=losses)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
            dist.broadcast(loss, src=1)  # the last stage has the losses
            return loss

        peers[name] = peer_step
    contestants = {**peers, **contestants}

    notes.append(f"peer: stage 0 = embedding + model.layers.0-{cut - 1} on rank 0, stage 1 = "
                 f"model.layers.{cut}-{size['layers'] - 1} + norm + lm_head on rank 1 "
                 "(shardfx's default cut)")
    out = race(contestants, warmup, steps, profile)
    out["stages"] = {}
    for name, runner in runners.items():  # their last step's actions, per stage
        spans = [(Action.parse(a), e - b) for r in runner.timeline() for a, b, e in r]
        out["stages"][name] = per_stage(spans)
    out["notes"] = notes
    if profile:  # every rank's profile: rank 1 runs the head and the loss
        profiles: list = [None] * dist.get_world_size()
        dist.all_gather_object(profiles, out["profiles"])
        out["profiles"] = {k: "\n\n".join(f"rank {r}: {p[k]}" for r, p in enumerate(profiles))
                           for k in out["profiles"]}
    return out if rank == 0 else None


# --- tables -----------------------------------------------------------------------------------


def rows_of(size_name: str, res: dict, labels: dict) -> tuple[list[str], list[str]]:
    """Table rows of one race at one size, and its one-line verdicts."""
    wall = res["times"]
    cpu = {k: [max(r[i] for r in ranks) for i in range(len(ranks[0]))]  # max over ranks
           for k, ranks in res["cpu_ranks"].items()}
    wmed = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    ref = res["losses"][PEER]
    rows, verdicts = [], []
    for k in labels:
        diff = abs(res["losses"][k] - ref) / abs(ref)
        rows.append(f"| {size_name} | {labels[k]} | {min(wall[k]) * 1e3:.0f} | "
                    f"{wmed[k] * 1e3:.0f} | {wmed[k] / wmed[PEER]:.2f}x | "
                    f"{min(cpu[k]) * 1e3:.0f} | {cmed[k] * 1e3:.0f} | "
                    f"{cmed[k] / cmed[PEER]:.2f}x | {res['losses'][k]:.6f} | "
                    f"{'—' if k == PEER else f'{diff:.1e}'} | {res['first'].get(k, 0):.1f} |")
        if k != PEER:
            verdicts.append(f"{size_name}, {labels[k]}: {wmed[k] / wmed[PEER]:.2f}x wall, "
                            f"{cmed[k] / cmed[PEER]:.2f}x CPU (median); loss differs by "
                            f"{diff:.1e} (relative)")
    return rows, verdicts


def pipeline_notes(size_name: str, res: dict, labels: dict) -> list[str]:
    out = []
    for k in labels:
        per_rank = " / ".join(f"{statistics.median(r) * 1e3:.0f}" for r in res["cpu_ranks"][k])
        line = f"{size_name}, {labels[k]}: CPU median per rank (rank 0 / rank 1) {per_rank} ms"
        if k in res.get("stages", {}):
            line += "; last step's median action per stage (F / B ms): " + "; ".join(
                f"stage {s}: " + " / ".join(f"{t[kind] * 1e3:.1f}" for kind in Kind
                                            if kind in t)
                for s, t in res["stages"][k].items())
        out.append(line)
    return out


def table(key: str, results: dict, sizes: dict, a) -> str:
    title = RACES[key][0]
    header = {
        "1": "one process, 1 intra-op thread",
        "2": "4 gloo processes, 1 thread each; wall: rank 0's step, barrier to barrier; CPU: "
             "per step the max over the 4 ranks",
        "3": "2 gloo processes, 1 thread each; wall: rank 0's step, barrier to barrier; CPU: "
             "per step the max over the 2 ranks",
    }[key]
    described = "; ".join(
        f"{n}: Llama {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, {s['kv']} "
        f"KV heads, intermediate {s['inter']}, vocab {s['vocab']} ({params_of(s):,} params, "
        f"{count(params_of(s))})" for n, s in sizes.items())
    rows = [f"step race {key}, {title}: {described}; global batch {BATCH} x {SEQ} tokens, "
            f"next-token cross entropy, AdamW, fp32; {header}; {a.steps} timed steps after "
            f"{a.warmup} warm-up, contestants alternating", "",
            "| model | variant | wall min (ms) | wall median (ms) | vs peer | CPU min (ms) | "
            f"CPU median (ms) | vs peer | loss after step {a.warmup + a.steps} | loss vs peer | "
            "first step (s) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts, notes = [], []
    for size_name, res in results.items():
        labels = {k: label(key, k) for k in res["times"]}  # the peer first
        r, v = rows_of(size_name, res, labels)
        rows += r
        verdicts += v
        notes += [f"{size_name}, {n}" for n in res.get("notes", [])]
        if key == "3":
            notes += pipeline_notes(size_name, res, labels)
    return "\n".join(rows + ["", *verdicts, "", *notes])


def sources() -> str:
    """A hash of the shardfx sources this run imports (they may change under a long run)."""
    import hashlib

    root = Path(shardfx.__file__).parent
    digest = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        digest.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return digest.hexdigest()[:12]


def in_child(fn, *args):
    """``fn(*args)`` in a fresh spawned process: the memory of its
    three models goes back to the system when it ends, before the multi-process races."""
    import importlib
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    fn = getattr(importlib.import_module(__name__ if __name__ != "__main__" else "bench.step"),
                 fn.__name__)  # by module name: this file may be running as __main__
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="a tiny Llama, 3 timed steps, not appended: a smoke test")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--races", default="1,2,3")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--profile", action="store_true",
                        help="one more step of each contestant under torch.profiler: top ops")
    parser.add_argument("--json", help="also write every step's times and losses here")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    if a.quick:
        sizes, a.steps = QUICK, min(a.steps, 3)
    else:
        sizes = {k: SIZES[k] for k in a.sizes.split(",")}
    for n, s in sizes.items():
        print(f"{n}: {params_of(s):,} parameters", flush=True)

    start, load, code = time.perf_counter(), os.getloadavg(), sources()
    tables, profiles, raw = [], [], {}
    for key in a.races.split(","):
        results = {}
        for size_name, size in sizes.items():
            t0 = time.perf_counter()
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
            if key == "1":
                results[size_name] = in_child(one_device, size, a.warmup, a.steps, a.profile)
            else:
                fn = dp_tp if key == "2" else pipelined
                results[size_name] = shardfx.launch(fn, size, a.warmup, a.steps, a.profile,
                                                    nprocs=4 if key == "2" else 2, timeout=600,
                                                    deadline=3600)[0]
            shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
            print(f"race {key}, {size_name}: {time.perf_counter() - t0:.0f} s", flush=True)
            profiles += [f"### race {key}, {size_name}, {label(key, k)}\n\n{p}"
                         for k, p in results[size_name]["profiles"].items()]
        raw[key] = {n: {k: v for k, v in r.items() if k in ("times", "cpu_ranks", "losses")}
                    for n, r in results.items()}
        tables.append(table(key, results, sizes, a))
        print(tables[-1], flush=True)
    load = (load, os.getloadavg())
    text = "\n\n".join(tables) + (
        f"\n\n{time.perf_counter() - start:.0f} s in all; load average (1 min) "
        f"{load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end, on "
        f"{os.cpu_count()} cores; shardfx sources {code}")
    if sources() != code:
        text += (f"\n\nWARNING: the shardfx sources changed during the run ({code} -> "
                 f"{sources()}): races started at different times timed different code")
    if profiles:
        print("\n\n".join(profiles))
    if a.json:
        Path(a.json).write_text(json.dumps(raw, indent=1))
    print(text.rsplit("\n", 1)[-1])
    if not a.quick and not a.no_append:
        append_results("step", text, machine())


if __name__ == "__main__":
    main()
