"""Mixture of experts: the experts op against Hugging Face's own loop, and expert parallelism
(the ``ep`` axis) on real processes against one device.

The experts of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 trace as one op,
``shardfx::experts``. Its arithmetic is checked in fp64 against each model's "eager" experts
loop (GPT-OSS's and Llama 4's in ``test_experts_hf``); whole models then train through shardfx
on ep=2, ep=4, dp=2 x ep=2, ep=2 x tp=2 and pp=2 x ep=2 within the testing rule
(``shardfx.testing``), GPT-OSS and Llama 4 on ep=2, dp=2 x ep=2 and ep=2 x tp=2. With a capacity the reference is the
model's own loop with the pairs shardfx drops given weight 0, chosen here by the rule the docs
state (per rank's tokens, each expert's first C pairs in token order), and the counts of
dropped pairs must agree.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import shardfx
from shardfx.errors import InputError, MeshError
from shardfx.kernels.experts import EXPERTS
from shardfx.testing import compare_inference, compare_training

from models import HIDDEN, SEQ, hf, lm_loss, tiny, token_batches
from test_errors import assert_explained

BATCH = 4
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
FIRST_DENSE = ("deepseek_v3", "llama4")  # families whose first layer has no experts


def build(name: str, layers: int = 2) -> torch.nn.Module:
    return tiny(name, layers) if name == "mixtral" else hf(name, layers)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


# --- the op ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_the_experts_op_computes_the_models_own_loop(name):
    """Output and every gradient (tokens, routing weights, both expert weights) in fp64."""
    model = build(name).double()
    model.set_experts_implementation("eager")
    module = _experts_modules(model)[0]
    experts = module.down_proj.shape[0]
    torch.manual_seed(0)
    x = torch.randn(12, HIDDEN, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(12, 2, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(experts)[:2] for _ in range(12)])
    index[:5] = torch.tensor([0, 1])  # expert 0 and 1 crowded, some other maybe idle
    grad = torch.randn(12, HIDDEN, dtype=torch.float64)
    wrt = [x, weights, module.gate_up_proj, module.down_proj]
    want = torch.autograd.grad(module(x, index, weights), wrt, grad)
    got_y = shardfx.experts(x, index, weights, module.gate_up_proj, module.down_proj,
                            act=module.config.hidden_act)
    got = torch.autograd.grad(got_y, wrt, grad)
    assert torch.allclose(got_y, module(x, index, weights), rtol=1e-12, atol=1e-14)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("gated, transposed, act", [(False, False, "relu"),
                                                    (True, True, "gelu_pytorch_tanh")])
def test_the_other_layouts_compute_a_loop_over_tokens(gated, transposed, act):
    """No gate (w_in (E, I, H)), and weights stored (in, out): against token by token."""
    from shardfx.kernels.expert_gate import ACTIVATIONS

    torch.manual_seed(0)
    experts, hidden, inter, tokens = 4, 6, 5, 9
    w_in = torch.randn(experts, (2 if gated else 1) * inter, hidden, dtype=torch.float64)
    w_out = torch.randn(experts, hidden, inter, dtype=torch.float64)
    if transposed:
        w_in, w_out = w_in.transpose(1, 2).contiguous(), w_out.transpose(1, 2).contiguous()
    w_in.requires_grad_(), w_out.requires_grad_()
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, dtype=torch.float64, requires_grad=True)
    f = ACTIVATIONS[act][0]

    def loop():
        rows = []
        for t in range(tokens):
            row = 0
            for j, e in enumerate(index[t].tolist()):
                a, b = (w_in[e], w_out[e]) if transposed else (w_in[e].t(), w_out[e].t())
                h = x[t] @ a
                h = f(h[:inter]) * h[inter:] if gated else f(h)
                row = row + weights[t, j] * (h @ b)
            rows.append(row)
        return torch.stack(rows)

    grad = torch.randn(tokens, hidden, dtype=torch.float64)
    wrt = [x, weights, w_in, w_out]
    want = torch.autograd.grad(loop(), wrt, grad)
    y = shardfx.experts(x, index, weights, w_in, w_out, act=act, gated=gated,
                        transposed=transposed)
    assert torch.allclose(y, loop(), rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(y, wrt, grad), want):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", MOE)
def test_hugging_face_experts_trace_as_one_op_per_layer(name):
    """Three MoE layers: two blocks traced, the last stamped (``partitioner.stamp``);
    DeepSeek-V3's first layer is dense."""
    (x,), (y,) = token_batches(1, BATCH)[0]
    model = build(name, 4 if name == "deepseek_v3" else 3)
    layers = len(_experts_modules(model))
    plan = shardfx.partition(model, (x,), lm_loss, (y,))
    assert plan.capture_path.startswith("stamped")
    assert len(plan.ir.graph.find_nodes(op="call_function", target=EXPERTS)) == layers == 3
    assert not any("grouped_mm" in str(n.target) for n in plan.ir.graph.nodes)


def test_data_parallel_runs_each_ranks_tokens_through_the_experts():
    """The experts see each token alone: on dp the op runs on the rank's own tokens, where
    the ops of a grouped matmul (a sort over all tokens) would gather every rank's first."""
    (x,), (y,) = token_batches(1, BATCH)[0]
    plan = shardfx.partition(tiny("mixtral"), (x,), lm_loss, (y,), mesh={"dp": 2})
    assert {c.kind for c in plan.collectives} == {"all_reduce"}, plan.collectives


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_are_gshards(ep):
    """Per MoE layer and direction, dispatch and combine send 2 k T h (ep-1)/ep values of each
    rank's T tokens (the even routing the program is counted on), plus the E counts."""
    (x,), (y,) = token_batches(1, 8)[0]
    plan = shardfx.partition(tiny("mixtral"), (x,), lm_loss, (y,), mesh={"ep": ep})
    tokens, k, layers = 8 * SEQ // ep, 2, 2
    sent = {"fwd": 0.0, "bwd": 0.0}
    counts = 0
    for c in plan.collectives:
        if c.kind == "all_to_all":
            assert c.axis == "ep"
            if "counts" in c.reason:
                counts += 1
            else:
                sent[c.phase] += c.nbytes * (ep - 1) / ep
    per_layer = 2 * k * tokens * HIDDEN * (ep - 1) / ep * 4  # fp32
    assert sent == {"fwd": layers * per_layer, "bwd": layers * per_layer}
    assert counts == 2 * layers
    params = {n: p.numel() for n, p in tiny("mixtral").named_parameters()}
    experts = sum(n for k, n in params.items() if ".experts." in k)
    held = plan.memory_breakdown()[0].parameters / 4
    assert held == sum(params.values()) - experts + experts / ep


def test_megatron_splits_every_experts_mlp_over_tp():
    """tp inside each expert, as in Megatron's MLP: the gate and up halves of ``gate_up_proj``
    split on the intermediate dimension (a strided split), ``down_proj`` on it too; the
    experts' output is summed over tp once, like a row-parallel layer's."""
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.distributed.tensor import Shard

    (x,), (y,) = token_batches(1, BATCH)[0]
    plan = shardfx.partition(tiny("mixtral"), (x,), lm_loss, (y,), mesh={"ep": 2, "tp": 2},
                             shard="megatron")
    placed = {n.meta["shardfx.role"].name: n.meta["shardfx.annotation"]
              for n in plan.ir.graph.find_nodes(op="placeholder") if "experts" in n.name}
    assert placed["model.layers.0.mlp.experts.gate_up_proj"] == (
        _StridedShard(1, split_factor=2), Shard(0))
    assert placed["model.layers.0.mlp.experts.down_proj"] == (Shard(2), Shard(0))
    params = {n: p.numel() for n, p in tiny("mixtral").named_parameters()}
    experts = sum(n for k, n in params.items() if ".experts." in k)
    assert plan.memory_breakdown()[0].parameters / 4 <= sum(params.values()) - experts * 3 / 4


# --- bad input -------------------------------------------------------------------------------


def test_experts_not_divisible_by_ep_is_refused():
    (x,), (y,) = token_batches(1, 8)[0]
    with pytest.raises(MeshError) as info:
        shardfx.partition(tiny("mixtral"), (x,), lm_loss, (y,), mesh={"ep": 8})
    assert_explained(info.value, cause=("4 experts", "not divisible by ep=8"),
                     where="model.layers.0.mlp.experts.gate_up_proj")


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), "1"])
def test_a_capacity_factor_must_be_positive(factor):
    (x,), (y,) = token_batches(1, BATCH)[0]
    with pytest.raises(InputError) as info:
        shardfx.partition(tiny("mixtral"), (x,), lm_loss, (y,), capacity_factor=factor)
    assert_explained(info.value, cause="capacity_factor must be a positive number",
                     where="capacity_factor")


def test_a_capacity_on_a_model_without_experts_is_refused():
    (x,), (y,) = token_batches(1, BATCH)[0]
    with pytest.raises(InputError) as info:
        shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), capacity_factor=1.0)
    assert_explained(info.value, cause="no mixture-of-experts layer", where="capacity_factor")


# --- on real processes -----------------------------------------------------------------------


@contextlib.contextmanager
def dropping(model: torch.nn.Module, factor: float, groups: int, dropped: list[int]):
    """Every copy of ``model``'s experts classes, run eagerly, drops the pairs shardfx's
    capacity drops: the batch's tokens in ``groups`` equal runs (one per rank and microbatch),
    in each run each expert's first ceil(factor T k / E) pairs in token order kept, the others'
    weights 0. Appends each call's count of dropped pairs to ``dropped``."""
    classes = {type(m) for m in _experts_modules(model)}
    before = {cls: cls.forward for cls in classes}

    def forward(self, hidden, index, weights):
        experts = self.down_proj.shape[0]
        keep = torch.ones_like(index, dtype=torch.bool)
        per = index.shape[0] // groups
        capacity = math.ceil(factor * per * index.shape[1] / experts)
        for g in range(groups):
            seen = [0] * experts
            for t in range(g * per, (g + 1) * per):
                for j, e in enumerate(index[t].tolist()):
                    keep[t, j] = seen[e] < capacity
                    seen[e] += 1
        dropped.append(int((~keep).sum()))
        return before[type(self)](self, hidden, index, weights * keep)

    for cls in classes:
        cls.forward = forward
    try:
        yield
    finally:
        for cls, f in before.items():
            cls.forward = f


def train(cases: list[tuple[str, dict, dict, bool]]) -> list[tuple]:
    """On every rank, for each (model, mesh, partition settings, infer): train 3 steps against
    one device (and where asked, infer); with a capacity, against the dropping reference."""
    out = []
    for name, mesh, kwargs, infer in cases:
        data = token_batches(3, BATCH)
        # one layer, unless a pipeline needs two (or the family's first is dense)
        model = build(name, 2 if "pp" in mesh or name in FIRST_DENSE else 1)
        factor = kwargs.get("capacity_factor")
        groups = mesh.get("dp", 1) * mesh.get("ep", 1) * kwargs.get("microbatches", 1)
        dropped: list[int] = []
        with dropping(model, factor, groups, dropped) if factor else contextlib.nullcontext():
            report = compare_training(model, data, lm_loss, mesh=mesh, **kwargs)
        if "memory_budget" in kwargs:  # the experts recomputed in the backward, all-to-alls too
            assert any(n.startswith("experts") for n in report.plan.remat.recomputed)
        load = report.runner.expert_load()  # this rank's pipeline stage's layers
        layers = [path for path, m in model.named_modules() if hasattr(m, "gate_up_proj")]
        last = dropped[-len(layers):]  # the last step's fp64 run, layer by layer
        truth = sum(n for path, n in zip(layers, last) if path in load) if factor else 0
        worst = compare_inference(copy.deepcopy(model), data[0][0], mesh=mesh, **kwargs) \
            if infer else 0.0
        pairs = [sum(r.tokens) for r in load.values()]
        k = model.config.num_experts_per_tok
        # the experts ops' operands are not redistributed over ep: forward and backward run as
        # expert parallelism, their only collectives its all-to-alls
        gathered = [c.reason for c in report.plan.collectives if c.axis == "ep" and
                    c.reason.startswith("experts") and c.kind != "all_to_all"]
        out.append((f"{name} {mesh} {kwargs}", report.max(), worst,
                     sum(r.dropped for r in load.values()), truth, pairs, k, gathered))
    return out


def check(results: list[list[tuple]]) -> None:
    for rank in results:
        for label, train_err, infer_err, dropped, truth, pairs, k, gathered in rank:
            assert train_err < 1e-5 and infer_err < 1e-5, (label, train_err, infer_err)
            assert dropped == truth, (label, dropped, truth)
            assert (truth > 0) == ("capacity" in label), (label, truth)  # the rule was tested
            assert pairs and all(n == k * BATCH * SEQ for n in pairs), (label, pairs)  # k T
            assert not gathered, (label, gathered)


def test_two_ranks_ep2_dropless_capacity_and_bf16():
    """GPT-OSS (biased experts, a clamped interleaved gate) and Llama 4 (scores applied to the
    input, a shared expert) beside the others (``test_experts_hf``: their arithmetic)."""
    check(shardfx.launch(train, [
        ("mixtral", {"ep": 2}, {}, True),
        ("qwen2_moe", {"ep": 2}, {}, False),
        ("deepseek_v3", {"ep": 2}, {"precision": "bf16"}, False),
        ("mixtral", {"ep": 2}, {"capacity_factor": 1.0}, False),
        ("phimoe", {"ep": 2}, {}, False),  # random routing on shardfx's stream, its own backward
        ("gpt_oss", {"ep": 2}, {}, False),
        ("llama4", {"ep": 2}, {}, False),
    ], nprocs=2, timeout=120, deadline=900))


PP = {"microbatches": 2}


def train_and_resume(cases: list, path: str) -> tuple[list, list]:
    """``train``, then a checkpoint saved on ep=2 x tp=2 (experts split by expert and, each,
    by tp's strided split) resumed on ep=4 and on dp=4 under ZeRO-3 (``test_resume``)."""
    from test_resume import _resume, _save

    losses, saved = _save(path, "mixtral", {"tp": 2, "ep": 2}, 0)
    resumed = _resume(path, [("mixtral", {"ep": 4}, 0, {}), ("mixtral", {"dp": 4}, 3, {})])
    same = [(mesh, all(torch.equal(state[k], saved[k]) for k in saved) and state.keys() ==
             saved.keys(), all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(after, losses)))
            for mesh, _, _, _, state, after in resumed]
    return train(cases), same


def test_four_ranks_ep4_dp_ep_tp_ep_and_a_checkpoint_across_them(tmp_path):
    """Mixtral and Qwen2-MoE on ep=4, dp=2 x ep=2 (Mixtral with ZeRO-3), ep=2 x tp=2 (each
    expert's MLP split over tp), GPT-OSS and Llama 4 on dp=2 x ep=2 and ep=2 x tp=2; a
    checkpoint of ep=2 x tp=2 resumes on ep=4 and dp=4."""
    results = shardfx.launch(train_and_resume, [
        ("mixtral", {"ep": 4}, {}, False),
        ("qwen2_moe", {"ep": 4}, {}, False),
        ("mixtral", {"dp": 2, "ep": 2}, {"zero": 3}, False),
        ("qwen2_moe", {"dp": 2, "ep": 2}, {}, False),
        ("mixtral", {"tp": 2, "ep": 2}, {"shard": "megatron"}, True),
        ("qwen2_moe", {"tp": 2, "ep": 2}, {"shard": "megatron"}, False),
        ("gpt_oss", {"dp": 2, "ep": 2}, {}, False),
        ("llama4", {"dp": 2, "ep": 2}, {}, False),
        ("gpt_oss", {"tp": 2, "ep": 2}, {"shard": "megatron"}, False),
        ("llama4", {"tp": 2, "ep": 2}, {"shard": "megatron"}, False),
    ], str(tmp_path / "ck"), nprocs=4, timeout=120, deadline=1200)
    check([trained for trained, _ in results])
    for _, resumed in results:  # the saved values exactly, and the next losses the same
        assert [r[1:] for r in resumed] == [(True, True)] * 2, resumed


def test_four_ranks_pp_ep_dropless_with_remat_and_capacity():
    """pp=2 x ep=2, two microbatches: Mixtral under a budget that recomputes the experts in
    the backward (their all-to-alls too), Qwen2-MoE, and Mixtral with a capacity."""
    check(shardfx.launch(train, [
        ("mixtral", {"pp": 2, "ep": 2}, {**PP, "memory_budget": 370_000}, True),
        ("qwen2_moe", {"pp": 2, "ep": 2}, PP, False),
        ("mixtral", {"pp": 2, "ep": 2}, {**PP, "capacity_factor": 1.0}, False),
    ], nprocs=4, timeout=120, deadline=900))
