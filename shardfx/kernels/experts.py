"""Mixture-of-experts layers as one op: ``shardfx.experts(x, index, weights, w_in, w_out)``.

An MoE layer's experts are one node in the captured graph (``shardfx::experts``, and
``shardfx::experts_backward`` in the backward), not the few dozen ops of a sort, a gather and
a grouped matmul: its sharding is then a rule like a matmul's (``rules.experts``), and on an
``ep`` mesh axis ``codegen.spmd`` runs it as expert parallelism, each rank holding E/ep of the
experts and the tokens exchanged by all-to-all (``codegen.expert_parallel``).

Hugging Face's MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS and the others
whose experts module is declared with ``use_experts_implementation``, and Llama 4's MoE block)
are recognised while shardfx traces them (``partitioner.experts_hf``). A model of one's own
calls the op where its experts are::

    y = shardfx.experts(x, top_k_index, top_k_weights, self.w_in, self.w_out, act="silu")

On one device, or run eagerly, it computes exactly ``compute.forward``'s arithmetic.
"""

from __future__ import annotations

import contextlib
import math

import torch

from shardfx.kernels import expert_compute as compute
from shardfx.kernels.expert_compute import Form, Local
from shardfx.kernels.expert_gate import Gate
from shardfx.ir.text import module_of

_CAPACITY: list[float | None] = [None]  # the plan's capacity factor while it traces


@torch.library.custom_op("shardfx::experts", mutates_args=())
def _experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor,
             w_out: torch.Tensor, b_in: torch.Tensor | None, b_out: torch.Tensor | None,
             act: str, gated: bool, interleaved: bool, alpha: float, limit: float,
             offset: float, transposed: bool, score_before: bool, capacity: float, layer: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    form = Form.from_args((act, gated, interleaved, alpha, limit, offset, transposed,
                           score_before, capacity, layer))
    y, xd, h, zs = compute.forward(x, index, weights, w_in, w_out, form, Local, b_in, b_out)
    return y, xd, h, zs


@_experts.register_fake
def _(x, index, weights, w_in, w_out, b_in, b_out, *form):
    return forward_shapes(x, index, w_in, Form.from_args(form))


def forward_shapes(x, index, w_in, form: Form, experts: int | None = None):
    """Empty (y, xd, h, zs) of the shapes ``compute.forward`` returns where the routing is
    even (every expert as many rows as any other): exact on one device and with a capacity;
    the average under expert parallelism without one."""
    tokens, k = index.shape
    experts = experts or w_in.shape[0]
    rows = tokens * k
    if form.capacity > 0:
        rows = experts * max(1, math.ceil(form.capacity * tokens * k / experts))
    width = w_in.shape[2] if form.transposed else w_in.shape[1]
    return (torch.empty_like(x), x.new_empty((rows, x.shape[-1])), x.new_empty((rows, width)),
            x.new_empty((tokens * k, 0 if form.score_before else x.shape[-1])))


@torch.library.custom_op("shardfx::experts_backward", mutates_args=())
def _experts_backward(grad_y: torch.Tensor, x: torch.Tensor, index: torch.Tensor,
                      weights: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                      xd: torch.Tensor, h: torch.Tensor, zs: torch.Tensor,
                      b_in: torch.Tensor | None, b_out: torch.Tensor | None, act: str,
                      gated: bool, interleaved: bool, alpha: float, limit: float,
                      offset: float, transposed: bool, score_before: bool, capacity: float,
                      layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor, torch.Tensor]:
    form = Form.from_args((act, gated, interleaved, alpha, limit, offset, transposed,
                           score_before, capacity, layer))
    out = compute.backward(grad_y, x, index, weights, w_in, w_out, xd, h, zs, form, Local,
                           b_in, b_out)
    return with_bias_grads(out, x)


def with_bias_grads(grads: tuple, x: torch.Tensor) -> tuple:
    """``compute.backward``'s gradients as the op returns them: an empty tensor for a bias the
    experts do not have (an op's outputs are tensors)."""
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@_experts_backward.register_fake
def _(grad_y, x, index, weights, w_in, w_out, xd, h, zs, b_in, b_out, *form):
    return (torch.empty_like(x), torch.empty_like(weights), torch.empty_like(w_in),
            torch.empty_like(w_out), *(x.new_empty(0) if b is None else torch.empty_like(b)
                                       for b in (b_in, b_out)))


def _setup_context(ctx, inputs, output):
    x, index, weights, w_in, w_out, b_in, b_out, *form = inputs
    _, xd, h, zs = output
    ctx.form = form
    ctx.save_for_backward(x, index, weights, w_in, w_out, xd, h, zs, b_in, b_out)
    ctx.mark_non_differentiable(xd, h, zs)


def _backward(ctx, grad_y, *_):
    saved = ctx.saved_tensors
    b_in, b_out = saved[-2:]
    grad_x, grad_weights, grad_in, grad_out, grad_b_in, grad_b_out = \
        EXPERTS_BACKWARD(grad_y, *saved, *ctx.form)
    return (grad_x, None, grad_weights, grad_in, grad_out,
            None if b_in is None else grad_b_in, None if b_out is None else grad_b_out,
            *[None] * len(ctx.form))


_experts.register_autograd(_backward, setup_context=_setup_context)

EXPERTS = torch.ops.shardfx.experts.default
EXPERTS_BACKWARD = torch.ops.shardfx.experts_backward.default
TENSORS = 7  # the op's tensor arguments: x, index, weights, w_in, w_out, b_in, b_out


def experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor,
            w_out: torch.Tensor, *, act: str = "silu", gated: bool = True,
            transposed: bool = False, b_in: torch.Tensor | None = None,
            b_out: torch.Tensor | None = None, interleaved: bool = False, alpha: float = 1.0,
            limit: float = 0.0, offset: float = 0.0, score_before: bool = False,
            name: str = "") -> torch.Tensor:
    """The output of a mixture-of-experts layer's experts for tokens ``x`` (T, H) that chose
    experts ``index`` (T, k) with ``weights`` (T, k): per token, the weighted sum of its
    experts' MLPs. ``w_in`` (E, 2I, H) holds each expert's gate and up projections stacked
    (``gated``; (E, I, H) and no gate otherwise), ``w_out`` (E, H, I) its down projection;
    ``transposed``: they are stored (E, H, 2I) and (E, I, H). ``b_in`` (E, 2I) and ``b_out``
    (E, H): the projections' biases, if any.

    Between the projections, the gate (``kernels.expert_gate``): ``act(gate) * up`` by default,
    ``act`` one of ``ACTIVATIONS``; ``interleaved``: the gate and up rows of ``w_in`` alternate
    (GPT-OSS) instead of standing [gate; up]; ``act(alpha v) / alpha`` for ``alpha`` other than
    1; ``limit``: the gate clamped to at most ``limit`` and up to [-limit, limit]; ``offset``
    added to up. ``score_before``: the weights scale each expert's input (Llama 4), not its
    output. ``name``: the layer's, in the routing each step records (``runner.expert_load()``);
    by default the module it is called in (``layer_name``).

    Written in a model, it marks the experts for shardfx: an ``ep`` mesh axis then spreads them
    over its ranks. The plan's ``capacity_factor`` applies to it as to a recognised layer."""
    gate = Gate(act, gated, interleaved, float(alpha), float(limit), float(offset))
    try:
        gate.check()
    except ValueError as e:
        raise ValueError(f"shardfx.experts: {e}") from None
    form = Form(gate, transposed, score_before, float(_CAPACITY[0] or 0.0), name)
    return EXPERTS(x, index, weights, w_in, w_out, b_in, b_out, *form.args())[0]


def name_layers(graph) -> None:
    """Each ``EXPERTS`` node's layer name (its last argument, which it records its routing
    under): the one given to ``experts``, else the model's module it was called in. Named after
    capture: the name of a block's module differs from block to block, and blocks whose ops'
    arguments differ are not stamped (``partitioner.repeats``)."""
    for node in graph.find_nodes(op="call_function", target=EXPERTS):
        if not node.args[-1]:
            node.args = (*node.args[:-1], module_of(node) or node.name)


@contextlib.contextmanager
def capacity_while_tracing(capacity: float | None):
    """``experts`` calls made inside use the plan's capacity factor (None: dropless)."""
    before, _CAPACITY[0] = _CAPACITY[0], capacity
    try:
        yield
    finally:
        _CAPACITY[0] = before
