"""The Llama workload the memory and precision benchmarks share (bench/remat.py,
bench/precision.py, bench/fused_loss.py): size flags, a seeded Hugging Face Llama, its batch
and loss, AdamW, and one training step."""

from __future__ import annotations

import argparse
import copy
from typing import Callable

import torch
import torch.nn.functional as F

from shardfx.runtime.measure import mark

SMALL = dict(layers=2, hidden=128, inter=352, heads=4, kv=2, vocab=1000, batch=4, seq=64)

def size_flags(parser: argparse.ArgumentParser, default: dict, seed: bool = True) -> None:
    """``--small``, a flag per model and batch size (``default`` when not given), ``--seed``."""
    parser.add_argument("--small", action="store_true",
                        help="quick check: " + ", ".join(f"{k} {v}" for k, v in SMALL.items()))
    for k, v in default.items():
        parser.add_argument(f"--{k}", type=int, default=None, help=f"default {v}")
    if seed:
        parser.add_argument("--seed", type=int, default=0)


def fill_sizes(a, default: dict) -> None:
    """The sizes not given: ``SMALL``'s under ``--small``, else ``default``'s."""
    for k, v in (SMALL if a.small else default).items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def workload(a) -> tuple[Callable[[], torch.nn.Module], tuple, int]:
    """A factory of copies of one seeded Llama (every row starts from the same weights), the
    batch, and the parameter count."""
    base, batch = llama(a), make_batch(a)

    def factory() -> torch.nn.Module:
        return copy.deepcopy(base).train()

    return factory, batch, sum(p.numel() for p in base.parameters())


def llama(a) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    config = LlamaConfig(
        num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.inter,
        num_attention_heads=a.heads, num_key_value_heads=a.kv, vocab_size=a.vocab,
        use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model.train()


def loss_of(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())


def make_batch(a) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(a.seed + 1)
    return tuple(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g) for _ in range(2))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def training_step(loss_fn: Callable, model, opt, ids, targets) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = loss_fn(model, ids, targets)
        loss.backward()
        mark("fwd+bwd")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def final_loss(model, ids, targets) -> float:
    """The loss of the trained model, computed the same way (eager, no grad) for every row."""
    with torch.no_grad():
        return loss_of(model, ids, targets).item()
