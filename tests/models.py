"""The tiny models and batches the tests train: one definition, imported by every test file
(and by the worker functions tests hand to ``shardfx.launch``, which run in other processes).

Hidden 32, vocab 64, sequence 8, dropout off: small enough for CPU, big enough to have the
structure that matters (grouped-query attention, tied embeddings, experts, several layers).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN = 64, 8, 32


def tiny(name: str, layers: int = 2) -> torch.nn.Module:
    """A seeded tiny ``llama`` | ``gpt2`` | ``mixtral`` | ``nanogpt``."""
    import transformers as T

    torch.manual_seed(0)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=layers, n_embd=HIDDEN, n_head=4, n_positions=2 * SEQ, vocab_size=VOCAB,
            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, vocab_size=VOCAB))
    if name == "nanogpt":
        nanogpt = example("nanogpt")
        return nanogpt.GPT(nanogpt.GPTConfig(block_size=2 * SEQ, vocab_size=VOCAB,
                                             n_layer=layers, n_head=4, n_embd=HIDDEN))
    raise ValueError(name)


def hf(name: str, layers: int = 2) -> torch.nn.Module:
    """A seeded tiny Hugging Face model: hidden 32, ``layers`` layers, 4 heads (2 kv heads where
    the architecture has them), vocabulary 64, few experts: ``qwen3_moe`` | ``qwen2_moe`` | ``gemma3`` |
    ``olmo2`` | ``deepseek_v3`` | ``qwen2`` | ``gpt_neox`` | ``bert`` | ``phimoe`` | ``gpt_oss`` |
    ``llama4``."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                  vocab_size=VOCAB, intermediate_size=2 * HIDDEN)
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if name == "qwen3_moe":  # per-head q_norm / k_norm: their gradients all-reduced over tp
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **common, **experts, num_key_value_heads=2, num_experts=4, head_dim=8))
    if name == "qwen2_moe":  # a shared expert beside the routed ones, with its own gate
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **common, **experts, num_key_value_heads=2, num_experts=4,
            shared_expert_intermediate_size=32))
    if name == "gemma3":
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**common, num_key_value_heads=2,
                                                      head_dim=8))
    if name == "olmo2":  # q_norm over all heads: its gradient gathered over tp
        return T.Olmo2ForCausalLM(T.Olmo2Config(**common, num_key_value_heads=2))
    if name == "deepseek_v3":  # multi-head latent attention: as many kv heads as heads
        return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **common, **experts, num_key_value_heads=4, n_routed_experts=4, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8))
    if name == "qwen2":  # biases on q, k and v
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=2))
    if name == "gpt_neox":
        return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common, max_position_embeddings=64))
    if name == "phimoe":  # router: Gumbel sampling, a custom autograd.Function, input jitter
        return T.PhimoeForCausalLM(T.PhimoeConfig(
            **common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64, input_jitter_noise=0.01))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(**common, max_position_embeddings=64,
                                              hidden_dropout_prob=0,
                                              attention_probs_dropout_prob=0))
    if name == "gpt_oss":  # experts with biases, an interleaved clamped gate; attention sinks,
        # sliding and full layers. The clamp at 0.1 (the real one is 7) acts at these sizes.
        return T.GptOssForCausalLM(T.GptOssConfig(
            **{**common, "intermediate_size": HIDDEN}, num_key_value_heads=2, head_dim=8,
            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.1, sliding_window=4))
    if name == "llama4":  # a dense layer, then a MoE one: a shared expert and 4 routed ones,
        # top-1 with sigmoid scores applied to the input; chunked attention (chunks of 4)
        return T.Llama4ForCausalLM(T.Llama4TextConfig(
            **{**common, "intermediate_size": HIDDEN}, intermediate_size_mlp=2 * HIDDEN,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=4))
    raise ValueError(name)


def lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, (B, T, V) vs (B, T); a Hugging Face output or plain logits."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_batches(n: int, batch: int = 4, seed: int = 1) -> list[tuple[tuple, tuple]]:
    """``n`` different (args, targets) pairs of token ids, each (batch, SEQ)."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, VOCAB, (batch, SEQ), generator=g),),
             (torch.randint(0, VOCAB, (batch, SEQ), generator=g),)) for _ in range(n)]


def example(name: str):
    """A module of examples/ (not a package), loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class HandFilled(torch.nn.Module):
    """A parameter its constructor fills by hand: on meta, nothing can say what it was."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.scale


LONG_SEQ = 16  # a sequence a band of keys of 3 crosses the cp chunks of (cp=2: 4 chunks of 4)


def banded(name: str, layers: int = 2) -> torch.nn.Module:
    """A seeded tiny Hugging Face model whose attention is a band of keys narrower than
    ``LONG_SEQ``: ``mistral`` (a sliding window of 3 keys), ``gemma3`` (a local layer, window 3,
    then a global one), ``gemma2`` and ``olmo3`` (likewise; Gemma 2's scores soft-capped, so
    attention as matmuls), ``llama4`` (dense: chunks of 3 positions, then a NoPE layer
    attending causally)."""
    import transformers as T

    T.logging.set_verbosity_error()  # tiny configs trip HF's config warnings
    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, intermediate_size=2 * HIDDEN)
    alternating = ["sliding_attention", "full_attention"] * (layers // 2) + \
        ["sliding_attention"] * (layers % 2)
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=3))
    if name == "gemma3":
        return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**common, head_dim=8, sliding_window=3,
                                                      layer_types=alternating))
    if name == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=8, sliding_window=3,
                                                  layer_types=alternating, pad_token_id=0))
    if name == "olmo3":
        return T.Olmo3ForCausalLM(T.Olmo3Config(**common, sliding_window=3,
                                                layer_types=alternating, pad_token_id=0))
    if name == "llama4":
        return T.Llama4ForCausalLM(T.Llama4TextConfig(
            **common, head_dim=8, attention_chunk_size=3, no_rope_layer_interval=2,
            moe_layers=[], intermediate_size_mlp=2 * HIDDEN, pad_token_id=0))
    raise ValueError(name)


def long_batches(n: int, batch: int = 1, seed: int = 1) -> list[tuple[tuple, tuple]]:
    """``n`` different (args, targets) pairs of token ids, each (batch, LONG_SEQ)."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, VOCAB, (batch, LONG_SEQ), generator=g),),
             (torch.randint(0, VOCAB, (batch, LONG_SEQ), generator=g),)) for _ in range(n)]
