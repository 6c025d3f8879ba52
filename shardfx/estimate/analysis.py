"""What a plan costs, read off the IR: node counts, parameter bytes, FLOPs and activation memory.

Requires: ROLE, OUTPUTS, PHASE, COST (after ``assign_phase`` and ``estimate_cost``).

Activation memory is a liveness walk over the program order: a tensor is live from the op that
makes it to its last reader; views add nothing of their own and keep their base alive. Parameters,
buffers and inputs are not activations. ``saved`` is what the forward leaves for the backward:
forward tensors read by a backward op (before any rematerialization).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.cost.values import readers
from shardfx.cost.node import is_view


@dataclass(frozen=True)
class Summary:
    mode: M.Mode
    model: str
    nodes: dict[str, int]  # "param", "buffer", "input", ..., "fwd op", "bwd op"
    param_count: int
    param_bytes: int
    buffer_bytes: int
    flops_fwd: int
    flops_bwd: int
    saved_bytes: int  # forward activations kept for backward
    peak_fwd_bytes: int  # peak live activations during forward
    peak_bwd_bytes: int  # peak live activations during backward (saved ones included)
    top_ops: tuple[tuple[str, int], ...]  # most frequent op types


def summarize(gm: fx.GraphModule) -> Summary:
    graph = gm.graph
    info = gm.meta[M.GRAPH]
    nodes: Counter[str] = Counter()
    param_count = param_bytes = buffer_bytes = 0
    for node in graph.find_nodes(op="placeholder"):
        role = node.meta[M.ROLE]
        nodes[str(role.kind)] += 1
        val = node.meta[M.VAL]
        if role.kind is M.InputKind.PARAM:
            param_count += val.numel()
            param_bytes += tensor_bytes(val)
        elif role.kind is M.InputKind.BUFFER:
            buffer_bytes += tensor_bytes(val)
    ops = op_nodes(graph)
    flops = Counter()
    kinds = Counter()
    for node in ops:
        phase = node.meta[M.PHASE]
        nodes[f"{phase} op"] += 1
        flops[phase] += node.meta[M.COST].flops
        kinds[getattr(node.target, "__name__", str(node.target))] += 1
    peak_fwd, peak_bwd, saved = _liveness(graph)
    return Summary(
        mode=info.mode, model=info.model, nodes=dict(nodes), param_count=param_count,
        param_bytes=param_bytes, buffer_bytes=buffer_bytes, flops_fwd=flops[M.Phase.FORWARD],
        flops_bwd=flops[M.Phase.BACKWARD], saved_bytes=saved, peak_fwd_bytes=peak_fwd,
        peak_bwd_bytes=peak_bwd, top_ops=tuple(kinds.most_common(8)),
    )


def _liveness(graph: fx.Graph, size=lambda n: n.meta[M.COST].out_bytes,
              phase=lambda n: n.meta[M.PHASE]) -> tuple[int, int, int]:
    """Peak live activation bytes in forward and in backward, and bytes saved for backward."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    base: dict[fx.Node, fx.Node] = {}  # view -> the node that owns its storage
    for node in graph.nodes:
        if node.op == "call_function" and is_view(node) and node.all_input_nodes:
            src = node.all_input_nodes[0]
            base[node] = base.get(src, src)
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for src in node.all_input_nodes:
            owner = base.get(src, src)
            last_use[owner] = max(last_use.get(owner, 0), order[node])
    live = peak_fwd = peak_bwd = saved = 0
    frees: dict[int, int] = Counter()
    for node in graph.nodes:
        i = order[node]
        if node.op == "call_function":
            nbytes = size(node)
            live += nbytes
            frees[last_use.get(node, i)] += nbytes
            if phase(node) is M.Phase.FORWARD:
                peak_fwd = max(peak_fwd, live)
                if any(u.op == "call_function" and phase(u) is M.Phase.BACKWARD
                       for u in readers(node)):
                    saved += nbytes
            else:
                peak_bwd = max(peak_bwd, live)
        live -= frees.pop(i, 0)
    return peak_fwd, peak_bwd, saved


def work_split(node: fx.Node, sizes: tuple[int, ...]) -> int:
    """Among how many devices an op's work is divided: the product of the mesh axes (``sizes``,
    in the IR's mesh order) on which it reads a shard or makes a shard or a partial sum. An op
    with no placements (one device) or none sharded runs whole on every device."""
    sharding = node.meta.get(M.SHARDING)
    if sharding is None:
        return 1
    outs = sharding.out if sharding.out and isinstance(sharding.out[0], tuple) else (sharding.out,)
    split = 1
    for axis, size in enumerate(sizes):
        placed = [p[axis] for p in (*outs, *(i for i in sharding.inputs if i)) if len(p) > axis]
        if any(isinstance(x, (Shard, Partial)) for x in placed):
            split *= size
    return split


def device_flops(gm: fx.GraphModule, stage_rank=None) -> dict[int, tuple[int, int]]:
    """Estimated FLOPs one device runs per traced batch, forward and backward: each op's cost
    divided by ``work_split``. Keyed by pp rank (``stage_rank(stage)``) on a pipeline plan,
    else ``{0: ...}``; a pipeline's rank runs this once per microbatch."""
    sizes = tuple(n for _, n in gm.meta[M.GRAPH].mesh or ())
    totals: dict[int, list[int]] = {}
    for node in op_nodes(gm.graph):
        rank = stage_rank(node.meta[M.STAGE]) if stage_rank else 0
        row = totals.setdefault(rank, [0, 0])
        backward = node.meta[M.PHASE] is not M.Phase.FORWARD
        row[backward] += node.meta[M.COST].flops // work_split(node, sizes)
    return {rank: tuple(row) for rank, row in sorted(totals.items())}


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
