"""Offload on one GPU: what activation offload saves and costs, and how much larger a model
trains with the optimizer offloaded. Made for CUDA; ``--small`` runs it on this CPU as a check
that it runs (the CPU's numbers say nothing about a GPU's, and are not appended).

**Activations.** A seeded Hugging Face Llama of TinyLlama-1.1B's shape (hidden 2048,
intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocabulary 32000; ``bench.llama_workload``),
``precision="bf16"``, AdamW, one batch of 4 x 2048 tokens. Rows, each from the same weights:

- shardfx, no budget: everything the backward reads is kept;
- shardfx, ``memory_budget`` = that row's state plus ``--keep`` (0.55) of its activations,
  planned on this GPU's device model (its calibration, else its preset: PCIe 5 to the host):
  the ILP keeps, recomputes or offloads each activation.

Per row: ``torch.cuda.memory_allocated()`` before a step (the state: weights, gradients' and
optimizer state, the batch), ``torch.cuda.max_memory_allocated()`` over it (reset first); the
activations are the difference. ``--warmup`` untimed steps, then ``--steps`` timed with
``torch.cuda.synchronize()`` around each; min and median.

**Capacity.** Under a cap of ``--cap`` GiB (``torch.cuda.set_per_process_memory_fraction``
and ``memory_budget``), the deepest Llama of the same width (fp32 AdamW, bf16 compute, batch 1
x 2048) that shardfx plans to fit, without and with ``offload_optimizer=True`` (depths doubled,
then bisected; models on the meta device, planned only), and one training step of the deepest
with offload, its weights made on the GPU (``init_seed``): its loss, its measured peak.

    python -m bench.offload_gpu [--small] [--keep 0.55] [--cap 24] [--steps 5] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import shardfx
from bench.common import append_results, count, cuda_peak, machine
from bench.llama_workload import fill_sizes, llama, make_batch, size_flags

DEFAULT = dict(layers=22, hidden=2048, inter=5632, heads=32, kv=4, vocab=32000, batch=4,
               seq=2048)


def _loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _on(device: str, batch: tuple) -> tuple:
    return tuple(t.to(device) for t in batch)


def _peak(device: str, step, *existing) -> tuple[int, int]:
    """(state, peak) bytes of one call of ``step``: allocated before it, and at its fullest
    (on a CPU: what ``existing`` holds, and the live storage at its fullest)."""
    if device == "cuda":
        return cuda_peak(step)
    from shardfx.runtime.measure import measured_peak  # CPU check only: the live storage
    peak = measured_peak(step, *existing)
    return peak.existing, peak.total


def _times(device: str, step, warmup: int, steps: int) -> list[float]:
    out = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


def activations(a, device: str) -> list[str]:
    ids, targets = _on(device, make_batch(a))
    rows, first = [], None  # first: the unbudgeted row's (state, peak, median step)
    for label in ("shardfx, no budget", f"shardfx, budget: state + {a.keep:.2f} x activations"):
        model = llama(a).to(device)
        kw = {} if first is None else \
            dict(memory_budget=first[0] + int(a.keep * (first[1] - first[0])))
        start = time.perf_counter()
        plan = shardfx.partition(model, (ids,), _loss, (targets,), precision="bf16", **kw)
        planned = time.perf_counter() - start
        runner = plan.runner(_adamw)

        def step(r=runner):
            return r.step((ids,), (targets,))

        step()  # the optimizer's state exists from here on
        state, peak = _peak(device, step, runner, ids, targets)
        times = _times(device, step, a.warmup, a.steps)
        median = statistics.median(times)
        first = first or (state, peak, median)
        remat = plan.remat
        chose = "-" if remat is None else (f"{len(remat.recomputed)} ops recomputed "
                                          f"({remat.flops / 1e12:.2f} TFLOP), "
                                          f"{remat.offloaded_bytes / 2**30:.2f} GiB offloaded")
        acts = peak - state
        rows.append(f"| {label} | {planned:.1f} | {state / 2**30:.2f} | {peak / 2**30:.2f} | "
                    f"{acts / 2**30:.2f} | {acts / (first[1] - first[0]):.2f}x | "
                    f"{min(times) * 1e3:.1f} / {median * 1e3:.1f} | {median / first[2]:.2f}x | "
                    f"{chose} | {float(step()):.4f} |")
        del runner, plan, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return [f"activations: Llama {a.layers} layers, hidden {a.hidden}, batch {a.batch} x "
            f"{a.seq}, bf16, AdamW; {a.steps} timed steps after {a.warmup}", "",
            "| row | plan s | state GiB | peak GiB | activations GiB | vs no budget | "
            "step ms min / median | vs no budget | chosen | loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|", *rows]


def capacity(a, device: str) -> list[str]:
    cap = int(a.cap * 2**30)
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0)
                                                   .total_memory)
    one = argparse.Namespace(**{**vars(a), "batch": 1})
    ids, targets = _on(device, make_batch(one))
    deepest = {}
    for offload in (False, True):
        def fits(layers: int) -> bool:
            with torch.device("meta"):
                model = llama(argparse.Namespace(**{**vars(one), "layers": layers}))
            try:
                shardfx.partition(model, (ids,), _loss, (targets,), precision="bf16",
                                  memory_budget=cap, offload_optimizer=offload)
                return True
            except shardfx.MemoryBudgetError:
                return False

        lo, hi = 0, 1
        while fits(hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        deepest[offload] = lo
    layers = deepest[True]
    with torch.device("meta"):
        model = llama(argparse.Namespace(**{**vars(one), "layers": layers}))
    params = count(sum(p.numel() for p in model.parameters()))
    plan = shardfx.partition(model, (ids,), _loss, (targets,), precision="bf16",
                             memory_budget=cap, offload_optimizer=True)
    runner = plan.runner(_adamw, init_seed=0)
    runner.step((ids,), (targets,))
    state, peak = _peak(device, lambda: runner.step((ids,), (targets,)), runner, ids, targets)
    loss = float(runner.step((ids,), (targets,)))
    return [f"capacity under {a.cap} GiB: the deepest Llama of hidden {a.hidden} shardfx fits, "
            f"batch 1 x {a.seq}, bf16 compute, fp32 AdamW", "",
            "| optimizer | deepest (layers) |", "|---|---:|",
            f"| on the device | {deepest[False]} |", f"| offloaded | {deepest[True]} |", "",
            f"{deepest[True] / max(1, deepest[False]):.1f}x the layers; the offloaded "
            f"{layers}-layer model ({params} params) trained: peak {peak / 2**30:.2f} GiB, "
            f"loss {loss:.4f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--keep", type=float, default=0.55)
    parser.add_argument("--cap", type=float, default=24.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    device = "cuda" if torch.cuda.is_available() and not a.small else "cpu"
    if device == "cpu" and not a.small:
        print("bench/offload_gpu.py needs a CUDA GPU: this machine has none. (--small checks "
              "the script on this CPU at tiny sizes.)")
        return
    if a.small:  # sizes where a budget still fits: the logits' transient dominates
        a.cap, a.keep = 0.03, 0.95
    table = "\n".join(activations(a, device) + [""] + capacity(a, device))
    print(table)
    if device == "cuda" and not a.no_append:
        append_results("offload on one GPU", table, f"{torch.cuda.get_device_name()}; "
                       f"{machine()}")


if __name__ == "__main__":
    main()
