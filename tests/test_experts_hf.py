"""GPT-OSS's and Llama 4's experts as ``shardfx::experts``, and the op's forms they need.

GPT-OSS's experts have biases and their own gate (interleaved gate and up, clamped, x
sigmoid(1.702 x), up + 1); Llama 4's MoE block scales each expert's input by its router score
and adds a shared expert. Both are recognised while shardfx traces (``partitioner.experts_hf``):
here their op is checked in fp64 against the modules' own code, every form of the op against a
loop over tokens, and a gate outside the forms is refused under ep. Whole models train on
ep=2, dp=2 x ep=2 and ep=2 x tp=2 in ``test_experts``'s launches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardfx
from shardfx.errors import InputError
from shardfx.kernels.expert_gate import Gate
from shardfx.kernels.experts import EXPERTS, capacity_while_tracing
from shardfx.partitioner.experts_hf import recognise, traced_as_shardfx_experts

from models import HIDDEN, hf, lm_loss, tiny, token_batches
from test_errors import assert_explained

F64 = dict(rtol=1e-12, atol=1e-13)


class _Ops(TorchDispatchMode):
    """The ops run inside."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def _through_shardfx(model, run):
    """``run()`` with the model's experts as ``shardfx::experts`` (which must have run), then as
    the model's own code: both results."""
    with traced_as_shardfx_experts(model), _Ops() as ops:
        got = run()
    assert EXPERTS in ops.seen
    return got, run()


def _assert_close(got, want):
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, **F64), (g - w).abs().max()


def test_gpt_oss_experts_compute_their_own_loop():
    """Output and every gradient (tokens, routing weights, weights and biases) in fp64, with
    the clamp acting on about half of the gate and up values."""
    model = hf("gpt_oss", 1).double()
    model.set_experts_implementation("eager")
    module = model.model.layers[0].mlp.experts
    (found,), missed = recognise(model)
    assert not missed and found.gate == Gate("silu", True, True, 1.702, 0.1, 1.0), found
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.05)  # biases too (GPT-OSS starts them at 0)
    x = torch.randn(12, HIDDEN, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(12, 2, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(12)])
    h = torch.einsum("th,thi->ti", x, module.gate_up_proj[index[:, 0]])
    assert 0.2 < ((h + module.gate_up_proj_bias[index[:, 0]]).abs() > 0.1).double().mean() < 0.8
    grad = torch.randn(12, HIDDEN, dtype=torch.float64)
    wrt = [x, weights, *module.parameters()]

    def run():
        y = module(x, index, weights)
        return (y, *torch.autograd.grad(y, wrt, grad))

    _assert_close(*_through_shardfx(model, run))


def test_llama4_block_runs_its_router_and_shared_expert_around_the_op():
    """The whole MoE block: output, router logits, and the gradients of the tokens, the
    router, the shared expert and the routed experts, in fp64."""
    model = hf("llama4", 2).double()
    block = model.model.layers[1].feed_forward
    (found,), missed = recognise(model)
    assert not missed and (found.path, found.block) == ("model.layers.1.feed_forward", True)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
    x = torch.randn(2, 6, HIDDEN, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(12, HIDDEN, dtype=torch.float64)
    wrt = [x, *block.parameters()]

    def run():
        y, logits = block(x)
        return (y, logits, *torch.autograd.grad((y * grad).sum() + logits.sum(), wrt))

    _assert_close(*_through_shardfx(model, run))


# --- the op's forms against a loop over tokens ---------------------------------------------------

FORMS = {
    "gpt-oss": dict(interleaved=True, alpha=1.702, limit=0.5, offset=1.0, transposed=True,
                    biased=True),
    "gpt-oss with a capacity": dict(interleaved=True, alpha=1.702, limit=0.5, offset=1.0,
                                    biased=True, capacity=1.0),  # a dropped pair: no bias either
    "llama4 with a capacity": dict(score_before=True, transposed=True, capacity=1.0),
    "scores first, biased, clamped": dict(score_before=True, limit=0.5, biased=True),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_computes_a_loop_over_tokens(form):
    """Biases, the interleaved and clamped gate with its alpha and offset, the scores applied
    to the inputs, a capacity: output and every gradient against token by token, in fp64."""
    f = dict(FORMS[form])
    biased, capacity = f.pop("biased", False), f.pop("capacity", None)
    torch.manual_seed(0)
    experts, inter, tokens, k = 4, 5, 10, 2
    w_in = torch.randn(experts, 2 * inter, HIDDEN, dtype=torch.float64) * 0.3
    w_out = torch.randn(experts, HIDDEN, inter, dtype=torch.float64) * 0.3
    if f.get("transposed"):
        w_in, w_out = w_in.transpose(1, 2).contiguous(), w_out.transpose(1, 2).contiguous()
    b_in = torch.randn(experts, 2 * inter, dtype=torch.float64) if biased else None
    b_out = torch.randn(experts, HIDDEN, dtype=torch.float64) if biased else None
    x = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    weights = torch.rand(tokens, k, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    index[:6, 0] = 0  # expert 0 crowded: a capacity drops some of its pairs
    params = [t.requires_grad_() for t in (x, weights, w_in, w_out, b_in, b_out) if t is not None]
    keep = _kept(index, experts, capacity)
    assert (capacity is not None) == (not keep.all())

    def loop():
        rows = []
        for t in range(tokens):
            row = torch.zeros(HIDDEN, dtype=torch.float64)
            for j, e in enumerate(index[t].tolist()):
                if keep[t, j]:
                    z = _expert(x[t] * weights[t, j] if f.get("score_before") else x[t],
                                e, w_in, w_out, b_in, b_out, f)
                    row = row + (z if f.get("score_before") else weights[t, j] * z)
            rows.append(row)
        return torch.stack(rows)

    grad = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    want = loop()
    want = (want, *torch.autograd.grad(want, params, grad))
    with capacity_while_tracing(capacity):
        y = shardfx.experts(x, index, weights, w_in, w_out, b_in=b_in, b_out=b_out, **f)
    _assert_close((y, *torch.autograd.grad(y, params, grad)), want)


def _kept(index: torch.Tensor, experts: int, factor: float | None) -> torch.Tensor:
    """The pairs a capacity keeps, by the rule docs/experts.md states: each expert's first
    ceil(factor T k / E) pairs in token order."""
    keep = torch.ones_like(index, dtype=torch.bool)
    if factor is None:
        return keep
    capacity, seen = math.ceil(factor * index.numel() / experts), [0] * experts
    for t in range(index.shape[0]):
        for j, e in enumerate(index[t].tolist()):
            keep[t, j], seen[e] = seen[e] < capacity, seen[e] + 1
    return keep


def _expert(v, e, w_in, w_out, b_in, b_out, f: dict) -> torch.Tensor:
    """Expert e on one row, as the docs write its gate."""
    a, b = (w_in[e], w_out[e]) if f.get("transposed") else (w_in[e].t(), w_out[e].t())
    h = v @ a + (b_in[e] if b_in is not None else 0)
    gate, up = (h[0::2], h[1::2]) if f.get("interleaved") else h.chunk(2)
    limit, alpha = f.get("limit"), f.get("alpha", 1.0)
    if limit:
        gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
    act = gate * torch.sigmoid(alpha * gate)
    return (act * (up + f.get("offset", 0.0))) @ b + (b_out[e] if b_out is not None else 0)


# --- what is refused -----------------------------------------------------------------------------


def test_a_gate_outside_the_forms_is_named_under_ep():
    """Step 3.7's gate clamps after the activation: no form computes it. The model traces as
    it is (one device), and an ep axis names the module, why and what to do."""
    model = tiny("mixtral", 1)
    experts = model.model.layers[0].mlp.experts

    class ClampedAfter(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate).clamp(max=0.5) * up

    experts.__class__ = ClampedAfter
    (x,), (y,) = token_batches(1, 4)[0]
    with pytest.raises(InputError) as info:
        shardfx.partition(model, (x,), lm_loss, (y,), mesh={"ep": 2})
    assert_explained(info.value, cause=("ep=2", "ClampedAfter._apply_gate", "computes none"),
                     where="model.layers.0.mlp.experts")
    assert "drop the ep axis" in info.value.fix
