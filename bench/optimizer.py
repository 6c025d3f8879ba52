"""The optimizer's step on CPU: torch's default for-loop AdamW against foreach, the fused
kernel the runner picks (``cost.optimizer.fused_step``) and a ``torch.compile``d step.

Model: the parameters of a seeded Hugging Face Llama (default 58M: 8 layers, hidden 512,
intermediate 1408, vocab 32000; ``--size 136M`` the bench.step's larger one), fp32, one
intra-op thread, AdamW (lr 1e-3, weight decay 0.01). Each row steps its own copy of the same
parameters with the same seeded gradients; the rows alternate step by step
(``bench.common.alternate``), ``--warmup`` untimed rounds then ``--steps`` timed; min and
median CPU time. The last column is each row's largest difference from the for-loop's
parameters after the race, in units of the largest parameter's float32 spacing (0: equal).
``torch.compile``'s first step (its compile) is reported apart.

    python -m bench.optimizer [--size 58M] [--steps 7] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import alternate, append_results, machine
from bench.step import SIZES, llama
from shardfx.cost.optimizer import fused_step


def rows(params: list[torch.Tensor]) -> dict:
    """Name -> (its parameters, its step)."""
    def make(**kw):
        ps = [p.detach().clone().requires_grad_() for p in params]
        return ps, torch.optim.AdamW(ps, lr=1e-3, **kw)

    out = {"for-loop (torch's CPU default)": make(foreach=False),
           "foreach": make(foreach=True)}
    ps, opt = make()
    assert fused_step(opt)
    out["fused (shardfx's choice)"] = (ps, opt)
    ps, opt = make(foreach=True)
    out["torch.compile(opt.step), foreach"] = (ps, opt, torch.compile(opt.step))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="58M", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [p.detach() for p in llama(**SIZES[a.size]).parameters()]
    contestants = rows(params)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    cpu: dict[str, list[float]] = {k: [] for k in contestants}
    first: dict[str, float] = {}

    def stepper(name, entry):
        ps, opt, *compiled = entry
        step = compiled[0] if compiled else opt.step

        def run():
            for p, gr in zip(ps, grads):
                p.grad = gr
            start = time.process_time()
            step()
            cpu[name].append(time.process_time() - start)
        return run

    steps = {k: stepper(k, v) for k, v in contestants.items()}
    alternate(steps, a.warmup, a.steps, first)
    base = contestants["for-loop (torch's CPU default)"][0]
    spacing = torch.finfo(torch.float32).eps * max(p.abs().max().item() for p in base)
    loop_median = statistics.median(cpu["for-loop (torch's CPU default)"][a.warmup:])
    n = sum(p.numel() for p in params)
    lines = [f"AdamW step of a {a.size} Llama's {len(params)} parameters ({n / 1e6:.1f} M "
             f"elements), fp32, 1 thread; {a.steps} timed steps after {a.warmup}, interleaved",
             "", "| step | CPU min (ms) | CPU median (ms) | vs for-loop | max diff (spacings) |",
             "|---|---:|---:|---:|---:|"]
    for name, times in cpu.items():
        timed = times[a.warmup:]
        diff = max((p - q).abs().max().item() for p, q in zip(contestants[name][0], base))
        lines.append(f"| {name} | {min(timed) * 1e3:.1f} | {statistics.median(timed) * 1e3:.1f}"
                     f" | {statistics.median(timed) / loop_median:.2f}x | "
                     f"{diff / spacing:.2f} |")
    name = "torch.compile(opt.step), foreach"
    lines += ["", f"{name}: first step (compiling) {first[name]:.1f} s wall"]
    table = "\n".join(lines)
    print(table)
    if not a.no_append:
        load = open("/proc/loadavg").read().split()[:3]
        append_results(f"Optimizer step (bench/optimizer.py, {a.size})", table,
                       f"{machine()}; load {' '.join(load)} at the end")


if __name__ == "__main__":
    main()
