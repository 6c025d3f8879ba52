"""Pipelines through what the split into parts must carry whole: multi-output ops (a part whose
only output is one, tuples holding None), and pp x tp gradients redistributed over tp just
before they are returned. Each trains against one device."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardfx
from shardfx.codegen.stages import inherit_stages
from shardfx.errors import PassError
from shardfx.ir import meta as M
from shardfx.codegen.steps import source
from shardfx.testing import compare_inference, compare_training

from models import VOCAB, hf, lm_loss, token_batches

# --- multi-output ops between parts ---------------------------------------------------------


class SoftmaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.softmax(x * -1.5, dim=-1))


class ReluLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 20)

    def forward(self, x):
        return self.lin(torch.relu(x))


class NormThenLinear(nn.Module):
    """Stage 0 ends in LayerNorm(softmax(-1.5 x)), stage 1 is Linear(relu(x)). ``inp`` has no
    bias, so below the norm the chain feeds one gradient (W): stage 0's B part computes
    ``native_layer_norm_backward`` and returns what it makes, nothing else."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16, bias=False)
        self.layers = nn.ModuleList([SoftmaxNorm(), ReluLinear()])
        self.head = nn.Linear(20, 12)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def conv_net() -> nn.Module:
    """Cut after the first conv: stage 0's ``convolution_backward`` needs no input gradient
    (output_mask [False, True, True]), so element 0 of its tuple is None."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def rows(shape: tuple, outputs: int, n: int = 3) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(*shape, generator=g),), (torch.randn(shape[0], outputs, generator=g),))
            for _ in range(n)]


CASES = {"norm": (NormThenLinear, (8, 16), 12), "conv": (conv_net, (8, 3, 8, 8), 10)}


def plan_of(case: str, **kwargs):
    build, shape, outputs = CASES[case]
    (x,), (y,) = rows(shape, outputs, 1)[0]
    return shardfx.partition(build(), (x,), F.mse_loss, (y,), mesh={"pp": 2}, microbatches=2,
                             **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_parts_return_tuples_of_tensors(case):
    """Every part returns a tuple, of one output too, and what it returns is a tensor: an
    element of a multi-output op's result is taken in the part that runs the op."""
    split = plan_of(case).stage_program
    for name, part in split.named_children():
        outputs = part.graph.output_node().args[0]
        assert isinstance(outputs, tuple), name
        for value in outputs:
            assert isinstance(value.meta[M.VAL], torch.Tensor), (name, value.format_node())
        for node in part.graph.find_nodes(op="call_function", target=operator.getitem):
            assert node.args[0].op == "call_function", (name, node.format_node())
    if case == "norm":  # B ends in the norm's backward: its three results, taken apart there
        count = {n: len(p.graph.output_node().args[0]) for n, p in split.named_children()}
        assert count["stage0_B"] == 3 and count["stage0_W"] == 1


def train_multi_output_parts():
    """On every rank: the cases above through 1F1B, and the conv net through zero-bubble
    (its W deferred), against one device."""
    out = []
    for case, schedule in (("norm", "1f1b"), ("conv", "1f1b"), ("conv", "zero-bubble")):
        build, shape, outputs = CASES[case]
        out.append(compare_training(build(), rows(shape, outputs), F.mse_loss, mesh={"pp": 2},
                                    microbatches=2, schedule=schedule).max())
    return out


def test_multi_output_ops_across_parts_train_as_on_one_device():
    for errors in shardfx.launch(train_multi_output_parts, nprocs=2, timeout=120, deadline=600):
        assert max(errors) < 1e-5, errors


# --- pp x tp: collectives that only feed the outputs ----------------------------------------




COLLECTIVES = (torch.ops._c10d_functional.all_reduce.default,
               torch.ops._c10d_functional.all_gather_into_tensor.default)


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3", "olmo2", "deepseek_v3", "gpt_neox",
                                  "bert"])
def test_gradients_redistributed_before_return_are_placed_where_made(name):
    """pp=2 x tp=2 plans: a weight gradient reduced or gathered over tp just before it is
    returned is redistributed in the backward (B or W part) of the stage whose ops read the
    weight, the stage that makes its gradient."""
    pytest.importorskip("transformers")
    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(hf(name), (x,), lm_loss, (y,), mesh={"pp": 2, "tp": 2},
                             microbatches=2, shard="megatron")
    split = plan.stage_program
    stage_of = {n.meta[M.ROLE].name: n.meta[M.STAGE]
                for n in plan.ir.graph.find_nodes(op="placeholder") if M.STAGE in n.meta}
    out = split.graph.output_node()
    moved = 0
    for value, role in zip(out.args[0], plan.ir.graph.output_node().meta[M.OUTPUTS]):
        part, index = source(value)
        returned = getattr(split, part).graph.output_node().args[0][index]
        chain = [returned, *returned.all_input_nodes]
        if role.kind is M.OutputKind.GRAD and any(n.target in COLLECTIVES for n in chain):
            moved += 1
            assert part in (f"stage{stage_of[role.name]}_B", f"stage{stage_of[role.name]}_W"), \
                (role.name, part)
    # DeepSeek-V3's tiny config returns each gradient placed as its parameter: nothing to place
    assert moved or name == "deepseek_v3", "no gradient is redistributed before it is returned"


def train_pp_tp_models():
    """On every rank: Gemma 3 (q_norm / k_norm gradients all-reduced over tp before they are
    returned) and OLMo 2 (gathered) under pp=2 x tp=2, and the inference of a model whose
    output is all-reduced over tp in the last stage, against one device."""
    errors = [compare_training(hf(name), token_batches(2), lm_loss, mesh={"pp": 2, "tp": 2},
                               microbatches=2, shard="megatron").max()
              for name in ("gemma3", "olmo2")]
    (x,), _ = rows((8, 16), 12, 1)[0]
    errors.append(compare_inference(RowSharded(), (x,), mesh={"pp": 2, "tp": 2},
                                    microbatches=2, shard=ROW_SHARDED))
    return errors


class RowSharded(nn.Module):
    """Linear | Linear, the second row-sharded over tp: its output is a partial sum, all-reduced
    just before it is returned."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 12)

    def forward(self, x):
        return self.b(shardfx.pipe_split(torch.relu(self.a(x))))


ROW_SHARDED = {"a.weight": [Shard(0)], "b.weight": [Shard(1)]}


def test_pp_tp_models_train_as_on_one_device():
    pytest.importorskip("transformers")
    for errors in shardfx.launch(train_pp_tp_models, nprocs=4, timeout=120, deadline=600):
        assert max(errors) < 1e-5, errors


class ReturnsWeight(RowSharded):
    def forward(self, x):
        return super().forward(x), self.a.weight


def test_a_returned_weight_is_gathered_in_the_stage_that_reads_it():
    """An inference plan returning a tp-sharded weight: the all-gather reads only a program
    input and feeds only an output; it runs in the stage that reads the weight."""
    plan = shardfx.partition(ReturnsWeight(), (torch.randn(8, 16),), mesh={"pp": 2, "tp": 2},
                             microbatches=2, shard=ROW_SHARDED)
    split = plan.stage_program
    gathers = {name for name, part in split.named_children() for n in part.graph.nodes
               if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default}
    assert gathers == {"stage0_F"}
    reduces = {name for name, part in split.named_children() for n in part.graph.nodes
               if n.target is torch.ops._c10d_functional.all_reduce.default}
    assert reduces == {"stage1_F"}


def test_an_op_no_rule_places_is_named():
    """An inserted op that reads only mesh inputs and feeds only the outputs belongs to no
    stage: a PassError names it (a ShardfxError, not a bare ValueError)."""
    graph = fx.Graph()
    coord = graph.placeholder("coord_tp")
    coord.meta[M.ROLE] = M.InputRole(M.InputKind.MESH, "coord(tp)")
    offset = graph.call_function(operator.mul, (coord, 4))
    graph.output((offset,)).meta[M.OUTPUTS] = (M.OutputRole(M.OutputKind.OUTPUT, "out[0]", 0),)
    with pytest.raises(PassError) as info:
        inherit_stages(fx.GraphModule(torch.nn.Module(), graph))
    assert "mul" in str(info.value) and "stage" in info.value.cause
