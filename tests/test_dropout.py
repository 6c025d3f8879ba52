"""Dropout and other random ops: values from each element's global place (passes.rng), so every
mesh trains alike."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardfx
from shardfx.ir import meta as M
from shardfx.ir.text import ir_to_text
from shardfx.passes.random_draws import on_stream_eagerly, sample
from shardfx.passes.rng import _fmix32, call, keep_mask, rng_value

P = 0.5


class Block(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(p)

    def forward(self, x):  # (B, 16)
        return x + self.drop(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self, p: float = P):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList([Block(p), Block(p)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):  # (B, 8) -> (B, 4)
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def data(steps: int = 2, batch: int = 8) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(batch, 8, generator=g),), (torch.randn(batch, 4, generator=g),))
            for _ in range(steps)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


# --- the masks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op,args,mean,std", [
    (torch.ops.aten.rand_like.default, (), 0.5, math.sqrt(1 / 12)),
    (torch.ops.aten.uniform.default, (-2.0, 4.0), 1.0, 6 * math.sqrt(1 / 12)),
    (torch.ops.aten.exponential.default, (4.0,), 0.25, 0.25),
    (torch.ops.aten.randn_like.default, (), 0.0, 1.0),
    (torch.ops.aten.normal_functional.default, (3.0, 0.5), 3.0, 0.5),
    (torch.ops.aten.bernoulli.p, (0.3,), 0.3, math.sqrt(0.3 * 0.7)),
], ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_each_random_op_draws_its_distribution(op, args, mean, std):
    """Moments over 2**18 draws within 5 standard errors; two steps draw apart."""
    n = 1 << 18
    like = torch.empty(n)
    draws = [sample(call, op, (like, *args), {}, rng_value(9, step), 0, (n,), torch.float32)
             for step in (0, 1)]
    got = draws[0].double()
    assert abs(got.mean().item() - mean) < 5 * std / math.sqrt(n), got.mean()
    assert abs(got.std().item() - std) < 0.01 * std, got.std()
    assert not torch.equal(draws[0], draws[1])
    assert sample(call, op, (like, *args), {}, rng_value(9, 0), 0, (n,), torch.float64) \
        .float().equal(draws[0])  # fp64 draws fp32's values


def test_cpu_eager_dropout_is_the_programs_mask():
    """CPU eager dropout draws ``bernoulli_(1 - p)``: on the stream it keeps what
    ``native_dropout`` (the traced op) keeps."""
    x = torch.ones(4096)
    with on_stream_eagerly(3, 2):
        eager = F.dropout(x, 0.3, True)
    assert torch.equal(eager != 0, keep_mask(call, rng_value(3, 2), (4096,), 0.3, 0))

def test_masks_keep_one_minus_p_of_the_elements():
    n = 1 << 20
    for p in (0.1, 0.5, 0.9):
        kept = keep_mask(call, rng_value(123, 7), (n,), p, 0).double().mean().item()
        six_sigma = 6 * math.sqrt(p * (1 - p) / n)
        assert abs(kept - (1 - p)) < six_sigma, (p, kept)


def test_masks_are_a_function_of_seed_step_op_and_place():
    mask = keep_mask(call, rng_value(5, 0), (8, 16), P, 0)
    assert torch.equal(mask, keep_mask(call, rng_value(5, 0), (8, 16), P, 0))  # reproduces
    for other in (keep_mask(call, rng_value(5, 1), (8, 16), P, 0),   # another step
                  keep_mask(call, rng_value(6, 0), (8, 16), P, 0),   # another seed
                  keep_mask(call, rng_value(5, 0), (8, 16), P, 1)):  # another dropout op
        assert not torch.equal(mask, other)
        assert (mask != other).double().mean() > 0.3  # independent, not shifted copies
    # a pipeline's slice 1 of 4 rows is rows 4..7 of the whole batch's mask
    assert torch.equal(keep_mask(call, rng_value(5, 0, 1), (4, 16), P, 0), mask[4:])
    # seeds past 32 bits count
    assert not torch.equal(keep_mask(call, rng_value(5 + (1 << 40), 0), (8, 16), P, 0), mask)


def test_the_mixer_is_murmur3_fmix32_exactly():
    """The int64 arithmetic (16-bit halves of each constant, no overflow) is murmur3's."""
    def fmix32(h: int) -> int:
        h ^= h >> 16
        h = h * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
        h = h * 0xC2B2AE35 & 0xFFFFFFFF
        return h ^ h >> 16

    xs = torch.randint(0, 1 << 32, (4096,), generator=torch.Generator().manual_seed(0))
    xs = torch.cat([xs, torch.tensor([0, 1, 0xFFFFFFFF])])
    assert _fmix32(call, xs).tolist() == [fmix32(x) for x in xs.tolist()]


# --- the pass -------------------------------------------------------------------------------

def test_the_rewrite_in_the_ir_and_eval_or_p0_untouched():
    x, y = data(1)[0]
    text = ir_to_text(shardfx.partition(Net(), x, F.mse_loss, y).ir)
    assert "rng: i64[3] = rng rng" in text
    assert "native_dropout.default" not in text and "native_dropout_backward" in text
    assert text.count("aten.arange.default") == 2 and "aten.bitwise_xor.Tensor" in text
    assert "native_dropout_mask: b8[8, 16] = aten.view.default(" in text
    for model in (Net(0.0), Net(1.0), Net().eval()):  # nothing random to rewrite
        plan = shardfx.partition(model, x, F.mse_loss, y)
        assert not [n for n in plan.ir.graph.find_nodes(op="placeholder")
                    if n.meta[M.ROLE].kind is M.InputKind.RNG]
        assert "bitwise" not in ir_to_text(plan.ir)


def test_one_device_step_is_eager_with_the_same_masks():
    """The program equals eager dropout given the masks keep_mask draws: the op numbers follow
    the model's order, the scale is 1/(1-p), and the step counts up."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    batches = data()
    x, y = batches[0]
    runner = shardfx.partition(model, x, F.mse_loss, y).runner(sgd)
    seed = torch.initial_seed() & ((1 << 63) - 1)
    opt = sgd(reference.parameters())
    for step, (x, y) in enumerate(batches):
        for op, layer in enumerate(reference.layers):
            mask = keep_mask(call, rng_value(seed, step), (8, 16), P, op)
            layer.drop.forward = lambda h, mask=mask: h * mask * (1 / (1 - P))
        opt.zero_grad()
        want = F.mse_loss(reference(*x), *y)
        want.backward()
        opt.step()
        got = runner.step(x, y)
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (step, got, want)
    for name, p in reference.named_parameters():
        assert torch.allclose(runner.state_dict()[name], p, rtol=1e-5, atol=1e-7), name


# --- every mesh: the same masks, the same training ------------------------------------------------

TP = {"layers.*.fc.weight": [Shard(0)], "layers.*.fc.bias": [Shard(0)]}  # dropout input S(1)
MESHES = {"dp": dict(mesh={"dp": 2}), "tp": dict(mesh={"tp": 2}), "pp": dict(mesh={"pp": 2},
                                                                         microbatches=2)}


def gpt2():
    """HF GPT-2, tiny, with its embedding, attention and residual dropouts on."""
    import transformers as T

    from models import HIDDEN, SEQ, VOCAB
    return T.GPT2LMHeadModel(T.GPT2Config(
        n_layer=2, n_embd=HIDDEN, n_head=4, n_positions=2 * SEQ, vocab_size=VOCAB,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))


def _train(build, batches: list, loss_fn, mesh: dict) -> tuple[torch.Tensor, dict, dict]:
    torch.manual_seed(0)
    model = build().train()
    runner = shardfx.partition(model, batches[0][0], loss_fn, batches[0][1], **mesh).runner(sgd, keep_grads=True)
    losses = torch.stack([runner.step(x, y) for x, y in batches])
    return losses, runner.grads(), runner.state_dict()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _every_mesh() -> dict[str, float]:
    """On every rank, for the MLP and GPT-2: one device, then dp=2, tp=2 and pp=2
    (2 microbatches), and GPT-2 with sequence parallelism on tp=2, 2 SGD steps each; the worst relative error of the losses, gradients
    and parameters vs one device's."""
    from models import lm_loss, token_batches

    out = {}
    sp = {"sp": dict(mesh={"tp": 2}, shard="megatron-sp")}  # dropout on each rank's tokens
    for model, build, batches, loss_fn, tp, more in [
            ("mlp", Net, data(), F.mse_loss, dict(shard=TP), {}),
            ("gpt2", gpt2, token_batches(2), lm_loss, dict(shard="megatron"), sp)]:
        one = _train(build, batches, loss_fn, {})
        for name, mesh in (MESHES | more).items():
            got = _train(build, batches, loss_fn, mesh | (tp if name == "tp" else {}))
            errors = [_rel(got[0], one[0])]
            errors += [_rel(got[1][k], one[1][k]) for k in one[1]]
            errors += [_rel(got[2][k], one[2][k]) for k in one[2]]
            out[f"{model} {name}"] = max(errors)
    return out


def test_every_mesh_trains_like_one_device():
    """Fails without passes.rng: dp replicas and tp shards draw their own local masks, and a
    pipeline's microbatches draw one after another (relative errors near 1)."""
    for errors in shardfx.launch(_every_mesh, nprocs=2, timeout=120):
        assert all(e < 1e-5 for e in errors.values()), errors


def _dp_pipeline() -> float:
    batches = data()
    one = _train(Net, batches, F.mse_loss, {})
    got = _train(Net, batches, F.mse_loss, dict(mesh={"dp": 2, "pp": 2}, microbatches=2))
    return max([_rel(got[0], one[0])] +
               [_rel(got[i][k], one[i][k]) for i in (1, 2) for k in one[i]])


def test_data_parallel_pipelines_train_like_one_device():
    """A slice of a dp x pp step is replica r's microbatch m: rows (r * microbatches + m)."""
    assert max(shardfx.launch(_dp_pipeline, nprocs=4, timeout=120)) < 1e-5
