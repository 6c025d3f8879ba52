"""Pipeline parallelism: measured bubble against the published formulas, and step time against
PyTorch's own pipelining (torch.distributed.pipelining).

The model is balanced on purpose: a learned per-feature scale (so that stage 0 computes its
input's gradient too, as the other stages do), then ``--layers`` identical blocks (Linear(H, H)
+ ReLU) with ``shardfx.pipe_split`` markers between equal groups. MSE loss, AdamW, global batch
``--rows`` x H in m = 8 microbatches, p = 2 gloo processes of one thread each (sharing 2 cores).

1. Bubble vs formula, for gpipe, 1f1b, interleaved-1f1b (v = 2) and zero-bubble (ZB-H1),
   medians of ``--repeats`` steps after 2 warm-up, against ``formula_bubble(name, p, m, v)``
   (goal: within 5%): ``runner.bubble()`` (the runner's spans are compute only, waiting for a
   neighbour's data is idle: ``bubble_fraction``'s definition); simulated,
   ``shardfx.schedule.simulate`` of the schedule with the measured compute times (free
   communication, no gaps): each stage's median F, B, W, and each action's own (which adds the
   jitter of this noisy machine).
2. Step time against the peer, same schedule, model, weights, data and microbatches: each rank
   wraps its half of the layers (an ``nn.Sequential``) in a manual ``PipelineStage`` and runs
   ``Schedule1F1B`` / ``ScheduleGPipe`` (``scale_grads=True``: gradients of the mean microbatch
   loss, as shardfx). One ``shardfx.launch`` per schedule, the two alternating step by step
   (``--warmup``, then ``--steps`` timed, barriers around each): rank 0's median step time,
   the ratio shardfx / peer (goal <= 1.0x), both losses after the last step (must agree).
3. ``bench/pipeline_trace.json``: ``runner.trace`` of the last measured 1f1b step.

    python -m bench.pipeline [--repeats 8] [--steps 12] [--no-append]

Prints the tables and appends them to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import shardfx
from bench.common import append_results, machine
from shardfx.schedule import (Action, Kind, bubble_fraction, formula_bubble, generate,
                               simulate)

warnings.filterwarnings("ignore")

P, M = 2, 8
TRACE = Path(__file__).with_name("pipeline_trace.json")
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 1}  # name -> v


class Scale(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):  # (rows, H)
        return x * self.weight


class Stack(nn.Module):
    """Scale, then ``blocks`` identical blocks with a ``pipe_split`` between equal groups."""

    def __init__(self, blocks: int, hidden: int, stages: int):
        super().__init__()
        torch.manual_seed(0)
        linears = [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(blocks)]
        self.layers = nn.ModuleList([Scale(hidden), *linears])
        self.cuts = {1 + blocks * k // stages for k in range(1, stages)}

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(shardfx.pipe_split(x) if i in self.cuts else x)
        return x


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def data(rows: int, hidden: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


# --- 1. bubble vs formula ---------------------------------------------------------------------

def bubbles(layers: int, hidden: int, rows: int, repeats: int) -> dict | None:
    """On every rank: each schedule's steps; rank 0 returns what `analyse` makes of each."""
    torch.set_num_threads(1)
    out = {}
    x, y = data(rows, hidden)
    for name, v in SCHEDULES.items():
        plan = shardfx.partition(Stack(layers, hidden, P * v), (x,), loss_fn, (y,),
                                 mesh={"pp": P}, microbatches=M, schedule=name)
        runner, out[name] = plan.runner(optimizer=adamw), []
        for i in range(2 + repeats):
            dist.barrier()
            runner.step((x,), (y,))
            spans, measured = runner.timeline(), runner.bubble()
            if i >= 2:
                out[name].append(analyse(plan.schedule, spans, measured))
        if name == "1f1b":
            runner.trace(str(TRACE))
    return out if dist.get_rank() == 0 else None


def analyse(schedule, spans, measured: float) -> dict:
    """One step: the measured bubble, each action's compute time, and the simulated bubble."""
    compute = {Action.parse(a): e - b for rank in spans for a, b, e in rank}
    return dict(measured=measured, durations=compute,
                simulated=bubble_fraction(simulate(schedule, lambda a: compute[a])))


def per_stage(steps: list[dict]) -> dict[int, dict[Kind, float]]:
    """Median compute time of each stage's F, B and W actions over the steps."""
    times: dict[int, dict[Kind, list[float]]] = {}
    for step in steps:
        for a, d in step["durations"].items():
            times.setdefault(a.stage, {}).setdefault(a.kind, []).append(d)
    return {s: {k: statistics.median(ds) for k, ds in kinds.items()}
            for s, kinds in sorted(times.items())}


def bubble_table(a) -> str:
    res = shardfx.launch(bubbles, a.layers, a.hidden, a.rows, a.repeats, nprocs=P, timeout=300,
                         deadline=900)[0]
    rows = [f"bubble: Scale + {a.layers} x (Linear({a.hidden}, {a.hidden}) + ReLU), pipe_split "
            f"into equal stages, global batch {a.rows} x {a.hidden}, p={P}, m={M}, {P} gloo "
            f"processes, 1 thread each; medians of {a.repeats} steps after 2 warm-up", "",
            "| schedule | formula | runner.bubble() | vs formula "
            "| sim. stage medians | vs formula | sim. each action | vs formula "
            "| F / B / W per stage (ms) |", "|---|" + "---:|" * 7 + "---|"]
    for name, steps in res.items():
        v = SCHEDULES[name]
        formula = formula_bubble(name, P, M, v)
        stages = per_stage(steps)
        med = {k: statistics.median(s[k] for s in steps)
               for k in ("measured", "simulated")}
        med["medians"] = bubble_fraction(simulate(generate(name, P, M, v),
                                                  lambda a: stages[a.stage][a.kind]))
        cells = [f"{med[k]:.3f} | {(med[k] - formula) / formula:+.0%}"
                 for k in ("measured", "medians", "simulated")]
        fbw = "; ".join(f"{s}: " + " / ".join(f"{k[x] * 1e3:.1f}" for x in Kind if x in k)
                        for s, k in stages.items())
        rows.append(f"| {name}{f' (v={v})' if v > 1 else ''} | {formula:.3f} | "
                    + " | ".join(cells) + f" | {fbw} |")
    rows += ["", "formula: `formula_bubble(name, p, m, v)` (zero-bubble: ZB-H1's (p-1)/(3m), "
             "F = B = W). runner.bubble(): idle (waiting included) over compute. sim.: "
             "`simulate` of the schedule with each stage's median F, B, W (stage medians) or "
             "with each action's own measured compute time (each action). F / B / W: median "
             "compute time of each "
             "stage's actions (B: the whole backward unless there is W). Without W actions the "
             "runner still sends the input gradient before computing the weight gradient, so "
             "gpipe and 1f1b can beat the simulations, which wait for the whole backward. "
             f"Trace of the last 1f1b step: bench/{TRACE.name}."]
    return "\n".join(rows)


# --- 2. step time against torch.distributed.pipelining ----------------------------------------


def race(name: str, layers: int, hidden: int, rows: int, warmup: int, steps: int) -> dict | None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    x, y = data(rows, hidden)
    plan = shardfx.partition(Stack(layers, hidden, P), (x,), loss_fn, (y,), mesh={"pp": P},
                             microbatches=M, schedule=name)
    runner = plan.runner(optimizer=adamw)
    rank, cut = dist.get_rank(), 1 + layers // P  # stage 0: Scale and the first half
    mine = Stack(layers, hidden, P).layers  # same seed, same weights; a copy of its own
    mine = nn.Sequential(*(mine[:cut] if rank == 0 else mine[cut:]))
    stage = PipelineStage(mine, rank, P, torch.device("cpu"))
    pipe = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name](stage, M, loss_fn=loss_fn)
    opt = adamw(mine.parameters())

    def peer_step():
        opt.zero_grad()
        losses: list = []
        pipe.step(x) if rank == 0 else pipe.step(target=y, losses=losses)
        opt.step()
        return torch.stack(losses).mean() if losses else torch.zeros(())

    contestants = {"shardfx": lambda: runner.step((x,), (y,)), "peer": peer_step}
    times: dict[str, list[float]] = {k: [] for k in contestants}
    losses = {}
    for i in range(warmup + steps):
        for key, step in contestants.items():
            dist.barrier()
            start = time.perf_counter()
            losses[key] = step()
            dist.barrier()
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    dist.broadcast(losses["peer"], src=P - 1)  # the last stage has the peer's losses
    return dict(times=times, losses={k: v.item() for k, v in losses.items()}) \
        if rank == 0 else None


def race_table(a) -> str:
    rows = [f"step time: same model, weights and batch, p={P}, m={M}, AdamW, {P} gloo "
            f"processes, 1 thread each, {a.steps} steps after {a.warmup} warm-up, alternating",
            "", f"| schedule | variant | min (ms) | median (ms) | vs peer | loss after step "
            f"{a.warmup + a.steps} |", "|---|---|---:|---:|---:|---:|"]
    verdicts = []
    for name, peer in (("1f1b", "Schedule1F1B"), ("gpipe", "ScheduleGPipe")):
        res = shardfx.launch(race, name, a.layers, a.hidden, a.rows, a.warmup, a.steps,
                             nprocs=P, timeout=300, deadline=900)[0]
        times, losses = res["times"], res["losses"]
        med = {k: statistics.median(ts) for k, ts in times.items()}
        labels = {"peer": f"torch.distributed.pipelining {peer} (peer)",
                  "shardfx": "shardfx runner.step"}
        for k in ("peer", "shardfx"):
            rows.append(f"| {name} | {labels[k]} | {min(times[k]) * 1e3:.1f} | "
                        f"{med[k] * 1e3:.1f} | {med[k] / med['peer']:.2f}x | {losses[k]:.6f} |")
        diff = abs(losses["shardfx"] - losses["peer"]) / abs(losses["peer"])
        verdicts.append(f"{name}: shardfx / peer {med['shardfx'] / med['peer']:.2f}x "
                        f"(goal <= 1.0x); losses differ by {diff:.1e} (relative)")
    return "\n".join(rows + [""] + verdicts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8, help="blocks, a multiple of 2 p")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=1024, help="global batch rows")
    parser.add_argument("--repeats", type=int, default=8, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="step race: untimed steps")
    parser.add_argument("--steps", type=int, default=12, help="step race: timed steps")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    table = "\n\n".join([bubble_table(a), race_table(a)])
    print(table)
    if not a.no_append:
        append_results("pipeline", table, machine())


if __name__ == "__main__":
    main()
