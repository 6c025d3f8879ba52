"""Buffers mutated in forward (BatchNorm's running statistics) are updated as eager updates them.

In train mode BatchNorm normalizes with the batch statistics and writes new running mean/var/
num_batches_tracked; the captured graph returns those as BUFFER_UPDATE outputs and the runner
copies them back into the module. ``compare_training`` compares buffers as well as parameters.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardfx
from shardfx.ir import meta as M
from shardfx.testing import compare_inference, compare_training


def bn_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4))


def batches(n: int) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(1)
    # shifted inputs, so the running mean moves away from its initial zeros
    return [((torch.randn(8, 16, generator=g) + 1.0,), (torch.randn(8, 4, generator=g),))
            for _ in range(n)]


def test_batchnorm_train_matches_eager():
    model = bn_mlp().train()
    compare_training(model, batches(3), F.mse_loss)


def test_batchnorm_running_stats_updated():
    model = bn_mlp().train()
    bn = model[1]
    mean0, var0 = bn.running_mean.clone(), bn.running_var.clone()
    data = batches(2)
    (args0, targets0) = data[0]
    plan = shardfx.partition(model, args0, F.mse_loss, targets0)
    updates = {r.name for r in plan.ir.graph.output_node().meta[M.OUTPUTS]
               if r.kind is M.OutputKind.BUFFER_UPDATE}
    assert updates == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}

    runner = plan.runner(optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    for args, targets in data:
        runner.step(args, targets)
    assert not torch.equal(bn.running_mean, mean0)
    assert not torch.equal(bn.running_var, var0)
    assert bn.num_batches_tracked.item() == 2
    assert torch.equal(runner.state_dict()["1.running_mean"], bn.running_mean)


def test_batchnorm_eval_inference_matches_eager():
    model = bn_mlp().train()
    with torch.no_grad():  # give it non-trivial running statistics first
        for (x,), _ in batches(3):
            model(x)
    model.eval()
    (args, _), = batches(1)
    compare_inference(model, args)
    # eval mode reads the running statistics and writes none
    plan = shardfx.partition(copy.deepcopy(model), args)
    kinds = {r.kind for r in plan.ir.graph.output_node().meta[M.OUTPUTS]}
    assert kinds == {M.OutputKind.OUTPUT}
