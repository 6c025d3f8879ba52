"""Programs that must run as the model does: layouts the kernels choose, constants in the graph.

Layouts: the strides in the IR are FakeTensor's prediction; a real kernel may lay its result
out otherwise (CPU ``mse_loss_backward`` returns a contiguous gradient for a transposed input),
and a ``view`` the trace chose on the predicted strides then fails at run time. Every generated
program computes the same values whatever layout its kernels give (``codegen.program``).

Constants: a tensor the model builds from Python values (the index of ``h[:, [0, 1]]``) is a
CONSTANT input of the IR, replicated, and fed to every program: one device, dp, tp, pp, pp x tp.

Each case trains 3 AdamW steps against eager (``compare_training``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import shardfx
from shardfx.codegen.program import generate
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.testing import compare_training

from models import lm_loss, token_batches

transformers = pytest.importorskip("transformers")


# --- models ----------------------------------------------------------------------------------


class TransposedNorm(nn.Module):
    """LayerNorm over an activation that a Linear over its transpose made (issue 9, defect 1)."""

    def __init__(self):
        super().__init__()
        self.seq1, self.norm, self.seq2 = nn.Linear(4, 4), nn.LayerNorm(24), nn.Linear(4, 4)

    def forward(self, x):  # (B, T=4, D=24)
        x = self.seq1(x.transpose(1, 2)).transpose(1, 2)
        x = self.norm(x)
        return self.seq2(x.transpose(1, 2)).transpose(1, 2)


class IndexedRows(nn.Module):
    """List indexing between two Linears: ``[0, 1]`` becomes a tensor constant in the graph.
    Named as Megatron's MLP, so tp=2 shards both Linears; under pp the indexing (forward and
    backward) runs in the second stage, whose parts take the constant as an input."""

    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):  # (B, T=4, 8)
        h = shardfx.pipe_split(self.up_proj(x))
        h = torch.cat([h[:, [0, 1]], h[:, 2:]], dim=1)
        return self.down_proj(h)


@torch.library.custom_op("shardfx_test::column_major", mutates_args=())
def column_major(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values, its last two dims laid out column-major: a kernel whose layout is not the
    one its fake implementation predicts (row-major)."""
    return x.mT.contiguous().mT


@column_major.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


column_major.register_autograd(lambda ctx, grad: grad)


class Relaid(nn.Module):
    """A reshape of a value whose real layout is not the traced one: the trace makes it a view."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):  # (B, T, 8)
        h = column_major(self.a(x))
        return self.b(h.reshape(-1, 8)).reshape(x.shape)


MODELS = {"transposed_norm": (TransposedNorm, (8, 4, 24)), "indexed_rows": (IndexedRows, (8, 4, 8)),
          "relaid": (Relaid, (8, 4, 8))}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def batches(name: str, n: int = 3) -> list[tuple[tuple, tuple]]:
    shape = MODELS[name][1]
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(*shape, generator=g),), (torch.randn(*shape, generator=g),))
            for _ in range(n)]


def falcon() -> nn.Module:
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64))


def train(cases: list[tuple[str, dict, dict]]) -> list[tuple[str, float]]:
    """On every rank: each (model, mesh, partition options) trained against eager."""
    out = []
    for name, mesh, options in cases:
        if name == "falcon":
            report = compare_training(falcon(), token_batches(3, 4), lm_loss, mesh=mesh, **options)
        else:
            report = compare_training(build(name), batches(name), F.mse_loss, mesh=mesh, **options)
        out.append((f"{name} {mesh}", report.max()))
    return out


# Column-parallel seq1, row-parallel seq2: the transposes meet sharded activations.
NORM_TP = {"seq1.*": Shard(0), "seq2.weight": Shard(1)}


# --- layouts ---------------------------------------------------------------------------------


def test_layernorm_over_a_transposed_activation_on_one_device():
    """The trace viewed ``transpose(mse_loss_backward(...))`` as [192, 4], predicting the
    gradient laid out like its transposed input; the CPU kernel returns it contiguous."""
    name = "transposed_norm"
    compare_training(build(name), batches(name), F.mse_loss)
    (x,), (y,) = batches(name, 1)[0]
    program = shardfx.partition(build(name), (x,), F.mse_loss, (y,)).program
    ops = {n.target for n in program.module.graph.nodes if n.op == "call_function"}
    assert not ops & {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}, \
        program.source  # views are reshapes: a view where the layout allows, a copy where not


def test_a_kernel_laid_out_unlike_its_fake():
    """Any kernel, not one op: a custom op whose result is column-major where its fake is
    row-major, then a reshape the trace turned into a view."""
    compare_training(build("relaid"), batches("relaid"), F.mse_loss)


def test_an_op_that_addresses_memory_reads_the_traced_layout():
    """``as_strided`` reads its operand's memory: the operand is laid out as traced first."""
    gm = text_to_ir("""
graph infer T
  x: f32[4, 6] = input args[0]
  t: f32[6, 4] = aten.t.default(x)
  flat: f32[24] = aten.as_strided.default(t, [24], [1])
  output output out[0] = flat
""")
    program = generate(gm)
    x = torch.arange(24.0).view(4, 6)
    column_major_x = x.t().contiguous().t()  # the same values, the other layout
    for arg in (x, column_major_x):
        (flat,) = program.module(arg)
        assert torch.equal(flat, x.flatten()), program.source
    assert "restride" in program.source


def test_restride_keeps_a_broadcast_dim():
    gm = text_to_ir("""
graph infer T
  x: f32[4] = input args[0]
  rows: f32[3, 4] = aten.expand.default(x, [3, 4])
  flat: f32[4] = aten.as_strided.default(rows, [4], [1])
  output output out[0] = flat
""")
    x = torch.arange(8.0)[::2]  # strides (2,), traced (1,)
    (flat,) = generate(gm).module(x)
    assert torch.equal(flat, x)


# --- constants -------------------------------------------------------------------------------


def test_tensor_constant_is_a_replicated_input():
    name = "indexed_rows"
    compare_training(build(name), batches(name), F.mse_loss)
    (x,), (y,) = batches(name, 1)[0]
    plan = shardfx.partition(build(name), (x,), F.mse_loss, (y,), mesh={"dp": 2, "tp": 2},
                             shard="megatron")
    (const,) = [n for n in plan.ir.graph.find_nodes(op="placeholder")
                if n.meta[M.ROLE].kind is M.InputKind.CONSTANT]
    assert torch.equal(const.meta[M.CONSTANT].value, torch.tensor([0, 1]))
    assert const.meta[M.ANNOTATION] == (Replicate(), Replicate())
    assert const.name in plan.program.input_names  # the program takes it, the runner feeds it


def test_constant_text_form_parses_back():
    """A small constant prints with its value, so the IR text of such a graph reads back."""
    text = """graph infer Pick
  x: f32[2, 4] = input args[0]
  idx: i64[2] = constant _tensor_constant0 [3, 0]
  picked: f32[2, 2] = aten.index_select.default(x, 1, idx)
  output output out[0] = picked
"""
    gm = text_to_ir(text)
    assert ir_to_text(gm) == text
    x = torch.randn(2, 4)
    program = generate(gm)
    placeholders = program.module.graph.find_nodes(op="placeholder")
    (picked,) = program.module(*[x if n.meta[M.ROLE].kind is M.InputKind.INPUT
                                 else n.meta[M.CONSTANT].value for n in placeholders])
    assert torch.equal(picked, x[:, [3, 0]])


def test_falcon_plans_on_every_mesh():
    """Falcon's rotary embedding indexes with constants (``tensor([-2])``)."""
    (x,), (y,) = token_batches(1, 4)[0]
    shardfx.partition(falcon(), (x,), lm_loss, (y,), mesh={"dp": 2, "tp": 2}, shard="megatron")
    for mesh in ({"pp": 2}, {"pp": 2, "tp": 2}):
        shardfx.partition(falcon(), (x,), lm_loss, (y,), mesh=mesh, microbatches=2,
                          shard="megatron")
    compare_training(falcon(), token_batches(3, 4), lm_loss)


# --- on real processes -----------------------------------------------------------------------


def test_on_two_processes():
    results = shardfx.launch(train, [
        ("transposed_norm", {"dp": 2}, {}),
        ("transposed_norm", {"tp": 2}, {"shard": NORM_TP}),
        ("transposed_norm", {"pp": 2}, {"microbatches": 2}),
        ("relaid", {"dp": 2}, {}),
        ("indexed_rows", {"dp": 2}, {}),
        ("indexed_rows", {"tp": 2}, {"shard": "megatron"}),
        ("indexed_rows", {"pp": 2}, {"microbatches": 2}),
        ("falcon", {"tp": 2}, {"shard": "megatron"}),
    ], nprocs=2, timeout=120, deadline=600)
    assert len(results[0]) == 8


def test_pipeline_by_tensor_parallel_on_four_processes():
    results = shardfx.launch(train, [
        # a pipeline's stages are planned over tp alone: one placement per glob
        ("transposed_norm", {"pp": 2, "tp": 2}, {"shard": NORM_TP, "microbatches": 2}),
        ("indexed_rows", {"pp": 2, "tp": 2}, {"microbatches": 2, "shard": "megatron"}),
    ], nprocs=4, timeout=120, deadline=600)
    assert len(results[0]) == 2
