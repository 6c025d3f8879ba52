"""stage_cut: where the pipeline is cut, checked on the IR text and on the stage report."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.errors import PipelineError
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.passes.stage_cut import block_of, stage_report

from models import VOCAB, lm_loss, tiny


def llama(layers: int = 2):
    return tiny("llama", layers)


def plan_for(model, pp: int):
    x, y = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    return shardfx.partition(model, (x,), lm_loss, (y,), mesh={"pp": pp})


def first_op_of_each_stage(gm) -> dict[int, str]:
    firsts: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and M.STAGE in node.meta:
            firsts.setdefault(node.meta[M.STAGE], block_of(node) or "-")
    return firsts


def test_cuts_fall_between_transformer_blocks():
    plan = plan_for(llama(4), pp=2)
    assert first_op_of_each_stage(plan.ir)[1] == "model.layers.2"  # 2 blocks per stage
    rows = stage_report(plan.ir)
    assert [r["stage"] for r in rows] == [0, 1]
    sent = dict((name, size) for name, size, _ in rows[0]["sends"])
    hidden = 2 * 8 * 32 * 4
    assert hidden in sent.values()  # the residual stream crosses the cut
    # backward ops run where their forward ops ran: a layer's weight gradient in its stage
    for node in plan.ir.graph.nodes:
        if node.op == "call_function":
            assert M.STAGE in node.meta
    out = plan.ir.graph.output_node()
    grads = {r.name: v for v, r in zip(out.args[0], out.meta[M.OUTPUTS])
             if r.kind is M.OutputKind.GRAD}
    assert grads["model.layers.0.mlp.down_proj.weight"].meta[M.STAGE] == 0
    assert grads["model.layers.3.mlp.down_proj.weight"].meta[M.STAGE] == 1
    assert grads["lm_head.weight"].meta[M.STAGE] == 1
    # in the backward, values only flow from later stages to earlier ones
    for node in plan.ir.graph.nodes:
        if node.op == "call_function" and node.meta[M.PHASE] is M.Phase.BACKWARD:
            for src in node.all_input_nodes:
                if src.meta.get(M.PHASE) is M.Phase.BACKWARD:
                    assert src.meta[M.STAGE] >= node.meta[M.STAGE], (src.name, node.name)
    assert "Pipeline stages" in str(plan)


def test_stages_round_trip_as_text():
    text = ir_to_text(plan_for(llama(2), pp=2).ir, people=False)
    assert "@1" in text  # the header names the mesh a stage is sharded over: none here
    assert ir_to_text(text_to_ir(text)) == text


def test_more_stages_than_blocks():
    with pytest.raises(PipelineError) as info:
        plan_for(llama(2), pp=4)
    assert "4 stages" in info.value.cause and "at most 3" in info.value.fix


class Marked(torch.nn.Module):
    def __init__(self, marks: int, twice: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.marks, self.twice = marks, twice

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i < self.marks:
                x = shardfx.pipe_split(x)
                if self.twice:  # two cuts with nothing between: an empty stage
                    x = shardfx.pipe_split(x)
        return x


def test_pipe_split_markers_decide_the_cuts():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plan = shardfx.partition(Marked(1), (x,), F.mse_loss, (y,), mesh={"pp": 2})
    firsts = first_op_of_each_stage(plan.ir)
    assert firsts[1] == "layers.1"  # right after the marker behind layer 0, not the balanced cut
    with pytest.raises(PipelineError) as info:
        shardfx.partition(Marked(2), (x,), F.mse_loss, (y,), mesh={"pp": 2})
    assert "2 pipe_split markers" in info.value.cause and "exactly 1" in info.value.fix
    with pytest.raises(PipelineError) as info:
        shardfx.partition(Marked(1, twice=True), (x,), F.mse_loss, (y,), mesh={"pp": 3})
    assert "stage 1 without any op" in info.value.cause
