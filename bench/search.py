"""``shardfx.search`` against measured steps: does it rank the meshes of 4 devices as they run?

A small HF Llama (4 blocks, hidden 256, 8 heads, 4 key-value heads, vocabulary 2048), a global
batch of 8 x 128 tokens, on 4 gloo processes of this machine, each one thread. The device model
is this machine's, measured first (``shardfx calibrate --quick``: its matmul and memory speeds
and the link between two processes). The search runs for 4 devices (recompute none: memory is
not what limits a CPU; micro-batches of up to 2 rows); for every mesh it considered, its
fastest candidate is planned on every rank and trained: 2 untimed steps, then ``--steps``
timed, the candidates' steps interleaved (one step of each in turn, barriers around each).

Per candidate: the search's predicted step (its plan's, for a finalist; else the composed
price), the plan's own ``predicted_step``, the measured min and median. Below: Spearman's rank
correlation of the search's predicted steps and the measured medians (and of the plans' own),
and the search's first choice against the fastest measured (goals: >= 0.8, <= 1.05x). Four
processes share this machine's cores: the measured steps are longer than the device model's
(one process's speeds), and it is their order that is compared.

    python -m bench.search [--steps 5] [--no-append]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import shardfx
from bench.common import alternate, append_results, machine
from shardfx.cost.device_model import DeviceModel
from shardfx.run.calibrate import calibrate

SIZE = dict(layers=4, hidden=256, ffn=512, heads=8, kv_heads=4, vocab=2048)
BATCH, SEQ, DEVICES = 8, 128, 4
GOALS = (0.8, 1.05)  # rank correlation at least; first choice over the fastest measured, at most


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=SIZE["layers"], hidden_size=SIZE["hidden"],
        intermediate_size=SIZE["ffn"], num_attention_heads=SIZE["heads"],
        num_key_value_heads=SIZE["kv_heads"], vocab_size=SIZE["vocab"],
        max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False))


def loss_fn(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, SIZE["vocab"], (BATCH, SEQ), generator=g),
            torch.randint(0, SIZE["vocab"], (BATCH, SEQ), generator=g))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)  # torch's default: fused where it can


def one_per_mesh(found) -> list:
    """The search's fastest candidate of each mesh it considered, in its order."""
    out, meshes = [], set()
    for r in found:
        if r.candidate.mesh not in meshes:
            meshes.add(r.candidate.mesh)
            out.append(r)
    return out


def measure(options: list[dict], model_json: dict, warmup: int, steps: int) -> dict:
    """On every rank: each candidate planned and trained, steps interleaved."""
    torch.set_num_threads(1)
    dm = DeviceModel.from_json(model_json)
    x, y = batch()
    contestants, predicted = {}, {}
    for i, kw in enumerate(options):
        plan = shardfx.partition(llama(), (x,), loss_fn, (y,), device_model=dm, **kw)
        predicted[i] = plan.predicted_step.total
        runner = plan.runner(optimizer=adamw)
        contestants[i] = lambda runner=runner: runner.step((x,), (y,))
    times, _ = alternate(contestants, warmup, steps)
    return {"times": times, "planned": predicted}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((p - ma) * (q - mb) for p, q in zip(ra, rb))
    var = (sum((p - ma) ** 2 for p in ra) * sum((q - mb) ** 2 for q in rb)) ** 0.5
    return cov / var if var else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()
    torch.set_num_threads(1)
    dm = calibrate("cpu", quick=True)
    x, y = batch()
    start = time.process_time()
    found = shardfx.search(llama(), (x,), loss_fn, (y,), devices=DEVICES, device_model=dm,
                           recompute=("none",), max_mbs=2)
    search_s = time.process_time() - start
    chosen = one_per_mesh(found)
    out = shardfx.launch(measure, [r.candidate.options() for r in chosen], dm.to_json(),
                         a.warmup, a.steps, nprocs=DEVICES, timeout=600, deadline=3000)[0]
    rows, predicted, measured = [], [], []
    for i, r in enumerate(chosen):
        t = out["times"][i]
        med = statistics.median(t)
        predicted.append(r.predicted_step)
        measured.append(med)
        rows.append(f"| {i + 1} | {r.candidate} | {r.predicted_step * 1e3:.1f} | "
                    f"{out['planned'][i] * 1e3:.1f} | {min(t) * 1e3:.1f} | {med * 1e3:.1f} |")
    rho = spearman(predicted, measured)
    rho_plans = spearman([out["planned"][i] for i in range(len(chosen))], measured)
    first = measured[0] / min(measured)
    table = "\n".join([
        f"search: HF Llama {SIZE['layers']} blocks, hidden {SIZE['hidden']}, vocabulary "
        f"{SIZE['vocab']}, batch {BATCH} x {SEQ}, {DEVICES} gloo processes of 1 thread; device "
        f"model: this machine's (calibrate --quick); {found.considered} candidates searched "
        f"in {search_s:.1f} s CPU; the fastest of each mesh trained, {a.steps} timed steps "
        f"after {a.warmup}, interleaved", "",
        "| # | candidate (the search's order) | search's step (ms) | plan's predicted (ms) | "
        "measured min (ms) | measured median (ms) |", "|---:|---|---:|---:|---:|---:|", *rows,
        "", f"rank correlation (Spearman) of predicted and measured medians: {rho:.2f} (goal >= "
        f"{GOALS[0]}); of the plans' own predicted steps and measured: {rho_plans:.2f}; the "
        f"first choice measures {first:.2f}x the fastest measured (goal <= {GOALS[1]}x)"])
    print(table)
    if not a.no_append:
        append_results("search", table, machine())


if __name__ == "__main__":
    main()
