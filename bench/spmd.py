"""SPMD: planning time over dp, tp and pp, and step time against PyTorch's own TP + DP.

1. Planning time. The same Hugging Face Llama (8 layers, hidden 1024, 16 heads, 8 KV heads,
   intermediate 2816, vocab 32000; on the meta device), the same global batch (64 x 128) and
   the same loss (``F.cross_entropy``) are planned for training with ``shard="megatron"`` on
   dp=2×tp=4 (8 devices), dp=16×tp=4 (64), dp=8×tp=8 (64), pp=4×tp=2 (8, 4 microbatches) and
   dp=2×pp=4×tp=8 (64, 4 microbatches). Every plan traces the backward: after the warm-up the
   bench fails unless each returns one gradient per trainable parameter. One program serves
   every rank of a role, so planning should not grow with dp: we report each mesh's min and
   median ``partition`` time (one warm-up each, then ``--repeats`` interleaved runs), the
   ratio to dp=2×tp=4, the gradient outputs, the per-device program's node count (summed over
   the stage parts under pp), and the ratio dp=16×tp=4 / dp=2×tp=4 (64 vs 8 devices, goal
   <= 1.2x, program nodes equal).

2. Step time. One ``shardfx.launch`` run of 4 gloo processes (mesh dp=2, tp=2) per model, one
   intra-op thread each (4 ranks share 2 cores), trains a seeded Llama with AdamW on one
   global batch (8 x 64): the tiny model (2 layers, hidden 256, 8 heads, 4 KV heads,
   intermediate 512, vocab 1024; ``--steps`` timed steps) and the medium one (8 layers, hidden
   768, 12 heads, 4 KV heads, intermediate 2048, vocab 32000: 99.5 M parameters, 50.3 M in the
   blocks; ``--medium-steps``, 0 to skip). Both contestants start from the same weights (same
   seed) and train on the same data:
   - shardfx: ``partition(..., shard="megatron")`` then ``runner.step`` on the global batch (the
     runner cuts each rank's slice);
   - peer: PyTorch's own 2-D parallelism on ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``:
     ``parallelize_module`` on ``mesh["tp"]`` (ColwiseParallel for q/k/v/gate/up, RowwiseParallel
     for o/down) and ``DistributedDataParallel(model, device_mesh=mesh["dp"])``; each rank feeds
     its dp slice. DDP with ``process_group=mesh["dp"].get_group()`` rejects the DTensor
     parameters (its initial broadcast mixes Tensor and DTensor); given ``device_mesh=`` it first
     turns them into local tensors with hooks (``_pre_dp_module_transform``), the documented
     TP + DDP path, and matches one-device training exactly. ``_composable.replicate`` runs but
     trains to different losses than one device on torch 2.13, so it is not the peer; FSDP2
     ``fully_shard`` also matches, but shards (gathers) parameters, which DDP does not.
   The two alternate step by step (``--warmup`` steps, then the timed ones, barriers around
   each); each table gives rank 0's min and median per-step wall time, the ratio shardfx / peer
   (goal <= 1.0x) and both global losses after the last timed step (they must agree: same
   function, same weights, same data). One more step of each is profiled on rank 0 with
   torch.profiler: the notes split it into collectives, matmuls, other ATen ops, and time outside
   ATen ops (Python, autograd engine, DDP's bucket waits).

    python -m bench.spmd [--repeats 5] [--steps 20] [--medium-steps 8] [--no-append]

Prints the tables and appends them to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfx
from bench.common import (alternate, append_results, check_backward, count, machine, mesh_label,
                          program_nodes, timed)

warnings.filterwarnings("ignore")

BIG = dict(layers=8, hidden=1024, heads=16, kv=8, inter=2816, vocab=32000)
SMALL = dict(layers=2, hidden=256, heads=8, kv=4, inter=512, vocab=1024)
MEDIUM = dict(layers=8, hidden=768, heads=12, kv=4, inter=2048, vocab=32000)  # 99.5 M params
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
          "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def llama(layers, hidden, heads, kv, inter, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, use_cache=False))


def loss_fn(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def train_step(forward, opt, x, y):
    """A plain training step of ``forward`` on ``(x, y)``: loss, backward, the optimizer's
    step, gradients dropped; it returns the loss."""
    def step():
        loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def batch(vocab: int, b: int, s: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, vocab, (b, s), generator=g) for _ in range(2))
    return x.to(device), y.to(device)


# --- 1. planning time over dp, tp and pp ----------------------------------------------------

PLAN_MESHES = [  # (mesh, microbatches); the first two differ in dp alone: the flatness check
    ({"dp": 2, "tp": 4}, 1), ({"dp": 16, "tp": 4}, 1), ({"dp": 8, "tp": 8}, 1),
    ({"pp": 4, "tp": 2}, 4), ({"dp": 2, "pp": 4, "tp": 8}, 4),
]


def planning(a) -> str:
    with torch.device("meta"):
        model = llama(**BIG)
    x, y = batch(BIG["vocab"], a.plan_batch, a.plan_seq, "meta")

    def plan(mesh, microbatches):
        extra = {"microbatches": microbatches} if microbatches > 1 else {}
        return shardfx.partition(model, (x,), loss_fn, (y,), mesh=mesh, shard="megatron",
                                 **extra)

    meshes = {mesh_label(m): (m, mb) for m, mb in PLAN_MESHES}
    grads, nodes = {}, {}
    for k, (mesh, mb) in meshes.items():  # warm-up; every plan traces the backward
        p = plan(mesh, mb)
        grads[k] = check_backward(p.ir, model, f"planning {k}")
        nodes[k] = program_nodes(p)
        del p
    times: dict[str, list[float]] = {k: [] for k in meshes}
    for _ in range(a.repeats):
        for k, (mesh, mb) in meshes.items():
            times[k].append(timed(lambda: plan(mesh, mb)))
    first, dp_grown = list(meshes)[:2]
    base = statistics.median(times[first])
    params = sum(p.numel() for p in model.parameters())
    rows = [f"planning: Llama {BIG['layers']} layers, hidden {BIG['hidden']} "
            f"({count(params)} params, meta device), global batch {a.plan_batch} x "
            f"{a.plan_seq}, F.cross_entropy, shard=megatron, training (backward traced), "
            f"{a.repeats} runs after one warm-up, interleaved", "",
            f"| mesh | devices | microbatches | min (s) | median (s) | vs {first} | gradients "
            "| program nodes |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k, ts in times.items():
        med, (mesh, mb) = statistics.median(ts), meshes[k]
        rows.append(f"| {k} | {math.prod(mesh.values())} | {mb} | {min(ts):.2f} | {med:.2f} | "
                    f"{med / base:.2f}x | {grads[k]} | {nodes[k]} |")
    ratio = statistics.median(times[dp_grown]) / base
    same = "equal" if nodes[first] == nodes[dp_grown] else "DIFFERENT"
    rows += ["", f"64 / 8 devices ({dp_grown} / {first}): {ratio:.2f}x (goal <= 1.2x); "
             f"program nodes {same}", "",
             "gradients: the plan's gradient outputs, checked to be one per trainable parameter. "
             "program nodes: the per-device program's, summed over the stage parts (F, B, W "
             "per stage) under pp."]
    return "\n".join(rows)


# --- 2. step time against PyTorch TP + DDP ----------------------------------------------------


def peer(model: torch.nn.Module, mesh, compiled: bool = False) -> torch.nn.Module:
    """PyTorch's TP over ``mesh["tp"]`` and DDP over ``mesh["dp"]``; ``compiled``: each
    decoder layer ``torch.compile``d between the two, as torchtitan applies TP, compile, DP."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.nn.parallel import DistributedDataParallel

    plan = {}
    for i in range(len(model.model.layers)):
        plan |= {f"model.layers.{i}.{n}": ColwiseParallel() for n in COLUMN}
        plan |= {f"model.layers.{i}.{n}": RowwiseParallel() for n in ROW}
    parallelize_module(model, mesh["tp"], plan)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    return DistributedDataParallel(model, device_mesh=mesh["dp"])


def race(size: dict, b: int, s: int, warmup: int, steps: int) -> dict | None:
    """On every rank: build both from the same seed, alternate their steps on the same batch;
    rank 0 returns times, losses, profile."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # 4 ranks on 2 cores: one intra-op thread each, for both
    x, y = batch(size["vocab"], b, s)
    plan = shardfx.partition(llama(**size), (x,), loss_fn, (y,), mesh={"dp": 2, "tp": 2},
                             shard="megatron")
    runner = plan.runner(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = peer(llama(**size), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = mesh["dp"].get_local_rank()
    xs, ys = x.chunk(2)[dp], y.chunk(2)[dp]

    def peer_step():
        opt.zero_grad()
        loss = loss_fn(model(xs), ys)
        loss.backward()
        opt.step()
        return loss.detach()

    contestants = {"shardfx": lambda: runner.step((x,), (y,)), "peer": peer_step}
    times, losses = alternate(contestants, warmup, steps)
    dist.all_reduce(losses["peer"], group=mesh["dp"].get_group())  # mean of the dp slices' means
    losses = {"shardfx": losses["shardfx"].item(), "peer": losses["peer"].item() / 2}
    notes = {name: profiled(step) for name, step in contestants.items()}
    return dict(times=times, losses=losses, notes=notes) if dist.get_rank() == 0 else None


def profiled(step) -> str:
    """One step, profiled on rank 0: where its wall time went."""
    if dist.get_rank() != 0:
        dist.barrier()
        step()
        return ""
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    parts = dict.fromkeys(("collectives", "matmuls", "other ATen ops"), 0.0)
    calls = 0
    for e in prof.key_averages():
        if e.key.startswith(("c10d::", "_c10d_functional::")):
            parts["collectives"] += e.self_cpu_time_total
        elif e.key.startswith("aten::"):
            kind = "matmuls" if e.key in ("aten::mm", "aten::addmm", "aten::bmm") \
                else "other ATen ops"
            parts[kind] += e.self_cpu_time_total
            calls += e.count
    parts = {k: v / 1e3 for k, v in parts.items()}  # us -> ms
    parts["outside ATen ops"] = max(0.0, wall * 1e3 - sum(parts.values()))
    split = ", ".join(f"{k} {v:.0f} ms ({v / (wall * 1e3):.0%})" for k, v in parts.items())
    return f"{wall * 1e3:.0f} ms profiled, {calls} ATen calls: {split}"


def stepping(a, name: str, size: dict, steps: int) -> str:
    res = shardfx.launch(race, size, a.batch, a.seq, a.warmup, steps, nprocs=4, timeout=300,
                         deadline=3600)[0]
    times, losses, notes = res["times"], res["losses"], res["notes"]
    med = {k: statistics.median(ts) for k, ts in times.items()}
    names = {"peer": "PyTorch TP (parallelize_module) + DDP (peer)",
             "shardfx": "shardfx partition + runner.step"}
    with torch.device("meta"):
        params = sum(p.numel() for p in llama(**size).parameters())
    rows = [f"step time, {name} model: Llama {size['layers']} layers, hidden {size['hidden']}, "
            f"{size['heads']} heads, {size['kv']} KV heads, intermediate {size['inter']}, vocab "
            f"{size['vocab']} ({count(params)} params), global batch {a.batch} x {a.seq}, AdamW, "
            f"4 gloo processes (dp=2, tp=2, shard=megatron), 1 thread each, {steps} steps after "
            f"{a.warmup} warm-up, alternating", "",
            f"| variant | min (ms) | median (ms) | vs peer | loss after step {a.warmup + steps} |",
            "|---|---:|---:|---:|---:|"]
    for k in ("peer", "shardfx"):
        rows.append(f"| {names[k]} | {min(times[k]) * 1e3:.1f} | {med[k] * 1e3:.1f} | "
                    f"{med[k] / med['peer']:.2f}x | {losses[k]:.6f} |")
    diff = abs(losses["shardfx"] - losses["peer"]) / abs(losses["peer"])
    rows += ["", f"shardfx / peer: {med['shardfx'] / med['peer']:.2f}x (goal <= 1.0x); "
             f"losses differ by {diff:.1e} (relative)", "",
             "One more step of each, profiled on rank 0:", ""]
    rows += [f"- {names[k]}: {notes[k]}" for k in ("peer", "shardfx")]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="partition runs per mesh")
    parser.add_argument("--plan-batch", type=int, default=64)
    parser.add_argument("--plan-seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch of the step race")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps, tiny model")
    parser.add_argument("--medium-steps", type=int, default=8,
                        help="timed steps, medium model (0: skip it)")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    parts = [planning(a), stepping(a, "tiny", SMALL, a.steps)]
    if a.medium_steps:
        parts.append(stepping(a, "medium", MEDIUM, a.medium_steps))
    table = "\n\n".join(parts)
    print(table)
    if not a.no_append:
        append_results("spmd", table, machine())


if __name__ == "__main__":
    main()
