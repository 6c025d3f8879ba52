"""Hugging Face's experts modules, recognised and traced as ``shardfx::experts``.

transformers declares each MoE model's experts module with ``use_experts_implementation``
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS, and some 70 others): the module holds
every expert's weights as 3-D parameters (``gate_up_proj`` (E, 2I, H), or ``up_proj`` without
a gate, and ``down_proj`` (E, H, I)), with their biases (``gate_up_proj_bias``,
``down_proj_bias``) where it has them, and is called as ``experts(hidden_states, top_k_index,
top_k_weights)``; the decorator records the layout (``has_gate``, ``is_transposed``,
``has_bias``, ``has_post_expert_norm``) on the instance, and the module computes its gate
between the projections with ``_apply_gate`` (the default ``act_fn(gate) * up``, or its own:
GPT-OSS's is clamped, offset and interleaved).

Llama 4 declares none: its MoE block (``Llama4TextMoe``) sends every token through every expert,
scaled by that expert's router score (the sigmoid of its logit among the top k, 0 elsewhere),
and adds a shared expert. The block is recognised itself: its router and shared expert run as
they are, the routed experts as ``shardfx.experts`` over the top k with the scores applied to
the inputs (``score_before``), the same sum without the zero terms.

The gate and the activation are recognised by what they compute, not by their names: each
``kernels.expert_gate.Gate`` a module may compute (the layouts, the activations, alpha, limit
and offset among its own float attributes and the defaults) is tried on probe values, in
float64, against the module's own ``_apply_gate`` (or ``act_fn``); the first that agrees is the
module's. A module none agrees with, or with a norm after each expert, traces as it is (its
experts then run on every rank that holds the layer) and ``recognise`` names it with why, so
an ``ep`` axis can refuse it. The tests compare each recognised family's op with its module's
own loop in float64.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from dataclasses import dataclass

import torch

from shardfx.kernels.expert_gate import ACTIVATIONS, Gate, activate
from shardfx.kernels.experts import experts

_LLAMA4 = ("transformers.models.llama4.modeling_llama4", "Llama4TextMoe")


@dataclass(frozen=True)
class Recognised:
    """One experts module (or Llama 4's MoE block, ``block``): its FQN, the gate, the weights'
    layout and whether they have biases."""

    path: str
    gate: Gate
    transposed: bool
    biased: bool = False
    block: bool = False

    def kwargs(self) -> dict:
        """``shardfx.experts``'s keyword arguments for the module's form."""
        g = self.gate
        return dict(act=g.act, gated=g.gated, interleaved=g.interleaved, alpha=g.alpha,
                    limit=g.limit, offset=g.offset, transposed=self.transposed,
                    score_before=self.block)


def declared(module: torch.nn.Module) -> bool:
    """``module`` is an experts module declared with ``use_experts_implementation``."""
    return hasattr(module, "has_gate") and hasattr(module, "is_concatenated") and \
        hasattr(type(module), "_apply_gate") and isinstance(getattr(module, "down_proj", None),
                                                            torch.nn.Parameter)


def llama4_block(module: torch.nn.Module) -> bool:
    """``module`` is Llama 4's MoE block (checked by class: no declaration says it)."""
    cls = getattr(sys.modules.get(_LLAMA4[0]), _LLAMA4[1], None)
    return cls is not None and isinstance(module, cls)


def why_not(module: torch.nn.Module) -> str | None:
    """Why ``shardfx.experts`` cannot compute this experts module or block; None if it can."""
    return _recognised("", module)[1]


def _recognised(path: str, module: torch.nn.Module) -> tuple[Recognised | None, str | None]:
    if llama4_block(module):
        e = getattr(module, "experts", None)
        w_in, w_out = getattr(e, "gate_up_proj", None), getattr(e, "down_proj", None)
        if not all(isinstance(w, torch.nn.Parameter) and w.dim() == 3 for w in (w_in, w_out)) \
                or w_in.shape[2] != 2 * w_out.shape[1]:
            return None, "its experts do not hold gate_up_proj (E, H, 2I) and down_proj (E, I, H)"
        act = _activation(getattr(e, "act_fn", None))
        if act is None:
            return None, f"its experts' activation {type(e.act_fn).__name__} is not one of " \
                         f"{', '.join(ACTIVATIONS)}"
        return Recognised(path, Gate(act), transposed=True, block=True), None
    if getattr(module, "has_post_expert_norm", False):
        return None, "a norm follows each expert"
    if module.has_gate:
        gate = _gate(module)
        if gate is None:
            return None, f"its gate ({type(module).__name__}._apply_gate) computes none of " \
                         "the gates shardfx.experts has (docs/experts.md)"
    else:
        act = _activation(getattr(module, "act_fn", None))
        if act is None:
            return None, f"its activation {type(getattr(module, 'act_fn', None)).__name__} " \
                         f"is not one of {', '.join(ACTIVATIONS)}"
        gate = Gate(act, gated=False)
    return Recognised(path, gate, bool(module.is_transposed), bool(module.has_bias)), None


def recognise(model: torch.nn.Module) -> tuple[list[Recognised], list[tuple[str, str]]]:
    """The experts modules (and Llama 4 blocks) of ``model`` traced as ``shardfx.experts``, and
    (FQN, why) of those that are not."""
    found, missed = [], []
    for path, module in model.named_modules():
        if not (declared(module) or llama4_block(module)):
            continue
        r, why = _recognised(path, module)
        if why:
            missed.append((path, why))
        else:
            found.append(r)
    return found, missed


# --- what a module computes, found on probe values ---------------------------------------------

_PROBE_ROWS, _PROBE_WIDTH = 64, 8


def _probe(scale: float) -> torch.Tensor:
    """Fixed float64 values around 0, many beyond ``scale`` on either side."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(_PROBE_ROWS, 2 * _PROBE_WIDTH, generator=g, dtype=torch.float64) * scale


def _same(f, g, x: torch.Tensor) -> bool:
    try:
        with torch.no_grad():
            a, b = f(x), g(x)
    except Exception:  # noqa: BLE001 -- a function that cannot take the probe is not this one
        return False
    return isinstance(a, torch.Tensor) and a.shape == b.shape and \
        torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def _activation(act_fn) -> str | None:
    """The name in ``ACTIVATIONS`` of the function ``act_fn`` computes, if any."""
    if not callable(act_fn):
        return None
    x = _probe(4.0)
    return next((name for name, (f, _) in ACTIVATIONS.items() if _same(act_fn, f, x)), None)


def _gate(module: torch.nn.Module) -> Gate | None:
    """The gate ``type(module)._apply_gate`` computes, if ``kernels.expert_gate`` has it: the
    first of the candidates that agrees on the probe (the module's own activation first)."""
    floats = sorted({v for v in vars(module).values() if type(v) is float and v > 0})
    x = _probe(1.0 + max(floats, default=1.0))
    own = _activation(getattr(module, "act_fn", None))
    acts = [a for a in dict.fromkeys([own, *ACTIVATIONS]) if a]
    for act, interleaved, alpha, limit, offset in itertools.product(
            acts, (False, True), [1.0, *floats], [0.0, *floats], (0.0, 1.0)):
        gate = Gate(act, True, interleaved, alpha, limit, offset)
        if _same(lambda h: type(module)._apply_gate(module, h), lambda h: activate(h, gate), x):
            return gate
    return None


# --- the trace -----------------------------------------------------------------------------------


@contextlib.contextmanager
def traced_as_shardfx_experts(model: torch.nn.Module):
    """Within: every recognised experts module (or Llama 4 block) of ``model`` calls
    ``shardfx.experts``. The forward is replaced on the modules' classes, not on the instances:
    an instance attribute would differ from block to block, and blocks that differ are not
    stamped (``partitioner.repeats``). Other instances of those classes run their own
    forward."""
    found, _ = recognise(model)
    ours = {id(model.get_submodule(r.path)): r for r in found}
    blocks = {type(model.get_submodule(r.path)): r.block for r in found}  # class -> a block?
    before = {cls: cls.__dict__.get("forward") for cls in blocks}
    for cls, block in blocks.items():
        cls.forward = (_block_forward if block else _forward)(cls.forward, ours)
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
        w_in, b_in = (self.gate_up_proj, "gate_up_proj_bias") if r.gate.gated else \
            (self.up_proj, "up_proj_bias")
        b_in, b_out = (getattr(self, b_in), self.down_proj_bias) if r.biased else (None, None)
        return experts(hidden_states, top_k_index, top_k_weights, w_in, self.down_proj,
                       b_in=b_in, b_out=b_out, **r.kwargs())
    return forward


def _block_forward(original, ours: dict):
    def forward(self, hidden_states):
        r = ours.get(id(self))
        if r is None:
            return original(self, hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])         # (T, H)
        scores, logits = self.router(x)  # (T, E): sigmoid of each top-k logit, 0 elsewhere
        index = torch.topk(logits, self.top_k, dim=1).indices        # the router's own choice
        e = self.experts
        routed = experts(x, index, scores.gather(1, index), e.gate_up_proj, e.down_proj,
                         **r.kwargs())
        return self.shared_expert(x) + routed, logits
    return forward
