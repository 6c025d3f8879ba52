"""Planning under a memory budget at scale: what ``memory_budget`` adds to ``partition``.

The model is ``bench.plan``'s: a Hugging Face ``LlamaForCausalLM`` of the Llama-3-70B shape on
the meta device, at ``--layers`` 4, 16, 32 and 80, the global batch 16 x 4096 token ids, on
dp=8 x tp=8 (``shard="megatron"``). After one untimed plan (a process's first trace is slower),
per layer count, each a fresh ``partition`` timed in CPU seconds (this machine is shared):

- plain: no budget;
- floor: ``memory_budget=1``, which no plan meets: the search for the lowest peak, stated by
  the ``MemoryBudgetError``;
- budget: halfway between that floor and the plain plan's peak, with each candidate judged on
  shallow copies of the model (``shardfx.shallow``, from ``shallow.DEEP`` = 16 layers);
- whole: the same budget, each candidate judged on the whole program (``shallow.DEEP`` raised
  past the layer count), as every plan was before: the two must choose the same recomputation
  and the same peak, and the bench fails (nothing appended) where they do not.

Per row: the seconds of each, what the budget recomputes (ops, FLOPs), the predicted peak
against the budget, and budget / plain. Below: the 80-layer budget plan against the 4-layer one
(goal <= 1.3x) and the shallow judging against the whole program's.

    python -m bench.plan_budget [--layers 4,16,32,80] [--no-append]

Small shapes for a quick check: ``--layers 4,16 --hidden 512 --inter 1408 --heads 8 --kv 8
--vocab 1000 --seq 256 --no-append``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings

import shardfx
from bench.common import append_results, machine
from bench.plan import build, loss_fn, shape_arguments
from shardfx import shallow

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


def one_size(a, layers: int) -> dict:
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

    plain, plain_s = cpu_seconds(plan)
    top = plain.memory_estimate()[0]
    del plain
    least, floor_s = cpu_seconds(floor)
    budget = (least + top) // 2
    out = dict(top=top, least=least, limit=budget, plain=plain_s, floor=floor_s)
    deep = shallow.DEEP
    for name, depth in (("budget", deep), ("whole", 10 ** 9)):
        shallow.DEEP = depth
        try:
            fitted, seconds = cpu_seconds(lambda: plan(budget))
        finally:
            shallow.DEEP = deep
        remat = fitted.remat
        out[name] = seconds
        out[name + " choice"] = (remat.recomputed if remat else (), fitted.memory_estimate()[0])
        out["flops"] = remat.flops if remat else 0
        del fitted
    return out


def rows(results: dict[int, dict]) -> list[str]:
    out = ["| layers | plain (s) | floor (s) | budget (s) | whole program (s) | budget / plain | "
           "recomputed ops | recompute TFLOP | peak / budget (GiB) | floor (GiB) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for layers, r in results.items():
        ops, peak = r["budget choice"]
        out.append(f"| {layers} | {r['plain']:.2f} | {r['floor']:.2f} | {r['budget']:.2f} | "
                   f"{r['whole']:.2f} | {r['budget'] / r['plain']:.2f}x | {len(ops)} | "
                   f"{r['flops'] / 1e12:.2f} | {peak / GiB:.1f} / {r['limit'] / GiB:.1f} | "
                   f"{r['least'] / GiB:.1f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="4,16,32,80", help="comma-separated layer counts")
    shape_arguments(parser)
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
    differ = [layers for layers, r in results.items() if r["budget choice"] != r["whole choice"]]
    lo, hi = min(results), max(results)
    title = (f"planning under memory_budget: Llama, hidden {a.hidden}, intermediate {a.inter}, "
             f"{a.heads} heads, {a.kv} KV heads, vocab {a.vocab} (meta device), global batch "
             f"{a.batch} x {a.seq}, dp=8 x tp=8, shard=megatron; CPU seconds of one partition "
             f"each; the budget halfway between the floor and the plain plan's peak")
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
