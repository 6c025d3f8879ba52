"""Train a small GPT with shardfx, and check every number against plain PyTorch.

The model is nanoGPT's (github.com/karpathy/nanoGPT, model.py), cut to what a training step
needs: token and position embeddings, pre-LayerNorm blocks of causal self-attention and a GELU
MLP, a final LayerNorm, and an LM head that shares its weight with the token embedding.

    python examples/nanogpt.py                           # partition, train 20 steps, infer
    shardfx inspect examples/nanogpt.py:workload         # print the plan only

Shapes in comments: B batch, T sequence length, C n_embd, nh n_head, hs = C // nh, V vocab_size.
"""

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfx
from shardfx.testing import rel_error


@dataclass
class GPTConfig:
    block_size: int = 64  # longest sequence the model accepts (GPT-2: 1024)
    vocab_size: int = 256  # number of distinct tokens; 256 = one per byte (GPT-2: 50257)
    n_layer: int = 4  # transformer blocks (GPT-2 small: 12)
    n_head: int = 4  # attention heads per block; must divide n_embd (GPT-2 small: 12)
    n_embd: int = 128  # width C of the residual stream (GPT-2 small: 768)
    dropout: float = 0.0  # dropout probability; 0.0 lets the demo compare steps with eager PyTorch
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2 has them


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # is_causal: each position attends to itself and earlier positions only
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, C)
        x = F.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):  # (B, T, C)
        x = x + self.attn(self.ln_1(x))  # pre-LayerNorm: normalize the input of each sublayer,
        x = x + self.mlp(self.ln_2(x))  # and add its output to the residual stream
        return x  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),  # token embedding
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),  # position embedding
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying: one (V, C) tensor embeds tokens and scores them. It has two names
        # (transformer.wte.weight, lm_head.weight); shardfx keeps one input and sums its gradients.
        self.transformer.wte.weight = self.lm_head.weight
        # GPT-2 init: N(0, 0.02) everywhere, zero biases, and the projections that write into
        # the residual stream scaled by 1/sqrt(2 * n_layer) so its variance stays put with depth.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):  # (B, T) token ids
        B, T = idx.shape
        assert T <= self.cfg.block_size, f"{T} tokens, block_size is {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C) + (T, C)
        x = self.transformer.drop(x)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V) logits for the next token at every position


def loss_fn(logits, targets):  # (B, T, V), (B, T)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))  # over (B*T, V)


# --- data: a tiny task the model can learn in a few steps ----------------------------------


def make_text(cfg: GPTConfig, length: int = 4096, seed: int = 0) -> torch.Tensor:
    """A fixed random cycle through the whole vocabulary, repeated: every token has exactly one
    successor, so the next token is predictable and the loss can fall from ln(V) towards 0."""
    cycle = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    return cycle.repeat(length // cfg.vocab_size + 1)[:length]  # (N,)


def get_batch(text, batch_size: int, seq_len: int, gen: torch.Generator):
    """Random windows of the text: inputs and the same windows shifted by one token."""
    start = torch.randint(len(text) - seq_len - 1, (batch_size,), generator=gen)  # (B,)
    window = start[:, None] + torch.arange(seq_len + 1)  # (B, T + 1)
    tokens = text[window]  # (B, T + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # idx (B, T), targets (B, T)


def workload(batch_size: int = 8, seq_len: int | None = None, seed: int = 0, **overrides):
    """The factory ``shardfx inspect examples/nanogpt.py:workload`` (and ``shardfx run``)
    calls: a model, one batch of example inputs and targets, the loss, and an endless stream
    of training batches from the same text (``run`` trains on them). Keyword overrides go to
    ``GPTConfig``."""
    cfg = GPTConfig(**overrides)
    torch.manual_seed(seed)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(seed)
    text, T = make_text(cfg), seq_len or cfg.block_size
    idx, targets = get_batch(text, batch_size, T, gen)
    return {"model": model, "args": (idx,), "loss_fn": loss_fn, "targets": (targets,),
            "batches": batches(text, batch_size, T, seed + 1)}


def shakespeare(batch_size: int = 8, seq_len: int = 64, seed: int = 0):
    """The factory of ``examples/shakespeare.toml``: this GPT with the vocabulary of the
    character-level Shakespeare text that ``examples/prepare_text.py`` tokenizes (its
    ``meta.json``); ``shardfx run`` trains it on the token file the config names."""
    meta = Path(__file__).parent / "data" / "meta.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{meta} is missing: run python examples/prepare_text.py first")
    vocab = json.loads(meta.read_text())["vocab_size"]
    w = workload(batch_size, seq_len, seed, vocab_size=vocab)
    del w["batches"]  # the token file's batches instead
    return w


def batches(text, batch_size: int, seq_len: int, seed: int):
    """Training batches ``((idx,), (targets,))``, forever, the same sequence for a seed."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        idx, targets = get_batch(text, batch_size, seq_len, gen)
        yield (idx,), (targets,)


# --- the demo ------------------------------------------------------------------------------


def main(steps: int = 20, checked_steps: int = 5, lr: float = 3e-3):
    w = workload()
    model, (idx,), (targets,) = w["model"], w["args"], w["targets"]
    eager = copy.deepcopy(model)  # same initial weights (and the same tying), trained by PyTorch

    t0 = time.perf_counter()
    plan = shardfx.partition(model, (idx,), loss_fn, (targets,))
    print(plan)
    print(f"partition: {time.perf_counter() - t0:.1f} s")

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

    runner = plan.runner(optimizer=adamw)  # trains `model`'s own parameters in place
    eager_opt = adamw(list(eager.parameters()))

    text = make_text(model.cfg)
    gen = torch.Generator().manual_seed(1)
    B, T = idx.shape
    print(f"training {steps} steps of AdamW on random windows (B={B}, T={T}) of a repeating text")
    worst = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = get_batch(text, B, T, gen)  # (B, T), (B, T)
        loss = runner.step((x,), (y,))
        if step < checked_steps:  # the same step in plain PyTorch, from the same weights
            eager_opt.zero_grad(set_to_none=True)
            eager_loss = loss_fn(eager(x), y)
            eager_loss.backward()
            eager_opt.step()
            worst = max(worst, rel_error(loss, eager_loss))
        if step % 4 == 0 or step == steps - 1:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    print(f"trained {steps} steps in {time.perf_counter() - t0:.1f} s "
          f"(a uniform guess scores ln(V) = {math.log(model.cfg.vocab_size):.4f})")
    print(f"loss vs eager PyTorch, first {checked_steps} steps: max relative difference "
          f"{worst:.2e}")

    x, y = get_batch(text, B, T, gen)
    logits = runner.forward((x,))  # (B, T, V), from the inference program
    with torch.no_grad():
        inference_error = rel_error(logits, model(x))
    accuracy = (logits.argmax(-1) == y).float().mean().item()  # (B, T) -> fraction correct
    print(f"inference: logits {tuple(logits.shape)}, next-token accuracy {accuracy:.1%}, "
          f"relative difference vs model(x) {inference_error:.2e}")


if __name__ == "__main__":
    main()
