"""Capture time: shardfx vs plain torch.export on a large Llama built on the meta device.

Every variant traces the same training callable, ``loss_fn(model(ids), targets)`` with
``F.cross_entropy`` (``shardfx.partitioner.capture._LossOf``):

- torch.export (peer): ``torch.export.export(strict=False)`` of that callable. Export is
  forward-only by nature: its graph computes the loss and stops there.
- shardfx capture: the same export, then the joint forward+backward trace
  (``aot_export_joint_with_descriptors``) and our naming, so the comparison is export against
  export + joint trace, not like for like. After the warm-up the bench fails unless the
  captured graph returns one gradient per trainable parameter: a forward-only capture would
  make shardfx look cheaper than it is.
- shardfx partition: the whole ``partition`` (capture, passes, codegen) on one device, for
  reference, checked for its gradients the same way.

The model is a 16-layer, 8192-hidden Llama (about 13 B parameters) on the meta device:
tracing only, no memory. Each variant runs ``--repeats`` times interleaved after one warm-up;
the table reports the minimum and the median (these machines are noisy), the ratio of the
medians, and each graph's gradient outputs and node count.

    python -m bench.capture [--layers 16] [--hidden 8192] [--repeats 5] [--no-append]

Prints the table and appends it to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import shardfx
from bench.common import (append_results, check_backward, count, machine,
                          program_nodes, timed)
from shardfx.partitioner.capture import _LossOf, capture

warnings.filterwarnings("ignore")


def build(layers: int, hidden: int, batch: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 128)  # head dimension 128
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=int(hidden * 3.5),
        num_attention_heads=heads, num_key_value_heads=min(8, heads), vocab_size=32000,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (batch, seq), device="meta")
    return model, (ids,), (ids.clone(),)


def loss_fn(out, targets):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


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
    warm = {name: fn() for name, fn in variants.items()}  # imports, op registrations, caches
    graphs = {"shardfx capture": warm["shardfx capture"].gm,
              "shardfx partition (capture, passes, codegen)":
                  warm["shardfx partition (capture, passes, codegen)"].ir}
    grads = {name: check_backward(gm, model, name) for name, gm in graphs.items()}
    nodes = {"torch.export (peer)": len(warm["torch.export (peer)"].graph.nodes),
             "shardfx capture": len(graphs["shardfx capture"].graph.nodes),
             "shardfx partition (capture, passes, codegen)":
                 program_nodes(warm["shardfx partition (capture, passes, codegen)"])}
    path = warm["shardfx capture"].path
    del warm, graphs
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn))

    peer = statistics.median(times["torch.export (peer)"])
    params = sum(p.numel() for p in model.parameters())
    title = (f"capture: Llama {a.layers} layers, hidden {a.hidden} ({count(params)} params, "
             f"meta device), batch {a.batch} x seq {a.seq}, F.cross_entropy, training "
             f"(backward traced: {grads['shardfx capture']} gradients; capture path: {path}), "
             f"{a.repeats} runs")
    rows = ["| variant | min (s) | median (s) | vs export | gradients | nodes |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(f"| {name} | {min(ts):.2f} | {med:.2f} | {med / peer:.2f}x | "
                    f"{grads.get(name, 0)} | {nodes[name]} |")
    ours = statistics.median(times["shardfx capture"])
    verdict = (f"shardfx overhead over export: {(ours - peer) / peer:.2f}x "
               f"(goal <= 1.00x; export traces the forward and loss only, shardfx's capture "
               f"the joint forward+backward too)")
    notes = ("nodes: of the exported graph, of the captured joint graph, and of the "
             "partitioned per-device program. gradients: the graph's gradient outputs, checked "
             "to be one per trainable parameter (export has none: forward only).")
    table = "\n".join([title, "", *rows, "", verdict, "", notes])
    print(table)
    if not a.no_append:
        append_results("capture", table, machine())


if __name__ == "__main__":
    main()
