"""Mixed precision on CPU: eager PyTorch under ``torch.autocast`` against shardfx's
``partition(..., precision=...)``, in fp32, bf16 and fp16, measured on training steps of a Llama.

The model is bench/remat.py's: a Hugging Face ``LlamaForCausalLM`` with random weights (seeded,
no download; ``use_cache=False``, ``attn_implementation="sdpa"``), by default 4 layers, hidden
1024, intermediate 2816, 16 heads, 8 KV heads, vocabulary 32000 (112.7 M parameters, 430 MiB in
fp32), trained on one batch of 4 x 512 random token ids with ``F.cross_entropy`` on
``model(ids).logits`` and AdamW (lr 1e-3, fp32 state). Every flag can be changed; ``--small`` is
a quick check (2 layers, hidden 128, vocabulary 1000, 4 x 64 tokens). Every row starts from the
same weights (a deepcopy of one seeded model) and trains on the same batch. The weights stay
fp32 in every row (fp32 master weights): only what the step computes in changes.

- ``eager fp32``: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``;
- ``eager autocast bf16`` / ``eager autocast fp16``: the forward and the loss under
  ``torch.autocast("cpu", dtype=...)``, the backward and AdamW outside it, as PyTorch's AMP
  recipe has it; fp16 also with ``torch.amp.GradScaler("cpu")`` (dynamic loss scaling:
  ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``). CPU autocast runs the
  matmul-class ops (linear, matmul, attention) in the low dtype and keeps the cross-entropy in
  fp32. fp16 matmuls run on CPU, but where it has no fp16 units about 100x slower than fp32
  (the bench measures each dtype's matmul speed first): there, at the default size, the fp16
  rows are left out (a step would take about 20 minutes, by that speed) unless
  ``--precisions`` names them;
- ``shardfx fp32`` / ``bf16`` / ``fp16``: ``partition(model, (ids,), loss, (targets,),
  precision=P, optimizer="adamw")`` on one device, its runner stepping AdamW (lr 1e-3) as the
  eager rows do; for fp16 the runner scales the loss dynamically (``runner.loss_scale``).

Per row, ``--train-steps`` N steps (3) of which the first warms up (it creates AdamW's state),
then one step under the memory tracker, then ``--steps`` timed steps:

- step s: median of the timed steps (``gc.collect()`` before each); and its ratio to eager
  fp32's;
- measured peak: ``shardfx.runtime.measure.measured_peak(step, model, optimizer, ids, targets)`` (the
  runner for shardfx's rows), the peak of live tensor storage during the step counting weights,
  gradients and AdamW state, minus the batch's bytes, as bench/remat.py measures it; and its
  ratio to eager fp32's;
- predicted peak (shardfx rows): ``max(plan.memory_estimate().values())``, and how far it is
  from the measured peak (predicted / measured - 1);
- loss after N steps: the loss the measured step returns, i.e. the loss of the weights after N
  updates, computed in the row's own precision; and its distance to eager fp32's.

Checks, printed as warnings: every shardfx row trained (after the row's steps every parameter
differs from the initial weights, and ``runner.grads()`` holds a finite gradient for every
parameter, not all zero); every row's loss after N steps is below its first step's; shardfx
fp32's loss agrees with eager fp32's to 1e-4 relative; every low-precision row's loss differs from both fp32 rows' by more than those two
differ from each other (else it computed in fp32, whatever it was asked), and a low-precision
shardfx program has ops whose output is in the low dtype. A row that cannot run (``precision=``
refused, say) is a table row with the error.

    python -m bench.precision [--small] [--layers 4] [--hidden 1024] [--inter 2816]
                              [--heads 16] [--kv 8] [--vocab 32000] [--batch 4] [--seq 512]
                              [--steps 3] [--train-steps 3] [--seed 0] [--append|--no-append]
                              [--precisions fp32,bf16,fp16]

Prints the table; appends it to bench/RESULTS.md with the machine and date unless ``--small``
(``--append`` / ``--no-append`` decide either way).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

import shardfx
from bench.common import append_results, count, machine, timed
from bench.llama_workload import adamw, fill_sizes, loss_of, size_flags, training_step, workload
from bench.remat import MiB, _loss_on_logits, failed
from bench.remat_report import LOSS_RTOL
from shardfx.runtime.measure import mark, measured_peak
from shardfx.request.precision import DTYPES

DEFAULT = dict(layers=4, hidden=1024, inter=2816, heads=16, kv=8, vocab=32000, batch=4, seq=512)


# --- one row ----------------------------------------------------------------------------------

def run_row(variant: str, step: Callable[[], torch.Tensor], existing: tuple,
            batch: tuple[torch.Tensor, torch.Tensor], a) -> dict:
    """A table row for ``step`` (one training step, returning the loss): ``a.train_steps``
    steps (the first warms up), one under the memory tracker (``existing``: what lives before
    it), ``a.steps`` timed."""
    losses = [step().item() for _ in range(a.train_steps)]
    measured = []
    peak = measured_peak(lambda: measured.append(step()), *existing)
    times = [timed(step) for _ in range(a.steps)]
    batch_bytes = sum(t.untyped_storage().nbytes() for t in batch)
    return dict(variant=variant, step_s=statistics.median(times), peak=peak.total - batch_bytes,
                existing=peak.existing - batch_bytes, first_loss=losses[0],
                loss=measured[0].item(), notes=[], warns=[])


def autocast_loss(dtype: torch.dtype) -> Callable:
    def loss(model, ids, targets) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return loss_of(model, ids, targets)
    return loss


def scaled_step(loss_fn: Callable, model, opt, scaler, ids, targets) -> Callable:
    """``bench.remat.training_step`` with a ``GradScaler``: PyTorch's fp16 AMP recipe."""
    def step() -> torch.Tensor:
        loss = loss_fn(model, ids, targets)
        scaler.scale(loss).backward()
        mark("fwd+bwd")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def eager_row(factory: Callable, batch, a, precision: str) -> dict:
    model = factory()
    opt = adamw(model)
    if precision == "fp32":
        return run_row("eager fp32", training_step(loss_of, model, opt, *batch),
                       (model, opt, *batch), batch, a)
    loss_fn = autocast_loss(DTYPES[precision])
    if precision == "bf16":
        return run_row("eager autocast bf16", training_step(loss_fn, model, opt, *batch),
                       (model, opt, *batch), batch, a)
    scaler = torch.amp.GradScaler("cpu")
    row = run_row("eager autocast fp16", scaled_step(loss_fn, model, opt, scaler, *batch),
                  (model, opt, *batch), batch, a)
    row["notes"].append(f"GradScaler's scale after the row's steps: {scaler.get_scale():g}")
    return row


def shardfx_row(factory: Callable, batch, a, precision: str, variant: str | None = None,
                describe: Callable | None = None, **partition_kwargs) -> dict:
    """A shardfx row; ``describe(plan)``: more notes; ``partition_kwargs``: to ``partition``."""
    variant = variant or f"shardfx {precision}"
    ids, targets = batch
    model = factory()
    try:
        t0 = time.perf_counter()
        plan = shardfx.partition(model, (ids,), _loss_on_logits, (targets,),
                                 precision=precision, optimizer="adamw", **partition_kwargs)
        planned = time.perf_counter() - t0
        runner = plan.runner(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                             keep_grads=True)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        row = run_row(variant, lambda: runner.step((ids,), (targets,)), (runner, ids, targets),
                      batch, a)
        row["predicted"] = max(plan.memory_estimate().values())
        row["warns"] += trained(model, runner, before)
        low, ops = low_dtype_ops(plan, DTYPES[precision])
        row["notes"].append(f"planned in {planned:.1f} s; {low} of {ops} ops of the program "
                            f"output {precision}")
        row["notes"] += describe(plan) if describe else []
        if precision != "fp32" and low == 0:
            row["warns"].append(f"no op of its program outputs {precision}: it computes in fp32")
        if precision == "fp16":
            row["notes"].append(f"loss scale after the row's steps: {runner.loss_scale:g}, "
                                f"{runner.loss_scaler.skipped} step(s) skipped on overflow")
    except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, not fatal
        traceback.print_exc()
        return failed(variant, "-", e)
    return row


def trained(model: torch.nn.Module, runner, before: dict[str, torch.Tensor]) -> list[str]:
    """Problems with the claim that the runner trained ``model``: parameters that did not
    change from ``before``, parameters with no gradient, gradients not finite or all zero."""
    out = []
    params = dict(model.named_parameters())
    same = [name for name, p in params.items() if torch.equal(p.detach(), before[name])]
    if same:
        out.append(f"{len(same)} of {len(params)} parameters unchanged after the row's steps "
                   f"(e.g. {same[0]})")
    grads = runner.grads()
    if len(grads) != len(params):
        out.append(f"runner.grads() has {len(grads)} gradients for {len(params)} parameters")
    if not all(g.isfinite().all() for g in grads.values()):
        out.append("runner.grads() has gradients that are not finite")
    if not any(g.count_nonzero() for g in grads.values()):
        out.append("every gradient in runner.grads() is zero")
    return out


def low_dtype_ops(plan, dtype: torch.dtype) -> tuple[int, int]:
    """How many ops of the plan's program output a ``dtype`` tensor, of how many ops."""
    ops = [n for n in plan.program.module.graph.nodes if n.op == "call_function"]
    low = sum(isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype == dtype for n in ops)
    return low, len(ops)


# --- table ------------------------------------------------------------------------------------

def table(rows: list[dict], title: str, notes: list[str], train_steps: int) -> str:
    base = next(r for r in rows if r["variant"] == "eager fp32")
    out = [title, "",
           f"| variant | step s | step / eager fp32 | measured peak MiB | peak / eager fp32 | "
           f"predicted peak MiB | predicted vs measured | loss after {train_steps} steps | "
           f"\\|loss - fp32 loss\\| |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | {r['error']} | - | - | - | - | - | - | - |")
            continue
        predicted = "- | -" if "predicted" not in r else \
            f"{r['predicted'] / MiB:.1f} | {r['predicted'] / r['peak'] - 1:+.1%}"
        out.append(f"| {r['variant']} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                   f"{r['peak'] / MiB:.1f} | {r['peak'] / base['peak']:.2f} | {predicted} | "
                   f"{r['loss']:.6f} | {abs(r['loss'] - base['loss']):.2e} |")
    return "\n".join(out + [""] + notes)


def fp32_losses(rows: list[dict]) -> tuple[list[float], float]:
    """The fp32 rows' losses (eager's, shardfx's where it ran) and how far apart they are: the
    noise floor a low-precision row's loss must be further than from both."""
    fp32 = [r["loss"] for r in rows if r["variant"] in ("eager fp32", "shardfx fp32")
            and "error" not in r]
    return fp32, max(fp32) - min(fp32)


def checks(rows: list[dict]) -> list[str]:
    """Warnings: rows that did not train, shardfx fp32 away from eager fp32, low-precision rows
    whose loss is no further from fp32's than the two fp32 rows are from each other."""
    ran = {r["variant"]: r for r in rows if "error" not in r}
    out = [f"WARNING: {v}: {w}" for v, r in ran.items() for w in r["warns"]]
    out += [f"WARNING: {v}: loss did not go down: {r['first_loss']:.6f} at the first step, "
            f"{r['loss']:.6f} after the others" for v, r in ran.items()
            if not r["loss"] < r["first_loss"]]
    fp32, floor = fp32_losses(rows)
    if len(fp32) == 2 and floor > LOSS_RTOL * abs(fp32[0]):
        out.append(f"WARNING: shardfx fp32's loss {fp32[1]:.6f} differs from eager fp32's "
                   f"{fp32[0]:.6f} by {floor / abs(fp32[0]):.1e} relative (> {LOSS_RTOL:g})")
    for v, r in ran.items():
        if "fp32" not in v and min(abs(r["loss"] - f) for f in fp32) <= floor:
            out.append(f"WARNING: {v}: loss {r['loss']:.6f} is within {floor:.1e} of fp32's "
                       f"({', '.join(f'{f:.6f}' for f in fp32)}), the fp32 rows' own difference: "
                       "it did not compute in low precision")
    return out


def matmul_gflops(dtype: torch.dtype) -> float:
    """One thread's matmul speed in ``dtype``: a CPU without fp16 units runs fp16 matmuls
    about 100x slower than fp32 (1 against 84 GFLOP/s on the AMD EPYC here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
        torch.mm(a, b)
        start = time.perf_counter()
        torch.mm(a, b)
        return 2 * 512 * 1024 * 1024 / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the others")
    parser.add_argument("--train-steps", type=int, default=3,
                        help="steps before the measured one (the first warms up); the loss "
                             "column is the loss after them")
    parser.add_argument("--precisions", default=None,
                        help="comma-separated, of fp32,bf16,fp16 (default: all three, but "
                        "fp16 only under --small on a CPU whose fp16 matmuls are slow)")
    parser.add_argument("--append", action=argparse.BooleanOptionalAction, default=None,
                        help="append to bench/RESULTS.md (default: unless --small)")
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    if a.train_steps < 1:
        parser.error("--train-steps must be at least 1 (the first warms up)")

    start = time.perf_counter()
    factory, batch, params = workload(a)
    speed = {p: matmul_gflops(d) for p, d in DTYPES.items()}
    precisions = a.precisions.split(",") if a.precisions else [
        p for p in DTYPES if a.small or speed[p] > 0.1 * speed["fp32"]]

    rows = []
    for kind, make in [("eager", eager_row), ("shardfx", shardfx_row)]:
        for precision in precisions:
            t0 = time.perf_counter()
            rows.append(make(factory, batch, a, precision))
            gc.collect()
            print(f"{kind} {precision}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    wall = time.perf_counter() - start

    title = (f"precision: Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.inter}, "
             f"{a.heads} heads, {a.kv} KV heads, vocab {a.vocab} ({count(params)} params, fp32 "
             f"weights, sdpa), batch {a.batch} x {a.seq}, F.cross_entropy, AdamW (fp32 state); "
             f"per row {a.train_steps} steps (the first warms up), one measured for memory, "
             f"{a.steps} timed")
    eager = rows[0]
    notes = [
        f"measured peak: live tensor storage at the step's peak (shardfx.runtime.measure), weights, "
        f"gradients and AdamW state included, the batch not; of which live before the step "
        f"(weights + AdamW state): {eager['existing'] / MiB:.1f} MiB. predicted peak: "
        f"max(plan.memory_estimate().values()); predicted vs measured: predicted / measured - 1. "
        f"step s: median of the timed steps. loss after {a.train_steps} steps: the loss the "
        f"measured step returns (the weights after {a.train_steps} updates, in the row's own "
        f"precision); fp32 loss: eager fp32's.",
        f"eager fp32 and shardfx fp32 losses differ by {fp32_losses(rows)[1]:.1e}, the floor "
        "a low-precision row's loss must be further than from both.",
        *[f"{r['variant']}: " + "; ".join(r["notes"]) for r in rows if r.get("notes")],
        "matmul speed here (512 x 1024 @ 1024 x 1024, one thread): " + ", ".join(
            f"{p} {g:.1f} GFLOP/s" for p, g in speed.items())
        + ("" if len(precisions) == len(DTYPES) else
           f"; left out: {', '.join(p for p in DTYPES if p not in precisions)} (under a tenth "
           "of fp32's speed: a step would take hours; --precisions fp32,bf16,fp16 runs it)"),
        f"wall time: {wall:.0f} s",
    ]
    warns = checks(rows)
    text = table(rows, title, notes + warns, a.train_steps)
    print(text)
    for w in warns:
        print(w, file=sys.stderr)
    if a.append if a.append is not None else not a.small:
        append_results("precision", text, machine())


if __name__ == "__main__":
    main()
