"""rng_stream: random values from each element's place in the batch, not from the mesh.

Requires: VAL on every value node; ``gm.meta[GRAPH].mode``.
Ensures:  in a training graph, every random op on shardfx's stream (``random_draws.ON_STREAM``:
          dropout with ``0 < p < 1`` in training, bernoulli, rand, uniform, exponential, randn,
          normal) is replaced by ordinary ATen ops computing its value from an RNG input (a
          placeholder of kind RNG, ``i64[3]`` = ``[seed, step, slice]``, which the runner
          feeds), its op number (program order) and the element's global position; VAL on
          every node added. Random ops off the stream (randint, randperm, multinomial...) stay
          as they are: ``off_stream`` names them, ``print(plan)`` lists them and
          ``shardfx.testing`` refuses them. ``gm.meta[RANDOM]``: a ``RandomReport`` of both,
          when there is any. Other graphs are returned unchanged.

Eager PyTorch draws from the device's generator, one element after another, over the tensor
it sees. On a mesh each device sees a part of the tensor: dp replicas would draw the same
values for their own rows and a pipeline draws microbatch by microbatch, so the mesh would
change what a batch draws. Here each value is a pure function of (seed, step, which random
op, the element's linear index in the one-device tensor) -- ``random_draws`` -- so a model with
dropout, a router's Gumbel noise (PhiMoE's ``exponential_``) or jitter trains to the same
losses, gradients and parameters (to fp32 rounding) on one device, dp, tp, pp and ep.

The values are shardfx's own stream (as torch.compile's Inductor draws from its own RNG by
default): not eager's bit for bit, but statistically the same. ``random_draws.on_stream_eagerly``
makes eager PyTorch draw the same values, which is how ``shardfx.testing`` compares a model
with random ops against eager.

How the position is found: the pass builds ``arange(numel).view(shape)`` at the traced shape,
an ordinary replicated value. Under dp and tp, ``shard_propagate`` gives the value the
placement of the tensor it meets, so every device keeps its own part of the one-device draw
(it computes the whole index and hash, then slices: simple, and O(numel) integer work).
A pipeline traces one slice of the batch (``Options.slices``: a microbatch of one dp replica)
and the runner feeds the slice's number, so the index is ``local + slice * numel``: the
one-device index of a batch-first tensor. A random op over a tensor whose first dimension is
not the batch still draws independently per slice in a pipeline, but not one device's values.
The runner's seed is ``draw_seed``'s (``torch.manual_seed`` before ``plan.runner()``
reproduces a run), the step counts its training steps from 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from shardfx.errors import user_line
from shardfx.ir import meta as M
from shardfx.passes.random_draws import (call, draws, fmix32, is_random, keep_mask, on_stream,
                                         sample, shape_of)
from shardfx.kernels.device import collective_device
from shardfx.ir.contract import contract, holds, on_ops

aten = torch.ops.aten
RNG_NAME = "rng"  # the RNG input's name: [seed, step, slice]
_fmix32 = fmix32  # the hash's finalizer, by its old name (tests check its avalanche)
__all__ = ["call", "keep_mask", "rng_stream", "off_stream", "reads_rng", "draw_seed", "rng_value"]


@dataclass(frozen=True)
class RandomReport:
    """What ``rng_stream`` found, for ``print(plan)``: op name -> count, on the stream and off
    it (with where each off-stream op is in the user's code)."""

    on: tuple[tuple[str, int], ...]
    off: tuple[tuple[str, int], ...]
    off_where: str

    def __str__(self) -> str:
        line = "Random: " + (", ".join(f"{name} x{n}" for name, n in self.on) or "nothing")
        line += " on shardfx's stream (the same draws on any mesh)"
        if self.off:
            line += "; OFF the stream, drawn by each device's generator (a mesh does not " \
                    f"draw what one device draws): {self.off_where}"
        return line


def _drawing(gm: fx.GraphModule) -> str | None:
    """The first op of a training graph still drawing on shardfx's stream, for the contract."""
    if gm.meta[M.GRAPH].mode is not M.Mode.TRAIN:
        return None
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and is_random(n.target)
                 and draws(n.target, n.args, n.kwargs) and on_stream(n.target)), None)
    return None if node is None else node.format_node()


@contract(requires=[on_ops(M.VAL, "VAL")],
          ensures=[holds("no op of a training graph drawing on shardfx's stream left",
                         "random op", _drawing)])
def rng_stream(gm: fx.GraphModule, options) -> fx.GraphModule:
    if gm.meta[M.GRAPH].mode is not M.Mode.TRAIN:
        return gm
    drawn = [n for n in gm.graph.nodes if n.op == "call_function" and is_random(n.target)
             and draws(n.target, n.args, n.kwargs) and on_stream(n.target)]
    off = off_stream(gm)
    if off or drawn:
        gm.meta[M.RANDOM] = RandomReport(_counts(drawn), _counts(off), describe_off_stream(off))
    if not drawn:
        return gm
    rng = _rng_input(gm)
    for op, node in enumerate(drawn):
        _rewrite(gm.graph, node, rng, op)
    gm.graph.lint()
    gm.recompile()
    return gm


def _counts(nodes: list[fx.Node]) -> tuple[tuple[str, int], ...]:
    return tuple(Counter(n.target.overloadpacket.__name__ for n in nodes).items())


def off_stream(gm: fx.GraphModule) -> list[fx.Node]:
    """The random ops of a program that draw from the device's generator, not shardfx's
    stream: a mesh does not draw what one device draws there."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and is_random(n.target)
            and draws(n.target, n.args, n.kwargs) and not on_stream(n.target)]


def describe_off_stream(nodes: list[fx.Node]) -> str:
    """``exponential (2x) at file:line, ...`` for messages: each op and place once."""
    counts: dict[str, int] = {}
    for n in nodes:
        key = f"{n.target.overloadpacket.__name__} at " \
              f"{user_line(n.meta.get('stack_trace')) or n.name}"
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(k if c == 1 else k.replace(" at ", f" ({c}x) at ", 1)
                     for k, c in counts.items())


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
    """A random op -> the ATen ops of its value on the stream (``random_draws.sample``). For
    ``native_dropout``, ``(x * mask * 1/(1-p), mask)``: its getitem users are rewired to the two
    values, so ``native_dropout_backward`` stays as it is."""
    val = node.meta[M.VAL]
    first = val[0] if isinstance(val, (tuple, list)) else val
    fake = first.fake_mode
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

    shape = shape_of(node.target, node.args, lambda a: a.meta[M.VAL])
    with graph.inserting_before(node):
        value = sample(emit, node.target, node.args, node.kwargs, rng, op, shape, first.dtype,
                       first.device)
    index = next(n for n in emitted if n.target is aten.add.Tensor
                 and n.args[0].target is aten.arange.default)  # arange + slice * numel
    index._rename(f"{node.name}_index")  # names a reader of the dump can follow
    if isinstance(value, tuple):  # native_dropout: (out, mask)
        for v, what in zip(value, ("out", "mask")):
            v._rename(f"{node.name}_{what}")
        for user in list(node.users):  # getitem(native_dropout, 0 | 1)
            user.replace_all_uses_with(value[user.args[1]])
            graph.erase_node(user)
    else:
        value._rename(f"{node.name}_value")
        node.replace_all_uses_with(value)
    shaped_by = node.args[0] if isinstance(node.args[0], fx.Node) else None
    graph.erase_node(node)
    if shaped_by is not None and not shaped_by.users and \
            shaped_by.target in (aten.empty_like.default, aten.empty.memory_format):
        graph.erase_node(shaped_by)  # exponential_'s empty_like: only its shape was read


def draw_seed() -> int:
    """The seed of a runner's random stream: ``torch.initial_seed()`` (so ``torch.manual_seed``
    before ``plan.runner()`` reproduces the masks), rank 0's when torch.distributed runs, so
    every device of the mesh agrees even when the ranks were seeded apart. Collective when
    torch.distributed is initialized: call it on every rank."""
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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
