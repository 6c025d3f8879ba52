"""Memory with the techniques a published system used that the program lacks
(``plan.memory_breakdown(assume=...)``, ``cost.techniques``): each one's mechanism on a tiny
Llama planned on CPU, against the program as is (which tests/test_memory.py holds within 5%
of the measured peak)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import shardfx
from shardfx.cost.techniques import Sizing, parameter_gradients, weight_cast
from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.ir.graph import phases

from models import lm_loss, tiny

VOCAB = 96  # no other dimension of the model or its batch is 96


def plan(mesh: dict, **kw) -> shardfx.Plan:
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False))
    ids = torch.randint(0, VOCAB, (4, 8))
    return shardfx.partition(model, (ids,), lm_loss, (ids,), mesh=mesh, precision="bf16",
                             optimizer="adamw", **kw)


def peak(plan: shardfx.Plan, *assume: str):
    return max(plan.memory_breakdown(assume=assume).values(), key=lambda m: m.total)


def test_low_precision_weights_hold_bf16_weights_and_an_fp32_main_copy():
    """Megatron's mixed precision: each weight 2 B in bf16, the optimizer's fp32 main copy
    4 B beside Adam's 8, and no cast of a weight made (nor saved for the backward)."""
    p = plan({})
    as_is, low = peak(p), peak(p, "low-precision-weights")
    assert low.parameters == as_is.parameters // 2
    assert low.optimizer == as_is.optimizer + as_is.parameters
    assert low.gradients == as_is.gradients  # fp32 main gradients, as the program's
    casts = [n for n in p.program.module.graph.nodes if weight_cast(n)]
    size = Sizing(weights=torch.bfloat16)
    assert casts and all(size.value(n) == 0 for n in casts)
    assert low.saved < as_is.saved


def test_low_precision_weights_make_the_activations_bf16():
    """With the model in bf16 (Megatron's Float16Module) the residual stream, fp32 in the
    program only because the embedding's weight is, is bf16; the parameters' gradients stay
    fp32 (the main gradients), and so do the forward's upcasts (the loss's)."""
    graph = plan({}).program.module.graph
    phase = phases(graph)
    low, elided = Sizing(weights=torch.bfloat16).lows(graph)
    residual = [n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor
                and phase[n] is M.Phase.FORWARD and n.meta[M.VAL].dtype == torch.float32
                and all(a.meta[M.VAL].shape == (4, 8, 32) for a in n.all_input_nodes)]
    assert residual and set(residual) <= low
    grads = parameter_gradients(graph)
    assert grads and not grads & (low | elided)
    upcasts = [n for n in graph.nodes if n.target is torch.ops.aten._to_copy.default
               and phase[n] is M.Phase.FORWARD and n.meta[M.VAL].dtype == torch.float32]
    assert upcasts and not set(upcasts) & (low | elided)


def test_low_precision_weights_in_a_pipeline_rank():
    """Per rank: the weights in bf16 beside an fp32 main copy, and the activations each stage
    saves and sends in bf16."""
    p = plan({"pp": 2}, microbatches=2)
    for as_is, low in zip(p.memory_breakdown().values(),
                          p.memory_breakdown(assume=("low-precision-weights",)).values()):
        assert low.parameters == as_is.parameters // 2
        assert low.optimizer == as_is.optimizer + as_is.parameters
        assert low.saved < as_is.saved


def test_vocab_parallel_splits_the_vocabulary_sized_tensors_over_tp():
    """The embedding and LM head (whole on each tp rank in the program as is) count half on
    tp=2, and so do their optimizer state and the logits."""
    p = plan({"tp": 2}, shard="megatron")
    vocab = sum(v.numel() * v.element_size() for n in p.program.module.graph.find_nodes(
        op="placeholder") if n.meta[M.ROLE].kind is M.InputKind.PARAM
        and VOCAB in (v := n.meta[M.VAL]).shape)
    as_is, split = peak(p), peak(p, "vocab-parallel")
    assert vocab and as_is.parameters - split.parameters == vocab // 2
    assert split.optimizer < as_is.optimizer and split.total < as_is.total
    assert peak(plan({}), "vocab-parallel") == peak(plan({}))  # no tp: nothing to split


def test_the_optimizer_over_dp_x_cp_halves_zero_state_on_cp2():
    p = plan({"dp": 2, "cp": 2}, zero=1)
    as_is, wide = peak(p), peak(p, "optimizer-over-dp-cp")
    assert wide.optimizer == pytest.approx(as_is.optimizer / 2, rel=0.02)
    assert wide.parameters == as_is.parameters
    no_zero = plan({"dp": 2, "cp": 2})
    assert peak(no_zero, "optimizer-over-dp-cp") == peak(no_zero)


def test_an_unknown_technique_is_refused():
    with pytest.raises(InputError, match="unknown technique"):
        plan({}).memory_breakdown(assume=("bf16-everything",))


def test_embedding_grad_once_keeps_the_tied_embeddings_copy_on_the_last_stage():
    """A tied embedding (nanoGPT's) on pp=2: Megatron's last stage keeps a copy of it, its
    fp32 gradient and optimizer state, and sends the first stage no contribution to its
    gradient in any microbatch (all-reduced once a step instead)."""
    torch.manual_seed(0)
    model = tiny("nanogpt")
    ids = torch.randint(0, 64, (4, 8))
    p = shardfx.partition(model, (ids,), lm_loss, (ids,), mesh={"pp": 2}, precision="bf16",
                          optimizer="adamw", microbatches=4)
    as_is = p.memory_breakdown(transport="gloo")
    once = p.memory_breakdown(transport="gloo", assume=("embedding-grad-once",))
    wte = model.transformer.wte.weight.numel() * 4
    assert once[1].optimizer == as_is[1].optimizer + 2 * wte + 4  # AdamW's moments, step
    assert once[1].gradients == as_is[1].gradients + wte
    assert once[0].communication < as_is[0].communication
    assert once[1].communication < as_is[1].communication
