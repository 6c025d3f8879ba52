"""SPMD: planning time as the mesh grows, and step time against PyTorch's own TP + DP.

1. Planning time. The same Hugging Face Llama (8 layers, hidden 1024, 16 heads, 8 KV heads,
   intermediate 2816, vocab 32000; on the meta device) and the same global batch (64 x 128) are
   planned with ``shard="megatron"`` for 8 devices (dp=2, tp=4) and for 64 (dp=16, tp=4). One
   program serves every rank of a role, so planning should not grow with dp: we report the median
   ``partition`` time of each (one warm-up each, then ``--repeats`` interleaved runs), their
   ratio (goal <= 1.2x) and the node count of ``plan.program.module.graph`` (should be equal).

2. Step time. One ``shardfx.launch`` run of 4 gloo processes (mesh dp=2, tp=2), one intra-op
   thread each (4 ranks share 2 cores), trains a small seeded Llama (2 layers, hidden 256,
   8 heads, 4 KV heads, intermediate 512, vocab 1024) with AdamW on one global batch (8 x 64):
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
   The two alternate step by step (``--warmup`` steps, then ``--steps`` timed, barriers around
   each); the table gives rank 0's min and median per-step wall time, the ratio shardfx / peer
   (goal <= 1.0x) and both global losses after the last timed step (they must agree: same
   function, same weights, same data). One more step of each is profiled on rank 0 with
   torch.profiler: the notes split it into collectives, matmuls, other ATen ops, and time outside
   ATen ops (Python, autograd engine, DDP's bucket waits).

    python -m bench.spmd [--repeats 5] [--steps 10] [--no-append]

Prints the tables and appends them to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfx
from bench.common import alternate, append_results, machine

warnings.filterwarnings("ignore")

BIG = dict(layers=8, hidden=1024, heads=16, kv=8, inter=2816, vocab=32000)
SMALL = dict(layers=2, hidden=256, heads=8, kv=4, inter=512, vocab=1024)
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def llama(layers, hidden, heads, kv, inter, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, use_cache=False))


def loss_fn(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def batch(vocab: int, b: int, s: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, vocab, (b, s), generator=g) for _ in range(2))
    return x.to(device), y.to(device)


# --- 1. planning time, 8 vs 64 devices ------------------------------------------------------


def planning(a) -> str:
    with torch.device("meta"):
        model = llama(**BIG)
    x, y = batch(BIG["vocab"], a.plan_batch, a.plan_seq, "meta")
    meshes = {"8 (dp=2, tp=4)": {"dp": 2, "tp": 4}, "64 (dp=16, tp=4)": {"dp": 16, "tp": 4}}

    def plan(mesh):
        return shardfx.partition(model, (x,), loss_fn, (y,), mesh=mesh, shard="megatron")

    nodes = {k: len(plan(m).program.module.graph.nodes) for k, m in meshes.items()}  # warm-up
    times: dict[str, list[float]] = {k: [] for k in meshes}
    for _ in range(a.repeats):
        for k, mesh in meshes.items():
            gc.collect()
            start = time.perf_counter()
            plan(mesh)
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times[next(iter(meshes))])
    params = sum(p.numel() for p in model.parameters())
    rows = [f"planning: Llama {BIG['layers']} layers, hidden {BIG['hidden']} "
            f"({params / 1e6:.0f} M params, meta device), global batch {a.plan_batch} x "
            f"{a.plan_seq}, shard=megatron, {a.repeats} runs", "",
            "| devices | min (s) | median (s) | vs 8 | program nodes |", "|---|---:|---:|---:|---:|"]
    for k, ts in times.items():
        med = statistics.median(ts)
        rows.append(f"| {k} | {min(ts):.2f} | {med:.2f} | {med / base:.2f}x | {nodes[k]} |")
    ratio = statistics.median(times[list(meshes)[1]]) / base
    same = "equal" if len(set(nodes.values())) == 1 else "DIFFERENT"
    rows += ["", f"64 / 8 devices: {ratio:.2f}x (goal <= 1.2x); program nodes {same}"]
    return "\n".join(rows)


# --- 2. step time against PyTorch TP + DDP ----------------------------------------------------


def peer(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.nn.parallel import DistributedDataParallel

    plan = {}
    for i in range(len(model.model.layers)):
        plan |= {f"model.layers.{i}.{n}": ColwiseParallel() for n in COLUMN}
        plan |= {f"model.layers.{i}.{n}": RowwiseParallel() for n in ROW}
    parallelize_module(model, mesh["tp"], plan)
    return DistributedDataParallel(model, device_mesh=mesh["dp"])


def race(b: int, s: int, warmup: int, steps: int) -> dict | None:
    """On every rank: build both, alternate their steps; rank 0 returns times, losses, profile."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # 4 ranks on 2 cores: one intra-op thread each, for both
    x, y = batch(SMALL["vocab"], b, s)
    plan = shardfx.partition(llama(**SMALL), (x,), loss_fn, (y,), mesh={"dp": 2, "tp": 2},
                             shard="megatron")
    runner = plan.runner(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = peer(llama(**SMALL), mesh)
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


def stepping(a) -> str:
    res = shardfx.launch(race, a.batch, a.seq, a.warmup, a.steps, nprocs=4, timeout=300,
                         deadline=900)[0]
    times, losses, notes = res["times"], res["losses"], res["notes"]
    med = {k: statistics.median(ts) for k, ts in times.items()}
    names = {"peer": "PyTorch TP (parallelize_module) + DDP (peer)",
             "shardfx": "shardfx partition + runner.step"}
    rows = [f"step time: Llama {SMALL['layers']} layers, hidden {SMALL['hidden']}, vocab "
            f"{SMALL['vocab']}, global batch {a.batch} x {a.seq}, AdamW, 4 gloo processes "
            f"(dp=2, tp=2, shard=megatron), 1 thread each, {a.steps} steps after {a.warmup} "
            "warm-up, alternating", "",
            f"| variant | min (ms) | median (ms) | vs peer | loss after step {a.warmup + a.steps} |",
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    table = "\n\n".join([planning(a), stepping(a)])
    print(table)
    if not a.no_append:
        append_results("spmd", table, machine())


if __name__ == "__main__":
    main()
