"""Planning under a memory budget at scale: what ``memory_budget`` adds to ``partition``.

The model is ``bench.plan``'s: a Hugging Face ``LlamaForCausalLM`` of the Llama-3-70B shape on
the meta device, at ``--layers`` 4, 16, 32 and 80, the global batch 16 x 4096 token ids, on
dp=8 x tp=8 (``shard="megatron"``). After one untimed plan (a process's first trace is slower),
per layer count ``--repeats`` rounds, each round every plan below in turn, each a fresh
``partition`` timed in CPU seconds (this machine is shared), the median and minimum reported:

- plain: no budget;
- floor: ``memory_budget=1``, which no plan meets: the search for the lowest peak, stated by
  the ``MemoryBudgetError``;
- budget: halfway between that floor and the plain plan's peak, with each candidate judged on
  shallow copies of the model (``shardfx.compiler.shallow``, from ``shallow.DEEP`` = 16 layers);
- whole: the same budget, each candidate judged on the whole program (``shallow.DEEP`` raised
  past the layer count), as every plan was before: the two must choose the same recomputation
  and the same peak, and the bench fails (nothing appended) where they do not.

Per row: the seconds of each, what the budget recomputes (ops, FLOPs), the predicted peak
against the budget, and budget / plain. Below: the 80-layer budget plan against the 4-layer one
(goal <= 1.3x) and the shallow judging against the whole program's.

    python -m bench.plan_budget [--layers 4,16,32,80] [--repeats 3] [--no-append]

Then the same model on pp=8 x tp=8 (``--pipeline-layers`` 8, 16, 80: a block a stage at
least), plain and under 85% of the plain plan's fullest rank (its floor search takes minutes
at 80 layers): shallow copies do not judge pipelines, so every candidate of every schedule is
judged on the whole stage programs.

Small shapes for a quick check: ``--layers 4,16 --hidden 512 --inter 1408 --heads 8 --kv 8
--vocab 1000 --seq 256 --pipeline-layers 8 --no-append``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings

import shardfx
from bench.common import append_results, machine
from bench.plan import build, loss_fn, shape_arguments
from shardfx.compiler import shallow

warnings.filterwarnings("ignore")

MESH = {"dp": 8, "tp": 8}
GOAL = 1.3  # the 80-layer budget plan against the 4-layer one
GiB = 2 ** 30


def cpu_seconds(fn):
    """``fn()`` and the CPU seconds it took (garbage collected first)."""
    gc.collect()
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def timings(rounds: list[dict]) -> dict:
    """Per contestant, the median of its rounds' CPU seconds, and the minimum (``" min"``)."""
    out = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        out[key], out[key + " min"] = statistics.median(values), min(values)
    return out


def one_size(a, layers: int) -> dict:
    """``--repeats`` rounds of the four plans, each round all four in turn (interleaved)."""
    model, args, targets = build(a, layers)

    def plan(budget=None):
        return shardfx.partition(model, args, loss_fn, targets, mesh=MESH, shard="megatron",
                                 memory_budget=budget)

    def floor():
        try:
            plan(1)
        except shardfx.MemoryBudgetError as e:
            return e.least.total
        raise AssertionError("a budget of 1 byte was met")

    rounds, out = [], {}
    for _ in range(a.repeats):
        seconds = {}
        plain, seconds["plain"] = cpu_seconds(plan)
        top = plain.memory_estimate()[0]
        del plain
        least, seconds["floor"] = cpu_seconds(floor)
        budget = (least + top) // 2
        out.update(top=top, least=least, limit=budget)
        deep = shallow.DEEP
        for name, depth in (("budget", deep), ("whole", 10 ** 9)):
            shallow.DEEP = depth
            try:
                fitted, seconds[name] = cpu_seconds(lambda: plan(budget))
            finally:
                shallow.DEEP = deep
            remat = fitted.remat
            choice = (remat.recomputed if remat else (), fitted.memory_estimate()[0])
            if out.setdefault(name + " choice", choice) != choice:  # planning is deterministic
                out[name + " choice"] = ("differs between rounds", 0)
            out["flops"] = remat.flops if remat else 0
            del fitted
        rounds.append(seconds)
    return out | timings(rounds)


PIPELINE = {"pp": 8, "tp": 8}
PIPELINE_SHARE = 0.85  # of the plain pipeline's fullest rank (its floor search took minutes
# at 80 layers; at 8 the floor is 82% of the plain peak, the last stage holding the 128k head)


def one_pipeline(a, layers: int) -> dict:
    """The pipeline's plain plan and its plan under ``PIPELINE_SHARE`` of the plain peak, each
    candidate of each schedule judged on the whole stage programs (no shallow copies here)."""
    model, args, targets = build(a, layers)

    def plan(budget=None):
        return shardfx.partition(model, args, loss_fn, targets, mesh=PIPELINE, shard="megatron",
                                 microbatches=a.microbatches, memory_budget=budget)

    rounds = []
    for _ in range(a.repeats):  # the two interleaved
        seconds = {}
        plain, seconds["plain"] = cpu_seconds(plan)
        top = max(plain.memory_estimate().values())
        del plain
        budget = int(PIPELINE_SHARE * top)
        fitted, seconds["budget"] = cpu_seconds(lambda: plan(budget))
        remat = fitted.remat
        out = dict(top=top, limit=budget, ops=len(remat.recomputed) if remat else 0,
                   peak=max(fitted.memory_estimate().values()),
                   schedule=next((c.name for c in fitted.budget_candidates
                                  if c.schedule is fitted.schedule), "as asked"))
        del fitted
        rounds.append(seconds)
    return out | timings(rounds)


def pipeline_rows(results: dict[int, dict]) -> list[str]:
    out = ["| layers | plain (s) | budget (s) | budget / plain | recomputed ops | schedule | "
           "peak / budget (GiB) |", "|---:|---:|---:|---:|---:|---|---|"]
    for layers, r in results.items():
        out.append(f"| {layers} | {cell(r, 'plain')} | {cell(r, 'budget')} | "
                   f"{r['budget'] / r['plain']:.2f}x | {r['ops']} | {r['schedule']} | "
                   f"{r['peak'] / GiB:.1f} / {r['limit'] / GiB:.1f} |")
    return out


def cell(r: dict, key: str) -> str:
    """Median seconds (minimum)."""
    return f"{r[key]:.2f} ({r[key + ' min']:.2f})"


def rows(results: dict[int, dict]) -> list[str]:
    out = ["| layers | plain (s) | floor (s) | budget (s) | whole program (s) | budget / plain | "
           "recomputed ops | recompute TFLOP | peak / budget (GiB) | floor (GiB) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for layers, r in results.items():
        ops, peak = r["budget choice"]
        out.append(f"| {layers} | {cell(r, 'plain')} | {cell(r, 'floor')} | "
                   f"{cell(r, 'budget')} | {cell(r, 'whole')} | "
                   f"{r['budget'] / r['plain']:.2f}x | {len(ops)} | "
                   f"{r['flops'] / 1e12:.2f} | {peak / GiB:.1f} / {r['limit'] / GiB:.1f} | "
                   f"{r['least'] / GiB:.1f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="4,16,32,80", help="comma-separated layer counts")
    shape_arguments(parser)
    parser.add_argument("--pipeline-layers", default="8,16,80",
                        help="layer counts of the pp=8 x tp=8 rows ('' for none)")
    parser.add_argument("--microbatches", type=int, default=8, help="of the pipeline")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds per layer count, the plans of a round in turn")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    layer_counts = sorted({int(n) for n in a.layers.split(",")})
    model, args, targets = build(a, layer_counts[0])  # warm-up, untimed: a process's first
    shardfx.partition(model, args, loss_fn, targets, mesh=MESH, shard="megatron")  # trace is slow
    del model
    results = {}
    for layers in layer_counts:
        results[layers] = one_size(a, layers)
        print(f"{layers} layers done", file=sys.stderr, flush=True)
    piped = {}
    for layers in sorted({int(n) for n in a.pipeline_layers.split(",") if n}):
        piped[layers] = one_pipeline(a, layers)
        print(f"{layers} layers of the pipeline done", file=sys.stderr, flush=True)
    differ = [layers for layers, r in results.items() if r["budget choice"] != r["whole choice"]]
    lo, hi = min(results), max(results)
    title = (f"planning under memory_budget: Llama, hidden {a.hidden}, intermediate {a.inter}, "
             f"{a.heads} heads, {a.kv} KV heads, vocab {a.vocab} (meta device), global batch "
             f"{a.batch} x {a.seq}, dp=8 x tp=8, shard=megatron; CPU seconds of a partition, "
             f"median (min) of {a.repeats} rounds, each round every plan of a layer count in "
             f"turn; the budget halfway between the floor and the plain plan's peak")
    summary = [
        f"- the {hi}-layer budget plan: {results[hi]['budget'] / results[lo]['budget']:.2f}x "
        f"the {lo}-layer one (goal <= {GOAL}x); its plain plan {results[hi]['plain']:.2f} s, "
        f"{results[hi]['plain'] / results[lo]['plain']:.2f}x the {lo}-layer plain plan",
        f"- judged on shallow copies vs on the whole program at {hi} layers: "
        f"{results[hi]['budget']:.2f} s vs {results[hi]['whole']:.2f} s "
        f"({results[hi]['budget'] / results[hi]['whole']:.2f}x); the same recomputation and "
        f"peak at every layer count" if not differ else f"- DIFFERENT choices at {differ}",
        f"- shallow copies judge candidates from {shallow.DEEP} layers; below, the whole "
        f"program does (the two columns are one path there)"]
    if piped:
        plo, phi = min(piped), max(piped)
        summary += [
            "", f"the same model on pp=8 x tp=8, {a.microbatches} microbatches, 1F1B (and 1F1B "
            f"with fewer in flight, the budget's other candidates), the budget "
            f"{PIPELINE_SHARE:.0%} of the plain plan's fullest rank; each candidate judged on "
            "the whole stage programs:", "", *pipeline_rows(piped), "",
            f"- the {phi}-layer pipeline's budget plan: {piped[phi]['budget']:.1f} s, "
            f"{piped[phi]['budget'] / piped[plo]['budget']:.2f}x the {plo}-layer one and "
            f"{piped[phi]['budget'] / piped[phi]['plain']:.1f}x its plain plan"]
    table = "\n".join([title, "", *rows(results), "", *summary])
    print(table)
    if differ:
        print(f"\nFAILED: shallow and whole-program judging chose differently at {differ} "
              "layers (nothing appended)", file=sys.stderr)
        sys.exit(1)
    if not a.no_append:
        append_results("plan_budget", table, machine())


if __name__ == "__main__":
    main()
