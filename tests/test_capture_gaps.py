"""Inputs eager PyTorch takes that capture and its neighbours did not: tensors read from outside
the model (closed over by ``loss_fn``, module-level globals, plain attributes) become CONSTANT
inputs and train like eager, on one device and on a mesh; a model that is not a module, a bad
loss-scaler state and an fp64 model asked for bf16 are said as they are."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardfx
from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.testing import compare_training

from models import SEQ, VOCAB, token_batches

# --- tensors from outside the model ---------------------------------------------------------

HIDDEN = 16
SCALE = torch.tensor(0.5)  # read by Attend.forward as a global
MASK = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))  # a global causal mask


class Attend(torch.nn.Module):
    """One causal self-attention over embeddings, its mask and output scale module globals,
    a temperature a plain (unregistered) tensor attribute."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.value = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.temperature = torch.tensor(4.0)  # not a buffer: torch.export lifts it a constant

    def forward(self, x):
        h = self.emb(x)  # (B, T, C)
        scores = (h @ h.transpose(1, 2)) / self.temperature  # (B, T, T)
        scores = scores.masked_fill(~MASK, float("-inf"))
        h = h + torch.softmax(scores, -1) @ self.value(h)
        return self.head(h) * SCALE  # (B, T, V)


def weighted_lm_loss(class_weights: torch.Tensor):
    """Cross entropy weighted per class, ``class_weights`` closed over. (Cast to the logits'
    dtype: the fp64 truth of ``compare_training`` runs the loss in double.)"""

    def loss_fn(out, targets):
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                               weight=class_weights.to(logits.dtype))

    return loss_fn


def vocab_weights() -> torch.Tensor:
    return torch.rand(VOCAB, generator=torch.Generator().manual_seed(3)) + 0.1


def test_closed_over_and_global_tensors_are_constants_and_train_like_eager():
    weights = vocab_weights()
    report = compare_training(Attend(), token_batches(3), weighted_lm_loss(weights))
    constants = {n.meta[M.ROLE].name: n.meta[M.CONSTANT].value
                 for n in report.plan.ir.graph.find_nodes(op="placeholder")
                 if n.meta[M.ROLE].kind is M.InputKind.CONSTANT}
    assert set(constants) == {"class_weights", "SCALE", "MASK", "temperature"}, constants
    assert torch.equal(constants["class_weights"], weights)
    assert torch.equal(constants["MASK"], MASK)
    # the weighted mean is its sum over the total weight: a mean of dp shards' means it is not
    nll = [n.args[3] for n in report.plan.ir.graph.nodes
           if n.target is torch.ops.aten.nll_loss_forward.default]
    assert nll == [2], nll  # reduction "sum"
    assert report.max() < 1e-5


def _on_a_mesh() -> list[float]:
    """dp=2: each replica's shard of the batch weighs its own; tp=2: the LM head split over the
    vocabulary, its logits meeting the global scale and the class weights."""
    weights = vocab_weights()
    vocab_split = {"head.weight": [Shard(0)], "head.bias": [Shard(0)]}
    reports = [compare_training(Attend(), token_batches(3), weighted_lm_loss(weights),
                                mesh={"dp": 2}),
               compare_training(Attend(), token_batches(3), weighted_lm_loss(weights),
                                mesh={"tp": 2}, shard=vocab_split)]
    head = next(n for n in reports[1].plan.ir.graph.find_nodes(op="placeholder")
                if n.name == "head_weight")
    assert head.meta[M.ANNOTATION] == (Shard(0),)
    return [r.max() for r in reports]


def test_constants_on_a_mesh_train_like_eager():
    for errors in shardfx.launch(_on_a_mesh, nprocs=2, timeout=120, deadline=600):
        assert max(errors) < 1e-5, errors


TRAINED_OUTSIDE = torch.ones(VOCAB, requires_grad=True)  # a tensor the user trains by hand


def test_a_closed_over_tensor_that_requires_grad_is_named():
    def loss_fn(out, targets):
        return F.cross_entropy(out.flatten(0, 1) * TRAINED_OUTSIDE, targets.flatten())

    (args, targets), = token_batches(1)
    with pytest.raises(InputError) as e:
        shardfx.partition(Attend(), args, loss_fn, targets)
    assert "TRAINED_OUTSIDE" in e.value.cause and "requires grad" in e.value.cause
    assert "test_capture_gaps.py" in e.value.where  # where loss_fn is
    assert "nn.Parameter" in e.value.fix


def test_a_constant_modified_in_place_is_named():
    counter = torch.zeros(())

    class Counts(Attend):
        def forward(self, x):
            counter.add_(1)
            return super().forward(x)

    (args, targets), = token_batches(1)
    with pytest.raises(InputError, match=r"(?s)modifies counter .*register_buffer"):
        shardfx.partition(Counts(), args, weighted_lm_loss(vocab_weights()), targets)


# --- a model that is not a module -----------------------------------------------------------


@pytest.mark.parametrize("model, named", [
    (lambda x: x * 2, "function '"),
    (torch.nn.Linear(4, 4).state_dict(), "OrderedDict of 2 entries (a state dict?)"),
    ("gpt2", "the string 'gpt2'"),
])
def test_a_model_that_is_not_a_module_is_named(model, named):
    with pytest.raises(InputError) as e:
        shardfx.partition(model, (torch.randn(2, 4),))
    assert f"model must be a torch.nn.Module, got {named}" in e.value.cause, e.value
    assert e.value.where == "partition(model, ...)"
    assert "nn.Module" in e.value.fix or "the module" in e.value.fix


# --- the loss scaler's state ------------------------------------------------------------------


@pytest.fixture(scope="module")
def scaler_plan() -> shardfx.Plan:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return shardfx.partition(model, (torch.randn(2, 4),), F.mse_loss, (torch.randn(2, 2),))


@pytest.mark.parametrize("state, key", [
    ({"scale": -5.0, "good_steps": 0}, "scale"),
    ({"scale": 0.0, "good_steps": 0}, "scale"),
    ({"scale": math.inf, "good_steps": 0}, "scale"),
    ({"scale": math.nan, "good_steps": 0}, "scale"),
    ({"scale": "abc", "good_steps": 0}, "scale"),
    ({"scale": 1024.0, "good_steps": -1}, "good_steps"),
    ({"scale": 1024.0, "good_steps": 2.5}, "good_steps"),
    ({"scale": 1024.0, "good_steps": 0, "skipped": -3}, "skipped"),
    ({"good_steps": 0}, "scale"),
    ({"scale": 1024.0}, "good_steps"),
    ([1024.0, 0], "dict"),
])
def test_a_bad_loss_scaler_state_is_refused_and_changes_nothing(scaler_plan, state, key):
    scaler = scaler_plan.runner(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                loss_scaling=True).loss_scaler
    scaler.load_state_dict({"scale": 512.0, "good_steps": 3, "skipped": 1})
    before = scaler.state_dict()
    with pytest.raises(InputError) as e:
        scaler.load_state_dict(state)
    assert e.value.where.startswith("runner.loss_scaler.load_state_dict")
    assert key in str(e.value) and "state_dict()" in e.value.fix, e.value
    assert scaler.state_dict() == before


def test_a_good_loss_scaler_state_loads(scaler_plan):
    runner = scaler_plan.runner(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                loss_scaling=True)
    runner.loss_scaler.load_state_dict({"scale": 1024, "good_steps": 5})  # saved before skipped
    assert (runner.loss_scale, runner.loss_scaler.good_steps, runner.loss_scaler.skipped) == \
        (1024.0, 5, 0)


# --- precision of an fp64 model -------------------------------------------------------------


def test_bf16_asked_of_an_fp64_model_says_it_runs_in_fp64():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.GELU(), torch.nn.Linear(16, 4)).double()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    plan = shardfx.partition(model, (x,), F.mse_loss, (y,), precision="bf16")
    dtypes = {n.meta[M.VAL].dtype for n in plan.ir.graph.nodes
              if isinstance(n.meta.get(M.VAL), torch.Tensor) and n.meta[M.VAL].is_floating_point()}
    assert dtypes == {torch.float64}  # what really runs: nothing is cast
    text = str(plan.precision)
    assert plan.precision.low == 0 and "ops in bf16" not in text and "in fp32" not in text, text
    assert "no op computes in bf16" in text and "fp64" in text, text
    assert text.split()[0] in " ".join(str(plan).split())  # print(plan) says the same
    # an fp32 model still computes its matmuls in bf16, and says so
    fp32 = shardfx.partition(model.float(), (x.float(),), F.mse_loss, (y.float(),),
                             precision="bf16").precision
    assert fp32.low > 0 and str(fp32).startswith(f"bf16: {fp32.low} ops in bf16"), fp32
