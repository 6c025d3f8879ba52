"""Long sequences: the longest sequence each plan fits in a per-rank memory budget, and the step.

A Hugging Face Llama (2 layers, hidden 256, 8 heads, 8 KV heads, intermediate 688, vocabulary
8192, fp32, AdamW; the parameter count is printed) trains on one sequence of random tokens.
For each plan -- one device, ``tp=4`` (``shard="megatron"``), ``tp=4`` with sequence
parallelism (``"megatron-sp"``) and ``cp=4`` (context parallelism, ring attention) -- the
longest sequence (a multiple of 64) whose predicted per-rank peak (``plan.memory_estimate``,
the fullest rank) is within ``--budget`` MiB is searched by bisection on plans alone (no
process runs them). Then each plan runs at its length on 4 gloo processes (the one-device
plan on each of them alike), one warm-up step and one measured (``shardfx.runtime.measure``: live
tensor storage, every rank; the fullest reported), to check the prediction the search relied
on. Then the cp=4 plan's step at its length: ``--steps`` steps after one untimed, barriers
around each; rank 0's wall and process CPU time, min and median, its first loss next to one
device's (the seeded model run whole on each rank), and its CPU time on every rank (the ranks'
attention work is the same).

The peer is PyTorch's ``context_parallel`` (torch.distributed.tensor.experimental) on the same
mesh, from the same weights: ids, labels and position ids given to it as buffers to shard (it
balances the causal load: each rank a front and a back chunk), the gradients averaged over cp
by hand (an all-reduce per parameter), AdamW. Its ring runs the CUDA attention ops only (flash,
efficient, cuDNN): on a CPU mesh (gloo, as here) it does not split attention over the ranks at
all, every rank computes the whole attention, so its step is not a context-parallel step and
no ratio to it is printed ("n/a on CPU"). It still runs one step there, untimed, for its first
loss (off one device's: the causal mask falls on the wrong tokens), which shows why. On a CUDA
mesh the two steps would alternate, timed alike, and the ratio of wall medians be printed.
Where context_parallel cannot run, the error it gives is printed.

    PYTHONPATH=. python -m bench.longseq [--budget 160] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import shardfx
from bench.common import append_results, machine
from shardfx.runtime.measure import measured_peak

PLANS = {"one device": ({}, "auto"), "tp=4": ({"tp": 4}, "megatron"),
         "tp=4 + SP": ({"tp": 4}, "megatron-sp"), "cp=4": ({"cp": 4}, "auto")}
VOCAB, STEP = 8192, 64
PEER = "PyTorch context_parallel"
PEER_ON_CPU = ("its ring runs the CUDA attention ops (flash, efficient, cuDNN) only; on CPU "
               "DTensor all-gathers q, k and v (by shardfx's rule for the CPU op: torch has "
               "none) and every rank computes the whole attention, in the balanced order, so "
               "the causal mask falls on the wrong tokens")


def build() -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=1 << 16))


def loss_fn(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return torch.randint(0, VOCAB, (1, seq), generator=g), torch.randint(0, VOCAB, (1, seq), generator=g)


def plan(name: str, seq: int):
    mesh, shard = PLANS[name]
    ids, labels = batch(seq)
    return shardfx.partition(build(), (ids,), loss_fn, (labels,), mesh=mesh, shard=shard)


def predicted(name: str, seq: int) -> int:
    return max(plan(name, seq).memory_estimate().values())


def longest(name: str, budget: int) -> tuple[int, int]:
    """(sequence, its predicted peak): the longest multiple of STEP within ``budget``."""
    lo, hi = 0, STEP
    while predicted(name, hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (mid, hi) if predicted(name, mid) <= budget else (lo, mid)
    return lo, predicted(name, lo) if lo else 0


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _measure(lengths: dict[str, int], steps: int) -> dict:
    """On every rank: each plan's measured peak at its length, then cp=4's step raced against
    PyTorch's context_parallel, steps interleaved."""
    out = {"peaks": {name: _peak(name, seq) for name, seq in lengths.items()}}
    out["race"] = _race(lengths["cp=4"], steps)
    return out


def _peak(name: str, seq: int) -> int:
    """The measured peak of this rank's second step of plan ``name`` at ``seq`` tokens."""
    runner = plan(name, seq).runner(_adamw)
    ids, labels = batch(seq)
    runner.step((ids,), (labels,))
    peak = measured_peak(lambda: runner.step((ids,), (labels,)), runner, ids, labels)
    return peak.total - ids.nbytes - labels.nbytes


def _race(seq: int, steps: int) -> dict:
    """shardfx's cp=4 step and PyTorch's context_parallel step in turn (barriers around each),
    both from the seeded weights on the same sequence: the first step of each is untimed, its
    loss set next to one device's; then ``steps`` timed, the peer's only where its ring runs
    (a CUDA mesh: ``peer_timed``)."""
    from torch.distributed.device_mesh import init_device_mesh

    ids, labels = batch(seq)
    with torch.no_grad():
        one = loss_fn(build()(ids), labels).item()  # the seeded weights, whole, on each rank
    runner = plan("cp=4", seq).runner(_adamw)
    contestants = {"shardfx cp=4": lambda: runner.step((ids,), (labels,))}
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    peer_timed = mesh.device_type == "cuda"  # its ring splits the CUDA attention ops only
    why = None
    try:
        contestants[PEER] = _torch_context_parallel(mesh, seq)
    except Exception as e:  # noqa: BLE001 -- the reason is the result
        why = f"cannot run here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    wall = {k: [] for k in contestants}
    cpu = {k: [] for k in contestants}
    first = {}
    for i in range(1 + steps):
        for name, step in list(contestants.items()):
            if i > 0 and name == PEER and not peer_timed:
                continue  # its first loss is all it shows on CPU
            torch.distributed.barrier()
            start, c = time.perf_counter(), time.process_time()
            try:
                loss = float(step())
            except Exception as e:  # noqa: BLE001 -- the peer's failure is the result
                why = f"cannot run here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                del contestants[name], wall[name], cpu[name]
                continue
            cpu_s = time.process_time() - c
            torch.distributed.barrier()
            wall_s = time.perf_counter() - start
            if i == 0:
                first[name] = loss
            else:
                wall[name].append(wall_s)
                cpu[name].append(cpu_s)
    return {"wall": wall, "cpu": cpu, "first": first, "one": one, "why": why,
            "peer_timed": peer_timed}


def _torch_context_parallel(mesh, seq: int):
    """A training step of PyTorch's context_parallel on ``mesh``: the ids, labels and position
    ids sharded (and load-balanced) by it, the gradients averaged over cp by hand, AdamW.
    Returns the step (its loss: the mean over the ranks)."""
    from torch.distributed.tensor.experimental import context_parallel

    model = build()
    opt = _adamw(list(model.parameters()))
    ids, labels = batch(seq)
    pos = torch.arange(seq).unsqueeze(0)
    group, n = mesh.get_group(), mesh.size()

    def step():
        opt.zero_grad(set_to_none=True)
        i, l, p = ids.clone(), labels.clone(), pos.clone()
        with context_parallel(mesh, buffers=[i, l, p], buffer_seq_dims=[1, 1, 1]):
            loss = loss_fn(model(i, position_ids=p), l)
            loss.backward()
        for prm in model.parameters():
            torch.distributed.all_reduce(prm.grad, group=group)
            prm.grad /= n
        opt.step()
        loss = loss.detach()
        torch.distributed.all_reduce(loss, group=group)
        return loss / n

    return step


def race_rows(runs: list[dict], seq: int, steps: int) -> list[str]:
    """The step table (rank 0's), shardfx's CPU by rank, and the ratio to the peer where the
    peer's ring ran ("n/a on CPU" otherwise, with the reason)."""
    race = runs[0]["race"]
    each = ("each, interleaved" if race["peer_timed"] else
            f"of shardfx's, one untimed step of {PEER}'s (below: why)")
    out = [f"Step at cp=4's length ({seq} tokens), 1 untimed + {steps} steps {each}, rank 0 "
           "(4 ranks on the machine's cores):", "",
           "| contestant | wall min (s) | wall median (s) | CPU min (s) | CPU median (s) | "
           f"first loss (one device: {race['one']:.6f}) |", "|---|---:|---:|---:|---:|---:|"]
    for name, loss in race["first"].items():
        wall, cpu = race["wall"].get(name), race["cpu"].get(name)  # none: failed or untimed
        times = (f"{min(wall):.3f} | {statistics.median(wall):.3f} | {min(cpu):.3f} | "
                 f"{statistics.median(cpu):.3f}" if wall else " | ".join(["n/a on CPU"] * 4))
        out.append(f"| {name} | {times} | {loss:.6f} |")
    if race["why"]:
        out.append(f"| {PEER} | {race['why']} | | | | |")
    per_rank = ", ".join(f"{statistics.median(r['race']['cpu']['shardfx cp=4']):.3f}"
                         for r in runs)
    out += ["", f"shardfx cp=4, CPU median by rank: {per_rank} s (each rank a front and a back "
            "chunk: the same attention work on each)"]
    if PEER not in race["first"]:
        return out
    if not race["peer_timed"]:
        out.append(f"shardfx / {PEER} step: n/a on CPU ({PEER_ON_CPU}): its step is not a "
                   "context-parallel step here, so it was run once for its loss, not timed")
    off = [name for name, loss in race["first"].items()
           if abs(loss - race["one"]) > 1e-6 * abs(race["one"])]
    if race["peer_timed"] and race["wall"].get(PEER):  # it ran every timed step
        ours, peer = (statistics.median(race["wall"][k]) for k in ("shardfx cp=4", PEER))
        out.append(f"shardfx / {PEER}, median wall: {ours / peer:.2f}x"
                   + (" -- not like for like: a first loss is off" if off else ""))
    return out + [f"{name}'s first loss is not one device's (beyond 1e-6 of it: fp32 rounding "
                  "is 1e-7)" for name in off]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=160, help="MiB per rank")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    budget = int(a.budget * 2**20)
    params = sum(p.numel() for p in build().parameters())
    print(f"HF Llama, {params:,} parameters; budget {a.budget:g} MiB per rank")
    found = {}
    for name in PLANS:
        start = time.process_time()
        found[name] = longest(name, budget)
        print(f"  {name}: {found[name][0]} tokens (predicted {found[name][1] / 2**20:.1f} MiB), "
              f"searched in {time.process_time() - start:.1f} s CPU")
    runs = shardfx.launch(_measure, {k: v[0] for k, v in found.items()}, a.steps, nprocs=4,
                          timeout=600)
    one = found["one device"][0]
    rows = ["| plan | longest sequence | vs one device | predicted peak (MiB) | measured peak, "
            "fullest rank (MiB) |", "|---|---:|---:|---:|---:|"]
    for name, (seq, pred) in found.items():
        measured = max(r["peaks"][name] for r in runs)
        rows.append(f"| {name} | {seq} | {seq / one:.2f}x | {pred / 2**20:.1f} | "
                    f"{measured / 2**20:.1f} |")
    rows += ["", *race_rows(runs, found["cp=4"][0], a.steps)]
    table = (f"longseq: HF Llama {params:,} parameters, 1 sequence, budget {a.budget:g} MiB per "
             "rank, 4 gloo processes\n\n" + "\n".join(rows) +
             f"\n\ncp=4 / one device: {found['cp=4'][0] / one:.2f}x (goal >= 3.6x)")
    print(table)
    append_results("longseq", table, machine())


if __name__ == "__main__":
    main()
