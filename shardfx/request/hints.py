"""Markers written in the model: ``shardfx.shard_hint(x, {"tp": Shard(1)})`` and
``x = shardfx.pipe_split(x)``.

A hint is a custom op (``shardfx::shard_hint``), an identity that torch.export and the joint
trace keep as a node (STYLE 7: annotations are marker ops in the graph, so tracing and dead-code
elimination keep them). ``shard_propagate`` redistributes the hinted value to the placements
asked for, on the axes named (other axes are left to the rules); codegen then drops the node.
On one device, or when the model runs eagerly, a hint does nothing but copy its input.

    def forward(self, x):                       # (B, T, C)
        h = self.up(x)                          # (B, T, 4C)
        h = shardfx.shard_hint(h, {"tp": Shard(2)})
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard

from shardfx.errors import ShardingError, user_line


@torch.library.custom_op("shardfx::shard_hint", mutates_args=())
def _shard_hint(x: torch.Tensor, placements: str) -> torch.Tensor:
    return x.clone()


@_shard_hint.register_fake
def _(x: torch.Tensor, placements: str) -> torch.Tensor:
    return torch.empty_like(x)


_shard_hint.register_autograd(lambda ctx, grad: (grad, None))

HINT = torch.ops.shardfx.shard_hint.default


@torch.library.custom_op("shardfx::pipe_split", mutates_args=())
def _pipe_split(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_pipe_split.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_pipe_split.register_autograd(lambda ctx, grad: grad)

PIPE_SPLIT = torch.ops.shardfx.pipe_split.default
MARKERS = (HINT, PIPE_SPLIT)


def pipe_split(x: torch.Tensor) -> torch.Tensor:
    """Cut the pipeline here: ops after this point (in forward order) run in the next stage.
    Returns ``x``; use the result, so tracing keeps the marker where you put it."""
    return PIPE_SPLIT(x)


def shard_hint(x: torch.Tensor, placements: dict[str, Placement]) -> torch.Tensor:
    """Ask that ``x`` have ``placements`` ({mesh axis: Shard(dim) | Replicate()}) here."""
    return HINT(x, encode(placements))


def encode(placements: dict[str, Placement]) -> str:
    parts = []
    for axis, p in placements.items():
        if type(p) is Shard:
            parts.append(f"{axis}=S({p.dim})")
        elif type(p) is Replicate:
            parts.append(f"{axis}=R")
        else:
            raise ShardingError(f"shard_hint takes Shard(dim) or Replicate(), got {p!r}",
                                where=f"shard_hint(..., {{{axis!r}: {p!r}}})",
                                fix="hint Shard(dim) or Replicate() per mesh axis")
    return ",".join(parts)


def decode(text: str, axes: list[str], where: str) -> dict[int, Placement]:
    """``"tp=S(1)"`` -> {index of tp in the mesh: Shard(1)}; unknown axes are an error."""
    out = {}
    for axis, p in _parts(text):
        if axis not in axes:
            raise ShardingError(f"shard_hint names mesh axis {axis!r}, which the mesh lacks",
                                where=where, fix=f"use one of {', '.join(axes)}, or drop the hint")
        m = re.fullmatch(r"S\((-?\d+)\)", p)
        out[axes.index(axis)] = Shard(int(m[1])) if m else Replicate()
    return out


def _parts(text: str) -> list[tuple[str, str]]:
    """``"dp=R,tp=S(1)"`` -> [("dp", "R"), ("tp", "S(1)")]."""
    return [(axis, p) for axis, _, p in (part.partition("=") for part in text.split(",") if part)]


def check_hint_axes(gm: fx.GraphModule, sharded: list[str], mesh: list[str]) -> None:
    """Every hint in ``gm`` names axes that tensors are sharded over (``sharded``: the whole
    mesh, or tp alone inside a pipeline's stages); else a ShardingError at the user's line (the
    node's ``stack_trace``). Run before planning, where that line is still known."""
    for node in gm.graph.find_nodes(op="call_function", target=HINT):
        for axis, _ in _parts(node.args[1]):
            if axis in sharded:
                continue
            why = "which the mesh lacks" if axis not in mesh else \
                "but a pipeline's stages are sharded over tp only"
            line = user_line(node.meta.get("stack_trace"))
            raise ShardingError(f"shard_hint names mesh axis {axis!r}, {why}",
                                where=f"shard_hint at {line or node.name}",
                                fix=f"hint one of {', '.join(sharded)}, or drop the hint")


def strip_hints(graph: fx.Graph) -> None:
    """Replace every marker by its input (once planned, they have done their work)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in MARKERS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
