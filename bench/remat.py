"""Activation rematerialization on CPU along the whole memory curve: eager, full activation
checkpointing and PyTorch's own memory-budgeted partitioner (torch.compile's min-cut) at a sweep
of ``activation_memory_budget`` values, against shardfx's remat at each of their measured peaks
and at shardfx's own floor, measured on training steps of a Llama.

The model is a Hugging Face ``LlamaForCausalLM`` built from a config with random weights (seeded,
no download; ``use_cache=False``, ``attn_implementation="sdpa"``): by default 6 layers, hidden
1024, intermediate 2816, 16 heads, 8 KV heads, vocabulary 32000 (136.3 M parameters, 520 MiB in
fp32), trained on one batch of 8 x 512 random token ids with ``F.cross_entropy`` on
``model(ids).logits`` and AdamW (lr 1e-3, fp32). Every flag can be changed; ``--small`` is a
quick check (2 layers, hidden 128, vocabulary 1000, 4 x 64 tokens). At 8 x 512 tokens the
activations, not AdamW's update, make the peak (eager's 5030 MiB against 1560 MiB of weights and
AdamW state), so every budget bites on what the forward keeps for the backward. Every row starts
from the same weights (a deepcopy of one model) and trains on the same batch:

- ``eager``: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``, nothing
  recomputed;
- ``full AC``: every decoder layer under ``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=False)``, through Hugging Face's ``activation_checkpointing_enable`` (the
  deprecated ``gradient_checkpointing_enable`` on older versions); the bench checks that every
  decoder layer is switched on and that the recompute FLOPs are > 0;
- ``torch.compile budget B`` for B in ``--budgets`` (0, 0.1, 0.25, 0.5, 0.75, 1): the loss
  function (model + loss) under ``torch.compile`` with
  ``torch._functorch.config.activation_memory_budget = B`` (set with ``config.patch`` around
  every step of the row), which aot_autograd's min-cut partitioner turns into a 0-1 knapsack:
  keep at most B of the activations the default partition would save, recompute the rest at
  the fewest FLOPs. The backward and the optimizer step run as usual outside the compiled
  region. A budget torch cannot run is a row with its error;
- ``shardfx at X``: ``partition(model, (ids,), loss, (targets,), memory_budget=P,
  optimizer="adamw")`` on one device (``fused_loss="auto"``, the default: the LM head is fused
  with its loss where the unfused plan misses the budget) for every distinct measured peak P of
  full AC and of the torch.compile rows (whole-step peaks, weights, gradients and AdamW state
  included: the same memory), its runner stepping AdamW (lr 1e-3, ``.grad`` freed after each
  optimizer step, the runner's default) as the other rows do. A budget no plan meets is a row
  with shardfx's ``MemoryBudgetError``: a finding, not a gap;
- ``shardfx floor``: the budget a ``MemoryBudgetError`` states when planning with
  ``memory_budget=1`` (``error.least.total``: the lowest peak shardfx's search reaches, which a
  plan meets by construction), then planned and run at exactly that budget;
- ``shardfx unfused at X`` (X a measured peak, or ``floor``: its own): the same, planned with
  ``fused_loss=False``. Every other row computes the whole (tokens, vocabulary) logits and
  their gradient; the fused head never makes them, a saving that is the fused head's, not
  remat's. These rows keep the plain loss's ATen ops, so they set shardfx's remat against full
  AC and torch.compile's budgets like for like. A budget under the unfused floor is a
  ``MemoryBudgetError`` row.

Backend. The compiled rows use ``aot_eager`` (aot_autograd with ``min_cut_rematerialization_
partition`` and a no-op compiler: the partitioned forward and backward graphs run op by op),
not inductor, although inductor does compile on this CPU: the memory here is counted by a
dispatch mode that sees each op's output storage, and inductor's kernels allocate their buffers
outside the dispatcher, so a measured peak of an inductor step misses most of them (forward +
backward of a 2-layer Llama, hidden 128, 4 x 256 tokens, measured 14.5 MiB above the weights
with inductor at budget 1.0 and 14.8 at 0.5, against 30.1 / 19.2 with aot_eager); its FLOPs
would be hidden in the same way, and inductor took 30-65 s to compile even that model on 2
cores. The budget is applied by the same partitioner either way.
``--backend aot_eager_decomp_partition`` uses inductor's decompositions and inductor's
partitioner settings before the same eager run, the closest measurable stand-in for what
inductor would save. The backend is PyTorch's own, wrapped: ``CountingBackend`` builds the same
aot_autograd call and wraps its forward and backward compilers to count their FLOPs and their
runs.

Two traps, both avoided here. (1) torch.compile falls back to eager (and then keeps skipping
the frame for good) when it is called under a ``TorchDispatchMode`` that does not declare
``ignore_compile_internals()``; shardfx's ``measured_peak`` and ``FlopCounterMode`` declare
nothing, so under them a compiled step silently measures the eager step. The compiled rows are
therefore measured with ``measured_peak(..., through_compile=True)`` (the same storage
tracker, declaring ``ignore_compile_internals``, so the compiled graphs run and their ops are
seen) and the FLOPs with a ``FlopCounterMode`` whose dispatch mode declares it
too; the bench checks that the compiled forward and backward ran on every measured step. (2)
``FlopCounterMode`` has no formula for CPU attention (``_scaled_dot_product_flash_attention_
for_cpu`` and its backward), so the bench adds PyTorch's own SDPA formulas for them (no causal
discount, as upstream).

Every row runs in a process of its own (``bench.row_processes``: ``python -m bench.remat
--row ...``, which rebuilds the same seeded model and batch): no row's allocator or
torch.compile caches are left to the next,
and a row whose process is killed (the machine is shared) runs once more, then is reported as
not run. ``--resume FILE`` appends each finished row to FILE and reads back the rows already
there, so a run that is stopped goes on where it stopped (a first default run, every row in one
process, was stopped after 13 of its 16 rows and lost them all).

Per row, one warm-up step (it compiles, and creates AdamW's state), then one step under the
memory tracker, one under the FLOP counter (not both in one step: ``FlopCounterMode``
decomposes ops it has no formula for, and under it the fused LM head's step measured 9% above
the same step measured alone, on the ``--small`` model), then ``--steps`` timed steps (default
5):

- measured peak: ``measured_peak(step, model, optimizer, ids, targets)``, the peak of live
  tensor storage during the step counting weights, gradients and AdamW state, minus the batch's
  bytes; and its ratio to eager's. fwd+bwd: the same step's peak up to the end of its backward
  (``shardfx.runtime.measure.mark("fwd+bwd")``, before ``opt.step()``, as shardfx's runner marks it);
- predicted peak (shardfx rows): ``plan.memory_estimate()[0]`` (which, like the measured peak,
  leaves the batch out), and its error against the measured peak (goal: within 2%);
- recompute GFLOPs: the step's FLOPs (``FlopCounterMode``, matmuls and attention) minus eager's;
  its ratio to full AC's, and for a shardfx row to torch.compile's at the same peak (the
  fewest of the torch rows that peak there). Recomputed pointwise ops (activations, norms,
  rotary) have no formula and count 0, so a budget can save memory at 0 recompute GFLOPs; a
  fused LM head recomputes its logits' matmul in the backward, which counts. For the compiled
  rows the FLOPs of the forward and backward graphs are also summed statically from their
  nodes with the same formulas, and the bench warns if the two counts differ;
- step s: median wall and CPU (``time.process_time``, every thread of the process) seconds of
  the timed steps (``gc.collect()`` before each);
- fused, ops recomputed (shardfx rows): ``plan.fused_losses()`` (the LM head computed with its
  loss in chunks; never in the unfused rows) and ``len(plan.remat.recomputed)``;
- loss: an eager ``no_grad`` forward of the row's model after all its steps (3 + ``--steps``
  updates), which must agree with eager's to 1e-4 relative (a warning is printed otherwise).

Under the table a summary, for shardfx's default rows and for its unfused ones apart: at every
point where both run, whether shardfx recomputes at most torch.compile's FLOPs (goal:
everywhere); at full AC's peak, shardfx's recompute over full AC's (goal <= 0.5); its floor.
Then, over all shardfx rows: the largest predicted-vs-measured error (goal <= 2%); rows that
failed or measured over their budget.

    python -m bench.remat [--small] [--layers 6] [--hidden 1024] [--inter 2816] [--heads 16]
                          [--kv 8] [--vocab 32000] [--batch 8] [--seq 512] [--steps 5]
                          [--budgets 0,0.1,0.25,0.5,0.75,1] [--backend aot_eager]
                          [--resume FILE] [--no-append]

Prints the table and appends it to bench/RESULTS.md with the machine, its load average and the
date.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench.common import append_results, count, machine
from bench.flops import CountingBackend, step_flops
from bench.llama_workload import (adamw, fill_sizes, final_loss, loss_of, size_flags,
                                 training_step, workload)
from bench.remat_report import FAMILIES, MiB, checks, summary, table
from bench.row_processes import RowProcesses, load
from shardfx.runtime.measure import measured_peak

warnings.filterwarnings("ignore")

DEFAULT = dict(layers=6, hidden=1024, inter=2816, heads=16, kv=8, vocab=32000, batch=8, seq=512)
aten = torch.ops.aten


# --- one row ----------------------------------------------------------------------------------

def clock(step: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds (``time.process_time``: every thread of this process) of one
    ``step()``, garbage collected first (the previous step's graphs are large)."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(variant: str, step: Callable[[], Any], existing: tuple, model_loss: Callable[[], float],
            batch: tuple[torch.Tensor, torch.Tensor], a, *, budget: str = "-",
            through_compile: bool = False) -> dict:
    """A table row for ``step`` (one training step): a warm-up step, one step under the memory
    tracker (``existing``: what lives before it: model, optimizer, batch, runner), one under
    the FLOP counter, ``a.steps`` timed; then ``model_loss()``. ``through_compile``: the step
    calls torch.compile'd code (see the module docstring)."""
    step()
    peak = measured_peak(step, *existing, through_compile=through_compile)
    flops = step_flops(step, through_compile)
    times = [clock(step) for _ in range(a.steps)]
    fwd_bwd = peak.marks.get("fwd+bwd")
    batch_bytes = sum(t.untyped_storage().nbytes() for t in batch)
    return dict(variant=variant, budget=budget, peak=peak.total - batch_bytes,
                fwd_bwd=None if fwd_bwd is None else fwd_bwd - batch_bytes,
                existing=peak.existing - batch_bytes, flops=flops,
                wall=[w for w, _ in times], cpu=[c for _, c in times],
                loss=model_loss(), notes=[])


def failed(variant: str, budget: str, error: BaseException) -> dict:
    text = " ".join(f"{type(error).__name__}: {error}".split())[:600].replace("|", "/")
    return dict(variant=variant, budget=budget, error=f"did not run: {text}", notes=[])


def eager_row(factory, batch, a) -> dict:
    model = factory()
    opt = adamw(model)
    return measure("eager", training_step(loss_of, model, opt, *batch), (model, opt, *batch),
                   lambda: final_loss(model, *batch), batch, a)


def full_ac_row(factory, batch, a) -> dict:
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = factory()
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    on = sum(bool(m.gradient_checkpointing) for m in layers)
    if not layers or on != len(model.model.layers):
        raise SystemExit(f"full AC: checkpointing is on in {on} of {len(model.model.layers)} "
                         "decoder layers")
    opt = adamw(model)
    row = measure("full AC", training_step(loss_of, model, opt, *batch), (model, opt, *batch),
                  lambda: final_loss(model, *batch), batch, a)
    row["notes"].append(f"checkpointing on in {on} / {len(model.model.layers)} decoder layers")
    return row


def compiled_row(factory, batch, a, budget: float) -> dict:
    variant = f"torch.compile {budget:g}"
    label = f"{budget:g} of activations"
    torch._dynamo.reset()
    try:
        model = factory()
        opt = adamw(model)
        backend = CountingBackend(a.backend)
        compiled = torch.compile(loss_of, backend=backend)
        step = training_step(compiled, model, opt, *batch)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            row = measure(variant, step, (model, opt, *batch), lambda: final_loss(model, *batch),
                          batch, a, budget=label, through_compile=True)
    except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, not fatal
        traceback.print_exc()
        return failed(variant, label, e)
    finally:
        torch._dynamo.reset()
    ran = 3 + a.steps  # warm-up, memory, FLOPs, timed
    graphs = collections.Counter(kind for kind, _ in backend.graphs)
    row["static_flops"] = backend.static_flops()
    row["torch_budget"] = budget
    row["notes"].append(f"{graphs['fw']} forward / {graphs['bw']} backward graph(s), "
                        f"ran {backend.runs['fw']} / {backend.runs['bw']} times")
    if graphs["fw"] != 1 or graphs["bw"] != 1 or backend.runs["fw"] != ran \
            or backend.runs["bw"] != ran:
        row["warn"] = (f"expected 1 forward and 1 backward graph, each run {ran} times; got "
                       f"{graphs['fw']} / {graphs['bw']} graphs run {backend.runs['fw']} / "
                       f"{backend.runs['bw']} times (a graph break, a recompile or an eager "
                       "fallback)")
    return row


# --- shardfx ----------------------------------------------------------------------------------

def shardfx_floor(model_factory: Callable[[], torch.nn.Module],
                  batch: tuple[torch.Tensor, torch.Tensor],
                  fused_loss: bool | str) -> tuple[int | None, str]:
    """The budget shardfx states for ``memory_budget=1`` with ``fused_loss``:
    ``MemoryBudgetError.least.total`` (bytes; like the measured peaks here, shardfx's memory
    model leaves the batch out), and a note with its parts."""
    import shardfx

    ids, targets = batch
    model = model_factory()
    name = f"{FAMILIES[fused_loss]} floor"
    t0 = time.perf_counter()
    try:
        shardfx.partition(model, (ids,), _loss_on_logits, (targets,), memory_budget=1,
                          optimizer="adamw", fused_loss=fused_loss)
    except shardfx.MemoryBudgetError as e:
        least = getattr(e, "least", None)
        took = time.perf_counter() - t0
        if least is None:
            return None, f"{name}: MemoryBudgetError at memory_budget=1 has no .least: {e}"
        parts = ", ".join(f"{k} {v}" for k, v in vars(least).items()
                          if isinstance(v, int) and v and k != "total")
        return least.total, (f"{name}: memory_budget=1 raised MemoryBudgetError in "
                             f"{took:.1f} s, least.total {least.total} B "
                             f"({least.total / MiB:.1f} MiB; {parts})")
    return None, f"{name}: memory_budget=1 did not raise MemoryBudgetError"


def shardfx_row(model_factory: Callable[[], torch.nn.Module],
                batch: tuple[torch.Tensor, torch.Tensor], nbytes: int, labels: list[str],
                fused_loss: bool | str, a) -> dict:
    """shardfx's rematerialization at ``nbytes`` (what the bytes are: ``labels``, e.g.
    ["full AC", "torch.compile 0.5"]): ``partition(..., memory_budget=nbytes,
    optimizer="adamw", fused_loss=fused_loss)`` on one device, its runner stepping AdamW (lr
    1e-3) as the other rows do. Also the plan's predicted peak, whether it fused the LM head,
    the ops it chose to recompute and the planning time."""
    import shardfx

    ids, targets = batch
    variant = shardfx_name(fused_loss, labels)
    label = f"{nbytes / MiB:.1f} MiB"
    identity = dict(labels=labels, target=nbytes, fused_loss=fused_loss)
    model = model_factory()
    t0 = time.perf_counter()
    try:
        plan = shardfx.partition(model, (ids,), _loss_on_logits, (targets,),
                                 memory_budget=nbytes, optimizer="adamw", fused_loss=fused_loss)
    except Exception as e:  # noqa: BLE001 - a budget shardfx refuses is a finding
        if not isinstance(e, shardfx.MemoryBudgetError):
            traceback.print_exc()
        return failed(variant, label, e) | identity
    planned = time.perf_counter() - t0
    runner = plan.runner(lambda params: torch.optim.AdamW(params, lr=1e-3))
    try:
        row = measure(variant, lambda: runner.step((ids,), (targets,)), (runner, ids, targets),
                      lambda: final_loss(model, *batch), batch, a, budget=label)
    except Exception as e:  # noqa: BLE001 - a plan that does not run is a finding
        traceback.print_exc()
        return failed(variant, label, e) | identity
    chose = plan.remat
    fused = plan.fused_losses()
    row.update(identity, predicted=plan.memory_estimate()[0],
               when=plan.memory_breakdown()[0].when, fused=bool(fused),
               recomputed=0 if chose is None else len(chose.recomputed),
               planned_flops=0 if chose is None else chose.flops)
    row["notes"].append(
        f"planned in {planned:.1f} s; "
        + (f"LM head fused ({plan.fused_loss_reason}; "
           + ", ".join(f"{f.tokens} tokens x {f.vocab} in chunks of {f.rows}" for f in fused)
           + "); " if fused else "LM head not fused; ")
        + ("nothing recomputed" if chose is None else
           f"{len(chose.recomputed)} ops recomputed ({chose.flops / 1e9:.2f} GFLOPs by the "
           f"plan's count), kept for the backward "
           f"{sum(chose.saved_before.values()) / MiB:.1f} -> "
           f"{sum(chose.saved_after.values()) / MiB:.1f} MiB")
        + f"; predicted peak at {row['when']}")
    if row["peak"] > nbytes:
        row["warn"] = (f"measured peak {row['peak']} B ({row['peak'] / MiB:.1f} MiB) over "
                       f"its budget {nbytes} B ({nbytes / MiB:.1f} MiB)")
    return row


def shardfx_name(fused_loss: bool | str, labels: list[str]) -> str:
    """``shardfx at full AC``, ``shardfx unfused at torch.compile 0.5 = floor``."""
    return f"{FAMILIES[fused_loss]} at {' = '.join(labels)}"


def _loss_on_logits(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- one process per row ------------------------------------------------------------------------

def run_row(a, spec: dict) -> dict:
    """The row ``spec`` names, in this process: {"kind": "eager" | "full AC"},
    {"kind": "torch.compile", "budget": B}, {"kind": "floor", "fused_loss": F} or
    {"kind": "shardfx", "bytes": N, "labels": [...], "fused_loss": F} (F a key of
    ``FAMILIES``). "floor" is no row: {"floor": bytes or None, "note": ...}."""
    factory, batch, params = workload(a)
    kind = spec["kind"]
    if kind == "eager":
        return eager_row(factory, batch, a) | dict(params=params)
    if kind == "full AC":
        return full_ac_row(factory, batch, a)
    if kind == "torch.compile":
        return compiled_row(factory, batch, a, spec["budget"])
    if kind == "floor":
        floor, note = shardfx_floor(factory, batch, spec["fused_loss"])
        return dict(floor=floor, note=note)
    return shardfx_row(factory, batch, spec["bytes"], spec["labels"], spec["fused_loss"], a)


def not_run(spec: dict, why: str) -> dict:
    """The row of a spec whose process did not finish."""
    if spec["kind"] == "floor":
        return dict(floor=None, note=f"{spec_name(spec)}: {why}")
    row = dict(variant=spec_name(spec), budget="-", error=f"did not run: {why}", notes=[])
    if spec["kind"] == "shardfx":
        row.update(labels=spec["labels"], target=spec["bytes"], fused_loss=spec["fused_loss"])
    return row


def spec_name(spec: dict) -> str:
    if spec["kind"] == "torch.compile":
        return f"torch.compile {spec['budget']:g}"
    if spec["kind"] == "shardfx":
        return shardfx_name(spec["fused_loss"], spec["labels"])
    if spec["kind"] == "floor":
        return f"{FAMILIES[spec['fused_loss']]} floor"
    return spec["kind"]


def with_floor(peaks: dict[int, list[str]], floor: int | None) -> dict[int, list[str]]:
    """``peaks`` (bytes -> the rows peaking there) with ``floor`` added, labelled "floor"."""
    budgets = {n: list(labels) for n, labels in peaks.items()}
    if floor is not None:
        budgets.setdefault(floor, []).append("floor")
    return budgets


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the others")
    parser.add_argument("--budgets", default="0,0.1,0.25,0.5,0.75,1",
                        help="comma-separated activation_memory_budget values for torch.compile")
    parser.add_argument("--backend", default="aot_eager",
                        choices=["aot_eager", "aot_eager_decomp_partition"])
    parser.add_argument("--resume", default=None,
                        help="a JSON-lines file: rows finished are appended to it, rows in it "
                             "are read back instead of run (a run the machine killed goes on)")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child: one row
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    if a.row is not None:
        Path(a.out).write_text(json.dumps(run_row(a, json.loads(a.row))))
        return
    budgets = [float(b) for b in a.budgets.split(",") if b]

    start, load_start = time.perf_counter(), load()
    flags = [f"--{k}={getattr(a, k)}" for k in (*DEFAULT, "seed", "steps", "backend")]
    run = RowProcesses("bench.remat", flags, a.resume, spec_name, not_run)
    rows = [run(dict(kind="eager")), run(dict(kind="full AC")),
            *[run(dict(kind="torch.compile", budget=b)) for b in budgets]]
    eager = rows[0]
    if "error" in eager or "error" in rows[1]:
        raise SystemExit(f"eager or full AC did not run: {eager.get('error')} "
                         f"{rows[1].get('error')}")

    # shardfx's budgets: every distinct measured peak of full AC and the torch.compile rows,
    # and, per family, its own floor
    peaks: dict[int, list[str]] = {}
    for r in rows[1:]:
        if "error" not in r:
            peaks.setdefault(r["peak"], []).append(r["variant"])
    floors, floor_notes = {}, []
    for fused_loss in FAMILIES:
        probe = run(dict(kind="floor", fused_loss=fused_loss))
        floors[fused_loss] = probe["floor"]
        floor_notes.append(probe["note"])
        rows += [run(dict(kind="shardfx", bytes=n, labels=labels, fused_loss=fused_loss))
                 for n, labels in with_floor(peaks, probe["floor"]).items()]
    wall = time.perf_counter() - start

    title = (f"remat: Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.inter}, "
             f"{a.heads} heads, {a.kv} KV heads, vocab {a.vocab} ({count(eager['params'])} "
             f"params, fp32, sdpa), batch {a.batch} x {a.seq}, F.cross_entropy, AdamW; per row "
             f"(a process each) one warm-up step, one measured for memory, one for FLOPs, "
             f"{a.steps} timed; torch.compile rows on {a.backend} at activation_memory_budget "
             f"{', '.join(f'{b:g}' for b in budgets)}; shardfx at each distinct measured peak "
             f"and at its own floor, with fused_loss=\"auto\" (its default) and with "
             f"fused_loss=False (shardfx unfused: the plain loss, as every other row)")
    notes = [
        f"measured peak: live tensor storage at the step's peak (shardfx.runtime.measure), weights, "
        f"gradients and AdamW state included, the batch not; of which live before the step "
        f"(weights + AdamW state): {eager['existing'] / MiB:.1f} MiB. fwd+bwd peak: the same "
        f"step's peak up to the end of its backward. shardfx's memory_budget: the measured peak "
        f"named in its variant, in bytes (shardfx's memory model, like these peaks, leaves the "
        f"batch out); predicted: plan.memory_estimate(). eager step: {eager['flops'] / 1e9:.2f} "
        f"GFLOPs (FlopCounterMode: matmuls and attention). recompute: the step's FLOPs minus "
        f"eager's (matmuls and attention only: recomputed pointwise ops count 0); / "
        f"torch.compile's there: over the torch.compile row(s) at the peak shardfx was given "
        f"(the fewest recomputed). step s: median wall and CPU seconds of {a.steps} timed "
        f"steps. loss: eager no-grad forward after the row's last step.",
        "",
        *summary(rows, floors),
        "",
        *[f"{r['variant']}: " + "; ".join(r["notes"]) for r in rows if r.get("notes")],
        *floor_notes,
        "step times (wall / CPU s): " + "; ".join(
            f"{r['variant']} " + " ".join(f"{w:.3g}/{c:.3g}" for w, c in zip(r["wall"], r["cpu"]))
            for r in rows if "wall" in r),
        f"wall time: {wall:.0f} s (CPU {run.child_cpu:.0f} s in the rows' processes"
        f"{', rows read back from ' + a.resume + ' not counted' if run.cached else ''}); load "
        f"average (1/5/15 min) {load_start} at the start, {load()} at the end",
    ]
    warns = checks(rows)
    text = table(rows, title, notes + warns)
    print(text)
    for w in warns:
        print(w, file=sys.stderr)
    if not a.no_append:
        append_results("remat", text, f"{machine()}; load average {load_start} at the start, "
                                      f"{load()} at the end")


if __name__ == "__main__":
    main()
