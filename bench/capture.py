"""Capture time: shardfx vs plain torch.export on a large Llama built on the meta device.

shardfx's capture is torch.export (non-strict) followed by the joint forward+backward trace and
our naming; the peer is torch.export alone on the same training callable. The model is a
16-layer, 8192-hidden Llama (about 13 B parameters) on the meta device: tracing only, no memory.
A third row times the whole ``partition`` (capture, passes, codegen) for reference.
Each variant runs ``--repeats`` times interleaved after one warm-up; the table reports the
minimum and the median (these machines are noisy), and the ratio of the medians.

    python bench/capture.py [--layers 16] [--hidden 8192] [--repeats 5]

Prints the table and appends it to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch

import shardfx
from bench.common import append_results, machine
from shardfx.partitioner.capture import _LossOf, capture

warnings.filterwarnings("ignore")


def build(layers: int, hidden: int, batch: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=int(hidden * 3.5),
        num_attention_heads=hidden // 128, num_key_value_heads=8, vocab_size=32000,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (batch, seq), device="meta")
    return model, (ids,), (ids.clone(),)


def loss_fn(out, targets):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    model, args, targets = build(a.layers, a.hidden, a.batch, a.seq)
    traced = _LossOf(model, loss_fn)
    variants = {
        "torch.export (peer)": lambda: torch.export.export(traced, (args, targets), strict=False),
        "shardfx capture": lambda: capture(model, args, loss_fn, targets),
        "shardfx partition (capture, passes, codegen)":
            lambda: shardfx.partition(model, args, loss_fn, targets),
    }
    for fn in variants.values():  # warm-up: imports, op registrations, caches
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn))

    peer = statistics.median(times["torch.export (peer)"])
    params = sum(p.numel() for p in model.parameters())
    title = (f"capture: Llama {a.layers} layers, hidden {a.hidden} ({params / 1e9:.1f} B params, "
             f"meta device), batch {a.batch} x seq {a.seq}, {a.repeats} runs")
    rows = ["| variant | min (s) | median (s) | vs export |", "|---|---:|---:|---:|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(f"| {name} | {min(ts):.2f} | {med:.2f} | {med / peer:.2f}x |")
    ours = statistics.median(times["shardfx capture"])
    verdict = (f"shardfx overhead over export: {(ours - peer) / peer:.2f}x "
               f"(goal <= 1.00x)")
    table = "\n".join([title, "", *rows, "", verdict])
    print(table)
    if not a.no_append:
        append_results("capture", table, machine())


if __name__ == "__main__":
    main()
