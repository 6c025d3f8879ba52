"""A small Hugging Face Mixtral (random weights, nothing downloaded) for ``shardfx inspect`` and
``shardfx run``: the mixture-of-experts example.

    shardfx inspect examples/moe.py:workload --mesh dp=2,ep=2
    shardfx run examples/moe.py:workload --mesh ep=2 --steps 10 --capacity-factor 1.25

Every layer's experts trace as one ``shardfx::experts`` op; an ``ep`` axis spreads them over
its ranks (docs/experts.md). The data is the nanoGPT example's learnable cycle through the
vocabulary, so the loss falls.
"""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F


def _nanogpt():
    path = Path(__file__).with_name("nanogpt.py")
    spec = importlib.util.spec_from_file_location("nanogpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loss_fn(out, targets):  # logits (B, T, V), targets (B, T)
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def workload(batch_size: int = 8, seq_len: int = 32, seed: int = 0, layers: int = 2,
             hidden: int = 64, experts: int = 4, top_k: int = 2, vocab: int = 128):
    """A model, one batch of example inputs and targets, the loss, and an endless stream of
    training batches (``shardfx run`` trains on them)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
        num_local_experts=experts, num_experts_per_tok=top_k, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4 * seq_len,
        use_cache=False))
    nanogpt = _nanogpt()
    text = nanogpt.make_text(nanogpt.GPTConfig(vocab_size=vocab))
    idx, targets = nanogpt.get_batch(text, batch_size, seq_len,
                                     torch.Generator().manual_seed(seed))
    return {"model": model, "args": (idx,), "loss_fn": loss_fn, "targets": (targets,),
            "batches": nanogpt.batches(text, batch_size, seq_len, seed + 1)}
