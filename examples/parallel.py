"""The nanoGPT of examples/nanogpt.py on 4 processes: data parallel x tensor parallel.

    python examples/parallel.py                      # spawns 4 local gloo processes
    torchrun --nproc-per-node 4 examples/parallel.py # the same, launched by torchrun
    python examples/parallel.py --mesh tp=2          # any mesh whose size is the process count
    python examples/parallel.py --mesh pp=2,tp=2 --schedule zero-bubble   # a pipeline of 2 stages

Every rank runs ``train``: it plans the model for the mesh (the same program on every rank),
keeps its own shard of each parameter, takes its slice of each global batch, and steps. Rank 0
prints the plan. At the end the losses are compared with the same model trained by plain
PyTorch on one device, step by step.
"""

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

import shardfx
from shardfx.mesh import MeshSpec

sys.path.insert(0, str(Path(__file__).parent))
from shardfx.metrics import memory  # noqa: E402  (CUDA's peak allocated, or peak RSS)
import nanogpt  # noqa: E402  (the model, the data and the loss, side by side in examples/)


def train(mesh: dict[str, int], steps: int, lr: float, schedule: str = "1f1b",
          microbatches: int = 4) -> list[float]:
    """One rank's part: partition, then ``steps`` AdamW steps on global batches."""
    w = nanogpt.workload(n_layer=2)
    model, (idx,), (targets,) = w["model"], w["args"], w["targets"]
    pipeline = {"schedule": schedule, "microbatches": microbatches} if "pp" in mesh else {}
    plan = shardfx.partition(model, (idx,), nanogpt.loss_fn, (targets,), mesh=mesh,
                             shard="megatron", **pipeline)
    if shardfx.runtime.launch.rank() == 0:
        print(plan)
        if plan.schedule is not None:
            print(plan.schedule)
    runner = plan.runner(optimizer=lambda params: torch.optim.AdamW(params, lr=lr))
    gen = torch.Generator().manual_seed(1)  # every rank draws the same global batches
    text = nanogpt.make_text(nanogpt.GPTConfig())
    losses = []
    for _ in range(steps):
        x, y = nanogpt.get_batch(text, idx.shape[0], idx.shape[1], gen)  # (B, T) each
        t0 = time.perf_counter()
        loss = runner.step((x,), (y,)).item()  # .item() waits for the step
        seconds = time.perf_counter() - t0
        losses.append((loss, seconds, memory(plan.device)))
    return losses


def eager_losses(steps: int, lr: float) -> list[float]:
    """The same training in plain PyTorch on one device."""
    w = nanogpt.workload(n_layer=2)
    model, (idx,) = copy.deepcopy(w["model"]), w["args"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    text = nanogpt.make_text(nanogpt.GPTConfig())
    losses = []
    for _ in range(steps):
        x, y = nanogpt.get_batch(text, idx.shape[0], idx.shape[1], gen)
        opt.zero_grad()
        loss = nanogpt.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=2,tp=2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--schedule", default="1f1b",
                        help="with a pp axis: gpipe | 1f1b | zero-bubble")
    parser.add_argument("--microbatches", type=int, default=4, help="with a pp axis")
    a = parser.parse_args()
    mesh = dict(MeshSpec.parse(a.mesh).axes)
    per_rank = shardfx.launch(train, mesh, a.steps, a.lr, a.schedule, a.microbatches,
                              nprocs=MeshSpec.parse(a.mesh).size,
                              timeout=120, deadline=900)
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun every rank gets here
        return
    ours, reference = [loss for loss, _, _ in per_rank[0]], eager_losses(a.steps, a.lr)
    assert all([loss for loss, _, _ in r] == ours for r in per_rank), "ranks disagree on the loss"
    print(f"\n{'step':>4}  {'shardfx ' + a.mesh:>18}  {'one device':>12}  {'step time':>10}  "
          f"{'peak memory (largest rank)':>26}")
    for i, (l, e) in enumerate(zip(ours, reference)):
        seconds = max(r[i][1] for r in per_rank)
        peak = max(r[i][2] for r in per_rank)
        print(f"{i:4d}  {l:18.6f}  {e:12.6f}  {seconds * 1e3:7.1f} ms  {peak / 2**30:22.2f} GiB")
    worst = max(abs(l - e) / abs(e) for l, e in zip(ours, reference))
    print(f"max relative difference: {worst:.1e}")


if __name__ == "__main__":
    main()
