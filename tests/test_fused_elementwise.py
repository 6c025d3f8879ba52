"""``fused-elementwise`` (``shardfx.cost.elementwise``): a program's chains of memory-bound ops
between its matmuls, each priced as one kernel in the compute dtype, as Megatron and
Transformer Engine run them (fused norms, activations, residual adds)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardfx
from shardfx.cost.device_model import PRESETS
from shardfx.cost.elementwise import chain_bytes, chains, compute_dtype
from shardfx.cost.node import matmul_shape, node_work
from shardfx.estimate.step_time import predict_step, program_time


class NormMLP(torch.nn.Module):
    """RMSNorm (a chain of casts, a square, a mean, a multiply), then two linears."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def plan():
    torch.manual_seed(0)
    x, y = torch.randn(512, 256), torch.randn(512, 256)
    return shardfx.partition(NormMLP(), (x,), F.mse_loss, (y,), precision="bf16",
                             device_model="h100")


def test_chains_lie_between_matmuls_and_move_their_ends_once_in_bf16():
    nodes = [n for n in plan().program.module.graph.nodes if n.op == "call_function"]
    assert compute_dtype(nodes) is torch.bfloat16
    found = chains(nodes)
    assert found and all(matmul_shape(n) is None for chain in found for n in chain)
    norm = max(found, key=len)  # the norm's casts, square, mean and multiplies
    assert len(norm) >= 4, [str(n.target) for n in norm]
    apart = sum(node_work(n)[1] for n in norm)
    fused = chain_bytes(norm, torch.bfloat16)
    assert 0 < fused < apart / 2, (fused, apart)


def test_fused_elementwise_shortens_the_step_and_leaves_matmuls():
    p = plan()
    h100 = PRESETS["h100"]
    graph = p.program.module.graph
    apart = program_time(graph, h100, p.mesh.axes)
    fused = program_time(graph, h100, p.mesh.axes, assume=("fused-elementwise",))
    matmuls = sum(h100.node_seconds(n) for n in graph.nodes if matmul_shape(n) is not None)
    assert matmuls < fused.compute < apart.compute
    step = predict_step(p, assume=("fused-elementwise",))
    assert step.total < p.predicted_step.total and step.assumed == ("fused-elementwise",)
