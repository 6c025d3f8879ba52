"""causal_mask: an attention whose mask is the causal one computes with ``is_causal`` instead.

Requires: VAL on every node; the CPU flash attention op (and its backward) as capture leaves
          ``F.scaled_dot_product_attention``.
Ensures:  each such op whose ``attn_mask`` is computed from constants alone (no model input,
          parameter or buffer) and is the causal mask -- every query attends to the keys at
          its position and before, ``0``/``-inf`` (or True/False) -- takes ``is_causal=True``
          and no mask, and so does its backward; the mask's ops, unread, are gone. Other ops
          and graphs are unchanged.

Why: Hugging Face models build their attention mask in the traced forward (from
``cache_position``: aranges, comparisons, a cumsum telling packed sequences apart), so the
captured attention carries a dense (T, T) mask even when it is plainly causal. Ring attention
(``codegen.ring_attention``, the ``cp`` axis) needs to know the mask is causal, to skip the
blocks of later ranks and mask only its own block; a dense mask it cannot split is refused.

How: the mask's ops are run once, on the CPU, from the constants they read, and the value is
compared with the causal pattern. That is (T, T) elements: masks over ``MAX_CHECKED``
elements are left as they are (and a cp plan then says why it cannot run them).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from shardfx.ir import meta as M

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
MAX_CHECKED = 1 << 26  # elements of a mask evaluated to check it (a 8192 x 8192 one)


def causal_mask(gm: fx.GraphModule, options) -> fx.GraphModule:
    """Run on plans with a ``cp`` axis (``pipeline.compile_ir``): only the ring needs it, and
    other plans keep the model's ops as traced."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=FLASH)):
        mask = node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and _is_causal(mask):
            _drop_mask(node, mask)
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _drop_mask(forward: fx.Node, mask: fx.Node) -> None:
    """The forward and every backward op reading the same mask: causal, unmasked."""
    for node in list(mask.users):
        if node.target not in (FLASH, FLASH_BACKWARD):
            continue
        names = [a.name for a in node.target._schema.arguments]
        args = list(node.args)
        at = names.index("is_causal")
        while len(args) <= at:  # defaults made explicit: dropout_p 0.0
            args.append(node.target._schema.arguments[len(args)].default_value)
        args[at] = True
        node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}


def _is_causal(mask: fx.Node) -> bool:
    val = mask.meta.get(M.VAL)
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.numel() > MAX_CHECKED:
        return False
    q, k = val.shape[-2:]
    if q != k:
        return False
    value = _evaluate(mask)
    if value is None:
        return False
    if value.dtype == torch.bool:
        allowed = value
    else:
        allowed = value == 0
        if not bool(((value == 0) | (value == float("-inf"))).all()):
            return False
    causal = torch.ones(q, k, dtype=torch.bool).tril()
    return bool((allowed == causal).all())


def _evaluate(node: fx.Node) -> torch.Tensor | None:
    """``node``'s value, from the constants its ops read; None if it reads anything else."""
    order, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if M.CONSTANT not in n.meta:
                return None
        elif n.op != "call_function":
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    env: dict[fx.Node, object] = {}
    for n in sorted(order, key=position.__getitem__):
        if n.op == "placeholder":
            env[n] = n.meta[M.CONSTANT].value.to("cpu")
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        env[n] = n.target(*args, **kwargs)
    return env[node]

