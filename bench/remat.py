"""Activation rematerialization on CPU: eager, full activation checkpointing and PyTorch's own
memory-budgeted partitioner, measured on one training step of a Llama.

The model is a Hugging Face ``LlamaForCausalLM`` built from a config with random weights (seeded,
no download; ``use_cache=False``, ``attn_implementation="sdpa"``): by default 6 layers, hidden
1024, intermediate 2816, 16 heads, 8 KV heads, vocabulary 32000 (136.3 M parameters, 520 MiB in
fp32), trained on one batch of 8 x 512 random token ids with ``F.cross_entropy`` on
``model(ids).logits`` and AdamW (lr 1e-3, fp32). Every flag can be changed; ``--small`` is a
quick check (2 layers, hidden 128, vocabulary 1000, 4 x 64 tokens). The batch is what makes the
budgets mean something: weights, gradients and AdamW's state and temporaries peak at 2330 MiB
in the optimizer's update whatever is recomputed, and at 4 x 256 tokens eager's whole step
peaks at only 2428 MiB, so every budget under it is either met by the optimizer's floor or
impossible; at 8 x 512 the activations are several times that and the budgets bite on them.
Every row starts from the same weights (a deepcopy of one model) and trains on the same batch:

- ``eager``: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``, nothing
  recomputed;
- ``full AC``: every decoder layer under ``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=False)``, through Hugging Face's ``activation_checkpointing_enable`` (the
  deprecated ``gradient_checkpointing_enable`` on older versions); the bench checks that every
  decoder layer is switched on and that the recompute FLOPs are > 0;
- ``torch.compile budget B`` for B in ``--budgets`` (0.5, 0.75): the loss function (model +
  loss) under ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B``
  (set with ``config.patch`` around every step of the row), which aot_autograd's min-cut
  partitioner turns into a 0-1 knapsack: keep at most B of the activations the default
  partition would save, recompute the rest at the fewest FLOPs. The backward and the optimizer
  step run as usual outside the compiled region.

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

Per row, one warm-up step (it compiles, and creates AdamW's state), then one step under the
memory tracker, one under the FLOP counter and ``--steps`` timed steps:

- measured peak: ``measured_peak(step, model, optimizer, ids, targets)``, the peak of live
  tensor storage during the step counting weights, gradients and AdamW state, minus the batch's
  bytes; and its ratio to eager's;
- recompute GFLOPs: the step's FLOPs (``FlopCounterMode``, matmuls and attention) minus eager's,
  and the ratio to full AC's. Recomputed pointwise ops (activations, norms, rotary) have no
  formula and count 0, so a budget can save memory at 0 recompute GFLOPs. For the compiled
  rows the FLOPs of the forward and backward graphs are also summed statically from their
  nodes with the same formulas, and the bench warns if the two counts differ;
- fwd+bwd peak: the same measured step's peak up to the end of its backward, before
  ``opt.step()`` (the step calls ``shardfx.measure.mark("fwd+bwd")`` there, as shardfx's
  runner does), and its ratio to eager's. Where a row's whole step peaks in ``opt.step()``
  (the gradients and AdamW's per-parameter temporaries on top of the weights and AdamW
  state), the measured peak is that floor, and this column is where rematerialization shows;
- step s: median of the timed steps (``gc.collect()`` before each);
- loss: an eager ``no_grad`` forward of the row's model after all its steps (warm-up, memory,
  FLOPs, timed: 3 + ``--steps`` updates), which must agree with eager's to 1e-4 relative (a
  warning is printed otherwise).

shardfx rows: ``partition(model, (ids,), loss, (targets,), memory_budget=B,
optimizer="adamw")`` on one device at the byte budgets from the rows above (full AC's measured
peak, 0.5 x and 0.75 x eager's, and each torch.compile row's measured peak, to compare
recompute FLOPs at the same memory: whole-step peaks, weights and AdamW state included), its runner
stepping AdamW (lr 1e-3) as the other rows do, measured the same way; per row also the plan's
predicted peak against the measured one, the ops it recomputes and the planning time. A budget
no plan meets is a row with shardfx's ``MemoryBudgetError``.

    python -m bench.remat [--small] [--layers 6] [--hidden 1024] [--inter 2816] [--heads 16]
                          [--kv 8] [--vocab 32000] [--batch 8] [--seq 512] [--steps 1]
                          [--budgets 0.5,0.75] [--backend aot_eager] [--no-append]

Prints the table and appends it to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import gc
import math
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from bench.common import append_results, count, machine, timed
from shardfx.measure import mark, measured_peak
from shardfx.passes.estimate_cost import CPU_ATTENTION_FLOPS

warnings.filterwarnings("ignore")

DEFAULT = dict(layers=6, hidden=1024, inter=2816, heads=16, kv=8, vocab=32000, batch=8, seq=512)
SMALL = dict(layers=2, hidden=128, inter=352, heads=4, kv=2, vocab=1000, batch=4, seq=64)
LOSS_RTOL = 1e-4
MiB = 2**20
aten = torch.ops.aten


# --- model, loss, batch -----------------------------------------------------------------------

def size_flags(parser: argparse.ArgumentParser, default: dict, seed: bool = True) -> None:
    """``--small``, a flag per model and batch size (``default`` when not given), ``--seed``."""
    parser.add_argument("--small", action="store_true",
                        help="quick check: " + ", ".join(f"{k} {v}" for k, v in SMALL.items()))
    for k, v in default.items():
        parser.add_argument(f"--{k}", type=int, default=None, help=f"default {v}")
    if seed:
        parser.add_argument("--seed", type=int, default=0)


def fill_sizes(a, default: dict) -> None:
    """The sizes not given: ``SMALL``'s under ``--small``, else ``default``'s."""
    for k, v in (SMALL if a.small else default).items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def workload(a) -> tuple[Callable[[], torch.nn.Module], tuple, int]:
    """A factory of copies of one seeded Llama (every row starts from the same weights), the
    batch, and the parameter count."""
    base, batch = llama(a), make_batch(a)

    def factory() -> torch.nn.Module:
        return copy.deepcopy(base).train()

    return factory, batch, sum(p.numel() for p in base.parameters())


def llama(a) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    config = LlamaConfig(
        num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.inter,
        num_attention_heads=a.heads, num_key_value_heads=a.kv, vocab_size=a.vocab,
        use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model.train()


def loss_of(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())


def make_batch(a) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(a.seed + 1)
    return tuple(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g) for _ in range(2))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def training_step(loss_fn: Callable, model, opt, ids, targets) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = loss_fn(model, ids, targets)
        loss.backward()
        mark("fwd+bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def final_loss(model, ids, targets) -> float:
    """The loss of the trained model, computed the same way (eager, no grad) for every row."""
    with torch.no_grad():
        return loss_of(model, ids, targets).item()


# --- FLOPs ------------------------------------------------------------------------------------

# FlopCounterMode knows no CPU attention kernel: PyTorch's own SDPA formulas for them, as
# shardfx's cost model counts them.
EXTRA_FLOPS = CPU_ATTENTION_FLOPS


class _CountThroughCompile(torch.utils.flop_counter._FlopCounterMode):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class FlopsThroughCompile(FlopCounterMode):
    """``FlopCounterMode`` whose dispatch mode lets torch.compile run its compiled graphs (and
    sees their ops) instead of falling back to eager."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mod_tracker.__enter__()
        self.mode = _CountThroughCompile(self)
        self.mode.__enter__()
        return self


def step_flops(step: Callable, through_compile: bool) -> int:
    counter = (FlopsThroughCompile if through_compile else FlopCounterMode)(
        display=False, custom_mapping=EXTRA_FLOPS)
    with counter:
        step()
    return counter.get_total_flops()


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of an aot_autograd graph, summed statically over its nodes with the formulas
    ``FlopCounterMode`` uses (and ``EXTRA_FLOPS``)."""
    formulas = FlopCounterMode(custom_mapping=EXTRA_FLOPS).flop_registry
    total = 0
    for node in gm.graph.nodes:
        formula = formulas.get(getattr(node.target, "overloadpacket", None))
        if node.op != "call_function" or formula is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        total += formula(*args, **kwargs, out_val=node.meta["val"])
    return total


# --- torch.compile backend --------------------------------------------------------------------

class CountingBackend:
    """PyTorch's ``aot_eager`` (or ``aot_eager_decomp_partition``) as torch builds it, with the
    forward and backward compilers wrapped: the FLOPs of each graph, counted from its nodes, and
    how many times each graph ran."""

    def __init__(self, name: str):
        self.name = name
        self.graphs: list[tuple[str, int]] = []  # (fw | bw, FLOPs)
        self.runs: collections.Counter = collections.Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if self.name == "aot_eager":
            kwargs = dict(partition_fn=min_cut_rematerialization_partition,
                          keep_inference_input_mutations=True)
        else:  # aot_eager_decomp_partition
            from torch._inductor.compile_fx import select_decomp_table
            kwargs = dict(decompositions=select_decomp_table(),
                          partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                         compiler="inductor"))
        return aot_autograd(fw_compiler=self._compiler("fw"), bw_compiler=self._compiler("bw"),
                            **kwargs)(gm, example_inputs)

    def _compiler(self, kind: str):
        from torch._dynamo.backends.debugging import boxed_nop

        def compile(gm: torch.fx.GraphModule, example_inputs):
            self.graphs.append((kind, graph_flops(gm)))
            inner = boxed_nop(gm, example_inputs)

            def run(args):
                self.runs[kind] += 1
                return inner(args)

            run._boxed_call = True
            return run
        return compile

    def static_flops(self) -> int:
        return sum(f for _, f in self.graphs)


# --- one row ----------------------------------------------------------------------------------

def measure(variant: str, step: Callable[[], Any], existing: tuple, model_loss: Callable[[], float],
            batch: tuple[torch.Tensor, torch.Tensor], steps: int, *, budget: str = "-",
            through_compile: bool = False) -> dict:
    """A table row for ``step`` (one training step): a warm-up step, one step under the memory
    tracker (``existing``: what lives before it: model, optimizer, batch, runner), one under
    the FLOP counter, ``steps`` timed; then ``model_loss()``. ``through_compile``: the step
    calls torch.compile'd code (see the module docstring)."""
    step()
    peak = measured_peak(step, *existing, through_compile=through_compile)
    fwd_bwd = peak.marks.get("fwd+bwd")
    flops = step_flops(step, through_compile)
    times = [timed(step) for _ in range(steps)]
    batch_bytes = sum(t.untyped_storage().nbytes() for t in batch)
    return dict(variant=variant, budget=budget, peak=peak.total - batch_bytes,
                fwd_bwd=None if fwd_bwd is None else fwd_bwd - batch_bytes,
                existing=peak.existing - batch_bytes, flops=flops,
                step_s=statistics.median(times), loss=model_loss(), notes=[])


def failed(variant: str, budget: str, error: BaseException) -> dict:
    text = " ".join(f"{type(error).__name__}: {error}".split())[:600].replace("|", "/")
    return dict(variant=variant, budget=budget, error=f"did not run: {text}", notes=[])


def eager_row(factory, batch, a) -> dict:
    model = factory()
    opt = adamw(model)
    return measure("eager", training_step(loss_of, model, opt, *batch), (model, opt, *batch),
                   lambda: final_loss(model, *batch), batch, a.steps)


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
                  lambda: final_loss(model, *batch), batch, a.steps)
    row["notes"].append(f"checkpointing on in {on} / {len(model.model.layers)} decoder layers")
    return row


def compiled_row(factory, batch, a, budget: float) -> dict:
    variant = f"torch.compile budget {budget:g}"
    torch._dynamo.reset()
    try:
        model = factory()
        opt = adamw(model)
        backend = CountingBackend(a.backend)
        compiled = torch.compile(loss_of, backend=backend)
        step = training_step(compiled, model, opt, *batch)
        with torch._functorch.config.patch(activation_memory_budget=budget):
            row = measure(variant, step, (model, opt, *batch), lambda: final_loss(model, *batch),
                          batch, a.steps, budget=f"{budget:g} of activations",
                          through_compile=True)
    except Exception as e:  # noqa: BLE001 - a row that cannot run is reported, not fatal
        traceback.print_exc()
        return failed(variant, f"{budget:g} of activations", e)
    finally:
        torch._dynamo.reset()
    ran = 3 + a.steps  # warm-up, memory, FLOPs, timed
    graphs = collections.Counter(kind for kind, _ in backend.graphs)
    row["static_flops"] = backend.static_flops()
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

def shardfx_rows(model_factory: Callable[[], torch.nn.Module],
                 batch: tuple[torch.Tensor, torch.Tensor],
                 budgets: dict[str, int], steps: int = 3) -> list[dict]:
    """shardfx's rematerialization at each byte budget: ``partition(..., memory_budget=B,
    optimizer="adamw")`` on one device, its runner stepping AdamW (lr 1e-3) as the other rows
    do. Per row also the plan's predicted peak against the measured one, the ops it chose to
    recompute and the planning time."""
    import shardfx

    rows = []
    ids, targets = batch
    for label, nbytes in budgets.items():
        variant = f"shardfx {label}"
        model = model_factory()
        try:
            t0 = time.perf_counter()
            plan = shardfx.partition(model, (ids,), _loss_on_logits, (targets,),
                                     memory_budget=nbytes, optimizer="adamw")
            planned = time.perf_counter() - t0
        except shardfx.MemoryBudgetError as e:
            rows.append(failed(variant, f"{nbytes / MiB:.1f} MiB", e))
            continue
        runner = plan.runner(lambda params: torch.optim.AdamW(params, lr=1e-3))
        row = measure(variant, lambda: runner.step((ids,), (targets,)), (runner, ids, targets),
                      lambda: final_loss(model, *batch), batch, steps,
                      budget=f"{nbytes / MiB:.1f} MiB")
        predicted = plan.memory_estimate()[0]
        row["predicted"] = predicted
        chose = plan.remat
        row["notes"].append(
            f"planned in {planned:.1f} s; predicted peak {predicted / MiB:.1f} MiB "
            f"({predicted / row['peak'] - 1:+.1%} of measured); " +
            ("nothing recomputed" if chose is None else
             f"{len(chose.recomputed)} ops recomputed, kept for the backward "
             f"{sum(chose.saved_before.values()) / MiB:.1f} -> "
             f"{sum(chose.saved_after.values()) / MiB:.1f} MiB"))
        if row["peak"] > nbytes:
            row["warn"] = f"{variant}: measured peak {row['peak']} B over its budget {nbytes} B"
        rows.append(row)
        del runner, plan, model
        gc.collect()
    return rows


def _loss_on_logits(out, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- table ------------------------------------------------------------------------------------

def table(rows: list[dict], title: str, notes: list[str]) -> str:
    eager = next(r for r in rows if r["variant"] == "eager")
    ac = next(r for r in rows if r["variant"] == "full AC")
    ac_recompute = ac["flops"] - eager["flops"]
    out = [title, "",
           "| variant | budget | measured peak (MiB) | peak / eager peak | recompute GFLOPs | "
           "recompute / full AC's | step s | loss | fwd+bwd peak (MiB) | fwd+bwd / eager's |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | {r['budget']} | {r['error']} | - | - | - | - | - "
                       "| - | - |")
            continue
        recompute = r["flops"] - eager["flops"]
        share = f"{recompute / ac_recompute:.2f}" if ac_recompute else "-"
        if r.get("fwd_bwd") is not None and eager.get("fwd_bwd"):
            fb = f"{r['fwd_bwd'] / MiB:.1f} | {r['fwd_bwd'] / eager['fwd_bwd']:.2f}"
        else:
            fb = "- | -"
        out.append(f"| {r['variant']} | {r['budget']} | {r['peak'] / MiB:.1f} | "
                   f"{r['peak'] / eager['peak']:.2f} | {recompute / 1e9:.2f} | {share} | "
                   f"{r['step_s']:.3f} | {r['loss']:.6f} | {fb} |")
    return "\n".join(out + [""] + notes)


def optimizer_peak_note(rows: list[dict]) -> list[str]:
    """A note naming the rows whose step peaks in opt.step (gradients + AdamW's temporaries),
    where the measured peak does not show what rematerialization saved."""
    late = [r["variant"] for r in rows
            if "error" not in r and r.get("fwd_bwd") is not None and r["peak"] > r["fwd_bwd"]]
    if not late:
        return []
    return [f"peak in opt.step, above the forward + backward's, for: {', '.join(late)}; there "
            "the measured peak hides what rematerialization saved (see fwd+bwd peak)."]


def checks(rows: list[dict]) -> list[str]:
    """Warnings: losses that differ from eager's, full AC without recompute, compiled rows
    whose graphs did not run as expected or whose static and counted FLOPs differ."""
    eager = next(r for r in rows if r["variant"] == "eager")
    ac = next(r for r in rows if r["variant"] == "full AC")
    out = []
    if ac["flops"] <= eager["flops"]:
        out.append("WARNING: full AC recomputed nothing (its FLOPs are not above eager's)")
    for r in rows:
        if "error" in r:
            continue
        rel = abs(r["loss"] - eager["loss"]) / abs(eager["loss"])
        if rel > LOSS_RTOL:
            out.append(f"WARNING: {r['variant']}: loss {r['loss']:.6f} differs from eager's "
                       f"{eager['loss']:.6f} by {rel:.1e} relative (> {LOSS_RTOL:g})")
        if "warn" in r:
            out.append(f"WARNING: {r['variant']}: {r['warn']}")
        if "static_flops" in r and not math.isclose(r["static_flops"], r["flops"], rel_tol=1e-3):
            out.append(f"WARNING: {r['variant']}: FLOPs counted at run time "
                       f"{r['flops'] / 1e9:.3f} G, summed over its graphs "
                       f"{r['static_flops'] / 1e9:.3f} G")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--steps", type=int, default=1, help="timed steps after the others")
    parser.add_argument("--budgets", default="0.5,0.75",
                        help="comma-separated activation_memory_budget values for torch.compile")
    parser.add_argument("--backend", default="aot_eager",
                        choices=["aot_eager", "aot_eager_decomp_partition"])
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    budgets = [float(b) for b in a.budgets.split(",") if b]

    start = time.perf_counter()
    factory, batch, params = workload(a)

    rows = []
    for name, make in [("eager", lambda: eager_row(factory, batch, a)),
                       ("full AC", lambda: full_ac_row(factory, batch, a)),
                       *[(f"budget {b:g}", functools.partial(compiled_row, factory, batch, a, b))
                         for b in budgets]]:
        t0 = time.perf_counter()
        rows.append(make())
        gc.collect()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    eager = rows[0]
    # Budgets in bytes for shardfx, from the measured peaks above.
    byte_budgets = {"full AC peak": rows[1]["peak"],
                    "0.5 x eager peak": int(0.5 * eager["peak"]),
                    "0.75 x eager peak": int(0.75 * eager["peak"])}
    for r in rows[2:]:  # the peer at its own memory: torch.compile's peaks
        if "error" not in r:
            byte_budgets[f"{r['variant']} peak"] = r["peak"]
    t0 = time.perf_counter()
    extra = shardfx_rows(factory, batch, byte_budgets, a.steps)
    if extra:
        rows += extra
        print(f"shardfx: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start

    title = (f"remat: Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.inter}, "
             f"{a.heads} heads, {a.kv} KV heads, vocab {a.vocab} ({count(params)} params, "
             f"fp32, sdpa), batch {a.batch} x {a.seq}, F.cross_entropy, AdamW; per row one "
             f"warm-up step, one measured for memory, one for FLOPs, {a.steps} timed; "
             f"torch.compile rows on {a.backend}")
    notes = [
        f"measured peak: live tensor storage at the step's peak (shardfx.measure), weights, "
        f"gradients and AdamW state included, the batch not; of which live before the step "
        f"(weights + AdamW state): {eager['existing'] / MiB:.1f} MiB. eager step: "
        f"{eager['flops'] / 1e9:.2f} GFLOPs (FlopCounterMode: matmuls and attention). "
        "recompute: the step's FLOPs minus eager's (matmuls and attention only: recomputed "
        "pointwise ops count 0). step s: median of the timed steps. loss: eager no-grad "
        "forward after the row's last step. fwd+bwd peak: the same step's peak up to the end "
        "of its backward, before opt.step.",
        *optimizer_peak_note(rows),
        f"budgets passed to shardfx_rows: " + ", ".join(
            f"{k} {v} B ({v / MiB:.1f} MiB)" for k, v in byte_budgets.items()),
        *[f"{r['variant']}: " + "; ".join(r["notes"]) for r in rows if r.get("notes")],
        f"wall time: {wall:.0f} s",
    ]
    warns = checks(rows)
    text = table(rows, title, notes + warns)
    print(text)
    for w in warns:
        print(w, file=sys.stderr)
    if not a.no_append:
        append_results("remat", text, machine())


if __name__ == "__main__":
    main()
