"""rng_dropout: dropout masks from each element's place in the batch, not from the mesh.

Requires: VAL on every value node; ``gm.meta[GRAPH].mode``.
Ensures:  in a training graph, no ``native_dropout(x, p, True)`` with ``0 < p < 1`` (p = 0 keeps
          and p = 1 drops every element: nothing random is left there): each is replaced
          by ordinary ATen ops computing its mask from an RNG input (a placeholder of kind RNG,
          ``i64[3]`` = ``[seed, step, slice]``, which the runner feeds) and the element's global
          position; VAL on every node added. Other graphs are returned unchanged.

Eager dropout draws its mask from the device's generator, one element after another, over the
tensor it sees. On a mesh each device sees a part of the tensor: dp replicas would draw the
same masks for their own rows and a pipeline draws microbatch by microbatch, so the mesh would
change the masks a batch gets. Here the keep/drop decision of an element is a pure function of
(seed, step, which dropout op, the element's linear index in the one-device tensor) -- a
counter-based generator, as Philox is -- so a model with dropout trains to the same losses,
gradients and parameters (to fp32 rounding) on one device, dp, tp and pp.

The masks are shardfx's own stream (as torch.compile's Inductor draws from its own RNG by
default): not eager's masks bit for bit, but statistically the same: each element kept with
probability 1 - p (to 2**-32), kept ones scaled by 1 / (1 - p), the mask returned as
native_dropout returns it so ``native_dropout_backward`` stays as it is.

How the position is found: the pass builds ``arange(numel).view(shape)`` at the traced shape,
an ordinary replicated value. Under dp and tp, ``shard_propagate`` gives the mask the
placement of the tensor it multiplies, so every device keeps its own part of the one-device
mask (it computes the whole index and hash, then slices: simple, and O(numel) integer work).
A pipeline traces one slice of the batch (``Options.slices``: a microbatch of one dp replica)
and the runner feeds the slice's number, so the index is ``local + slice * numel``: the
one-device index of a batch-first tensor. A dropout on a tensor whose first dimension is not
the batch still gets independent masks per slice in a pipeline, but not one device's.

The hash: murmur3's 32-bit finalizer (``fmix32``: xor-shift, multiply, full avalanche), keyed
per op and step, two rounds with a key word in each. Philox4x32-10 needs the high half of
32x32-bit products, which overflow int64 (C++ signed overflow: undefined) or take several
times the ops in exact 16-bit limbs; every product here is exact in int64 (``_mul32``), so the
masks are the same on every backend and machine. Two keyed rounds of a bijective mixer are
plenty for a Bernoulli mask; the two key words come from four more rounds over (seed, step,
op). The runner feeds the RNG input: the seed is ``draw_seed``'s (``torch.manual_seed``
before ``plan.runner()`` reproduces a run), the step counts its training steps from 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from shardfx.ir import meta as M

aten = torch.ops.aten
M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / phi: spreads small op numbers over the key space
RNG_NAME = "rng"  # the RNG input's name: [seed, step, slice]


def rng_dropout(gm: fx.GraphModule, options) -> fx.GraphModule:
    if gm.meta[M.GRAPH].mode is not M.Mode.TRAIN:
        return gm
    drops = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target is aten.native_dropout.default and _train(n) and 0 < _p(n) < 1]
    if not drops:
        return gm
    rng = _rng_input(gm)
    for op, node in enumerate(drops):
        _rewrite(gm.graph, node, rng, op)
    gm.graph.lint()
    gm.recompile()
    return gm


def _p(node: fx.Node) -> float:
    return float(node.args[1] if len(node.args) > 1 else node.kwargs["p"])


def _train(node: fx.Node) -> bool:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return bool(train)  # None: not training, as ATen's native_dropout reads it


def _rng_input(gm: fx.GraphModule) -> fx.Node:
    """The RNG placeholder, after the other inputs."""
    last = gm.graph.find_nodes(op="placeholder")[-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(RNG_NAME)
    node.meta[M.ROLE] = M.InputRole(M.InputKind.RNG, RNG_NAME)
    fake = last.meta[M.VAL].fake_mode
    with fake:
        node.meta[M.VAL] = torch.empty(3, dtype=torch.int64, device=last.meta[M.VAL].device)
    return node


def _rewrite(graph: fx.Graph, node: fx.Node, rng: fx.Node, op: int) -> None:
    """``native_dropout(x, p, True)`` -> ``(x * mask * 1/(1-p), mask)``, the mask from
    ``keep_mask``; its getitem users are rewired to the two values."""
    x, p = node.args[0], _p(node)
    val = x.meta[M.VAL]
    fake = val.fake_mode
    emitted: list[fx.Node] = []

    def emit(target, *args, **kwargs) -> fx.Node:
        new = graph.call_function(target, args, kwargs)
        new.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "seq_nr")
                         if k in node.meta})
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda a: a.meta[M.VAL])
        with fake:
            new.meta[M.VAL] = target(*fake_args, **fake_kwargs)
        emitted.append(new)
        return new

    with graph.inserting_before(node):
        mask = keep_mask(emit, rng, tuple(val.shape), p, op, val.device)
        out = emit(aten.mul.Tensor, emit(aten.mul.Tensor, x, mask), 1.0 / (1.0 - p))
    index = next(n for n in emitted if n.target is aten.add.Tensor
                 and n.args[0].target is aten.arange.default)  # arange + slice * numel
    bits = mask.args[0].args[0]  # view(ge(bits, threshold))
    for value, what in ((index, "index"), (bits, "bits"), (mask, "mask"), (out, "out")):
        value._rename(f"{node.name}_{what}")  # names a reader of the dump can follow
    for user in list(node.users):  # getitem(native_dropout, 0 | 1)
        user.replace_all_uses_with(out if user.args[1] == 0 else mask)
        graph.erase_node(user)
    graph.erase_node(node)


def keep_mask(f, rng, shape: tuple[int, ...], p: float, op: int, device=None):
    """The bool mask of dropout number ``op`` (True: kept) over a tensor of ``shape``, given
    ``rng`` = ``[seed, step, slice]`` (int64). ``f(target, *args)`` applies an ATen op: ``call``
    to compute it, or the pass's emitter to build it into the graph; the same function both
    ways, so tests compare the program with this one."""
    n = 1
    for s in shape:
        n *= s
    seed, step, piece = (f(aten.select.int, rng, 0, i) for i in range(3))
    salt = (op + 1) * GOLDEN & M32
    seed_lo = f(aten.bitwise_and.Scalar, seed, M32)
    seed_hi = f(aten.bitwise_and.Scalar, f(aten.bitwise_right_shift.Tensor_Scalar, seed, 32), M32)
    a = _fmix32(f, f(aten.bitwise_xor.Scalar, seed_hi, salt))
    a = _fmix32(f, f(aten.bitwise_xor.Tensor, seed_lo, a))
    k0 = _fmix32(f, f(aten.bitwise_xor.Tensor, a, f(aten.bitwise_and.Scalar, step, M32)))
    k1 = _fmix32(f, f(aten.bitwise_xor.Scalar, k0, GOLDEN))
    index = f(aten.arange.default, n, dtype=torch.int64, device=device)
    index = f(aten.add.Tensor, index, f(aten.mul.Tensor, piece, n))  # the global position
    h = _fmix32(f, f(aten.bitwise_xor.Tensor, f(aten.bitwise_and.Scalar, index, M32), k0))
    high = f(aten.bitwise_right_shift.Tensor_Scalar, index, 32)  # nonzero past 2**32 elements
    h = _fmix32(f, f(aten.bitwise_xor.Tensor, f(aten.bitwise_xor.Tensor, h, high), k1))
    threshold = round(p * 2**32)  # uniform(h) >= p, in integers
    return f(aten.view.default, f(aten.ge.Scalar, h, threshold), list(shape))


def call(target, *args, **kwargs):
    """``keep_mask``'s ``f`` for computing the mask eagerly."""
    return target(*args, **kwargs)


def _fmix32(f, h):
    """murmur3's finalizer on values in [0, 2**32) held in int64."""
    h = f(aten.bitwise_xor.Tensor, h, f(aten.bitwise_right_shift.Tensor_Scalar, h, 16))
    h = _mul32(f, h, 0x85EBCA6B)
    h = f(aten.bitwise_xor.Tensor, h, f(aten.bitwise_right_shift.Tensor_Scalar, h, 13))
    h = _mul32(f, h, 0xC2B2AE35)
    return f(aten.bitwise_xor.Tensor, h, f(aten.bitwise_right_shift.Tensor_Scalar, h, 16))


def _mul32(f, x, c: int):
    """``x * c mod 2**32`` for ``x`` in [0, 2**32), exact in int64: no product passes 2**48."""
    lo = f(aten.mul.Tensor, x, c & 0xFFFF)
    hi = f(aten.bitwise_and.Scalar, f(aten.mul.Tensor, x, c >> 16), 0xFFFF)
    return f(aten.bitwise_and.Scalar, f(aten.add.Tensor, lo, f(aten.mul.Tensor, hi, 1 << 16)), M32)


def draw_seed() -> int:
    """The seed of a runner's dropout masks: ``torch.initial_seed()`` (so ``torch.manual_seed``
    before ``plan.runner()`` reproduces the masks), rank 0's when torch.distributed runs, so
    every device of the mesh agrees even when the ranks were seeded apart. Collective when
    torch.distributed is initialized: call it on every rank."""
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from shardfx.runtime.device import collective_device

        seed = seed.to(collective_device())
        dist.broadcast(seed, src=0)
    return int(seed)


def rng_value(seed: int, step: int, piece: int = 0) -> torch.Tensor:
    """The RNG input of one step: ``[seed, step, slice]``."""
    return torch.tensor([seed, step, piece], dtype=torch.int64)


def reads_rng(gm: fx.GraphModule) -> bool:
    """Whether a program (or a pipeline's split program) takes the RNG input."""
    return any(n.meta.get(M.ROLE) is not None and n.meta[M.ROLE].kind is M.InputKind.RNG
               for n in gm.graph.find_nodes(op="placeholder"))
