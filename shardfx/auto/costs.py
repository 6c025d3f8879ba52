"""What a strategy costs: an op's time on its local shapes, a redistribution's collectives, and
the bytes a value holds on one device, all from the plan's ``DeviceModel``.

An op runs its global work divided by the ranks of every axis on which any of its operands or
results is split or partial (an axis on which everything is replicated repeats the whole op on
each rank). A redistribution is priced axis by axis as the collective codegen emits for it
(``codegen.redistribute``): partial -> replicated an all-reduce, partial -> split a
reduce-scatter, split -> replicated an all-gather, split -> split on another dimension an
all-to-all (priced as an all-gather of the same bytes), replicated -> split a local slice (free).
A gradient's partial sum is reduced in buckets instead (``reduced_seconds``, ``bucket_latency``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.cost.device_model import DeviceModel
from shardfx.ir import meta as M
from shardfx.ir.graph import operands
from shardfx.mesh import DATA_AXES
from shardfx.cost.node import is_view, node_work


def is_split(p) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def parts(placements, sizes) -> int:
    """Into how many pieces ``placements`` cut a tensor (partial shares are whole tensors)."""
    return math.prod(n for p, n in zip(placements, sizes) if is_split(p))


def flat(out) -> list:
    """The placements tuples of a strategy's result (one, or one per tensor output)."""
    if out is None:
        return []
    if out and not isinstance(out[0], Placement):
        return [o for o in out if o is not None]
    return [out]


def work_parts(out, inputs, sizes) -> int:
    """The ranks an op's work is divided among (the module docstring)."""
    touched = set()
    for placements in [*flat(out), *(p for p in inputs if p is not None)]:
        touched |= {i for i, p in enumerate(placements) if not isinstance(p, Replicate)}
    return math.prod(sizes[i] for i in touched)


def op_seconds(node: fx.Node, out, inputs, sizes, model: DeviceModel) -> float:
    """The op's roofline on one rank: its FLOPs divided among ``work_parts``, the bytes of
    each operand and result as the rank holds it (a replicated weight is read whole by each)."""
    flops, moved, dtype = node_work(node)
    if not flops and not moved:
        return 0.0
    k = work_parts(out, inputs, sizes)
    local = _local_moved(node, out, inputs, sizes) if moved else 0.0
    return model.op_seconds(flops / k, local, dtype)


def _local_moved(node: fx.Node, out, inputs, sizes) -> float:
    """Bytes an op of the IR reads and writes on one rank: ``node_work``'s count (each
    tensor input read once, each output written once) on local shapes."""
    ops = node.all_input_nodes
    given = dict(zip(operands(node), inputs))
    moved = 0.0
    for u in ops:
        vals = u.meta.get(M.VAL)
        for v in (vals if isinstance(vals, (tuple, list)) else [vals]):
            if isinstance(v, torch.Tensor):
                moved += local_bytes(v, given.get(u) or (), sizes)
    vals = node.meta.get(M.VAL)
    vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    outs = flat(out) if out is not None else []
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor):
            moved += local_bytes(v, outs[i] if i < len(outs) and len(outs) == len(vals)
                                 else (outs[0] if len(outs) == 1 else ()), sizes)
    return moved


def fed_seconds(node: fx.Node, placements, sizes, model: DeviceModel) -> float:
    """Seconds to copy a rank's part of an input or target placeholder to it (0 for any other
    node): fed its slice, a rank copies less than fed the whole batch and slicing it, which is
    otherwise as cheap (a replicated -> split move is free)."""
    if node.op != "placeholder" or node.meta[M.ROLE].kind not in (M.InputKind.INPUT,
                                                                   M.InputKind.TARGET):
        return 0.0
    return local_bytes(node.meta[M.VAL], placements, sizes) / model.memory_bandwidth


def tensor_bytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def local_bytes(val, placements, sizes) -> float:
    return tensor_bytes(val) / parts(placements, sizes)


def redistribute_seconds(src, dst, val, axes: tuple, model: DeviceModel) -> float:
    """Seconds to take a value of global ``val`` from placements ``src`` to ``dst``."""
    if src is None or dst is None or src == dst or not isinstance(val, torch.Tensor):
        return 0.0
    sizes = [n for _, n in axes]
    total = 0.0
    now = list(src)
    for i, (a, b) in enumerate(zip(src, dst)):
        if a == b or sizes[i] == 1:
            now[i] = b
            continue
        nbytes = local_bytes(val, now, sizes)
        kind = _collective(a, b)
        if kind is not None:
            if kind == "all_gather":
                nbytes *= sizes[i]
            link = model.link_of(axes, axes[i][0])
            total += model.collective_seconds(kind, nbytes, sizes[i], link)
        now[i] = b
    return total


def reduced_seconds(src, dst, val, axes: tuple, model: DeviceModel) -> float:
    """Seconds to take a gradient from ``src`` to its parameter's placements ``dst``. Over dp
    (and HSDP's dp_replicate), none here: the ZeRO stage prices a parameter's gradient traffic (``auto.zero_stage``). A
    partial sum on another axis is all-reduced in DDP's buckets (``codegen.bucketing``): its
    bytes, and the latency of the buckets past the first shared by the bytes in them (the
    first's is ``bucket_latency``, once). Any other move is ``redistribute_seconds``'s."""
    if src is None or dst is None or src == dst or not isinstance(val, torch.Tensor):
        return 0.0
    names, sizes = [a for a, _ in axes], [n for _, n in axes]
    src = tuple(b if a in DATA_AXES else p for a, p, b in zip(names, src, dst))
    reduced = bucketed_axes(src, dst, axes)
    rest = tuple(src[i] if i in reduced else b for i, b in enumerate(dst))
    total = redistribute_seconds(src, rest, val, axes, model)
    nbytes = local_bytes(val, rest, sizes)
    for i in reduced:
        link = model.link_of(axes, names[i])
        once = model.collective_seconds("all_reduce", 0.0, sizes[i], link)
        total += model.collective_seconds("all_reduce", nbytes, sizes[i], link) - once \
            + once * nbytes / BUCKET_BYTES
    return total


def bucketed_axes(src, dst, axes: tuple) -> list[int]:
    """The axes (not dp, not dp_replicate) on which a gradient placed ``src`` is all-reduced to reach its
    parameter's ``dst``: in a bucket (``codegen.bucketing``)."""
    if src is None or dst is None:
        return []
    return [i for i, ((a, n), p, b) in enumerate(zip(axes, src, dst))
            if a not in DATA_AXES and n > 1 and isinstance(p, Partial)
            and isinstance(b, Replicate)]


def bucket_latency(i: int, axes: tuple, model: DeviceModel) -> float:
    """The latency of the first bucket of gradients reduced on axis ``i`` (the rest of each
    bucket's is in ``reduced_seconds``, by the byte). Over dp too the gradients reduced on
    both get a bucket of their own (its latency: here, the stage counts one dp bucket)."""
    names = [a for a, _ in axes]
    sizes = dict(axes)
    out = model.collective_seconds("all_reduce", 0.0, sizes[names[i]],
                                   model.link_of(axes, names[i]))
    if sizes.get("dp", 1) > 1:
        out += model.collective_seconds("all_reduce", 0.0, sizes["dp"], model.link_of(axes, "dp"))
    return out


def _collective(a, b) -> str | None:
    if isinstance(a, Partial):
        return "reduce_scatter" if is_split(b) else "all_reduce" if isinstance(b, Replicate) else None
    if is_split(a):
        return "all_gather"  # to replicated, or (as an all-to-all) to another split
    return None  # replicated -> split: a local slice; -> partial: a zero-filled share


def saved(node: fx.Node) -> bool:
    """A forward value a backward op reads, holding memory of its own from the forward to the
    backward. A view holds its base's: counted where the base is not counted already (a
    parameter's transpose is the parameter; a saved view of a saved value is that value)."""
    if not _read_in_backward(node):
        return False
    if not is_view(node):
        return True
    root = node
    while root.op == "call_function" and is_view(root) and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    return root.op != "placeholder" and not _read_in_backward(root)


def _read_in_backward(node: fx.Node) -> bool:
    if node.meta.get(M.PHASE) is not M.Phase.FORWARD:
        return False
    return any(u.meta.get(M.PHASE) is M.Phase.BACKWARD for u in node.users)
