"""Hugging Face models through shardfx match eager PyTorch.

Each model (GPT-2 with tied embeddings, Llama with grouped-query attention, Mixtral with a
4-expert top-2 MoE) trains 3 AdamW steps on 3 different batches, eagerly and through a plan;
loss, every gradient, every parameter and buffer agree after every step (``compare_training``).
Inference agrees too, and the runner's state dict speaks the model's own names and shapes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shardfx
from shardfx.ir import meta as M
from shardfx.testing import adamw, compare_inference, compare_training

transformers = pytest.importorskip("transformers")


def gpt2(s) -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=s.layers, n_embd=s.hidden, n_head=4, vocab_size=s.vocab, n_positions=s.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def llama(s) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=4, num_key_value_heads=2,  # grouped-query attention
        vocab_size=s.vocab, max_position_embeddings=s.seq, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(config)


def mixtral(s) -> torch.nn.Module:
    config = transformers.MixtralConfig(
        hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=s.vocab,
        max_position_embeddings=s.seq, num_local_experts=4, num_experts_per_tok=2,
        attention_dropout=0.0)
    return transformers.MixtralForCausalLM(config)


MODELS = {"gpt2": gpt2, "llama": llama, "mixtral": mixtral}


@pytest.mark.parametrize("name", MODELS)
def test_training_matches_eager(name, sizes, lm_loss_fn, batches):
    report = compare_training(MODELS[name](sizes), batches(3), lm_loss_fn)
    assert len(report.loss) == 3


@pytest.mark.parametrize("name", MODELS)
def test_inference_matches_eager(name, sizes, batches):
    model = MODELS[name](sizes).eval()
    (args, _), = batches(1)
    compare_inference(model, args)


def test_gpt2_tied_weight_is_one_placeholder(sizes, lm_loss_fn, batches):
    model = gpt2(sizes)
    assert model.lm_head.weight is model.transformer.wte.weight
    (args, targets), = batches(1)
    plan = shardfx.partition(model, args, lm_loss_fn, targets)
    roles = [n.meta[M.ROLE] for n in plan.ir.graph.find_nodes(op="placeholder")]
    tied = [r for r in roles if {"transformer.wte.weight", "lm_head.weight"} & {r.name, *r.aliases}]
    assert len(tied) == 1, [str(r) for r in tied]
    assert tied[0].kind is M.InputKind.PARAM
    assert (tied[0].name, tied[0].aliases) == ("transformer.wte.weight", ("lm_head.weight",))
    grads = [r.name for r in plan.ir.graph.output_node().meta[M.OUTPUTS]
             if r.kind is M.OutputKind.GRAD]
    assert grads.count("transformer.wte.weight") == 1 and "lm_head.weight" not in grads


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("name", ["gpt2", "llama"])  # tied weights; non-persistent buffers
def test_state_dict_after_training(name, sizes, lm_loss_fn, batches):
    """SGD, not Adam: GPT-2's key bias has a zero gradient (softmax ignores a constant added
    to every key), so Adam's update of it is its rounding noise divided by itself, and differs
    between any two correct programs; compare_training checks Adam (by replaying it)."""
    model = MODELS[name](sizes)
    eager = copy.deepcopy(model)
    data = batches(2)
    (args0, targets0) = data[0]
    runner = shardfx.partition(model, args0, lm_loss_fn, targets0,
                               optimizer="sgd-momentum").runner(optimizer=sgd)
    opt = sgd(list(eager.parameters()))
    for args, targets in data:
        runner.step(args, targets)
        opt.zero_grad()
        lm_loss_fn(eager(*args), *targets).backward()
        opt.step()

    ours, theirs = runner.state_dict(), eager.state_dict()
    assert list(ours) == list(theirs)
    for k in theirs:
        assert ours[k].shape == theirs[k].shape, k
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-7, msg=k)
    # the runner trains the user's module in place
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())


def test_load_state_dict_round_trip(sizes, lm_loss_fn, batches):
    model = gpt2(sizes)
    (args, targets), = batches(1)
    runner = shardfx.partition(model, args, lm_loss_fn, targets).runner(optimizer=adamw)
    saved = {k: v.clone() for k, v in runner.state_dict().items()}
    runner.step(args, targets)
    key = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(runner.state_dict()[key], saved[key])

    runner.load_state_dict(saved)
    for k, v in runner.state_dict().items():
        assert torch.equal(v, saved[k]), k
    # the program computes with the restored weights: the same output as eager GPT-2 loaded
    # from the saved state dict
    eager = gpt2(sizes)
    eager.load_state_dict(saved)
    torch.testing.assert_close(runner.forward(args).logits, eager(*args).logits)


def test_use_cache_true_still_works_and_is_restored(sizes, lm_loss_fn, batches):
    model = llama(sizes)
    model.config.use_cache = True  # the HF default: forward returns a KV cache (not a tensor)
    (args, targets), = batches(1)
    expected_loss = lm_loss_fn(copy.deepcopy(model)(*args), *targets)
    plan = shardfx.partition(model, args, lm_loss_fn, targets)
    assert model.config.use_cache is True
    loss = plan.runner(optimizer=adamw).step(args, targets)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)

    model.eval()
    expected = copy.deepcopy(model)(*args)
    assert expected.past_key_values is not None  # eager still returns the cache
    got = shardfx.partition(model, args).runner().forward(args)
    assert model.config.use_cache is True
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)


def test_use_cache_false_is_left_alone(sizes, batches):
    model = llama(sizes).eval()
    model.config.use_cache = False
    (args, _), = batches(1)
    shardfx.partition(model, args)
    assert model.config.use_cache is False
