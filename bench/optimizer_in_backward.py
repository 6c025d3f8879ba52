"""The optimizer's step in the backward: a training step's peak memory and time, shardfx's
``optimizer_in_backward=True`` against PyTorch's own way of doing it and against both without.

Model: a seeded Hugging Face Llama (``bench.llama_workload``; default 136M: 12 layers, hidden
768, vocab 32000), fp32, AdamW (lr 1e-3), one device, 1 intra-op thread, a batch of 8 x 64
tokens (a shape where the weights, not the activations, fill memory: the gradients are a
quarter of what a step holds). Rows, each from the same weights:

- eager: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``;
- eager, optimizer in backward (the peer): PyTorch's recipe ("How to save memory by fusing the
  optimizer step into the backward pass"): one AdamW per parameter, stepped and its gradient
  freed by ``register_post_accumulate_grad_hook``;
- shardfx defaults, and ``partition(..., optimizer_in_backward=True)``.

Peaks are measured by ``shardfx.runtime.measure.measured_peak`` (live tensor storage, the batch left
out) on a step after the optimizer's state exists; shardfx's predicted peak
(``plan.memory_estimate()``) is printed next to its measured one. Step times: the rows
alternate step by step (``bench.common.alternate``), ``--warmup`` untimed rounds then
``--steps`` timed; min and median wall and CPU time. The losses after the last step are
printed: every row trains the same model on the same batch.

    python -m bench.optimizer_in_backward [--small] [--steps 6] [--no-append]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import shardfx
from bench.common import alternate, append_results, clocked, count, machine
from bench.llama_workload import (adamw, fill_sizes, loss_of, size_flags, training_step,
                                  workload)
from shardfx.runtime.measure import measured_peak

DEFAULT = dict(layers=12, hidden=768, inter=2112, heads=12, kv=12, vocab=32000, batch=8, seq=64)


def in_backward_eager(model: torch.nn.Module, ids, targets):
    """PyTorch's optimizer-in-backward recipe: the step of one parameter in its gradient's
    post-accumulate hook, then the gradient freed."""
    optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

    def hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def step() -> torch.Tensor:
        loss = loss_of(model, ids, targets)
        loss.backward()
        return loss.detach()

    return step, list(optimizers.values())


def contestants(factory, ids, targets) -> dict:
    """Each row: (step function, what measured_peak counts as existing, shardfx's plan)."""
    rows = {}
    model = factory()
    opt = adamw(model)
    rows["eager"] = (training_step(loss_of, model, opt, ids, targets), (model, opt), None)
    model = factory()
    step, optimizers = in_backward_eager(model, ids, targets)
    rows["eager, optimizer in backward (peer)"] = (step, (model, *optimizers), None)

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    for label, kw in (("shardfx defaults", {}),
                      ("shardfx optimizer_in_backward=True", dict(optimizer_in_backward=True))):
        plan = shardfx.partition(factory(), (ids,), loss_fn, (targets,), **kw)
        runner = plan.runner(lambda params: torch.optim.AdamW(params, lr=1e-3))
        rows[label] = (lambda r=runner: r.step((ids,), (targets,)), (runner,), plan)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    factory, (ids, targets), params = workload(a)
    rows = contestants(factory, ids, targets)
    peaks = {}
    for name, (step, existing, _) in rows.items():
        step()  # the optimizer's state exists from here on
        peak = measured_peak(step, *existing, ids, targets)
        peaks[name] = peak.total - ids.nbytes - targets.nbytes
    cpu = {name: [] for name in rows}
    losses = {name: [] for name in rows}
    times, _ = alternate({name: clocked(step, cpu[name], losses[name])
                          for name, (step, _, _) in rows.items()}, a.warmup, a.steps)
    base, base_time = peaks["eager"], statistics.median(times["eager"])
    lines = [f"optimizer in backward: Llama {a.layers} layers, hidden {a.hidden}, vocab "
             f"{a.vocab} ({count(params)} params), batch {a.batch} x {a.seq} tokens, fp32, "
             f"AdamW, one device, 1 thread; {a.steps} timed steps after {a.warmup}, rows "
             "alternating; peaks measured (live tensor storage, the batch left out)", "",
             "| variant | peak (MiB) | vs eager | predicted (MiB) | wall min (ms) | "
             "wall median (ms) | vs eager | CPU median (ms) | loss after the last step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (_, _, plan) in rows.items():
        predicted = f"{plan.memory_estimate()[0] / 2**20:.1f}" if plan is not None else "—"
        t = times[name]
        lines.append(
            f"| {name} | {peaks[name] / 2**20:.1f} | {peaks[name] / base:.2f}x | {predicted} | "
            f"{min(t) * 1e3:.0f} | {statistics.median(t) * 1e3:.0f} | "
            f"{statistics.median(t) / base_time:.2f}x | "
            f"{statistics.median(cpu[name]) * 1e3:.0f} | {losses[name][-1]:.6f} |")
    lines.append("")
    lines.append(f"{time.perf_counter() - start:.0f} s in all; load average (1 min) {load:.1f} "
                 f"at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
    table = "\n".join(lines)
    print(table)
    if not a.no_append:
        append_results("optimizer_in_backward", table, machine())


if __name__ == "__main__":
    main()
