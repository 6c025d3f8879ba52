"""codegen.stages: the joint graph regrouped into per-stage F, B and W programs."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.codegen.program import generate
from shardfx.codegen.stages import backward_parts, split_stages, stage_parts
from shardfx.ir import meta as M

from models import VOCAB, lm_loss, tiny


def build(name: str):
    return tiny(name, layers=4 if name == "llama" else 2)


@pytest.mark.parametrize("name, pp", [("llama", 2), ("llama", 3), ("gpt2", 2)])
def test_split_computes_the_joint_graph(name, pp):
    model = build(name)
    x, y = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
    plan = shardfx.partition(model, (x,), lm_loss, (y,), mesh={"pp": pp})
    split = split_stages(plan.ir)
    parts = stage_parts(split)
    assert parts[:pp] == [f"stage{s}_F" for s in range(pp)]  # forwards first, in stage order
    # every stage's backward splits into its activation-gradient chain and its weight gradients
    assert all(f"stage{s}_{k}" in parts for s in range(pp) for k in "BW")

    # each part holds only its stage's nodes, and the right kind of them
    by_name = {n.name: n for n in plan.ir.graph.nodes}
    part_of = backward_parts(plan.ir)
    for part in parts:
        stage, kind = int(part[5:].split("_")[0]), part[-1]
        for node in getattr(split, part).graph.nodes:
            if node.op == "call_function":
                original = by_name[node.name]
                assert (original.meta[M.STAGE], part_of[original]) == (stage, kind)

    # a W part feeds nothing but the outputs: it can run any time after its B
    for node, kind in part_of.items():
        if kind == "W":
            assert all(u.op == "output" or part_of.get(u) == "W" for u in node.users), node

    # and the regrouped program computes the same numbers, bit for bit
    program = generate(plan.ir)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())

    def value(role):
        if role.kind is M.InputKind.PARAM:
            return params[role.name].detach()
        if role.kind is M.InputKind.BUFFER:
            return buffers[role.name]
        if role.kind is M.InputKind.TANGENT:
            return torch.ones(())
        return (x, y)[role.index]

    inputs = [value(r) for r in program.inputs]
    with torch.no_grad():
        expected, got = program.module(*inputs), split(*inputs)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def test_backward_splits_into_activation_and_weight_gradients():
    """Zero-bubble's premise for matmul layers: per stage, B and W each hold one matmul per
    layer, as F does; on the first stage too, though it sends no gradient back."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16, bias=False) for _ in range(4)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.ReLU())])
    x, y = torch.randn(8, 16, requires_grad=False), torch.randn(8, 16)
    plan = shardfx.partition(model, (x,), torch.nn.functional.mse_loss, (y,), mesh={"pp": 2})
    matmuls: dict[tuple[int, str], int] = {}
    for node, kind in backward_parts(plan.ir).items():
        if node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            key = (node.meta[M.STAGE], kind)
            matmuls[key] = matmuls.get(key, 0) + 1
    # stage 0's first layer needs no input gradient: its B is one matmul short
    assert matmuls == {(0, "F"): 2, (0, "B"): 1, (0, "W"): 2,
                       (1, "F"): 2, (1, "B"): 2, (1, "W"): 2}
