"""Pipeline parallelism: measured bubble against the published formulas, and step time against
PyTorch's own pipelining (torch.distributed.pipelining).

1. Bubble vs formula on an artificially balanced model (``bench/timed.py``): every stage's
   F, B and W take exactly ``--ms`` (``timed_work``: the core sleeps, as a CPU does while its
   GPU computes; tensors are tiny, so messages cost next to nothing). gpipe, 1f1b,
   interleaved-1f1b (v = 2, each action half as long) and zero-bubble (ZB-H1); p = 2 gloo
   processes, m = 8; medians of ``--repeats`` steps after 2 warm-up, for ``--ms`` 10 and 100.
   ``runner.bubble()`` (idle, waiting for data included, over compute) against
   ``formula_bubble(name, p, m, v)`` as published and as shardfx runs the schedule
   (``send_early=True``: without W actions a B sends its input gradient before computing the
   weight gradient, which shrinks the first three schedules' bubbles by (F+B-W)/(F+B) = 2/3).
   Goal: within 5% of the latter. The difference, spread over a rank's actions, is what the
   runner adds per action (posting, Python, message latency): it shows in the 10 ms rows.
2. The same on real arithmetic: a scale, then ``--layers`` Linear(H, H) + ReLU blocks with
   ``pipe_split`` between equal groups, one thread per process. On this machine's two shared
   cores the stages' speeds drift apart, which the formulas do not model: the per-stage
   medians show how far.
3. Step time against the peer, same schedule, model, weights, data, cuts and microbatches, on
   two models: the small one of part 2 (``--steps`` timed steps) and a medium one, a scale then
   ``--medium-layers`` Linear(``--medium-hidden``) + ReLU blocks (12 x 2048: 50.4 M
   parameters) on ``--medium-rows`` rows (``--medium-steps`` timed steps, 0 to skip). Each
   rank wraps each of its stages' layers (an ``nn.Sequential``, cut where the model's
   ``pipe_split`` markers cut it) in a manual ``PipelineStage`` and runs ``Schedule1F1B`` /
   ``ScheduleGPipe`` / ``ScheduleInterleaved1F1B`` (2 stages per rank; ``scale_grads=True``:
   gradients of the mean microbatch loss, as shardfx). One ``shardfx.launch`` per model and
   schedule, the two alternating step by step (``--warmup``, then the timed steps, barriers
   around each): rank 0's min and median step time, the ratio shardfx / peer (goal <= 1.0x),
   both losses after the last step (must agree).
4. ``bench/pipeline_trace.json``: ``runner.trace`` of the last measured 1f1b step of part 1
   at 100 ms (not written with ``--no-append``).

    python -m bench.pipeline [--repeats 5] [--steps 30] [--medium-steps 10] [--no-append]

Prints the tables and appends them to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import shardfx
from bench.common import alternate, append_results, count, machine
from bench.timed import Timed
from shardfx.schedule import Action, Kind, formula_bubble

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


# --- 1 and 2. bubble vs formula -----------------------------------------------------------------

def bubbles(model: str, size: dict, repeats: int, trace: bool) -> dict | None:
    """On every rank: each schedule's steps; rank 0 returns the measured bubbles and each
    stage's median F, B, W compute time."""
    torch.set_num_threads(1)
    out = {}
    x, y = data(size["rows"], size["hidden"])
    for name, v in SCHEDULES.items():
        if model == "timed":  # each action ms long: interleaved's 2 virtual stages half as long
            net = Timed(P * v, size["hidden"], P * v, size["ms"] / v)
        else:
            net = Stack(size["layers"], size["hidden"], P * v)
        plan = shardfx.partition(net, (x,), loss_fn, (y,), mesh={"pp": P}, microbatches=M,
                                 schedule=name)
        runner, measured, spans = plan.runner(optimizer=adamw), [], []
        for i in range(2 + repeats):
            dist.barrier()
            runner.step((x,), (y,))
            timeline, bubble = runner.timeline(), runner.bubble()
            if i >= 2:
                measured.append(bubble)
                spans += [(Action.parse(a), e - b) for rank in timeline for a, b, e in rank]
        out[name] = dict(bubble=statistics.median(measured), stages=per_stage(spans),
                         actions=len(plan.schedule.actions[0]))
        if trace and name == "1f1b":
            runner.trace(str(TRACE))
    return out if dist.get_rank() == 0 else None


def per_stage(spans: list[tuple[Action, float]]) -> dict[int, dict[Kind, float]]:
    """Median compute time of each stage's F, B and W actions."""
    times: dict[int, dict[Kind, list[float]]] = {}
    for a, d in spans:
        times.setdefault(a.stage, {}).setdefault(a.kind, []).append(d)
    return {s: {k: statistics.median(ds) for k, ds in kinds.items()}
            for s, kinds in sorted(times.items())}


def bubble_rows(res: dict, label: str) -> list[str]:
    rows = []
    for name, r in res.items():
        v = SCHEDULES[name]
        published, as_run = formula_bubble(name, P, M, v), formula_bubble(name, P, M, v,
                                                                          send_early=True)
        stages = r["stages"]
        busy = sum(k[x] for k in stages.values() for x in k) * M  # one step, all ranks
        per_action = (r["bubble"] - as_run) * busy / (P * r["actions"])
        fbw = "; ".join(f"{s}: " + " / ".join(f"{k[x] * 1e3:.1f}" for x in Kind if x in k)
                        for s, k in stages.items())
        rows.append(f"| {label} | {name}{f' (v={v})' if v > 1 else ''} | {published:.4f} | "
                    f"{as_run:.4f} | {r['bubble']:.4f} | {(r['bubble'] - as_run) / as_run:+.1%} "
                    f"| {per_action * 1e3:+.2f} | {fbw} |")
    return rows


HEADER = ["| model | schedule | formula (published) | formula (as run) | runner.bubble() "
          "| vs as run | idle added per action (ms) | F / B / W per stage (ms) |",
          "|---|---|---:|---:|---:|---:|---:|---|"]


def bubble_tables(a) -> str:
    rows = [f"bubble: p={P}, m={M}, {P} gloo processes, 1 thread each; medians of {a.repeats} "
            f"steps after 2 warm-up", "", *HEADER]
    for ms in (10, 100):
        size = dict(ms=ms, hidden=16, rows=64)
        trace = ms == 100 and not a.no_append  # a recorded run's trace only
        res = shardfx.launch(bubbles, "timed", size, a.repeats, trace, nprocs=P,
                             timeout=300, deadline=1200)[0]
        rows += bubble_rows(res, f"timed, {ms} ms per F, B, W")
    size = dict(layers=a.layers, hidden=a.hidden, rows=a.rows)
    res = shardfx.launch(bubbles, "matmul", size, a.repeats, False, nprocs=P, timeout=300,
                         deadline=1200)[0]
    rows += bubble_rows(res, f"Scale + {a.layers} x (Linear({a.hidden}, {a.hidden}) + ReLU), "
                             f"batch {a.rows}")
    rows += ["", "formula (published): `formula_bubble(name, p, m, v)`; (as run): with "
             "`send_early=True`, the runner sending a B's input gradient before its weight "
             "gradient (2/3 of the published bubble at F = W = B/2; zero-bubble runs W apart "
             "and is unchanged). runner.bubble(): idle (waiting for data included) over compute, "
             "summed over ranks. idle added per action: (measured - as run) x compute / "
             "(ranks x actions per rank). F / B / W: median compute time of each stage's "
             "actions (B: the whole backward unless there is W). timed: `bench/timed.py`, "
             "each action sleeps its time exactly; interleaved's actions are half as long "
             "(two virtual stages per rank)."]
    if not a.no_append:
        rows[-1] += f" Trace of the last 1f1b step at 100 ms: bench/{TRACE.name}."
    return "\n".join(rows)


# --- 3. step time against torch.distributed.pipelining ----------------------------------------


PEERS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
         "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def race(name: str, layers: int, hidden: int, rows: int, warmup: int, steps: int) -> dict | None:
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    x, y = data(rows, hidden)
    stages = P * SCHEDULES[name]
    plan = shardfx.partition(Stack(layers, hidden, stages), (x,), loss_fn, (y,),
                             mesh={"pp": P}, microbatches=M, schedule=name)
    runner = plan.runner(optimizer=adamw)
    rank = dist.get_rank()
    full = Stack(layers, hidden, stages)  # same seed, same weights; a copy of its own
    bounds = [0, *sorted(full.cuts), len(full.layers)]  # the same cuts as the markers'
    mine = {s: nn.Sequential(*full.layers[bounds[s]:bounds[s + 1]])
            for s in range(rank, stages, P)}  # stage s on rank s % P, as shardfx places it
    peer = [pipelining.PipelineStage(m, s, stages, torch.device("cpu")) for s, m in mine.items()]
    schedule = getattr(pipelining, PEERS[name])
    pipe = schedule(peer if stages > P else peer[0], M, loss_fn=loss_fn)
    opt = adamw([p for m in mine.values() for p in m.parameters()])

    def peer_step():
        opt.zero_grad()
        losses: list = []
        pipe.step(x) if rank == 0 else pipe.step(target=y, losses=losses)
        opt.step()
        return torch.stack(losses).mean() if losses else torch.zeros(())

    times, losses = alternate({"shardfx": lambda: runner.step((x,), (y,)), "peer": peer_step},
                              warmup, steps)
    dist.broadcast(losses["peer"], src=P - 1)  # the last stage has the peer's losses
    return dict(times=times, losses={k: v.item() for k, v in losses.items()}) \
        if rank == 0 else None


def race_table(a) -> str:
    sizes = {"small": dict(layers=a.layers, hidden=a.hidden, rows=a.rows, steps=a.steps),
             "medium": dict(layers=a.medium_layers, hidden=a.medium_hidden, rows=a.medium_rows,
                            steps=a.medium_steps)}
    sizes = {k: v for k, v in sizes.items() if v["steps"]}
    rows = [f"step time: same model, weights, batch and cuts for both, p={P}, m={M}, AdamW, {P} "
            f"gloo processes, 1 thread each, {a.warmup} warm-up steps then the timed ones, "
            "alternating", "",
            "| model | schedule | variant | min (ms) | median (ms) | vs peer | loss after the "
            "last step |", "|---|---|---|---:|---:|---:|---:|"]
    verdicts, models = [], []
    for size_name, size in sizes.items():
        with torch.device("meta"):
            params = sum(p.numel() for p in Stack(size["layers"], size["hidden"], P).parameters())
        models.append(f"- {size_name}: Scale + {size['layers']} x (Linear({size['hidden']}, "
                      f"{size['hidden']}) + ReLU), {count(params)} params, batch {size['rows']} "
                      f"rows, {size['steps']} timed steps")
        for name, peer in PEERS.items():
            res = shardfx.launch(race, name, size["layers"], size["hidden"], size["rows"],
                                 a.warmup, size["steps"], nprocs=P, timeout=300,
                                 deadline=1800)[0]
            times, losses = res["times"], res["losses"]
            med = {k: statistics.median(ts) for k, ts in times.items()}
            labels = {"peer": f"torch.distributed.pipelining {peer} (peer)",
                      "shardfx": "shardfx runner.step"}
            for k in ("peer", "shardfx"):
                rows.append(f"| {size_name} | {name} | {labels[k]} | {min(times[k]) * 1e3:.1f} | "
                            f"{med[k] * 1e3:.1f} | {med[k] / med['peer']:.2f}x | "
                            f"{losses[k]:.6f} |")
            diff = abs(losses["shardfx"] - losses["peer"]) / abs(losses["peer"])
            verdicts.append(f"{size_name}, {name}: shardfx / peer "
                            f"{med['shardfx'] / med['peer']:.2f}x (goal <= 1.0x); losses differ "
                            f"by {diff:.1e} (relative)")
    return "\n".join(rows + ["", *models, "", *verdicts])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16, help="blocks, a multiple of 2 p")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=2048, help="global batch rows")
    parser.add_argument("--repeats", type=int, default=5, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="step race: untimed steps")
    parser.add_argument("--steps", type=int, default=30, help="step race: timed steps, small")
    parser.add_argument("--medium-layers", type=int, default=12, help="a multiple of 2 p")
    parser.add_argument("--medium-hidden", type=int, default=2048)
    parser.add_argument("--medium-rows", type=int, default=256, help="global batch rows")
    parser.add_argument("--medium-steps", type=int, default=10,
                        help="step race: timed steps, medium (0: skip it)")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    table = "\n\n".join([bubble_tables(a), race_table(a)])
    print(table)
    if not a.no_append:
        append_results("pipeline", table, machine())


if __name__ == "__main__":
    main()
