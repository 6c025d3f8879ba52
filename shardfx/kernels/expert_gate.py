"""The gate of a mixture-of-experts layer: what each expert computes between its two
projections, forward and backward.

An expert's first projection gives each of its rows ``h``. With a gate, ``h`` holds the gate
and up projections, either side by side, ``[gate; up]`` (Mixtral, Qwen, DeepSeek: Hugging
Face's ``is_concatenated``), or interleaved, ``gate_0, up_0, gate_1, up_1, ...`` (GPT-OSS);
without one, the up projection alone. The gate computes, element by element,

    act_alpha(min(gate, limit)) * (clamp(up, -limit, limit) + offset)      (gated)
    act_alpha(up)                                                           (not gated)

where ``act`` is one of ``ACTIVATIONS`` and ``act_alpha(v) = act(alpha v) / alpha`` (``act``
itself where alpha is 1). The defaults -- alpha 1, no limit (0), offset 0 -- are the SwiGLU of
Llama, Mixtral and Qwen. GPT-OSS's is silu with alpha 1.702 (``v sigmoid(1.702 v)``), limit 7
and offset 1; DeepSeek-V4 clamps at its limit with offset 0. Megatron-Core has the same three
knobs (``activation_func_clamp_value``, ``glu_linear_offset``, ``quick_gelu``).

Each output column reads only its own (gate, up) pair, so a split of the intermediate
dimension over tp (``rules.experts.hidden_split``) computes each rank's columns from its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_SILU = (F.silu, aten.silu_backward)
_RELU = (F.relu, lambda grad, x: aten.threshold_backward(grad, x, 0))
_GELU = (F.gelu, aten.gelu_backward)
_GELU_TANH = (lambda x: F.gelu(x, approximate="tanh"),
              lambda grad, x: aten.gelu_backward(grad, x, approximate="tanh"))
# Hugging Face's ``hidden_act`` names: the function and its backward (grad, input) -> grad input.
ACTIVATIONS = {"silu": _SILU, "swish": _SILU, "relu": _RELU, "gelu": _GELU,
               "gelu_pytorch_tanh": _GELU_TANH, "gelu_new": _GELU_TANH}


@dataclass(frozen=True)
class Gate:
    """What the experts compute between their projections (the module docstring's formula):
    the activation's name (``ACTIVATIONS``), whether ``h`` holds a gate and an up projection
    (``gated``) and whether they alternate (``interleaved``) rather than stand side by side,
    the activation's scale ``alpha``, the clamp ``limit`` (0: none) and the ``offset`` added
    to the up projection."""

    act: str = "silu"
    gated: bool = True
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = 0.0
    offset: float = 0.0

    def __str__(self) -> str:
        act = self.act if self.alpha == 1 else f"{self.act}({self.alpha:g}x)/{self.alpha:g}"
        if not self.gated:
            return act
        parts = [f"{act}(gate) * (up{f' + {self.offset:g}' if self.offset else ''})"]
        if self.limit:
            parts.append(f"clamped at {self.limit:g}")
        if self.interleaved:
            parts.append("interleaved")
        return ", ".join(parts)

    def check(self) -> None:
        """ValueError naming what is out of range."""
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.act!r}; use one of "
                             f"{', '.join(ACTIVATIONS)}")
        if not self.alpha > 0 or self.limit < 0:
            raise ValueError(f"alpha must be positive and limit at least 0 (0: no clamp); "
                             f"got alpha={self.alpha}, limit={self.limit}")
        if not self.gated and (self.interleaved or self.limit or self.offset):
            raise ValueError("interleaved, limit and offset apply to gated experts only")


def split(h: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a gated ``h``."""
    if gate.interleaved:
        return h[..., 0::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def _joined(g_gate: torch.Tensor, g_up: torch.Tensor, gate: Gate) -> torch.Tensor:
    """The inverse of ``split``: the two halves' gradients in ``h``'s layout."""
    if gate.interleaved:
        return torch.stack([g_gate, g_up], dim=-1).flatten(-2)
    return torch.cat([g_gate, g_up], dim=-1)


def _act(v: torch.Tensor, gate: Gate) -> torch.Tensor:
    f = ACTIVATIONS[gate.act][0]
    return f(v) if gate.alpha == 1 else f(gate.alpha * v) / gate.alpha


def _act_backward(grad: torch.Tensor, v: torch.Tensor, gate: Gate) -> torch.Tensor:
    """The gradient of ``_act`` at ``v``: act'(alpha v) (the alphas cancel)."""
    backward = ACTIVATIONS[gate.act][1]
    return backward(grad, v) if gate.alpha == 1 else backward(grad, gate.alpha * v)


def activate(h: torch.Tensor, gate: Gate) -> torch.Tensor:
    """The gate of ``h`` (rows, 2I), or of the up projection alone (rows, I): (rows, I)."""
    if not gate.gated:
        return _act(h, gate)
    g, up = split(h, gate)
    if gate.limit:
        g, up = g.clamp(max=gate.limit), up.clamp(-gate.limit, gate.limit)
    return _act(g, gate) * (up + gate.offset if gate.offset else up)


def activate_backward(h: torch.Tensor, grad: torch.Tensor, gate: Gate) -> torch.Tensor:
    """The gradient of ``activate`` at ``h``; a clamped value's is zero (as torch's clamp: the
    bounds themselves pass it)."""
    if not gate.gated:
        return _act_backward(grad, h, gate)
    g, up = split(h, gate)
    gc, uc = g, up
    if gate.limit:
        gc, uc = g.clamp(max=gate.limit), up.clamp(-gate.limit, gate.limit)
    g_gate = _act_backward(grad * (uc + gate.offset if gate.offset else uc), gc, gate)
    g_up = grad * _act(gc, gate)
    if gate.limit:
        g_gate = g_gate * (g <= gate.limit)
        g_up = g_up * ((up >= -gate.limit) & (up <= gate.limit))
    return _joined(g_gate, g_up, gate)
