"""Compile time: the first step of a compiled plan (``kernels="compiled"``) as the model grows
deeper, against ``torch.compile`` of the same model, with Inductor's on-disk cache empty and
then full.

Models: ``LlamaForCausalLM`` from a config, seeded random weights, fp32 (``bench.spmd.llama``):
hidden 256, 4 heads, 4 KV heads, intermediate 512, vocab 2048, at 4 and at 32 layers (the
``--layers`` list); one batch of 4 x 64 tokens, next-token cross entropy, AdamW.

Each measurement runs in a fresh spawned process (nothing compiled in it before), one
intra-op thread, Inductor's cache in a folder of the run's own: "cold" with the folder empty,
"warm" in a second process on the folder the first filled (a second run of the same plan, or
of the same script). A row's "first step" is the wall time of the first training step (the
compile is in it, and for shardfx the plan is not: partition's time is its own column); "step"
the median of the 3 steps after it. shardfx's row also gives the region codes it compiled and
the region calls a step makes (``shardfx.compiled_regions()``).

    python -m bench.compile [--layers 4,32] [--no-append]

Prints a table and appends it to bench/RESULTS.md with the machine, load and date.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import torch

from bench.common import append_results, machine

warnings.filterwarnings("ignore")

SIZE = dict(hidden=256, heads=4, kv=4, inter=512, vocab=2048)
BATCH, SEQ = 4, 64


def measure(who: str, layers: int, cache: str) -> dict:
    """In this (fresh) process: partition's time, the first step's, the median of 3 more."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch.set_num_threads(1)
    import shardfx
    from bench.spmd import batch, llama, loss_fn, train_step

    x, y = batch(SIZE["vocab"], BATCH, SEQ)
    model = llama(layers=layers, **SIZE)
    planning = 0.0
    if who == "shardfx":
        start = time.perf_counter()
        plan = shardfx.partition(model, (x,), loss_fn, (y,), kernels="compiled")
        planning = time.perf_counter() - start
        runner = plan.runner(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))

        def step():
            return runner.step((x,), (y,))
    else:
        step = train_step(torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-3),
                          x, y)

    times = []
    for _ in range(4):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    out = dict(planning=planning, first=times[0], step=statistics.median(times[1:]))
    if who == "shardfx":
        c = shardfx.compiled_regions()
        out.update(codes=c.codes, calls=c.calls // 4)
    return out


def in_child(*args) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="4,32")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    depths = [int(n) for n in a.layers.split(",")]
    load, start = os.getloadavg(), time.perf_counter()
    rows = ["| contestant | layers | cache | partition (s) | first step (s) | step median (ms) | "
            "region codes | region calls a step |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    first: dict = {}
    for layers in depths:
        for who in ("shardfx", "torch.compile"):
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                for state in ("cold", "warm"):
                    r = in_child(who, layers, cache)
                    first[(who, layers, state)] = r["first"]
                    rows.append(f"| {who} | {layers} | {state} | {r['planning']:.1f} | "
                                f"{r['first']:.1f} | {r['step'] * 1e3:.0f} | "
                                f"{r.get('codes', '—')} | {r.get('calls', '—')} |")
                    print(rows[-1], flush=True)
    lo, hi = min(depths), max(depths)
    verdicts = [f"{who}, cache {state}: first step at {hi} layers {first[(who, hi, state)] / first[(who, lo, state)]:.2f}x "
                f"the first step at {lo}" for who in ("shardfx", "torch.compile")
                for state in ("cold", "warm")]
    verdicts += [f"{state} cache, {layers} layers: shardfx's first step "
                 f"{first[('shardfx', layers, state)] / first[('torch.compile', layers, state)]:.2f}x "
                 "torch.compile's" for layers in depths for state in ("cold", "warm")]
    end = os.getloadavg()
    text = (f"compile: Llama hidden {SIZE['hidden']}, {SIZE['heads']} heads, intermediate "
            f"{SIZE['inter']}, vocab {SIZE['vocab']}, fp32, batch {BATCH} x {SEQ}, AdamW; each row a "
            "fresh process, 1 intra-op thread; Inductor's cache empty (cold), then as the "
            "row before left it (warm)\n\n" + "\n".join(rows) + "\n\n" + "\n".join(verdicts) +
            f"\n\n{time.perf_counter() - start:.0f} s in all; load average (1 min) {load[0]:.1f} "
            f"at the start, {end[0]:.1f} at the end, on {os.cpu_count()} cores")
    print(text)
    if not a.no_append:
        append_results("compile", text, machine())


if __name__ == "__main__":
    main()
