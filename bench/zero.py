"""ZeRO: shardfx's ``zero=1, 2, 3`` against PyTorch's FSDP2 (``fully_shard``), memory and time.

One ``shardfx.launch`` run of 4 gloo processes (mesh dp=4), one intra-op thread each (4 ranks
share the machine's cores), trains a Hugging Face Llama (``--layers`` layers, default 9, hidden
768, 12 heads, 4 KV heads, intermediate 2048, vocab 32000, untied head: 105,789,696 parameters
at 9 layers; the count is printed) with AdamW (lr 1e-3) on one seeded global batch (8 x 64
tokens), loss ``F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())``. Every contestant
starts from the same weights (the same seed) and trains on the same data:

- FSDP2 (the ZeRO-3 peer), wrapped as TorchTitan wraps its Llama (``apply_fsdp`` in
  torchtitan/models/llama3/infra/parallelize.py, its default policy without pp), bottom-up:
  ``fully_shard(..., mesh=dp)`` on the embedding (``embed_tokens``) and on each decoder layer
  with ``reshard_after_forward=True``, on the final norm and the LM head as one group
  (``fully_shard([norm, lm_head])``) with ``reshard_after_forward=False`` (the backward starts
  with them: resharding would only gather them again at once), then on the root (FSDP2's
  default; it holds no parameters of its own by then). Wrapping only the decoder layers and
  the root left the embedding and the head in the root's group, gathered for the whole step:
  its peak at 9 layers was 872 MiB, 697 this way (2026-11-29);
- FSDP2 with TorchTitan's "never" policy (``reshard_after_forward=False`` for every group; the
  ZeRO-2 peer, and ZeRO-1's);
- shardfx: ``partition(model, (ids,), loss_fn, (labels,), mesh={"dp": 4}, zero=k)``, then
  ``plan.runner(...).step`` on the global batch (the runner cuts each rank's rows), for k = 3,
  2, 1, and k = 0 (plain data parallelism) as a reference row. Where ``shardfx.partition``
  takes no ``zero=`` the ZeRO rows are skipped with a note (zero=0 is ``partition`` without it).

Each FSDP2 rank feeds its dp slice (2 rows) and FSDP2 averages the gradients over dp; its step
all-reduces the slices' losses and divides by 4, so it returns the global batch's loss, as
shardfx's ``runner.step`` does. Checks, each fatal: every contestant's first-step loss equals
the global batch's loss computed whole by the seeded model on each rank (so the mean of the
slices' losses is the batch's), and every loss after the last step agrees with the first row's
to 1e-5 (relative). shardfx plans with its defaults: its fused LM-head loss never makes the
(tokens, vocab) logits, which FSDP2's eager forward does (16 MiB per rank here, and their
gradient): part of any peak difference.

Phases. All six together would hold about 10.5 times the fp32 weights per rank (404 MiB at 9
layers; plain dp alone 4 times), about 19 GB over 4 ranks: more than this 24 GB machine spares.
So the run is three phases, each a stage's contestants built together, raced, measured and
freed: (1) FSDP2 default and zero=3, (2) FSDP2 ``reshard_after_forward=False``, zero=2 and
zero=1, (3) zero=0. A ratio always compares rows of one phase; zero=0's times come from a phase
of its own (another moment of a shared, noisy machine).

Time. In each phase ``--warmup`` untimed rounds, then ``--steps`` timed ones, each round one
step of every contestant in turn, barriers around each step (``bench.common.alternate``).
Reported: rank 0's per-step wall time (barrier to barrier: the slowest rank's step) and the
per-step CPU time of the slowest rank (each rank's process CPU time, ``time.process_time``
around the step alone: every thread of it, gloo's included; then, step by step, the max over the
4 ranks: a step is done when its slowest rank is, and rank 0 alone, or the mean, would hide a
rank that works more; with 4 ranks on 2 cores wall time depends on the others' scheduling and
on anything else the machine runs, CPU time less), min and median over the timed steps, and the
ratio of medians to the FSDP2 row of the same stage: zero=3 to FSDP2 default, zero=2 and zero=1
to ``reshard_after_forward=False``.

Memory, measured on one more step of each contestant after the timed ones (in turn, barriers
around each; its loss is the last one reported). The peak is ``shardfx.runtime.measure``'s measure of
live tensor storage, the same for every row: every storage an op returns counts, at its size
in bytes, from then until Python frees it; what lives before the step (the model's or the
runner's parameters and their gradients, the optimizer and its state, the batch) counts from
the start. It is ``shardfx.runtime.measure.measured_peak`` (the runners' ``mark("fwd+bwd")`` records
the peak of forward and backward; the FSDP2 step marks it between ``backward()`` and
``opt.step()``), which sees what FSDP2 does to its tensors:
  1. a DTensor counts as its local tensor: the wrapper's ``untyped_storage()`` has the global
     size (FSDP2's parameters, gradients and optimizer state are DTensors);
  2. storage resizes are followed: FSDP2 frees an unsharded parameter with
     ``untyped_storage().resize_(0)`` and brings it back by resizing the same storage
     (``free_storage`` / ``alloc_storage``, torch/distributed/fsdp/_fully_shard/_fsdp_param.py);
  3. a storage an op writes (``Tensor(a!)`` in its schema) counts from then, as one it returns
     does: FSDP2 copies the gathered parameters out with ``fsdp::split_with_sizes_copy(...,
     out=[...]) -> ()``, which returns nothing (_fsdp_collectives.py).
shardfx's runners do none of these things (zero=0's and zero=3's peaks were the same before
``measure`` saw them). Checked against glibc (``mallinfo2()`` in-use bytes sampled after every
op, at 2 layers): FSDP2's step grew 471 MiB by glibc, 469 by this measure; zero=0 188 and 188;
zero=3 331 and 198. The difference is gloo's: an async ``all_gather_into_tensor`` holds a
hidden copy of the whole output until it is waited on (a 92 MiB gather: 92 MiB more in use
before ``wait()``), and zero=3 issues the next bucket's gather before waiting for the current
one. The measure, like shardfx's memory model, does not see a collective's internal buffers
(nor, in general, storages an op makes and frees inside its own implementation); under NCCL
that copy does not exist.

Reported per rank (max over the 4 ranks, MiB): the peak and its forward-and-backward part; the
state alone after the step: the storages holding the rank's parameters, their gradients and the
optimizer's state, each storage once, at its size (FSDP2's padded shards; zero=1, 2's
whole-parameter buffer that the stepped rows are views of); and for shardfx rows the memory
model's prediction (``plan.memory_breakdown()[rank]``: parameters + gradients + optimizer state
at the predicted peak, and the predicted peak).

FSDP2 runs on CPU with gloo in torch 2.13 with no workaround (its all-gathers and
reduce-scatters run on gloo; default options).

With ``--in-backward`` every shardfx row is planned with ``optimizer_in_backward=True`` (each
rank steps its rows of a block's parameters in the backward, the gradients freed there); the
FSDP2 rows are as above.

    python -m bench.zero [--in-backward] [--steps 5] [--warmup 2] [--layers 9] [--no-append]

Prints the tables and appends them to bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardfx
from bench.common import alternate, append_results, clocked, count, machine
from bench.spmd import batch, llama, loss_fn
from shardfx.runtime.measure import mark, measured_peak
from shardfx.estimate.memory import DeviceMemory

SIZE = dict(hidden=768, heads=12, kv=4, inter=2048, vocab=32000)  # and --layers
DP = 4
LR = 1e-3
ZERO = {"shardfx zero=3": 3, "shardfx zero=2": 2, "shardfx zero=1": 1,
        "shardfx zero=0 (plain dp)": 0}
NO_RESHARD = "FSDP2 reshard_after_forward=False"
FSDP = {"FSDP2 fully_shard": True, NO_RESHARD: False}  # -> reshard_after_forward
PEER = {"shardfx zero=3": "FSDP2 fully_shard", "shardfx zero=2": NO_RESHARD,
        "shardfx zero=1": NO_RESHARD}  # the FSDP2 row each is compared with
# Contestants alive together, alternating (module docstring): each ZeRO stage with its peer.
PHASES = [["FSDP2 fully_shard", "shardfx zero=3"],
          [NO_RESHARD, "shardfx zero=2", "shardfx zero=1"],
          ["shardfx zero=0 (plain dp)"]]
RTOL = 1e-5
MiB = 2**20


def has_zero() -> bool:
    return "zero" in inspect.signature(shardfx.partition).parameters


def state_bytes(params, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages holding ``params``, their gradients and ``optimizer``'s state,
    each storage once, at its current size."""
    params = list(params)
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))]
    storages = {}
    for t in tensors:
        s = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
        storages[s._cdata] = s.nbytes()
    return sum(storages.values())


# --- the contestants, on every rank -----------------------------------------------------------


@dataclass
class Contestant:
    step: Callable[[], torch.Tensor]  # one training step; returns the global batch's loss
    existing: tuple  # what lives across steps, for the measure: model or runner, optimizer
    params: Callable[[], Iterable[torch.Tensor]]  # the rank's parameters, as the optimizer has them
    optimizer: torch.optim.Optimizer
    modelled: DeviceMemory | None = None  # shardfx's prediction for this rank


def shard_like_torchtitan(model: torch.nn.Module, mesh, reshard: bool) -> None:
    """FSDP2's groups as TorchTitan's ``apply_fsdp`` makes them, bottom-up: the embedding, each
    decoder layer, the final norm with the LM head, then the root. ``reshard`` is the
    embedding's and the layers' ``reshard_after_forward`` (TorchTitan's "default" policy: True;
    "never": False). The norm + head group is never resharded after forward: the backward
    starts with it, so FSDP would gather it again at once. The root keeps FSDP2's default, as
    in TorchTitan; it is left with the rotary embedding's buffers only."""
    from torch.distributed.fsdp import fully_shard

    llama_body = model.model
    fully_shard(llama_body.embed_tokens, mesh=mesh, reshard_after_forward=reshard)
    for layer in llama_body.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard([llama_body.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)


def fsdp2(layers: int, mesh, reshard: bool, xs, ys) -> Contestant:
    """A seeded Llama under FSDP2 (TorchTitan's wrapping), its AdamW, a step on this rank's
    slice."""
    model = llama(layers=layers, **SIZE)
    shard_like_torchtitan(model, mesh, reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step():
        opt.zero_grad()
        loss = loss_fn(model(xs), ys)
        loss.backward()
        mark("fwd+bwd")
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)  # the slices' means, summed (gloo has no AVG): as shardfx returns
        return loss / DP

    return Contestant(step, (model, opt), model.parameters, opt)


def planned(k: int, model: torch.nn.Module, x, y, in_backward: bool = False) -> Contestant:
    """shardfx's plan of ``model`` with zero=k (k=0: ``partition`` without ``zero=``;
    ``in_backward``: with ``optimizer_in_backward=True``), its runner with AdamW, a step on
    the global batch."""
    plan = shardfx.partition(model, (x,), loss_fn, (y,), mesh={"dp": DP},
                             **({"zero": k} if k else {}),
                             **({"optimizer_in_backward": True} if in_backward else {}))
    runner = plan.runner(optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    return Contestant(lambda: runner.step((x,), (y,)), (runner,), runner.parameters,
                      runner.optimizer, plan.memory_breakdown()[dist.get_rank()])


def race(layers: int, b: int, s: int, warmup: int, steps: int, phases: list[list[str]],
         in_backward: bool = False) -> dict | None:
    """On every rank, phase by phase: build the phase's contestants, alternate their steps,
    measure one more step of each, free them. Rank 0 returns times, losses and memory (every
    rank's)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # 4 ranks share the cores: one intra-op thread each, for all
    mesh = init_device_mesh("cpu", (DP,), mesh_dim_names=("dp",))
    x, y = batch(SIZE["vocab"], b, s)
    rank = dist.get_rank()
    xs, ys = x.chunk(DP)[rank], y.chunk(DP)[rank]
    with torch.no_grad():  # the global batch's loss, whole, before training
        first = loss_fn(llama(layers=layers, **SIZE)(x), y).item()
    times, cpu, losses, memory, modelled = {}, {}, {}, {}, {}
    for phase in phases:
        built, shared = {}, None
        for name in phase:
            if name in FSDP:
                built[name] = fsdp2(layers, mesh, FSDP[name], xs, ys)
            else:  # the phase's plans share one seeded model (their runners copy it)
                shared = llama(layers=layers, **SIZE) if shared is None else shared
                built[name] = planned(ZERO[name], shared, x, y, in_backward)
        for name in phase:
            cpu[name], losses[name] = [], []
        clocked_steps = {k: clocked(c.step, cpu[k], losses[k]) for k, c in built.items()}
        phase_times, _ = alternate(clocked_steps, warmup, steps)
        times |= phase_times
        for name, step in clocked_steps.items():  # one more step each, measured
            c = built[name]
            dist.barrier()
            peak = measured_peak(step, *c.existing, x, y)
            dist.barrier()
            memory[name] = dict(peak=peak.total, fwd_bwd=peak.marks.get("fwd+bwd"),
                                state=state_bytes(c.params(), c.optimizer))
            cpu[name] = cpu[name][warmup:warmup + steps]
            if c.modelled is not None:
                m = c.modelled
                modelled[name] = (m.parameters + m.gradients + m.optimizer, m.total)
        del built, clocked_steps, c, shared
        gc.collect()
    memories, cpus = [None] * DP, [None] * DP
    dist.all_gather_object(memories, memory)
    dist.all_gather_object(cpus, cpu)
    return dict(times=times, cpu=slowest(cpus), losses=losses, first=first, memory=memories,
                modelled=modelled) if rank == 0 else None


def slowest(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per contestant and timed step, the max over the ranks of that step's CPU seconds: the
    steps are barrier to barrier, so step i on every rank is the same step."""
    return {name: [max(steps) for steps in zip(*(rank[name] for rank in per_rank))]
            for name in per_rank[0]}


# --- the tables ---------------------------------------------------------------------------------


def mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:.0f}"


def tables(a, res: dict, params: int, phases: list[list[str]], seconds: float
           ) -> tuple[str, list[str]]:
    """The markdown tables, and what failed the loss checks."""
    times, cpu, losses = res["times"], res["cpu"], res["losses"]
    memory, modelled = res["memory"], res["modelled"]
    phase_of = {name: i + 1 for i, phase in enumerate(phases) for name in phase}
    names = list(phase_of)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    peaks = {k: max(m[k]["peak"] for m in memory) for k in names}  # max over ranks

    def most(k: str, field: str) -> str:
        return mib(max(m[k][field] or 0 for m in memory))

    def ratio(k: str, values: dict) -> str:  # an FSDP2 row is its own peer
        peer = PEER.get(k, k if k in FSDP else None)
        return f"{values[k] / values[peer]:.2f}x" if peer else "—"

    steps = a.warmup + a.steps + 1
    rows = [f"ZeRO vs FSDP2: Llama {a.layers} layers, hidden {SIZE['hidden']}, {SIZE['heads']} "
            f"heads, {SIZE['kv']} KV heads, intermediate {SIZE['inter']}, vocab {SIZE['vocab']} "
            f"({params:,} params, {count(params)}), global batch {a.batch} x {a.seq}, AdamW, "
            f"4 gloo processes (dp=4), 1 thread each; in each phase the contestants alternate, "
            f"{a.steps} timed steps after {a.warmup} warm-up, then one measured step each; "
            f"{seconds:.0f} s in all", "",
            "Step time (wall: rank 0's, barrier to barrier, so the slowest rank's step; CPU: "
            "each rank's process CPU time of the step alone, per step the max over the 4 ranks):",
            "",
            "| variant | phase | peer | wall min (ms) | wall median (ms) | vs peer | CPU min, max "
            f"over ranks (ms) | CPU median, max over ranks (ms) | vs peer | loss after step "
            f"{steps} |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in names:
        rows.append(f"| {k} | {phase_of[k]} | {PEER.get(k, '—')} | {min(times[k]) * 1e3:.0f} | "
                    f"{med[k] * 1e3:.0f} | {ratio(k, med)} | {min(cpu[k]) * 1e3:.0f} | "
                    f"{cmed[k] * 1e3:.0f} | {ratio(k, cmed)} | {losses[k][-1]:.6f} |")
    rows += ["", "Memory per rank (MiB, max over the 4 ranks), measured on the last step "
             "(live tensor storage); modelled: shardfx's `plan.memory_breakdown()`:", "",
             "| variant | peak | fwd+bwd peak | vs peer (peak) | state after the step | "
             "modelled state (p+g+opt) | modelled peak |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k in names:
        state, total = modelled.get(k, (None, None))
        rows.append(f"| {k} | {mib(peaks[k])} | {most(k, 'fwd_bwd')} | {ratio(k, peaks)} | "
                    f"{most(k, 'state')} | {mib(state)} | {mib(total)} |")
    failures = [f"{k}: first-step loss {losses[k][0]:.7f}, the global batch's {res['first']:.7f}"
                for k in names if abs(losses[k][0] - res["first"]) > RTOL * abs(res["first"])]
    ref = losses[names[0]][-1]
    failures += [f"{k}: loss {losses[k][-1]:.7f} after step {steps}, {names[0]}'s {ref:.7f}"
                 for k in names if abs(losses[k][-1] - ref) > RTOL * abs(ref)]
    spread = max(abs(losses[k][-1] - ref) / abs(ref) for k in names)
    rows += ["", f"Losses: every first step's equals the global batch's ({res['first']:.6f}); "
             f"after step {steps} they differ by at most {spread:.1e} (relative)"
             if not failures else "Losses: DISAGREE (" + "; ".join(failures) + ")"]
    if not has_zero():
        rows += ["", "shardfx.partition takes no zero= yet: the shardfx ZeRO rows were skipped."]
    return "\n".join(rows), failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=9,
                        help="decoder layers (9: 105.8 M parameters; 8 would be 99.5 M)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--in-backward", action="store_true",
                        help="plan every shardfx row with optimizer_in_backward=True")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    phases = PHASES
    if not has_zero():
        print("note: shardfx.partition takes no zero= yet; running FSDP2 and shardfx zero=0 "
              "(plain dp) only")
        phases = [[k for k in phase if ZERO.get(k, 0) == 0] for phase in PHASES]
        phases = [phase for phase in phases if phase]
    with torch.device("meta"):
        params = sum(p.numel() for p in llama(layers=a.layers, **SIZE).parameters())
    print(f"Llama {a.layers} layers: {params:,} parameters")
    start = time.perf_counter()
    res = shardfx.launch(race, a.layers, a.batch, a.seq, a.warmup, a.steps, phases,
                         a.in_backward, nprocs=DP, timeout=600, deadline=3600)[0]
    table, failures = tables(a, res, params, phases, time.perf_counter() - start)
    if a.in_backward:
        table += ("\n\nEvery shardfx row planned with optimizer_in_backward=True (each block's "
                  "rows stepped in the backward).")
    print(table)
    if failures:
        raise SystemExit("zero: the contestants' losses disagree (same function, weights and "
                         "data): " + "; ".join(failures))
    if not a.no_append:
        append_results("zero (optimizer_in_backward)" if a.in_backward else "zero", table,
                       machine())


if __name__ == "__main__":
    main()
