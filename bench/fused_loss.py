"""The LM head fused with its cross-entropy (``partition(..., fused_loss=True)``, the default)
against the same plan with the ATen ops (``fused_loss=False``) and against eager PyTorch, on
training steps of a Llama on CPU: measured peak, predicted peak, step time, loss.

The model and batch are bench/precision.py's (bench/remat.py's Llama: by default 4 layers,
hidden 1024, intermediate 2816, 16 heads, 8 KV heads, vocabulary 32000, batch 4 x 512, seeded
random weights, ``F.cross_entropy`` on the logits, AdamW): its logits are 4 x 512 x 32000 fp32,
250 MiB, and their log-softmax and gradient as much each. Rows, each from the same weights:

- ``eager fp32`` / ``eager autocast bf16``: bench/precision.py's eager rows;
- ``shardfx P, ATen head``: ``partition(..., precision=P, fused_loss=False)``;
- ``shardfx P, fused head``: ``partition(..., precision=P)``: the head in chunks of rows
  (``plan.fused_losses()`` says how many), its gradients computed in the forward.

Per row bench/precision.py's protocol (``--train-steps`` steps, the first warming up, one
measured for memory, ``--steps`` timed; gradients and updates checked). The check this bench
exists for, printed as a warning when it fails: a fused row's measured peak is below its ATen
row's by at least the logits' bytes, and its loss equals the ATen row's (to 1e-4 relative in
fp32, 1e-2 in bf16). The fused rows do the ATen rows' FLOPs in chunks (fp16 would
recompute the matmul in the backward, tokens x hidden x vocab x 2 FLOPs).

    python -m bench.fused_loss [--small] [size flags of bench.precision] [--steps 3]
                               [--train-steps 3] [--precisions fp32,bf16] [--append|--no-append]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from bench.common import append_results, count, machine
from bench.precision import DEFAULT, eager_row, table
from bench.precision import shardfx_row as precision_row
from bench.llama_workload import fill_sizes, size_flags, workload
from bench.remat import MiB


def shardfx_row(factory, batch, a, precision: str, fused: bool) -> dict:
    def heads(plan) -> list[str]:
        found = plan.fused_losses()
        return [f"{f.weight} in {f.chunks} chunks of {f.rows} rows" for f in found] or \
            ["no head fused"]

    return precision_row(factory, batch, a, precision,
                         f"shardfx {precision}, {'fused' if fused else 'ATen'} head", heads,
                         fused_loss=fused)


def checks(rows: list[dict], logits: int) -> list[str]:
    ran = {r["variant"]: r for r in rows if "error" not in r}
    out = [f"WARNING: {v}: {w}" for v, r in ran.items() for w in r["warns"]]
    for v, fused in ran.items():
        aten = ran.get(v.replace("fused", "ATen"))
        if "fused" not in v or aten is None:
            continue
        if aten["peak"] - fused["peak"] < logits:
            out.append(f"WARNING: {v}: peak {fused['peak'] / MiB:.1f} MiB is not below the ATen "
                       f"head's {aten['peak'] / MiB:.1f} MiB by the logits' "
                       f"{logits / MiB:.1f} MiB")
        rtol = 1e-4 if "fp32" in v else 1e-2
        if abs(fused["loss"] - aten["loss"]) > rtol * abs(aten["loss"]):
            out.append(f"WARNING: {v}: loss {fused['loss']:.6f} vs the ATen head's "
                       f"{aten['loss']:.6f} (> {rtol:g} relative)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    size_flags(parser, DEFAULT)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the others")
    parser.add_argument("--train-steps", type=int, default=3,
                        help="steps before the measured one (the first warms up)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--append", action=argparse.BooleanOptionalAction, default=None,
                        help="append to bench/RESULTS.md (default: unless --small)")
    a = parser.parse_args()
    fill_sizes(a, DEFAULT)
    start = time.perf_counter()
    factory, batch, params = workload(a)
    rows = []
    for precision in a.precisions.split(","):
        for make in (lambda: eager_row(factory, batch, a, precision),
                     lambda: shardfx_row(factory, batch, a, precision, False),
                     lambda: shardfx_row(factory, batch, a, precision, True)):
            t0 = time.perf_counter()
            rows.append(make())
            gc.collect()
            print(f"{rows[-1]['variant']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    tokens = a.batch * a.seq
    logits = tokens * a.vocab * 4
    title = (f"fused_loss: Llama {a.layers} layers, hidden {a.hidden}, intermediate {a.inter}, "
             f"{a.heads} heads, {a.kv} KV heads, vocab {a.vocab} ({count(params)} params), batch "
             f"{a.batch} x {a.seq}: fp32 logits {logits / MiB:.1f} MiB; F.cross_entropy, AdamW; "
             f"per row {a.train_steps} steps (the first warms up), one measured for memory, "
             f"{a.steps} timed")
    notes = [
        "measured peak: live tensor storage at the step's peak (shardfx.runtime.measure), weights, "
        "gradients and AdamW state included, the batch not. predicted: "
        "max(plan.memory_estimate().values()). step s: median of the timed steps. loss: the "
        "loss the measured step returns.",
        f"the fused head's recomputed matmul: {2 * tokens * a.hidden * a.vocab / 1e9:.1f} GFLOPs "
        "per step",
        *[f"{r['variant']}: " + "; ".join(r["notes"]) for r in rows if r.get("notes")],
        f"wall time: {time.perf_counter() - start:.0f} s",
    ]
    warns = checks(rows, logits)
    text = table(rows, title, notes + warns, a.train_steps)
    print(text)
    if a.append if a.append is not None else not a.small:
        append_results("bench/fused_loss.py", text, machine())


if __name__ == "__main__":
    main()
