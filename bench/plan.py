"""Planning time at scale: ``partition`` of a Llama-3-70B shape against plain torch.export.

The model is a Hugging Face ``LlamaForCausalLM`` of the Llama-3-70B shape (hidden 8192,
intermediate 28672, 64 heads, 8 KV heads, vocabulary 128256) built on the meta device with
``use_cache=False``, at ``--layers`` 8, 16, 32 and 80 (80 is the real model); the global batch
is ``--batch`` x ``--seq`` token ids (16 x 4096: two rows per dp rank on dp=8), the loss
``F.cross_entropy`` on the logits. Each layer count is planned on each mesh of ``--meshes``:

- dp=8×tp=8, ``shard="megatron"``;
- pp=8×tp=8, ``shard="megatron"``, ``--microbatches`` 8 (every mesh with pp gets them).

Next to them, ``torch.export.export(strict=False)`` of the same training callable
(``loss_fn(model(ids), targets)``, ``shardfx.partitioner.capture._LossOf``) at the same layer
count: the first step of shardfx's own capture, forward and loss only. shardfx's plan also
traces the backward: after the warm-up the bench checks that each plan returns one gradient
per trainable parameter, and fails loudly (no rows appended, exit status 1) where one does not.

Per layer count every variant runs once to warm up (its time is reported as "first": a cache
kept between ``partition`` calls would show as a first run slower than the rest), then
``--repeats`` rounds (at least 3), the variants interleaved, ``gc.collect()`` before each run.

Times are CPU seconds: ``time.process_time`` (every thread of this process) plus the CPU time of
any child process that ended during the run (``resource.getrusage(RUSAGE_CHILDREN)``; planning
spawns none today, a solver run in a subprocess would count). Planning is single-process work on
a machine shared with other jobs: its wall time measures the machine's load as much as the
planner, its CPU time far less. Wall medians are shown beside them for reference.

Per row: the layers, the mesh, shardfx's first, minimum and median CPU seconds, its median wall
seconds, torch.export's median CPU seconds, the ratio of CPU medians, the gradient outputs, the
per-device program's node count (summed over the stage parts under pp) and the capture path the
plan reports ("-" where it says none). Below the table: each variant's slope, CPU seconds per
extra layer between the fewest and the most layers, and the goal: <= 10 s at 80 layers, flat
past the first block.

    python -m bench.plan [--layers 8,16,32,80] [--meshes "dp=8,tp=8;pp=8,tp=8"]
                         [--batch 16] [--seq 4096] [--repeats 3] [--no-append]

Small shapes for a quick check: ``--layers 2,4 --hidden 512 --inter 1024 --heads 8 --kv 8
--vocab 1000 --meshes "dp=2,tp=2;pp=2,tp=2" --no-append``.

Prints the table and appends it to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
import traceback
import warnings
from importlib.metadata import version

import torch
import torch.nn.functional as F

import shardfx
from bench.common import (append_results, capture_path, check_backward, count, machine,
                          mesh_label, program_nodes)
from bench.row_processes import load
from shardfx.partitioner.capture import _LossOf

warnings.filterwarnings("ignore")

GOAL_S = 10.0  # seconds at 80 layers
EXPORT = "torch.export"
MIN_REPEATS = 3  # a median of fewer runs is one run's noise


def cpu_now() -> float:
    """CPU seconds used so far by this process (all threads) and its waited-for children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def cpu_and_wall(fn) -> tuple[float, float, object]:
    """CPU and wall seconds of ``fn()``, garbage collected first (the previous plan's graphs
    are large), and its result."""
    gc.collect()
    cpu, wall = cpu_now(), time.perf_counter()
    result = fn()
    return cpu_now() - cpu, time.perf_counter() - wall, result


def build(a, layers: int):
    """The meta model, one global batch of ids and its targets."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=a.hidden, intermediate_size=a.inter,
        num_attention_heads=a.heads, num_key_value_heads=a.kv, vocab_size=a.vocab,
        use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids, targets = (torch.randint(0, a.vocab, (a.batch, a.seq), device="meta") for _ in range(2))
    return model, (ids,), (targets,)


def loss_fn(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def parse_meshes(text: str) -> list[dict[str, int]]:
    """``"dp=8,tp=8;pp=8,tp=8"`` -> ``[{"dp": 8, "tp": 8}, {"pp": 8, "tp": 8}]``."""
    meshes = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        axes = (axis.split("=") for axis in spec.split(","))
        meshes.append({name.strip(): int(size) for name, size in axes})
    return meshes


def planner(model, args, targets, mesh: dict[str, int], microbatches: int):
    """A call that plans ``model`` for ``mesh`` (with microbatches where the mesh has pp)."""
    extra = {"microbatches": microbatches} if mesh.get("pp", 1) > 1 else {}
    return lambda: shardfx.partition(model, args, loss_fn, targets, mesh=mesh, shard="megatron",
                                     **extra)


def one_size(a, layers: int, meshes: list[dict[str, int]]) -> dict:
    """Every variant at ``layers``: first run, then ``--repeats`` interleaved. Returns per
    variant its times and, for the plans, gradients, nodes and capture path (or the error)."""
    model, args, targets = build(a, layers)
    traced = _LossOf(model, loss_fn)
    variants = {EXPORT: lambda: torch.export.export(traced, (args, targets), strict=False)}
    variants |= {mesh_label(m): planner(model, args, targets, m, a.microbatches) for m in meshes}
    res: dict[str, dict] = {name: {"cpu": [], "wall": []} for name in variants}
    res["params"] = sum(p.numel() for p in model.parameters())
    for name, fn in variants.items():  # warm-up, timed as "first"; each plan checked
        try:
            res[name]["first"], _, result = cpu_and_wall(fn)
            if name != EXPORT:
                res[name] |= dict(
                    grads=check_backward(result.ir, model, f"{name}, {layers} layers"),
                    nodes=program_nodes(result), path=capture_path(result))
            del result
        except (Exception, SystemExit) as e:  # the row says what failed; the run exits 1
            first_line = (str(e).splitlines() or [""])[0][:300]
            res[name] = {"error": f"{type(e).__name__}: {first_line}"}
            print(f"--- {name}, {layers} layers failed:", file=sys.stderr)
            traceback.print_exc()
    ok = {name: fn for name, fn in variants.items() if "error" not in res[name]}
    for _ in range(a.repeats):
        for name, fn in ok.items():
            cpu, wall, _ = cpu_and_wall(fn)
            res[name]["cpu"].append(cpu)
            res[name]["wall"].append(wall)
    return res


def rows(results: dict[int, dict], meshes: list[dict[str, int]]) -> list[str]:
    out = ["| layers | params | mesh | first CPU (s) | min CPU (s) | median CPU (s) | median "
           "wall (s) | torch.export median CPU (s) | vs export (CPU) | gradients | program nodes "
           "| capture path |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for layers, res in results.items():
        export = res[EXPORT]
        peer = statistics.median(export["cpu"]) if export.get("cpu") else None
        peer_s = f"{peer:.2f}" if peer else export.get("error", "-")
        for mesh in map(mesh_label, meshes):
            r = res[mesh]
            head = f"| {layers} | {count(res['params'])} | {mesh} |"
            if "error" in r:
                out.append(f"{head} FAILED: {r['error']} | | | | {peer_s} | | | | |")
                continue
            med = statistics.median(r["cpu"])
            ratio = f"{med / peer:.2f}x" if peer else "-"
            out.append(f"{head} {r['first']:.2f} | {min(r['cpu']):.2f} | {med:.2f} | "
                       f"{statistics.median(r['wall']):.2f} | {peer_s} | {ratio} | "
                       f"{r['grads']} | {r['nodes']} | {r['path']} |")
    return out


def slopes(results: dict[int, dict], names: list[str]) -> list[str]:
    """CPU seconds per extra layer between the fewest and the most layers, per variant."""
    lo, hi = min(results), max(results)
    out = []
    for name in names:
        a, b = results[lo][name].get("cpu"), results[hi][name].get("cpu")
        if hi == lo or not a or not b:
            out.append(f"- {name}: -")
            continue
        slope = (statistics.median(b) - statistics.median(a)) / (hi - lo)
        out.append(f"- {name}: {slope:.3f} CPU s per layer ({lo} -> {hi} layers: "
                   f"{statistics.median(a):.2f} s -> {statistics.median(b):.2f} s)")
    return out


def shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape (``build``): Llama-3-70B's by default, and the global batch."""
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--inter", type=int, default=28672, help="MLP intermediate size")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv", type=int, default=8, help="KV heads")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=16, help="global batch rows")
    parser.add_argument("--seq", type=int, default=4096)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="8,16,32,80", help="comma-separated layer counts")
    parser.add_argument("--meshes", default="dp=8,tp=8;pp=8,tp=8",
                        help='semicolon-separated meshes, e.g. "dp=8,tp=8;pp=8,tp=8"')
    parser.add_argument("--microbatches", type=int, default=8, help="for meshes with pp")
    shape_arguments(parser)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS,
                        help=f"timed runs after one warm-up (at least {MIN_REPEATS})")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    if a.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be at least {MIN_REPEATS}: a median of fewer is noise")
    layer_counts = sorted({int(n) for n in a.layers.split(",")})
    meshes = parse_meshes(a.meshes)

    results, load_start = {}, load()
    for layers in layer_counts:
        results[layers] = one_size(a, layers, meshes)
        print(f"{layers} layers done", file=sys.stderr, flush=True)

    names = [mesh_label(m) for m in meshes]
    failed = [f"{n}, {layers} layers" for layers, res in results.items()
              for n in [EXPORT, *names] if "error" in res[n]]
    title = (f"planning: Llama, hidden {a.hidden}, intermediate {a.inter}, {a.heads} heads, "
             f"{a.kv} KV heads, vocab {a.vocab} (meta device), global batch {a.batch} x "
             f"{a.seq}, F.cross_entropy, shard=megatron, {a.microbatches} microbatches under pp; "
             f"transformers {version('transformers')}; "
             f"one warm-up (first) then {a.repeats} runs, interleaved; CPU seconds (the process's "
             f"and its children's), wall for reference; load average {load_start} at the "
             f"start, {load()} at the end")
    table = "\n".join([
        title, "", *rows(results, meshes), "",
        f"Slope, CPU seconds per extra layer ({min(results)} -> {max(results)} layers):",
        *slopes(results, [*names, EXPORT]), "",
        f"goal: <= {GOAL_S:.0f} s (CPU) at 80 layers, flat past the first block", "",
        "gradients: the plan's gradient outputs, checked to be one per trainable parameter "
        "(the backward is traced). program nodes: the per-device program's, summed over the "
        "stage parts (F, B, W per stage) under pp. torch.export: the same training callable, "
        "forward and loss only.",
    ])
    print(table)
    if failed:
        print(f"\nFAILED: {'; '.join(failed)} (nothing appended)", file=sys.stderr)
        sys.exit(1)
    if not a.no_append:
        append_results("plan", table, machine())


if __name__ == "__main__":
    main()
