"""The Hugging Face families ``bench/heldout.py`` trains: how to build a tiny one of each, what
it takes as input and as loss, and which meshes apply to it.

Each is built from a tiny config with seeded random weights (no download): hidden 32,
``layers`` layers, 4 heads (2 KV heads where the family has them), vocabulary 64, MoE families
4 experts top-2 (top-1 where the family routes so), dropout as the config has it. Causal LMs and
encoders read 4 x 8 token ids and are scored by next-token cross entropy on the logits (an
encoder's too: a loss over every token); encoder-decoders read 8 source and 8 target tokens;
image classifiers 3 x 16 x 16 images (8 x 8 for ViT) and 10 classes. Sliding windows and chunks
are 3 positions, so a band of keys crosses the cp ranks' chunks of a sequence of 8.

``FAMILIES`` lists the families of the first sweep (Llama ... GPT-2 with gradient checkpointing)
then those added after: Falcon, Bloom, OPT, GPT-BigCode, Phi-2, Granite, Nemotron, Helium,
Exaone 4, SmolLM3, OLMo 3, ERNIE 4.5 and its MoE, Hunyuan dense and MoE, Apertus, Arcee,
Seed-OSS, JetMoE, Llama 4 (text), GPT-OSS, dots.llm1, RoBERTa, T5, BART, ViT and ConvNeXt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from models import HIDDEN, SEQ, VOCAB, hf, lm_loss, tiny, token_batches


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family: how to build a tiny one, its data, and what its meshes
    need."""

    build: Callable[[int], torch.nn.Module]  # layers -> a seeded model, train mode
    moe: bool = False  # has experts: runs on ep2
    sequence: bool = True  # reads token sequences, which cp2 splits (not images)
    batches: Callable[[int, int], list] = token_batches  # (steps, batch) -> [(args, targets)]
    loss: Callable[..., torch.Tensor] = lm_loss  # (output, *targets) -> scalar


def _t():
    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs trip HF's config warnings
    return transformers


def _common(layers: int, kv: bool = True) -> dict[str, Any]:
    c = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
             vocab_size=VOCAB, intermediate_size=2 * HIDDEN)
    return {**c, "num_key_value_heads": 2} if kv else c


# Token ids of a config's default special tokens can lie outside a vocabulary of 64.
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 3  # sliding windows and chunks: narrower than a cp rank's part of 8 positions


def _alternating(layers: int) -> list[str]:
    """A local layer, then a global one (Gemma's, OLMo 3's, Exaone 4's pattern, shortened)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _hf(model: str, config: str, kv: bool = True, **extra) -> Callable[[int], torch.nn.Module]:
    """A builder of ``transformers.<model>(transformers.<config>(hidden 32, ..., **extra))``;
    an ``extra`` value that is callable is called with the layer count."""
    def build(layers: int) -> torch.nn.Module:
        t = _t()
        torch.manual_seed(0)
        given = {k: v(layers) if callable(v) else v for k, v in extra.items()}
        return getattr(t, model)(getattr(t, config)(**_common(layers, kv), **given)).train()
    return build


def _models(builder, name: str) -> Callable[[int], torch.nn.Module]:
    """A builder from tests/models.py (``tiny`` or ``hf``)."""
    def build(layers: int) -> torch.nn.Module:
        _t()
        return builder(name, layers).train()
    return build


def _checkpointed(reentrant: bool) -> Callable[[int], torch.nn.Module]:
    def build(layers: int) -> torch.nn.Module:
        model = _models(tiny, "llama")(layers)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    return build


def _gpt2(layers: int) -> torch.nn.Module:  # the config's dropout (0.1), unlike tests/models.py
    t = _t()
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=layers, n_embd=HIDDEN, n_head=4,
                                          n_positions=2 * SEQ, vocab_size=VOCAB, **_IDS)).train()


def _gptj(layers: int) -> torch.nn.Module:
    t = _t()
    torch.manual_seed(0)
    return t.GPTJForCausalLM(t.GPTJConfig(n_layer=layers, n_embd=HIDDEN, n_head=4, rotary_dim=4,
                                          n_positions=2 * SEQ, vocab_size=VOCAB, **_IDS)).train()


def _bert(layers: int) -> torch.nn.Module:  # the config's dropout (0.1)
    t = _t()
    torch.manual_seed(0)
    return t.BertForMaskedLM(t.BertConfig(**_common(layers, kv=False),
                                          max_position_embeddings=2 * SEQ)).train()


# --- families added after the first sweep -------------------------------------------------------


def _bloom(layers: int) -> torch.nn.Module:  # ALiBi: a bias on the scores by distance
    t = _t()
    torch.manual_seed(0)
    return t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=layers,
                                            n_head=4, **_IDS)).train()


def _bigcode(layers: int) -> torch.nn.Module:  # multi-query attention, dropout 0.1
    t = _t()
    torch.manual_seed(0)
    return t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(
        vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=HIDDEN, n_layer=layers, n_head=4,
        n_inner=2 * HIDDEN, **_IDS)).train()


def _opt(layers: int) -> torch.nn.Module:  # learned positions offset by 2, dropout 0.1
    t = _t()
    torch.manual_seed(0)
    return t.OPTForCausalLM(t.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, ffn_dim=2 * HIDDEN,
        num_attention_heads=4, max_position_embeddings=2 * SEQ, word_embed_proj_dim=HIDDEN,
        **_IDS)).train()


def _falcon(layers: int) -> torch.nn.Module:  # parallel attention and MLP, multi-query
    t = _t()
    torch.manual_seed(0)
    return t.FalconForCausalLM(t.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
        ffn_hidden_size=2 * HIDDEN, **_IDS)).train()


def _jetmoe(layers: int) -> torch.nn.Module:  # experts in the MLP and in attention (MoA)
    t = _t()
    torch.manual_seed(0)
    return t.JetMoeForCausalLM(t.JetMoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_key_value_heads=2,
        kv_channels=8, intermediate_size=2 * HIDDEN, num_local_experts=4, num_experts_per_tok=2,
        **_IDS)).train()


def _roberta(layers: int) -> torch.nn.Module:  # positions counted past padding, dropout 0.1
    t = _t()
    torch.manual_seed(0)
    return t.RobertaForMaskedLM(t.RobertaConfig(**_common(layers, kv=False),
                                                max_position_embeddings=2 * SEQ + 2)).train()


class Seq2Seq(torch.nn.Module):
    """An encoder-decoder LM as ``(source ids, target ids) -> logits``: the target ids are the
    decoder's input (teacher forcing), scored by ``lm_loss`` against the next ones."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, source, target):  # (B, S), (B, T) -> (B, T, V)
        return self.model(input_ids=source, decoder_input_ids=target).logits


def _t5(layers: int) -> torch.nn.Module:  # relative position buckets, dropout 0.1
    t = _t()
    torch.manual_seed(0)
    return Seq2Seq(t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=layers,
        num_decoder_layers=layers, num_heads=4, relative_attention_num_buckets=8,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))).train()


def _bart(layers: int) -> torch.nn.Module:  # learned positions, dropout 0.1
    t = _t()
    torch.manual_seed(0)
    return Seq2Seq(t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=2 * SEQ, decoder_start_token_id=2,
        **_IDS))).train()


def _pair_batches(steps: int, batch: int) -> list[tuple[tuple, tuple]]:
    """(source, target) ids and the targets' next tokens, each (batch, SEQ)."""
    g = torch.Generator().manual_seed(1)
    ids = lambda: torch.randint(0, VOCAB, (batch, SEQ), generator=g)  # noqa: E731
    return [((ids(), ids()), (ids(),)) for _ in range(steps)]


CLASSES = 10


def _vit(layers: int) -> torch.nn.Module:  # 8 x 8 images in patches of 4: 4 patches + [CLS]
    t = _t()
    torch.manual_seed(0)
    return t.ViTForImageClassification(t.ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=2 * HIDDEN, image_size=8, patch_size=4, num_labels=CLASSES)).train()


def _convnext(layers: int) -> torch.nn.Module:  # 16 x 16 images, two stages
    t = _t()
    torch.manual_seed(0)
    return t.ConvNextForImageClassification(t.ConvNextConfig(
        num_stages=2, hidden_sizes=[16, HIDDEN], depths=[1, max(1, layers - 1)],
        image_size=16, num_labels=CLASSES)).train()


def _images(size: int) -> Callable[[int, int], list]:
    def batches(steps: int, batch: int) -> list[tuple[tuple, tuple]]:
        """(batch, 3, size, size) images and (batch,) class labels."""
        g = torch.Generator().manual_seed(1)
        return [((torch.randn(batch, 3, size, size, generator=g),),
                 (torch.randint(0, CLASSES, (batch,), generator=g),)) for _ in range(steps)]
    return batches


def class_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of an image classifier's logits (B, classes) against labels (B,)."""
    return F.cross_entropy(out.logits if hasattr(out, "logits") else out, labels)


_EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=HIDDEN)

FAMILIES: dict[str, Family] = {
    "llama": Family(_models(tiny, "llama")),
    "mistral": Family(_hf("MistralForCausalLM", "MistralConfig")),
    "qwen2": Family(_models(hf, "qwen2")),
    "qwen3": Family(_hf("Qwen3ForCausalLM", "Qwen3Config", head_dim=8)),
    "qwen3_moe": Family(_models(hf, "qwen3_moe"), moe=True),
    "qwen2_moe": Family(_models(hf, "qwen2_moe"), moe=True),
    "phi3": Family(_hf("Phi3ForCausalLM", "Phi3Config", **_IDS)),
    "phimoe": Family(_models(hf, "phimoe"), moe=True),
    "stablelm": Family(_hf("StableLmForCausalLM", "StableLmConfig", **_IDS)),
    "cohere": Family(_hf("CohereForCausalLM", "CohereConfig", **_IDS)),
    "olmo": Family(_hf("OlmoForCausalLM", "OlmoConfig", **_IDS)),
    "olmo2": Family(_models(hf, "olmo2")),
    "olmoe": Family(_hf("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2,
                        **_IDS), moe=True),
    "granitemoe": Family(_hf("GraniteMoeForCausalLM", "GraniteMoeConfig", num_local_experts=4,
                             num_experts_per_tok=2, **_IDS), moe=True),
    "glm4": Family(_hf("Glm4ForCausalLM", "Glm4Config", head_dim=8, **_IDS)),
    "glm4_moe": Family(_hf("Glm4MoeForCausalLM", "Glm4MoeConfig", head_dim=8, n_routed_experts=4,
                           n_group=1, topk_group=1, first_k_dense_replace=1, **_EXPERTS, **_IDS),
                       moe=True),
    "deepseek_v3": Family(_models(hf, "deepseek_v3"), moe=True),
    "gemma": Family(_hf("GemmaForCausalLM", "GemmaConfig", head_dim=8, **_IDS)),
    "gemma2": Family(_hf("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, **_IDS)),
    "gemma3": Family(_models(hf, "gemma3")),
    "gptj": Family(_gptj),
    "gpt2": Family(_gpt2),
    "gpt_neox": Family(_models(hf, "gpt_neox")),
    "starcoder2": Family(_hf("Starcoder2ForCausalLM", "Starcoder2Config", **_IDS)),
    "bert": Family(_bert),
    "mixtral": Family(_models(tiny, "mixtral"), moe=True),
    "llama+ckpt-reentrant": Family(_checkpointed(True)),
    "llama+ckpt": Family(_checkpointed(False)),
    # added after the first sweep
    "falcon": Family(_falcon),
    "bloom": Family(_bloom),
    "opt": Family(_opt),
    "gpt_bigcode": Family(_bigcode),
    "phi": Family(_hf("PhiForCausalLM", "PhiConfig", **_IDS)),
    "granite": Family(_hf("GraniteForCausalLM", "GraniteConfig", **_IDS)),
    "nemotron": Family(_hf("NemotronForCausalLM", "NemotronConfig", **_IDS)),
    "helium": Family(_hf("HeliumForCausalLM", "HeliumConfig", head_dim=8, **_IDS)),
    "exaone4": Family(_hf("Exaone4ForCausalLM", "Exaone4Config", sliding_window=WINDOW,
                          layer_types=_alternating, **_IDS)),
    "smollm3": Family(_hf("SmolLM3ForCausalLM", "SmolLM3Config", no_rope_layer_interval=2,
                          **_IDS)),
    "olmo3": Family(_hf("Olmo3ForCausalLM", "Olmo3Config", sliding_window=WINDOW,
                        layer_types=_alternating, **_IDS)),
    "ernie4_5": Family(_hf("Ernie4_5ForCausalLM", "Ernie4_5Config", **_IDS)),
    "ernie4_5_moe": Family(_hf("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", moe_num_experts=4,
                               moe_k=2, moe_intermediate_size=HIDDEN, moe_layer_start_index=1,
                               moe_num_shared_experts=1, **_IDS), moe=True),
    "hunyuan_v1_dense": Family(_hf("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config",
                                   head_dim=8, **_IDS)),
    "hunyuan_v1_moe": Family(_hf("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", head_dim=8,
                                 num_experts=4, moe_topk=2, **_IDS), moe=True),
    "apertus": Family(_hf("ApertusForCausalLM", "ApertusConfig", **_IDS)),
    "arcee": Family(_hf("ArceeForCausalLM", "ArceeConfig", **_IDS)),
    "seed_oss": Family(_hf("SeedOssForCausalLM", "SeedOssConfig", head_dim=8, **_IDS)),
    "jetmoe": Family(_jetmoe, moe=True),
    "llama4": Family(_hf("Llama4ForCausalLM", "Llama4TextConfig", head_dim=8,
                         attention_chunk_size=WINDOW, no_rope_layer_interval=2,
                         intermediate_size_mlp=2 * HIDDEN, num_local_experts=4,
                         num_experts_per_tok=1, interleave_moe_layer_step=2, **_IDS), moe=True),
    "gpt_oss": Family(_hf("GptOssForCausalLM", "GptOssConfig", head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=WINDOW, **_IDS), moe=True),
    "dots1": Family(_hf("Dots1ForCausalLM", "Dots1Config", n_routed_experts=4, n_group=1,
                        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, **_EXPERTS,
                        **_IDS), moe=True),
    "roberta": Family(_roberta),
    "t5": Family(_t5, batches=_pair_batches),
    "bart": Family(_bart, batches=_pair_batches),
    "vit": Family(_vit, sequence=False, batches=_images(8), loss=class_loss),
    "convnext": Family(_convnext, sequence=False, batches=_images(16), loss=class_loss),
}
ADDED = list(FAMILIES)[list(FAMILIES).index("falcon"):]  # the families of the second sweep
