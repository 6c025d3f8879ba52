"""Hugging Face's experts modules, recognised and traced as ``shardfx::experts``.

transformers declares each MoE model's experts module with ``use_experts_implementation``
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Aria, and some 70 others): the module holds every
expert's weights as 3-D parameters (``gate_up_proj`` (E, 2I, H), or ``up_proj`` without a
gate, and ``down_proj`` (E, H, I)) and is called as ``experts(hidden_states, top_k_index,
top_k_weights)``; the decorator records the layout (``has_gate``, ``is_transposed``,
``is_concatenated``, ``has_bias``, ``has_post_expert_norm``) on the instance.

While shardfx traces a model, each such module whose layout ``shardfx.experts`` computes -- no
biases, no norm after the experts, gate and up side by side rather than interleaved, the
default gating ``act(gate) * up``, an activation in ``compute.ACTIVATIONS`` -- runs through it
instead of its own implementation; the arithmetic is the same (the tests compare it with the
module's "eager" loop). The others trace as they are (their experts then run on every rank
that holds the layer) and ``unrecognised`` names them, so an ``ep`` axis can refuse them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from shardfx.kernels.experts import ACTIVATIONS, experts


@dataclass(frozen=True)
class Recognised:
    """One experts module: its FQN, the activation's name and the weights' layout."""

    path: str
    act: str
    gated: bool
    transposed: bool


def declared(module: torch.nn.Module) -> bool:
    """``module`` is an experts module declared with ``use_experts_implementation``."""
    return hasattr(module, "has_gate") and hasattr(module, "is_concatenated") and \
        hasattr(type(module), "_apply_gate") and isinstance(getattr(module, "down_proj", None),
                                                            torch.nn.Parameter)


def why_not(module: torch.nn.Module) -> str | None:
    """Why ``shardfx.experts`` cannot compute this declared experts module; None if it can."""
    from transformers.integrations.moe import _default_apply_gate

    if module.has_bias:
        return "its experts have biases"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm follows each expert"
    if module.has_gate and not module.is_concatenated:
        return "its gate and up projections are interleaved"
    if module.has_gate and type(module)._apply_gate is not _default_apply_gate:
        return f"it gates with its own {type(module).__name__}._apply_gate"
    act = _activation(module)
    if act is None:
        return f"its activation {type(getattr(module, 'act_fn', None)).__name__} is not one of " \
               f"{', '.join(ACTIVATIONS)}"
    return None


def _activation(module: torch.nn.Module) -> str | None:
    from transformers.activations import ACT2FN

    config = getattr(module, "config", None)
    name = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    # isinstance: while blocks are traced their modules' classes are recording subclasses
    # (``partitioner.repeats.cut_to_traced``)
    if name in ACTIVATIONS and isinstance(getattr(module, "act_fn", None), type(ACT2FN[name])):
        return name
    return None


def recognise(model: torch.nn.Module) -> tuple[list[Recognised], list[tuple[str, str]]]:
    """The experts modules of ``model`` traced as ``shardfx.experts``, and (FQN, why) of the
    declared ones that are not."""
    found, missed = [], []
    for path, module in model.named_modules():
        if not declared(module):
            continue
        if why := why_not(module):
            missed.append((path, why))
            continue
        found.append(Recognised(path, _activation(module), bool(module.has_gate),
                                bool(module.is_transposed)))
    return found, missed


@contextlib.contextmanager
def traced_as_shardfx_experts(model: torch.nn.Module):
    """Within: every recognised experts module of ``model`` calls ``shardfx.experts``. The
    forward is replaced on the modules' classes, not on the instances: an instance attribute
    would differ from block to block, and blocks that differ are not stamped
    (``partitioner.repeats``). Other instances of those classes run their own forward."""
    found, _ = recognise(model)
    ours = {id(model.get_submodule(r.path)): r for r in found}
    classes = {type(model.get_submodule(r.path)) for r in found}
    before = {cls: cls.__dict__.get("forward") for cls in classes}
    for cls in classes:
        cls.forward = _forward(cls.forward, ours)
    try:
        yield
    finally:
        for cls, f in before.items():
            if f is None:
                del cls.forward
            else:
                cls.forward = f


def _forward(original, ours: dict):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        r = ours.get(id(self))
        if r is None:
            return original(self, hidden_states, top_k_index, top_k_weights)
        w_in = self.gate_up_proj if r.gated else self.up_proj
        return experts(hidden_states, top_k_index, top_k_weights, w_in, self.down_proj,
                       act=r.act, gated=r.gated, transposed=r.transposed)
    return forward
