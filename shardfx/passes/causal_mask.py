"""causal_mask: an attention whose mask is the causal one computes with ``is_causal`` instead,
one whose mask lets every query attend to every key computes without it, and one whose mask
is another band of keys (a sliding window, chunks: ``ir.band``) says so.

Requires: VAL on every node; the CPU flash attention op (and its backward) as capture leaves
          ``F.scaled_dot_product_attention``.
Ensures:  each such op whose ``attn_mask`` is computed from constants alone (no model input,
          parameter or buffer) and is the causal mask -- every query attends to the keys at
          its position and before, ``0``/``-inf`` (or True/False) -- takes ``is_causal=True``
          and no mask, and so does its backward; one whose mask allows every key (``0``
          everywhere, or True: Hugging Face BERT's mask when no sequence is padded) takes no
          mask; one whose mask is another band, each query attending to one run of keys
          around its own (Mistral's sliding window, Gemma's and OLMo 3's local layers, Llama
          4's chunks), reads the same mask made by ``shardfx.band_mask`` (its ``before``,
          ``after`` and ``chunk`` in the IR's text), one op right before each attention op
          (forward and backward), with that op's source and module. The traced mask's ops,
          unread, are gone. Every other masked one gets ``MASK``: what its mask is (one made
          from the model's inputs such as a padding ``attention_mask``, or another pattern),
          and the pass refuses it (``mask_refusal``: ring attention runs bands of keys only,
          and a ShardingError naming the mask and a fix for it beats a failure further on).
          Other ops and graphs are unchanged.

Why: Hugging Face models build their attention mask in the traced forward (from
``cache_position``: aranges, comparisons, a cumsum telling packed sequences apart), so the
captured attention carries a dense (T, T) mask even when it is plainly causal. Ring attention
(``codegen.ring_attention``, the ``cp`` axis) needs to know which keys each query attends to,
to skip the blocks and the rows of blocks no query sees and mask only where the band's edge
crosses a block; a dense mask it cannot split is refused. A band's mask stays in the graph
(the program computes what the model does wherever the ring does not run); the ring reads its
band and never makes it.

How: the mask's ops are run, on the CPU, from the constants they read, and each query row's
allowed keys are read off, a block of query rows at a time (``BLOCK`` elements): the run of
keys each row allows (``Band.fit`` finds the band of those runs), or that it allows every key
(full attention, also where queries and keys differ in length). The mask is built by
broadcasting a column of query positions against a row of key positions, so every (T, T)
value is computed per block from its operands' rows, and the (T,) or (T, 1) ones whole. A long
context's mask is checked in O(T^2) time but O(T) memory per row. A (T, T) value made by an
op that does not keep rows apart (a view, a reduction) is not split: such a mask is checked
whole up to ``BLOCK`` elements and left as it is beyond (a cp plan then says why it cannot
run it).
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

from shardfx.codegen.ring_attention import mask_refusal
from shardfx.ir import meta as M
from shardfx.ir.band import Band
from shardfx.ir.contract import contract, on_ops
from shardfx.ir.graph import fake_mode_of, fake_value, hashable
from shardfx.kernels.attention import BAND_MASK, band_mask_args

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
BLOCK = 1 << 24  # elements of a (T, T) value computed at once
# Answers kept across graphs (every plan of one model, its shallow copies, a search's hundred
# plans: the same mask each time), keyed by the mask's ops and the constants' values
_ANSWERS: dict = {}
KEPT = 64
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
        seen, band = answers[key] if key in answers else _known(mask, key)
        if key is not None:
            answers[key] = seen, band
        if band is not None and (band.causal or band.full):
            _drop_mask(mask, causal=band.causal)
        elif band is not None:
            _band_mask(mask, band)
        else:
            for user in mask.users:
                if user.target in (FLASH, FLASH_BACKWARD):
                    user.meta[M.MASK] = seen
            raise mask_refusal(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _known(mask: fx.Node, key) -> tuple[M.AttentionMask, Band | None]:
    """``_classify(mask)``, from ``_ANSWERS`` where a graph before had the same ops on the
    same constants (its placeholders' values, compared by content)."""
    if key is None:
        return _classify(mask)
    full = (key, tuple(_fingerprint(n) for n in _constant_ops(mask) if n.op == "placeholder"))
    if full not in _ANSWERS:
        if len(_ANSWERS) >= KEPT:
            _ANSWERS.pop(next(iter(_ANSWERS)))
        _ANSWERS[full] = _classify(mask)
    return _ANSWERS[full]


def _fingerprint(placeholder: fx.Node) -> tuple:
    """A constant's value, whole: its dtype, shape and the digest of its bytes."""
    value = placeholder.meta[M.CONSTANT].value.detach().to("cpu").contiguous()
    data = value.reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(value.dtype), tuple(value.shape), hashlib.sha256(data).hexdigest()


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


def _band_mask(mask: fx.Node, band: Band) -> None:
    """Every attention op (forward and backward) reading ``mask`` reads ``band``'s mask made
    by ``BAND_MASK`` right before it instead (the same value: shape, dtype, entries)."""
    val = mask.meta[M.VAL]
    args, kwargs = band_mask_args(band, val.shape, val.dtype, val.device)
    graph = mask.graph
    for node in list(mask.users):
        if node.target not in (FLASH, FLASH_BACKWARD):
            continue
        with graph.inserting_before(node):
            made = graph.create_node("call_function", BAND_MASK, args, kwargs, name="band_mask")
        made.meta.update({k: v for k, v in node.meta.items() if k in _PLACE})
        made.meta[M.VAL] = fake_value(fake_mode_of(graph), BAND_MASK, args, kwargs)
        node.kwargs = {**node.kwargs, "attn_mask": made}


# What a made mask takes from the attention op it is made for: its source line and module (for
# dumps, and stage cuts between blocks) and the forward op it belongs to (a backward's stage).
_PLACE = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "seq_nr", "partitioner_tag",
          "autograd_backward")


def _classify(mask: fx.Node) -> tuple[M.AttentionMask, Band | None]:
    """What ``mask`` is, and its band of keys (None: not one)."""
    val = mask.meta.get(M.VAL)
    order = _constant_ops(mask)
    if order is None:
        return M.AttentionMask("input", "computed from the model's inputs (an attention_mask "
                                        "passed to forward: padding, or packed sequences)"), None
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return M.AttentionMask("other", "not a (query, key) mask"), None
    q, k = val.shape[-2:]
    blocks = _row_blocks(mask, order, val)
    if blocks is None:
        return M.AttentionMask("other", f"a ({q}, {k}) mask too large to check"), None
    rows = max(1, BLOCK * q // max(1, val.numel()))
    full, first, last = True, [], []
    for start in range(0, q, rows):
        allowed = blocks(start, min(q, start + rows))
        if allowed is None:
            return M.AttentionMask("other", "an additive bias (values other than 0 and -inf)"), \
                None
        allowed = allowed.reshape(-1, *allowed.shape[-2:])  # (masks of the batch, rows, keys)
        if len(allowed) > 1 and not bool((allowed == allowed[:1]).all()):
            return _other(q, k), None
        full = full and bool(allowed[0].all())
        if q != k and not full:
            return _other(q, k), None
        run = _runs(allowed[0], start) if q == k else None
        if q == k and run is None:
            return _other(q, k), None
        if run is not None:
            first.append(run[0])
            last.append(run[1])
    band = Band() if full else Band.fit(torch.cat(first), torch.cat(last))
    if band is None:
        return _other(q, k), None
    if band.full or band.causal:
        return M.AttentionMask(str(band).split()[0], str(band)), band
    return M.AttentionMask("band", str(band)), band


def _runs(allowed: torch.Tensor, start: int):
    """(first, last) key each of query rows ``start ..`` of a square mask allows (``allowed``:
    (rows, keys) bool), when each allows one run of keys; else None. Causal rows, the common
    case, are checked by one comparison."""
    rows, k = allowed.shape
    keys, queries = torch.arange(k), torch.arange(start, start + rows)
    if bool((allowed == (keys <= queries.unsqueeze(1))).all()):
        return torch.zeros_like(queries), queries
    lo = allowed.view(torch.uint8).argmax(-1)  # the first allowed key (0 if none)
    hi = lo + allowed.sum(-1) - 1  # the last, if they are one run
    run = (keys >= lo.unsqueeze(1)) & (keys <= hi.unsqueeze(1))
    if not bool((hi >= lo).all() and (allowed == run).all()):
        return None
    return lo, hi


def _other(q: int, k: int) -> M.AttentionMask:
    return M.AttentionMask("other", f"a ({q}, {k}) pattern that is not a band of keys (causal, "
                                    "full, a sliding window, chunks)")


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
