"""causal_mask: an attention whose mask is the causal one computes with ``is_causal`` instead,
and one whose mask lets every query attend to every key computes without it.

Requires: VAL on every node; the CPU flash attention op (and its backward) as capture leaves
          ``F.scaled_dot_product_attention``.
Ensures:  each such op whose ``attn_mask`` is computed from constants alone (no model input,
          parameter or buffer) and is the causal mask -- every query attends to the keys at
          its position and before, ``0``/``-inf`` (or True/False) -- takes ``is_causal=True``
          and no mask, and so does its backward; one whose mask allows every key (``0``
          everywhere, or True: Hugging Face BERT's mask when no sequence is padded) takes no
          mask; the mask's ops, unread, are gone. Every other masked one gets ``MASK``: what
          its mask is (a sliding window of W keys, one made from the model's inputs such as
          a padding ``attention_mask``, or another pattern), and the pass refuses it
          (``mask_refusal``: ring attention runs causal or full attention only, and a
          ShardingError naming the mask and a fix for it beats a failure further on). Other
          ops and graphs are unchanged.

Why: Hugging Face models build their attention mask in the traced forward (from
``cache_position``: aranges, comparisons, a cumsum telling packed sequences apart), so the
captured attention carries a dense (T, T) mask even when it is plainly causal. Ring attention
(``codegen.ring_attention``, the ``cp`` axis) needs to know the mask is causal, to skip the
blocks of later ranks and mask only its own block; a dense mask it cannot split is refused.

How: the mask's ops are run, on the CPU, from the constants they read, and the value is
compared with the causal pattern, a block of query rows at a time (``BLOCK`` elements): the
mask is built by broadcasting a column of query positions against a row of key positions, so
every (T, T) value is computed per block from its operands' rows, and the (T,) or (T, 1) ones
whole. A long context's mask is checked in O(T^2) time but O(T) memory per row. A (T, T)
value made by an op that does not keep rows apart (a view, a reduction) is not split: such a
mask is checked whole up to ``BLOCK`` elements and left as it is beyond (a cp plan then says
why it cannot run it).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from shardfx.ir import meta as M
from shardfx.ir.graph import hashable
from shardfx.codegen.ring_attention import mask_refusal
from shardfx.ir.contract import contract, on_ops

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
BLOCK = 1 << 24  # elements of a (T, T) value computed at once
aten = torch.ops.aten
ROWWISE = {  # ops whose output row i reads row i of each operand (broadcasting): split by rows
    aten.eq.Tensor, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor,
    aten.gt.Tensor, aten.eq.Scalar, aten.ne.Scalar, aten.le.Scalar, aten.lt.Scalar,
    aten.ge.Scalar, aten.gt.Scalar, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.logical_not.default, aten.where.self, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Tensor, aten.add.Scalar, aten.mul.Scalar, aten.masked_fill.Scalar,
    aten.expand.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
}


@contract(requires=[on_ops(M.VAL, "VAL")],
          ensures=[])
def causal_mask(gm: fx.GraphModule, options) -> fx.GraphModule:
    """Run on plans with a ``cp`` axis (``compiler.driver.compile_ir``): only the ring needs it, and
    other plans keep the model's ops as traced."""
    changed, answers = False, {}
    for node in list(gm.graph.find_nodes(op="call_function", target=FLASH)):
        mask = node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        key = _same_ops(mask)  # each stamped block computes the same mask again: check once
        seen = answers[key] if key in answers else _classify(mask)
        if key is not None:
            answers[key] = seen
        if seen.kind in ("causal", "full"):
            _drop_mask(mask, causal=seen.kind == "causal")
            changed = True
        else:
            for user in mask.users:
                if user.target in (FLASH, FLASH_BACKWARD):
                    user.meta[M.MASK] = seen
            raise mask_refusal(node)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _drop_mask(mask: fx.Node, causal: bool) -> None:
    """Every attention op (forward and backward) reading ``mask``: unmasked, causal or not."""
    for node in list(mask.users):
        if node.target not in (FLASH, FLASH_BACKWARD):
            continue
        names = [a.name for a in node.target._schema.arguments]
        args = list(node.args)
        at = names.index("is_causal")
        while len(args) <= at:  # defaults made explicit: dropout_p 0.0
            args.append(node.target._schema.arguments[len(args)].default_value)
        args[at] = causal
        node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}


def _classify(mask: fx.Node) -> M.AttentionMask:
    """What ``mask`` is: causal, full, a sliding window, from the inputs, or other."""
    val = mask.meta.get(M.VAL)
    order = _constant_ops(mask)
    if order is None:
        return M.AttentionMask("input", "computed from the model's inputs (an attention_mask "
                                        "passed to forward: padding, or packed sequences)")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return M.AttentionMask("other", "not a (query, key) mask")
    q, k = val.shape[-2:]
    blocks = _row_blocks(mask, order, val)
    if blocks is None:
        return M.AttentionMask("other", f"a ({q}, {k}) mask too large to check")
    last = blocks(q - 1, q)
    if last is None:
        return M.AttentionMask("other", "an additive bias (values other than 0 and -inf)")
    window = int(last[..., -1, :].sum(-1).max())  # keys the last query may attend to
    kinds = {"full": lambda a, start: bool(a.all()),
             "causal": lambda a, start: q == k and bool((a == _band(start, a, k)).all()),
             "window": lambda a, start: q == k and bool((a == _band(start, a, window)).all())}
    rows = max(1, BLOCK * q // max(1, val.numel()))
    for start in range(0, q, rows):
        allowed = blocks(start, min(q, start + rows))
        if allowed is None:
            return M.AttentionMask("other", "an additive bias (values other than 0 and -inf)")
        kinds = {name: ok for name, ok in kinds.items() if ok(allowed, start)}
        if not kinds:
            return M.AttentionMask("other", f"a ({q}, {k}) pattern that is neither causal, "
                                            "full nor a sliding window")
    if "full" in kinds:
        return M.AttentionMask("full", "every query attends to every key")
    if "causal" in kinds:
        return M.AttentionMask("causal", "each query attends to the keys up to its own")
    return M.AttentionMask("window", f"a sliding window: each query attends to its own key "
                                     f"and the {window - 1} before it")


def _band(start: int, allowed: torch.Tensor, width: int) -> torch.Tensor:
    """Rows ``start ..`` of the causal mask limited to ``width`` keys back (``width`` >= the
    row count: the causal mask itself)."""
    rows, k = allowed.shape[-2:]
    keys, queries = torch.arange(k), torch.arange(start, start + rows).unsqueeze(1)
    return (keys <= queries) & (keys > queries - max(width, 1))


def _row_blocks(mask: fx.Node, order: list[fx.Node], val: torch.Tensor):
    """A function (start, stop) -> the allowed (bool) query rows ``start:stop`` of ``mask``
    (None for an additive bias); None when the mask is too large and not computed row-wise."""
    q, k = val.shape[-2:]
    if val.numel() <= BLOCK:
        whole = _allowed(_run(order, {}, None)[mask])
        return lambda start, stop: None if whole is None else whole[..., start:stop, :]
    pairwise = [n for n in order if _rows_of(n, q) and n.meta[M.VAL].shape[-1] == k]
    split = set(pairwise)
    if any(n.op != "call_function" or n.target not in ROWWISE for n in pairwise) or any(
            a in split for n in order if n not in split for a in n.all_input_nodes):
        return None  # a value that does not keep the rows apart
    small = _run([n for n in order if n not in split], {}, None)
    return lambda start, stop: _allowed(_run(pairwise, small, (start, stop, q))[mask])


def _allowed(value: torch.Tensor) -> torch.Tensor | None:
    """Where a mask lets a query attend: True, or 0 of a 0/-inf mask; None for another bias."""
    if value.dtype == torch.bool:
        return value
    if not bool(((value == 0) | (value == float("-inf"))).all()):
        return None
    return value == 0


def _same_ops(mask: fx.Node):
    """What determines the mask's value: its ops in order, each with its arguments (operands by
    their place in that order, the constants by name); None if it reads anything else."""
    order = _constant_ops(mask)
    if order is None:
        return None
    at = {n: i for i, n in enumerate(order)}
    try:
        key = tuple(n.name if n.op == "placeholder" else (n.target, hashable(
            fx.node.map_arg((n.args, n.kwargs), at.__getitem__))) for n in order)
        hash(key)
    except TypeError:
        return None
    return key


def _rows_of(n: fx.Node, q: int) -> bool:
    """Whether ``n``'s value has the query rows (dim -2 of length q)."""
    val = n.meta.get(M.VAL)
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-2] == q


def _constant_ops(node: fx.Node) -> list[fx.Node] | None:
    """The ops ``node``'s value comes from, in graph order; None if it reads anything but
    constants."""
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
    return sorted(order, key=position.__getitem__)


def _run(nodes: list[fx.Node], env: dict, rows: tuple[int, int, int] | None) -> dict:
    """The values of ``nodes`` (in order) on the CPU, the others read from ``env``; with
    ``rows`` = (start, stop, q), only those query rows of each value that has q rows (and of
    its operands: a broadcast operand of one row is read whole)."""
    env, made = dict(env), set(nodes)

    def operand(a: fx.Node):
        v = env[a]
        if rows is not None and a not in made and _rows_of(a, rows[2]):
            return v.narrow(-2, rows[0], rows[1] - rows[0])
        return v

    for n in nodes:
        if n.op == "placeholder":
            env[n] = n.meta[M.CONSTANT].value.to("cpu")
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), operand)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if rows is not None and n.target is aten.expand.default and args[1][-2] == rows[2]:
            args = (args[0], [*args[1][:-2], rows[1] - rows[0], args[1][-1]], *args[2:])
        env[n] = n.target(*args, **kwargs)
    return env
