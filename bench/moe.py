"""Expert parallelism: a Mixtral on ep=4 against the same model on dp=4 (experts replicated).

One ``shardfx.launch`` run of 4 gloo processes, one intra-op thread each, trains a Hugging Face
Mixtral with random weights (``--layers`` 4, hidden 256, 8 experts of intermediate 768, top-2,
8 heads, 4 KV heads, vocab 2000: the experts hold about 90% of the weights; the count is
printed) with AdamW (lr 1e-3) on one seeded global batch (8 x 128 tokens), dropless. Both
contestants are shardfx plans of copies of one seeded model:

- dp=4: ``partition(..., mesh={"dp": 4}, zero=0)``: every rank holds every expert; each rank's
  tokens run through its own copy of the experts, and every gradient is all-reduced;
- ep=4: ``partition(..., mesh={"ep": 4})``: rank r holds experts 2r, 2r+1 of every layer; each
  layer's tokens go to their experts' ranks by all-to-all and come back by a second, forward
  and backward; only the gradients of the other weights are all-reduced.

Time: ``--warmup`` untimed rounds, then ``--steps`` timed ones, each round one step of each in
turn, barriers around each step (``bench.common.alternate``). Reported: rank 0's wall time
(barrier to barrier) and process CPU time of the step alone, min and median, and the ratio of
medians ep=4 / dp=4. Memory: one more step of each, measured by ``shardfx.runtime.measure`` (live
tensor storage, the peak over the step, max over ranks), next to the plan's model; and the
bytes of the experts' training state on a rank (their weights, gradients and AdamW's two
moments). Checks, fatal: both first-step losses equal the global batch's loss computed whole,
and the last losses agree to 1e-5 (relative).

Before the race, in this process on one thread: one layer's experts arithmetic, forward and
backward (``kernels.expert_compute``, every expert local), at dp=4's rows per rank and at the
whole batch's, with each expert's matmuls as one ``torch._grouped_mm`` (what shardfx runs where
the dtype and device allow) against a matmul per expert (what it ran before, and runs where
they do not), alternating, ``--steps`` x 4 timed rounds after a warm-up, fp32 and bf16.

    PYTHONPATH=. python -m bench.moe [--layers 4] [--steps 6] [--warmup 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfx
from bench.common import alternate, append_results, clocked, count, machine
from shardfx.runtime.measure import measured_peak

SIZE = dict(hidden=256, inter=768, experts=8, k=2, heads=8, kv=4, vocab=2000, batch=8, seq=128)
N = 4
RTOL = 1e-5
MiB = 2 ** 20


def mixtral(layers: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        num_hidden_layers=layers, hidden_size=SIZE["hidden"], intermediate_size=SIZE["inter"],
        num_local_experts=SIZE["experts"], num_experts_per_tok=SIZE["k"],
        num_attention_heads=SIZE["heads"], num_key_value_heads=SIZE["kv"],
        vocab_size=SIZE["vocab"], use_cache=False)).train()


def loss_fn(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (SIZE["batch"], SIZE["seq"])
    return tuple(torch.randint(0, SIZE["vocab"], shape, generator=g) for _ in range(2))


def expert_state(runner) -> int:
    """Bytes of this rank's experts' weights, gradients and optimizer state."""
    total = 0
    for p in runner.parameters():
        if p.dim() != 3:  # the experts' weights are the 3-D ones
            continue
        total += 2 * p.numel() * p.element_size()  # the weight and its gradient
        state = runner.optimizer.state.get(p, {})
        total += sum(t.numel() * t.element_size() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.dim())
    return total


def arithmetic(tokens: int, dtype: torch.dtype, rounds: int) -> tuple[dict, float]:
    """Times of one experts forward + backward (s), grouped and looped, and their outputs'
    largest difference."""
    from shardfx.kernels import expert_compute as ec

    g = torch.Generator().manual_seed(2)
    e, h, i, k = SIZE["experts"], SIZE["hidden"], SIZE["inter"], SIZE["k"]
    x = torch.randn(tokens, h, generator=g).to(dtype)
    index = torch.randint(0, e, (tokens, k), generator=g)
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    w_in = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    w_out = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dtype)
    grad_y = torch.randn(tokens, h, generator=g).to(dtype)
    form = ec.Form()

    def step():
        y, xd, hh, zs = ec.forward(x, index, weights, w_in, w_out, form, ec.Local)
        return (y,) + ec.backward(grad_y, x, index, weights, w_in, w_out, xd, hh, zs, form,
                                  ec.Local)

    grouped = ec._grouped

    def looped():
        ec._grouped = lambda a, b: False
        try:
            return step()
        finally:
            ec._grouped = grouped

    times = {"grouped_mm": [], "loop": []}
    outs = {"grouped_mm": step(), "loop": looped()}
    for _ in range(rounds):
        for name, fn in (("grouped_mm", step), ("loop", looped)):
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(outs["grouped_mm"], outs["loop"]) if a is not None)  # no biases
    return times, diff


def arithmetic_table(rounds: int) -> str:
    torch.set_num_threads(1)
    rows = [f"One layer's experts, forward + backward, on one thread ({SIZE['experts']} experts, "
            f"hidden {SIZE['hidden']}, intermediate {SIZE['inter']}, top-{SIZE['k']}, "
            f"gated SiLU), CPU seconds, {rounds} alternating rounds after one warm-up:", "",
            "| tokens | dtype | grouped_mm min / median (ms) | loop of mm min / median (ms) "
            "| grouped / loop (median) | largest difference |", "|---|---|---:|---:|---:|---:|"]
    for tokens in (SIZE["batch"] * SIZE["seq"] // N, SIZE["batch"] * SIZE["seq"]):
        for dtype in (torch.float32, torch.bfloat16):
            t, diff = arithmetic(tokens, dtype, rounds)
            med = {k: statistics.median(v) for k, v in t.items()}
            rows.append(f"| {tokens} | {str(dtype)[6:]} | {min(t['grouped_mm']) * 1e3:.1f} / "
                        f"{med['grouped_mm'] * 1e3:.1f} | {min(t['loop']) * 1e3:.1f} / "
                        f"{med['loop'] * 1e3:.1f} | {med['grouped_mm'] / med['loop']:.2f}x | "
                        f"{diff:.1e} |")
    return "\n".join(rows)


def race(layers: int, warmup: int, steps: int) -> dict | None:
    torch.set_num_threads(1)  # 4 ranks share the cores
    x, y = batch()
    base = mixtral(layers)
    with torch.no_grad():
        first = loss_fn(copy.deepcopy(base)(x), y).item()
    meshes = {"dp=4": {"dp": N}, "ep=4": {"ep": N}}
    runners, plans, cpu, losses = {}, {}, {}, {}
    for name, mesh in meshes.items():
        plans[name] = shardfx.partition(copy.deepcopy(base), (x,), loss_fn, (y,), mesh=mesh,
                                        zero=0)
        runners[name] = plans[name].runner(
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        cpu[name], losses[name] = [], []
    stepped = {k: clocked(lambda r=r: r.step((x,), (y,)), cpu[k], losses[k])
               for k, r in runners.items()}
    times, _ = alternate(stepped, warmup, steps)
    memory, experts = {}, {}
    for name, step in stepped.items():
        dist.barrier()
        memory[name] = measured_peak(step, x, y).total
        dist.barrier()
        experts[name] = expert_state(runners[name])
        cpu[name] = cpu[name][warmup:warmup + steps]
    gathered = [None] * N
    dist.all_gather_object(gathered, (memory, experts))
    rank = dist.get_rank()
    modelled = {k: p.memory_breakdown()[rank].total for k, p in plans.items()}
    moved = {k: sum(c.nbytes for c in p.collectives) for k, p in plans.items()}
    return dict(times=times, cpu=cpu, losses=losses, first=first, memory=gathered,
                modelled=modelled, moved=moved) if rank == 0 else None


def table(a, res: dict, params: int, expert_params: int, seconds: float) -> tuple[str, list]:
    times, cpu, losses = res["times"], res["cpu"], res["losses"]
    names = list(times)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    peak = {k: max(m[0][k] for m in res["memory"]) for k in names}
    held = {k: max(m[1][k] for m in res["memory"]) for k in names}
    steps = a.warmup + a.steps + 1
    rows = [f"Expert parallelism vs data parallelism: Mixtral {a.layers} layers, hidden "
            f"{SIZE['hidden']}, {SIZE['experts']} experts of intermediate {SIZE['inter']}, "
            f"top-{SIZE['k']}, {SIZE['heads']} heads, {SIZE['kv']} KV heads, vocab "
            f"{SIZE['vocab']} ({params:,} params, {count(params)}; experts {expert_params:,}, "
            f"{expert_params / params:.0%}), global batch {SIZE['batch']} x {SIZE['seq']}, "
            f"dropless, AdamW, 4 gloo processes, 1 thread each; alternating, {a.steps} timed "
            f"steps after {a.warmup} warm-up, then one measured step each; {seconds:.0f} s",
            "", "| mesh | wall min (ms) | wall median (ms) | CPU min (ms) | CPU median (ms) | "
            "vs dp=4 (CPU median) | peak MiB (max rank) | modelled MiB | experts' state MiB "
            f"| vs dp=4 | communication bytes in (plan) | loss after step {steps} |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in names:
        rows.append(
            f"| {k} | {min(times[k]) * 1e3:.0f} | {med[k] * 1e3:.0f} | {min(cpu[k]) * 1e3:.0f} "
            f"| {cmed[k] * 1e3:.0f} | {cmed[k] / cmed['dp=4']:.2f}x | {peak[k] / MiB:.0f} | "
            f"{res['modelled'][k] / MiB:.0f} | {held[k] / MiB:.1f} | "
            f"{held[k] / held['dp=4']:.2f}x | {res['moved'][k] / MiB:.1f} MiB | "
            f"{losses[k][-1]:.6f} |")
    failures = [f"{k}: first-step loss {losses[k][0]:.7f}, the batch's {res['first']:.7f}"
                for k in names if abs(losses[k][0] - res["first"]) > RTOL * abs(res["first"])]
    ref = losses["dp=4"][-1]
    failures += [f"{k}: loss {losses[k][-1]:.7f} after step {steps}, dp=4's {ref:.7f}"
                 for k in names if abs(losses[k][-1] - ref) > RTOL * abs(ref)]
    goal_mem = held["ep=4"] / held["dp=4"] <= 0.4
    goal_time = cmed["ep=4"] / cmed["dp=4"] <= 1.0
    rows += ["", f"Goals: ep=4's experts' state <= 0.4x dp=4's: "
             f"{'met' if goal_mem else 'NOT met'} ({held['ep=4'] / held['dp=4']:.2f}x); ep=4's "
             f"step <= 1.0x dp=4's (CPU median): {'met' if goal_time else 'NOT met'} "
             f"({cmed['ep=4'] / cmed['dp=4']:.2f}x; wall {med['ep=4'] / med['dp=4']:.2f}x)",
             "", f"Losses: both first steps equal the global batch's ({res['first']:.6f}); "
             f"after step {steps} they agree to {RTOL:g}" if not failures else
             "Losses: DISAGREE (" + "; ".join(failures) + ")"]
    return "\n".join(rows), failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-save", action="store_true", help="print only")
    a = parser.parse_args()
    model = mixtral(a.layers)
    params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    load = open("/proc/loadavg").read().split()[:3]
    experts = arithmetic_table(4 * a.steps)
    print(experts)
    start = time.perf_counter()
    res = shardfx.launch(race, a.layers, a.warmup, a.steps, nprocs=N, timeout=600,
                         deadline=3600)[0]
    text, failures = table(a, res, params, expert_params, time.perf_counter() - start)
    print(text)
    text = experts + "\n\n" + text
    if not a.no_save:
        append_results("MoE: expert parallelism (ep=4) vs data parallelism (dp=4)", text,
                       f"{machine()}; load average before {' '.join(load)}")
    if failures:
        raise SystemExit("losses disagree: " + "; ".join(failures))


if __name__ == "__main__":
    main()
