"""Offload: a training step's device and host memory and its time, shardfx's
``offload_optimizer=True`` and activation offload under ``memory_budget`` against the same plan
without them, against recomputation alone, and against eager.

Model: a seeded Hugging Face Llama (``bench.llama_workload``; default the remat bench's 136.3 M:
6 layers, hidden 1024, intermediate 2816, 16 heads, 8 KV heads, vocab 32000), fp32, AdamW (lr
1e-3), one device, 1 intra-op thread, one batch of 8 x 512 tokens. Rows, each from the same
weights:

- eager: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``: nothing recomputed,
  nothing offloaded (the "no-remat peak" the others are read against);
- shardfx defaults;
- shardfx ``offload_optimizer=True``: AdamW's moments, the copy it steps and the gradients on
  the host, each block's gradients sent there as they are final;
- shardfx ``offload_optimizer=True, memory_budget=`` half of eager's measured peak: what is
  left on the device (the activations) cut by shardfx's recomputation until it fits;
- shardfx ``memory_budget=`` 0.6x eager's peak, recomputation alone (the ``cpu`` preset: no
  host memory to offload to; with AdamW's state on the device, half does not fit);
- the same budget planned for this CPU with 64 GiB of host memory beside it (``HOST``): the
  ILP offloads activations where their copies hide behind compute, and recomputes the rest;
- both offloads at a third of eager's peak.

The "recomputed / offloaded" column is what the plan chose: the FLOPs it recomputes per step,
and the activation bytes it sends to the host and back.

Peaks are measured by ``shardfx.runtime.measure.measured_peak`` (live tensor storage, the batch
left out) on a step after the optimizer's state exists. On this CPU host and "device" are one
memory: the host's tensors (made under ``kernels.host_copy.on_host``) are counted apart, so the
device column is what a GPU would hold and the host column what its host would. Predicted
peaks are ``plan.memory_breakdown()``'s total and ``host``. Step times: the rows alternate step
by step (``bench.common.alternate``), ``--warmup`` untimed rounds then ``--steps`` timed; min
and median wall and CPU time (on a CPU the copies to and from the "host" are memory copies, so
the times say what the bookkeeping costs, not what a PCIe link would).

    python -m bench.offload [--small] [--steps 5] [--no-append]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

import shardfx
from bench.common import alternate, append_results, clocked, count, machine
from bench.llama_workload import (adamw, fill_sizes, loss_of, size_flags, training_step,
                                  workload)
from shardfx.cost.device_model import Host, Link, device_model
from shardfx.runtime.measure import measured_peak

DEFAULT = dict(layers=6, hidden=1024, inter=2816, heads=16, kv=8, vocab=32000, batch=8,
               seq=512)


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


# The cpu preset has no host memory (its "host" is the same DRAM): for the activation-offload
# rows the plan is made for this CPU with 64 GiB of host memory beside it, at the preset's
# 5 GB/s each way.
HOST = dataclasses.replace(device_model("cpu"),
                           host=Host(64 * 2**30, Link(5e9, 1e-6), Link(5e9, 1e-6)))


def contestants(factory, ids, targets, eager_peak: int) -> dict:
    """Each shardfx row: (step function, what measured_peak counts as existing, its plan)."""
    rows = {}
    half, tight, third = eager_peak // 2, int(0.6 * eager_peak), eager_peak // 3
    for label, kw in (
            ("shardfx defaults", {}),
            ("shardfx offload_optimizer", dict(offload_optimizer=True)),
            ("shardfx offload_optimizer, budget 0.5x eager",
             dict(offload_optimizer=True, memory_budget=half)),
            ("shardfx budget 0.6x eager (recompute only)", dict(memory_budget=tight)),
            ("shardfx budget 0.6x eager, host memory (activation offload)",
             dict(memory_budget=tight, device_model=HOST)),
            ("shardfx both offloads, budget 0.33x eager",
             dict(offload_optimizer=True, memory_budget=third, device_model=HOST))):
        try:
            plan = shardfx.partition(factory(), (ids,), _loss, (targets,), **kw)
        except shardfx.MemoryBudgetError as e:
            print(f"{label}: does not fit ({e.cause})")
            continue
        runner = plan.runner(lambda params: torch.optim.AdamW(params, lr=1e-3))
        rows[label] = (lambda r=runner: r.step((ids,), (targets,)), (runner,), plan)
    return rows


def _peak(step, existing, ids, targets):
    step()  # the optimizer's state exists from here on
    peak = measured_peak(step, *existing, ids, targets)
    return peak.total - ids.nbytes - targets.nbytes, peak.host


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    factory, (ids, targets), params = workload(a)
    model = factory()
    opt = adamw(model)
    rows = {"eager": (training_step(loss_of, model, opt, ids, targets), (model, opt), None)}
    peaks = {"eager": _peak(*rows["eager"][:2], ids, targets)}
    rows |= contestants(factory, ids, targets, peaks["eager"][0])
    for name, (step, existing, plan) in rows.items():
        if name != "eager":
            peaks[name] = _peak(step, existing, ids, targets)
    cpu = {name: [] for name in rows}
    losses = {name: [] for name in rows}
    times, _ = alternate({name: clocked(step, cpu[name], losses[name])
                          for name, (step, _, _) in rows.items()}, a.warmup, a.steps)
    base, base_time = peaks["eager"][0], statistics.median(cpu["eager"])
    mib = 2 ** 20
    lines = [f"offload: Llama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab} "
             f"({count(params)} params), batch {a.batch} x {a.seq} tokens, fp32, AdamW, one "
             f"device, 1 thread; {a.steps} timed steps after {a.warmup}, rows alternating; "
             "peaks measured (live tensor storage, the batch left out; the host's apart)", "",
             "| variant | device peak (MiB) | vs eager | predicted | host peak (MiB) | "
             "predicted | recomputed / offloaded | wall min / median (s) | CPU median (s) | "
             "vs eager | loss after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (_, _, plan) in rows.items():
        device, host = peaks[name]
        if plan is not None:
            b = plan.memory_breakdown()[0]
            predicted = (f"{b.total / mib:.1f} ({(b.total - device) / device:+.1%})",
                         f"{b.host / mib:.1f} ({(b.host - host) / host:+.1%})" if host else
                         f"{b.host / mib:.1f}")
        else:
            predicted = ("-", "-")
        remat = plan.remat if plan is not None else None
        chose = "-" if remat is None else (
            f"{remat.flops / 1e9:.1f} GFLOP / {remat.offloaded_bytes / mib:.0f} MiB")
        t, c = times[name], cpu[name]
        lines.append(
            f"| {name} | {device / mib:.1f} | {device / base:.2f}x | {predicted[0]} | "
            f"{host / mib:.1f} | {predicted[1]} | {chose} | "
            f"{min(t):.2f} / {statistics.median(t):.2f} | "
            f"{statistics.median(c):.2f} | {statistics.median(c) / base_time:.2f}x | "
            f"{losses[name][-1]:.6f} |")
    lines.append("")
    lines.append(f"{time.perf_counter() - start:.0f} s in all; load average (1 min) {load:.1f} "
                 f"at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
    table = "\n".join(lines)
    print(table)
    if not a.no_append:
        append_results("offload", table, machine())


if __name__ == "__main__":
    main()
