"""A model whose every F, B and W takes a set time: the premise of the pipeline-bubble formulas
(every stage's forward, input-gradient and weight-gradient steps equal) made exact.

``timed_work(x, ms)`` is an operator that takes ``ms`` milliseconds and returns ``x``: it
sleeps, leaving its core free as a CPU is while its GPU computes, and spins the last
millisecond on the clock to end on time; its backward does the same to the incoming gradient. ``Timed`` is a learned per-feature scale, then ``blocks`` blocks of

    h = x * tap(w)          tap: identity forward; its backward runs timed_work on dL/dw
    y = timed_work(h, ms)

so that per block the forward runs one ``timed_work`` (F), the activation gradient another
(``dh``: B, it reaches the layer below through ``w``) and the weight gradient a third (W, the
leaf ``dL/dw`` only). The leading scale gives the model's first block an activation gradient
to compute too (the scale's weight needs it), so the first stage's B is as long as the
others'. Tensors are tiny, so the real arithmetic and the messages between stages cost next
to nothing beside ``ms``: what the runner adds to the schedule's own idle time is what is
left to see.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

import shardfx


@torch.library.custom_op("shardfx_bench::timed_work", mutates_args=())
def timed_work(x: torch.Tensor, ms: float) -> torch.Tensor:
    end = time.perf_counter() + ms / 1e3
    if ms > 1:
        time.sleep((ms - 1) / 1e3)  # the core is free, as a CPU is while its GPU computes
    while time.perf_counter() < end:  # the last millisecond exact
        pass
    return x.clone()


@timed_work.register_fake
def _(x, ms):
    return torch.empty_like(x)


def _work_backward(ctx, grad):
    return timed_work(grad, ctx.ms), None


def _work_context(ctx, inputs, output):
    ctx.ms = inputs[1]


timed_work.register_autograd(_work_backward, setup_context=_work_context)


@torch.library.custom_op("shardfx_bench::tap", mutates_args=())
def tap(w: torch.Tensor, ms: float) -> torch.Tensor:
    return w.clone()


@tap.register_fake
def _(w, ms):
    return torch.empty_like(w)


tap.register_autograd(_work_backward, setup_context=_work_context)


class Block(nn.Module):
    def __init__(self, hidden: int, ms: float):
        super().__init__()
        self.weight, self.ms = nn.Parameter(torch.ones(hidden)), ms

    def forward(self, x):
        return timed_work(x * tap(self.weight, self.ms), self.ms)


class Timed(nn.Module):
    """A scale, then ``blocks`` timed blocks, ``pipe_split`` between ``stages`` equal groups."""

    def __init__(self, blocks: int, hidden: int, stages: int, ms: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))
        self.blocks = nn.ModuleList(Block(hidden, ms) for _ in range(blocks))
        self.cuts = {blocks * k // stages for k in range(1, stages)}

    def forward(self, x):
        x = x * self.scale
        for i, block in enumerate(self.blocks):
            x = block(shardfx.pipe_split(x) if i in self.cuts else x)
        return x
