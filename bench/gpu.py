"""Whole training steps on one GPU: shardfx against eager PyTorch and ``torch.compile``, on
the same model, the same batch, the same initial weights and the same AdamW, in one run.

Models (seeded random weights, no download; each contestant gets its own copy of one base
model, moved to the GPU with ``model.to("cuda")`` before anything else sees it):

- ``nanogpt``: examples/nanogpt.py at GPT-2 small's sizes: 12 layers, 12 heads, n_embd 768,
  block 1024, vocabulary 50304, tied embedding; batch 8 x 1024 tokens. Attention is the
  model's own ``F.scaled_dot_product_attention(is_causal=True)``.
- ``llama``: a Hugging Face ``LlamaForCausalLM`` of TinyLlama-1.1B's shape (bench/remat.py's
  ``llama``): hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocabulary 32000,
  untied LM head; batch 4 x 2048 tokens; ``attn_implementation="sdpa"`` on every side.

Contestants, per precision, one after another (the GPU's memory freed between them):

- ``eager``: ``opt.zero_grad(set_to_none=True); loss_fn(model(ids), targets).backward();
  opt.step()``; in bf16 the forward and the loss under ``torch.autocast("cuda",
  torch.bfloat16)``, the backward and AdamW outside it.
- ``torch.compile``: the same step with the forward and the loss ``torch.compile``d (default
  mode; AdamW eager, as in every row).
- ``shardfx`` (the default, ``kernels="auto"``: ATen ops) / ``kernels=triton``:
  ``shardfx.partition(model, (ids,), loss_fn, (targets,), precision=P, kernels=K)`` and
  ``plan.runner(optimizer=...).step``; "triton" runs the fused Triton kernels (the row says
  how many).

Precisions: ``fp32`` with TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``, the
default, set for every row) and ``bf16`` (autocast for eager and torch.compile,
``precision="bf16"`` for shardfx: fp32 weights, gradients and AdamW state everywhere). AdamW:
lr 1e-4, betas (0.9, 0.95), weight decay 0.1, PyTorch's default (foreach) implementation.

Measured per row: ``--warmup`` steps untimed (torch.compile compiles in the first, shardfx
compiles its Triton kernels there), then ``--steps`` timed, ``torch.cuda.synchronize()``
before and after each. Columns: plan s (``partition``'s wall time), first step s (the first
warmup step: torch.compile's compilation is in it), step ms (median of the timed steps),
tokens/s (batch tokens / median), the ratios to the same precision's eager and torch.compile
rows, MFU, peak GiB (``torch.cuda.max_memory_allocated``, reset before the row's model
reaches the GPU: weights, gradients, AdamW state, activations, the batch), and the first
step's loss.

MFU = model FLOPs per step / median step time / the GPU's peak FLOP/s. Model FLOPs per token
(PaLM's appendix B, nanoGPT's ``estimate_mfu``): ``6 N + 12 L H T``, N the parameters a token's
matmuls read (all of them less the embedding tables that are only looked up: nanoGPT's
position embedding, Llama's token embedding; a tied embedding is the LM head's weight and
counts), L layers, H the hidden size, T the sequence length (attention, forward and backward,
causal mask not discounted). The peak is the data sheet's dense number for the precision
(``PEAK``, by ``torch.cuda.get_device_name()``; fp32 rows use the fp32 peak while TF32 is
off); an unknown GPU's MFU is "n/a".

The claim checked, a row's "check" column: its first step's loss (from the initial weights,
on the batch) equals eager's of the same precision to 1e-4 relative in fp32 (2e-2 in bf16),
and after the timed steps every parameter has a gradient that is finite and not all zero
(``runner.grads()``; ``p.grad`` for eager and torch.compile). A row that fails it says so in
the table and as a WARNING; a row that cannot run (out of memory, say) is a row with the
error.

    python -m bench.gpu [--models nanogpt,llama] [--precisions fp32,bf16] [--layers N]
                        [--batch B] [--seq T] [--warmup 3] [--steps 10] [--no-compile]
                        [--smoke] [--append|--no-append]

On CUDA it prints one table per model and appends it to bench/RESULTS.md with the machine
(``bench.common.machine``, the GPU's name included). Each model takes a few minutes:
``--models llama`` and ``--models nanogpt`` split the run. Without CUDA it says it needs a
GPU and exits 0; ``--smoke`` runs the whole harness on CPU at tiny sizes (2 layers, hidden 64,
sequence 32, 2 timed steps) to check the script: its timings mean nothing and are not
appended.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn

import shardfx
from bench.common import append_results, count, machine
from bench.kernels import _failure
from bench.llama_workload import llama
from bench.remat import _loss_on_logits

SIZES = {  # per model: the default run
    "nanogpt": dict(layers=12, hidden=768, heads=12, vocab=50304, batch=8, seq=1024),
    "llama": dict(layers=22, hidden=2048, inter=5632, heads=32, kv=4, vocab=32000, batch=4,
                  seq=2048),
}
SMOKE = {  # per model: --smoke, on CPU
    "nanogpt": dict(layers=2, hidden=64, heads=4, vocab=512, batch=2, seq=32),
    "llama": dict(layers=2, hidden=64, inter=176, heads=4, kv=2, vocab=512, batch=2, seq=32),
}
SMOKE_STEPS = dict(warmup=1, steps=2)

# Dense peak FLOP/s (no sparsity) from NVIDIA's data sheets, by a substring of
# torch.cuda.get_device_name(); the first match wins, so the H100 PCIe comes before the SXM.
PEAK = [
    ("H100 PCIe", dict(bf16=756e12, tf32=378e12, fp32=51.2e12)),
    ("H100 80GB HBM3", dict(bf16=989.4e12, tf32=494.7e12, fp32=66.9e12)),  # the SXM's name
    ("H100 SXM", dict(bf16=989.4e12, tf32=494.7e12, fp32=66.9e12)),
    ("H200", dict(bf16=989.4e12, tf32=494.7e12, fp32=66.9e12)),
    ("A100", dict(bf16=312e12, tf32=156e12, fp32=19.5e12)),
]
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}  # a row's first-step loss against eager's
GiB = 2**30


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


# --- models -----------------------------------------------------------------------------------

@dataclass
class Workload:
    """One model and batch, as every contestant gets them."""

    title: str  # the table's heading: sizes, parameters, batch, attention
    base: nn.Module  # on CPU; each contestant trains a copy of it
    loss_fn: Callable  # loss_fn(model(ids), targets)
    batch: tuple[torch.Tensor, torch.Tensor]  # ids, targets, on the device
    flops_per_token: float  # 6 N + 12 L H T

    @property
    def tokens(self) -> int:
        return self.batch[0].numel()


def matmul_params(model: nn.Module) -> int:
    """N of ``6 N``: every parameter less the embedding tables a token only looks up (an
    embedding tied to a Linear's weight, GPT-2's LM head, is a matmul's and counts)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup = {id(m.weight): m.weight.numel() for m in model.modules()
              if isinstance(m, nn.Embedding) and id(m.weight) not in linear}
    return sum(p.numel() for p in model.parameters()) - sum(lookup.values())


def workload(name: str, s: dict, device: str) -> Workload:
    torch.manual_seed(0)
    if name == "nanogpt":
        from examples.nanogpt import GPT, GPTConfig, loss_fn

        base = GPT(GPTConfig(block_size=s["seq"], vocab_size=s["vocab"], n_layer=s["layers"],
                             n_head=s["heads"], n_embd=s["hidden"], dropout=0.0))
        shape = (f"nanoGPT {s['layers']} layers, {s['heads']} heads, n_embd {s['hidden']}, "
                 f"vocab {s['vocab']}, tied embedding")
        attention = "F.scaled_dot_product_attention(is_causal=True)"
    else:
        base = llama(SimpleNamespace(**s, seed=0))
        loss_fn = _loss_on_logits
        shape = (f"HF Llama {s['layers']} layers, hidden {s['hidden']}, intermediate "
                 f"{s['inter']}, {s['heads']} heads, {s['kv']} KV heads, vocab {s['vocab']}")
        attention = "attn_implementation sdpa"
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device)
                    for _ in range(2))
    n = matmul_params(base)
    flops = 6 * n + 12 * s["layers"] * s["hidden"] * s["seq"]
    title = (f"{shape} ({count(sum(p.numel() for p in base.parameters()))} parameters, "
             f"N = {count(n)} without lookup-only embeddings), batch {s['batch']} x {s['seq']}, "
             f"{attention}; model FLOPs/token 6 N + 12 L H T = {flops / 1e9:.3g} GFLOP")
    return Workload(title, base, loss_fn, (ids, targets), flops)


# --- contestants ------------------------------------------------------------------------------
# Each maps (its copy of the model on the device, the workload, the precision) to a step
# (returning the loss), a function giving the last step's gradients by parameter name, the
# seconds ``partition`` took (None for the others), and notes.

def eager(compiled: bool):
    def make(model: nn.Module, w: Workload, precision: str):
        ids, targets = w.batch
        device = ids.device.type

        def forward_loss(model, ids, targets):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                return w.loss_fn(model(ids), targets)

        fwd = torch.compile(forward_loss) if compiled else forward_loss
        opt = adamw(model.parameters())

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)  # here, not after: p.grad is the last step's
            loss = fwd(model, ids, targets)
            loss.backward()
            opt.step()
            return loss.detach()

        return step, (lambda: {n: p.grad for n, p in model.named_parameters()}), None, []
    return make


def with_shardfx(kernels: str):
    def make(model: nn.Module, w: Workload, precision: str):
        ids, targets = w.batch
        start = time.perf_counter()
        plan = shardfx.partition(model, (ids,), w.loss_fn, (targets,), precision=precision,
                                 kernels=kernels)
        planned = time.perf_counter() - start
        runner = plan.runner(optimizer=adamw, keep_grads=True)
        notes = [f"{len(plan.kernels())} fused Triton kernels"] if kernels == "triton" else []
        return (lambda: runner.step((ids,), (targets,))), runner.grads, planned, notes
    return make


def contestants(precision: str, compile_: bool) -> dict[str, Callable | str]:
    """Row name -> maker, or the reason it is skipped."""
    label = "bf16 autocast" if precision == "bf16" else "fp32"
    return {
        f"eager {label}": eager(False),
        f"torch.compile {label}": eager(True) if compile_ else
        "skipped (--no-compile)",
        f"shardfx {precision} (default: kernels=auto, ATen ops)": with_shardfx("auto"),
        f"shardfx {precision}, kernels=triton": with_shardfx("triton"),
    }


# --- one row ----------------------------------------------------------------------------------

@dataclass
class Row:
    precision: str
    name: str
    plan_s: float | None = None
    first_s: float = 0.0
    step_s: float = 0.0
    loss: float = float("nan")  # the first step's
    peak: int | None = None  # bytes, CUDA only
    error: str | None = None  # did not run
    problems: list[str] = field(default_factory=list)  # the check, where it failed
    notes: list[str] = field(default_factory=list)


def free(device: str) -> None:
    """What the last row left: its compiled graphs, tensors, cached blocks and peak."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_row(w: Workload, precision: str, name: str, make: Callable, a, device: str) -> Row:
    row = Row(precision, name)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        model = copy.deepcopy(w.base).to(device)
        step, grads, row.plan_s, row.notes = make(model, w, precision)
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        row.first_s = time.perf_counter() - start
        row.loss = loss.item()
        for _ in range(a.warmup - 1):
            step()
        times = []
        for _ in range(a.steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        row.step_s = statistics.median(times)
        if device == "cuda":
            row.peak = torch.cuda.max_memory_allocated()
        row.problems = gradient_problems(model, grads())
    except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, not fatal
        traceback.print_exc()
        row.error = _failure(e).replace("|", "/")
    return row


def gradient_problems(model: nn.Module, grads: dict[str, torch.Tensor | None]) -> list[str]:
    """Parameters (tied ones once) without a gradient, with one not finite, or all zero."""
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if grads.get(n) is None]
    have = [n for n in names if n not in missing]
    bad = [n for n in have if not bool(grads[n].isfinite().all())]
    zero = [n for n in have if n not in bad and int(grads[n].count_nonzero()) == 0]
    return [f"{len(found)} of {len(names)} parameters {what} (e.g. {found[0]})"
            for what, found in (("have no gradient", missing), ("have a gradient not finite", bad),
                                ("have an all-zero gradient", zero)) if found]


def check_losses(rows: list[Row]) -> None:
    """Each row's first-step loss against eager's of the same precision."""
    for r in rows:
        ref = rows[0]  # eager, first of its precision's rows
        if r is ref or r.error:
            continue
        if ref.error:
            r.problems.append("no eager loss to compare with")
            continue
        rel = abs(r.loss - ref.loss) / abs(ref.loss)
        if not rel <= LOSS_RTOL[r.precision]:
            r.problems.append(f"first-step loss {r.loss:.6f} is {rel:.1e} relative from eager's "
                              f"{ref.loss:.6f} (> {LOSS_RTOL[r.precision]:g})")


# --- table ------------------------------------------------------------------------------------

def peak_flops(precision: str) -> tuple[str, float] | None:
    """(GPU name, its peak FLOP/s in ``precision``), or None for a GPU not in ``PEAK``."""
    if not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_name()
    kind = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
    return next(((gpu, peaks[kind]) for key, peaks in PEAK if key in gpu), None)


def table(w: Workload, rows: list[Row], a) -> str:
    out = [f"gpu: {w.title}; AdamW, fp32 state; median of {a.steps} timed steps after "
           f"{a.warmup} untimed", "",
           "| contestant | plan s | first step s | step ms | tokens/s | / eager | "
           "/ torch.compile | MFU | peak GiB | first-step loss | check |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for precision in dict.fromkeys(r.precision for r in rows):
        mine = [r for r in rows if r.precision == precision]
        ref = {kind: next((r.step_s for r in mine if r.name.startswith(kind) and not r.error),
                          None) for kind in ("eager", "torch.compile")}
        peak = peak_flops(precision)
        for r in mine:
            if r.error:
                out.append(f"| {r.name} | {r.error} |" + " - |" * 9)
                continue

            def vs(kind):
                return f"{ref[kind] / r.step_s:.2f}" if ref[kind] else "-"

            mfu = f"{w.flops_per_token * w.tokens / r.step_s / peak[1]:.1%}" if peak else "n/a"
            check = "ok" if not r.problems else "FAIL: " + "; ".join(r.problems)
            out.append(
                f"| {r.name} | {'-' if r.plan_s is None else f'{r.plan_s:.1f}'} | "
                f"{r.first_s:.2f} | {r.step_s * 1e3:.1f} | {w.tokens / r.step_s:,.0f} | "
                f"{vs('eager')} | {vs('torch.compile')} | {mfu} | "
                f"{'-' if r.peak is None else f'{r.peak / GiB:.2f}'} | {r.loss:.6f} | {check} |")
    notes = [f"{r.name}: {'; '.join(r.notes)}" for r in rows if r.notes and not r.error]
    peaks = {p: peak_flops(p) for p in dict.fromkeys(r.precision for r in rows)}
    gpu = next((pk[0] for pk in peaks.values() if pk), None)
    if gpu:
        notes.append("MFU against " + ", ".join(f"{p} {pk[1] / 1e12:g} TFLOP/s"
                                                for p, pk in peaks.items()) + f" ({gpu}, dense)")
    else:
        notes.append("MFU n/a: " + ("this GPU is not in bench/gpu.py's PEAK"
                                    if torch.cuda.is_available() else "no GPU"))
    notes.append(f"TF32 matmuls: {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}; "
                 "step ms: median of the timed steps; / eager, / torch.compile: their step time "
                 "over this row's (above 1: faster), in the same precision; first step s: "
                 "torch.compile compiles there, shardfx compiles its Triton kernels there")
    warns = [f"WARNING: {r.name}: {p}" for r in rows for p in r.problems]
    return "\n".join(out + [""] + notes + warns)


# --- main -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="nanogpt,llama", help="comma-separated: nanogpt, llama")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--batch", type=int, default=None, help="override the batch size")
    parser.add_argument("--seq", type=int, default=None, help="override the sequence length")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps, at least 1")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="the torch.compile rows")
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU needed: tiny sizes on CPU, to check the script (timings "
                             "meaningless, nothing appended)")
    parser.add_argument("--append", action=argparse.BooleanOptionalAction, default=None,
                        help="append to bench/RESULTS.md (default: on CUDA, unless --smoke)")
    a = parser.parse_args()
    models, precisions = a.models.split(","), a.precisions.split(",")
    if not set(models) <= set(SIZES) or not set(precisions) <= set(LOSS_RTOL) or a.warmup < 1:
        parser.error(f"--models of {list(SIZES)}, --precisions of {list(LOSS_RTOL)}, "
                     "--warmup at least 1")
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("bench/gpu.py needs a CUDA GPU: this machine has none. (--smoke checks the script "
              "on CPU at tiny sizes.)")
        return
    device = "cuda" if cuda and not a.smoke else "cpu"
    if a.smoke:
        a.warmup, a.steps = SMOKE_STEPS["warmup"], SMOKE_STEPS["steps"]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, on every side
    torch.backends.cudnn.allow_tf32 = False

    start = time.perf_counter()
    for name in models:
        s = dict((SMOKE if a.smoke else SIZES)[name])
        s.update({k: v for k in ("layers", "batch", "seq") if (v := getattr(a, k)) is not None})
        w = workload(name, s, device)
        rows = []
        for precision in precisions:
            mine = []
            for row_name, make in contestants(precision, a.compile).items():
                t0 = time.perf_counter()
                if isinstance(make, str):
                    mine.append(Row(precision, row_name, error=make))
                    continue
                free(device)
                row = run_row(w, precision, row_name, make, a, device)
                mine.append(row)
                free(device)
                # as it goes, so a run cut short still says what it measured
                said = row.error or (f"step {row.step_s * 1e3:.1f} ms, plan "
                                     f"{row.plan_s or 0:.1f} s, first step {row.first_s:.1f} s")
                print(f"{name} {row_name}: {said} ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
            check_losses(mine)
            rows += mine
        text = table(w, rows, a)
        print(text + "\n", flush=True)
        if device == "cuda" and a.append is not False:  # never a smoke run's timings
            append_results("bench/gpu.py", text, machine())
    print(f"wall time: {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
