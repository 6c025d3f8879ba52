"""shard_hint: a marker in the model, kept through tracing, obeyed by propagation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardfx
from shardfx.errors import ShardingError
from shardfx.ir import meta as M
from shardfx.testing import compare_training


class Hinted(torch.nn.Module):
    def __init__(self, axis: str = "tp"):
        super().__init__()
        self.axis = axis
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):  # (B, 8)
        h = torch.relu(self.up(x))  # (B, 16)
        h = shardfx.shard_hint(h, {self.axis: Shard(1)})
        return self.down(h)


def data(n: int = 3):
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(4, 8, generator=g),), (torch.randn(4, 8, generator=g),))
            for _ in range(n)]


def hint_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.shardfx.shard_hint.default]


def test_hint_survives_tracing_and_vanishes_on_one_device():
    torch.manual_seed(0)
    (x,), (y,) = data(1)[0]
    plan = shardfx.partition(Hinted(), (x,), F.mse_loss, (y,))
    assert len(hint_nodes(plan.ir)) == 1
    assert "shard_hint" not in plan.program.source
    compare_training(Hinted(), data(), F.mse_loss)


def test_propagation_obeys_the_hint():
    torch.manual_seed(0)
    (x,), (y,) = data(1)[0]
    plan = shardfx.partition(Hinted(), (x,), F.mse_loss, (y,), mesh={"tp": 2}, shard="replicate")
    (node,) = hint_nodes(plan.ir)
    assert node.meta[M.SHARDING].out == (Shard(1),)
    (user,) = [u for u in node.users if u.meta[M.PHASE] is M.Phase.FORWARD]
    assert user.meta[M.SHARDING].out == (torch.distributed.tensor.Partial(),)  # row-parallel
    assert "shard_hint" not in plan.program.source


def test_hint_naming_an_axis_the_mesh_lacks():
    (x,), (y,) = data(1)[0]
    with pytest.raises(ShardingError) as info:
        shardfx.partition(Hinted("ep"), (x,), F.mse_loss, (y,), mesh={"tp": 2})
    assert "'ep'" in info.value.cause and "shard_hint" in info.value.where


def _train_hinted():
    torch.manual_seed(0)
    return compare_training(Hinted(), data(), F.mse_loss, mesh={"tp": 2}, shard="replicate").max()


def test_hinted_model_trains_like_one_device_on_two_processes():
    assert max(shardfx.launch(_train_hinted, nprocs=2, timeout=60)) < 1e-5
