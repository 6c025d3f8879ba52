"""shard_annotate: the user's sharding request becomes a placement for every graph input.

Requires: ROLE on placeholders; ``options.mesh``, ``options.shard``, ``options.module_types``.
Ensures:  ANNOTATION (one DTensor placement per mesh axis) on every tensor placeholder.

``shard`` is one of
  - ``"replicate"``: every parameter replicated (pure data parallel);
  - ``"megatron"``: Megatron-LM's tensor-parallel plan on the ``tp`` axis, found by module
    name: attention q/k/v and MLP gate/up/fc projections column-parallel (output features
    sharded), attention output and MLP down projections row-parallel (input features sharded);
    embeddings and the LM head replicated; everything else replicated;
  - ``"megatron-sp"``: the same parameters, with Megatron's sequence parallelism (Korthikanti
    et al. 2022): the inputs and targets are also split on their sequence dimension (dim 1)
    over ``tp``, so the embedding, norms, dropout and residual adds run on each rank's part
    of the sequence; ``shard_propagate`` turns a row-parallel output's all-reduce into a
    reduce-scatter onto that split, and a column-parallel input is all-gathered;
  - ``"auto"``: every parameter replicated here; ``auto_shard`` (the solver) then decides
    them, with every op's placement;
  - ``{glob: placements}``: for each parameter FQN the first matching glob (``fnmatch``) gives
    its placements, one per mesh axis; unmatched parameters are replicated. A glob whose value
    is ``"auto"`` (``{"*.wq.weight": [...], "*": "auto"}``) leaves its parameters to the solver.
On an ``ep`` axis, each mixture-of-experts layer's expert weights (the ``shardfx::experts`` op's
``w_in`` and ``w_out``, (E, ...), and its biases where it has them) are split by expert, E/ep
on each rank, whatever ``shard`` says; everything else is replicated over ep, as over dp.
Inputs and targets are sharded on their batch dimension (dim 0) over ``dp`` and ``ep`` (dp's
part split again over ep, GShard's layout: each ep rank routes its own tokens), and those of the
first input's (batch, sequence) shape on dim 1 over ``cp`` (context parallelism) and, with
``megatron-sp``, over ``tp`` (within cp's part, when both split it); the tangent, buffers and
constants (the same on every device) are replicated.
"""

from __future__ import annotations

import fnmatch
import math
import re

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.ir import strided
from shardfx.errors import MeshError, ShardingError
from shardfx.ir import meta as M
from shardfx.kernels.expert_compute import Form
from shardfx.kernels.experts import EXPERTS
from shardfx.rules.experts import hidden_split
from shardfx.ir.contract import contract, on_inputs

# Module names (the last FQN component before .weight/.bias) of Megatron's parallel linears.
COLUMN = r"(q_proj|k_proj|v_proj|query|key|value|qkv_proj|c_attn|gate_proj|up_proj|w1|w3|c_fc|fc1|fc_in)"
ROW = r"(o_proj|out_proj|down_proj|w2|c_proj|fc2|fc_out|dense)"
# Hugging Face GPT-2 stores Conv1D weights as [in, out]: the sharded dims swap.
TRANSPOSED = ("Conv1D",)
# Column-parallel linears that are q, k and v side by side (GPT-2's c_attn, Phi-3's qkv_proj):
# where the three are equal (out = 3 x in), each rank takes its heads of each
# (``_StridedShard``, see ``shardfx.ir.strided``): the split into q, k and v needs no gather.
FUSED = r"(c_attn|qkv_proj)"


@contract(requires=[on_inputs(M.ROLE, "ROLE")],
          ensures=[on_inputs(M.ANNOTATION, "ANNOTATION")])
def shard_annotate(gm: fx.GraphModule, options) -> fx.GraphModule:
    mesh = options.mesh
    axes = [a for a, _ in mesh.axes]
    params = _param_placements(gm, options)
    if mesh.axis("ep") > 1:
        params = _experts_split(gm, params, mesh)
    sp = sequence_parallel(options)
    tokens = sequence_shape(gm) if sp or mesh.axis("cp") > 1 else None
    for node in gm.graph.find_nodes(op="placeholder"):
        role = node.meta[M.ROLE]
        if role.kind is M.InputKind.PARAM:
            placements = params.get(role.name, AUTO)  # "auto": replicated until auto_shard
            node.meta[M.ANNOTATION] = replicated(axes) if placements == AUTO else placements
        elif role.kind in (M.InputKind.INPUT, M.InputKind.TARGET):
            node.meta[M.ANNOTATION] = _batch_sharded(node, role, mesh, tokens, sp)
        elif role.kind is not M.InputKind.MESH:
            node.meta[M.ANNOTATION] = replicated(axes)
    return gm


def replicated(axes: list[str]) -> M.Placements:
    return tuple(Replicate() for _ in axes)


def sequence_parallel(options) -> bool:
    """Whether the plan splits the sequence over ``tp`` (``shard="megatron-sp"``)."""
    return options.shard == "megatron-sp" and options.mesh.axis("tp") > 1


def sequence_split(options) -> str:
    """How the plan splits each sequence, in words ('' where it does not)."""
    if options.mesh.axis("cp") > 1:
        then = (f", then over tp={options.mesh.axis('tp')} between the parallel matmuls "
                "(megatron-sp)") if sequence_parallel(options) else ""
        return (f"each sequence split over cp={options.mesh.axis('cp')} (context parallelism: "
                f"every activation on its rank's tokens, attention as a ring){then}")
    if sequence_parallel(options):
        return (f"each sequence split over tp={options.mesh.axis('tp')} between the parallel "
                "matmuls (megatron-sp: embedding, norms, dropout and residual adds on the "
                "rank's tokens)")
    return ""


def sequence_shape(gm: fx.GraphModule) -> tuple[int, int] | None:
    """(batch, sequence) of the traced tokens: the first input's first two dimensions. A value
    of this leading shape is split on dim 1 under sequence parallelism."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get(M.VAL)
        if node.meta[M.ROLE].kind is M.InputKind.INPUT and isinstance(val, torch.Tensor):
            return tuple(val.shape[:2]) if val.dim() >= 2 else None
    return None


BATCH_AXES = ("dp_replicate", "dp", "ep")  # the batch is split over these, in mesh order


def _batch_sharded(node: fx.Node, role: M.InputRole, mesh, tokens: tuple[int, int] | None,
                   sp: bool) -> M.Placements:
    """The batch over dp and ep; the sequence over cp, and under megatron-sp over tp (within
    cp's part: nested in mesh order)."""
    val = node.meta[M.VAL]
    out = []
    for axis, n in mesh.axes:
        if (axis == "cp" or axis == "tp" and sp) and tokens is not None and n > 1 and \
                tuple(val.shape[:2]) == tokens:
            out.append(_sequence_split(role, val, axis, n, mesh.axis("cp")))
            continue
        if axis not in BATCH_AXES or n == 1 or val.dim() == 0:
            out.append(Replicate())
            continue
        split = [(a, k) for a, k in mesh.axes if a in BATCH_AXES and k > 1]
        parts = math.prod(k for _, k in split)
        if val.shape[0] % parts:
            what = " x ".join(f"{a}={k}" for a, k in split)
            raise MeshError(
                f"{role.name} has batch size {val.shape[0]}, not divisible by {what}",
                where=f"{role.name} (shape {list(val.shape)})",
                fix=f"use a global batch that is a multiple of {parts}, or smaller "
                    f"{' and '.join(a for a, _ in split)}")
        out.append(Shard(0))
    return tuple(out)


def _experts_split(gm: fx.GraphModule, params: dict, mesh) -> dict[str, M.Placements]:
    """``params`` with each expert weight split by expert over ep (``expert_weights``)."""
    axes = [a for a, _ in mesh.axes]
    ep, n = axes.index("ep"), mesh.axis("ep")
    weights = expert_weights(gm)
    if not weights:
        raise MeshError(
            f"the mesh has an ep axis (ep={n}), and the model has no mixture-of-experts layer "
            "shardfx recognises", where="mesh['ep']",
            fix="drop the ep axis (use dp for those devices), or mark the model's experts with "
                "shardfx.experts(...) (docs/experts.md)")
    out = dict(params)
    for fqn, count in weights.items():
        if count % n:
            raise MeshError(
                f"{fqn} holds {count} experts, not divisible by ep={n}: each ep rank holds an "
                "equal share of every layer's experts", where=f"{fqn} ({count} experts)",
                fix=f"use an ep dividing {count}")
        given = out.get(fqn, AUTO)
        placements = list(replicated(axes) if given == AUTO else given)
        placements[ep] = Shard(0)
        out[fqn] = tuple(placements)
    return out


def expert_splits(gm: fx.GraphModule) -> dict[str, Placement]:
    """FQN -> placement on tp of each expert weight under Megatron's plan: each expert's
    intermediate dimension split, as an MLP's (``rules.experts.hidden_split``); the first
    projection's bias with it, the second's replicated (it is added once, to the sum)."""
    out = {}
    for node in gm.graph.find_nodes(op="call_function", target=EXPERTS):
        w_in, w_out, _, b_in = hidden_split(Form.from_args(node.args))
        for arg, p in zip(node.args[3:6], (w_in, w_out, b_in)):
            if (param := _param_of(arg)) is not None:
                out[param.meta[M.ROLE].name] = p
    return out


def _param_of(arg) -> fx.Node | None:
    """The parameter placeholder ``arg`` reads (through a view or a cast), if any."""
    while isinstance(arg, fx.Node) and arg.op == "call_function" and \
            len(arg.all_input_nodes) == 1:
        arg = arg.all_input_nodes[0]
    if isinstance(arg, fx.Node) and arg.op == "placeholder" and \
            arg.meta[M.ROLE].kind is M.InputKind.PARAM:
        return arg
    return None


def expert_weights(gm: fx.GraphModule) -> dict[str, int]:
    """FQN -> experts, of the parameters the graph's ``shardfx::experts`` ops read as their
    expert weights and biases."""
    out = {}
    for node in gm.graph.find_nodes(op="call_function", target=EXPERTS):
        for arg in node.args[3:7]:
            if (param := _param_of(arg)) is not None:
                out[param.meta[M.ROLE].name] = param.meta[M.VAL].shape[0]
    return out


def _sequence_split(role: M.InputRole, val, axis: str, n: int, cp: int = 1) -> Shard:
    parts = 2 * n if axis == "cp" else n * cp  # megatron-sp with cp: tp splits cp's part
    if val.shape[1] % parts:
        what = f"2*cp={parts}" if axis == "cp" else f"cp*tp={parts}" if cp > 1 else f"tp={n}"
        why = "megatron-sp splits the sequence over tp" if axis == "tp" else \
            "context parallelism gives each cp rank a front and a back chunk of the sequence, " \
            "so causal attention is the same work on every rank"
        instead = 'shard="megatron" (no sequence split)' if axis == "tp" else "a smaller cp"
        raise MeshError(
            f"{role.name} has sequence length {val.shape[1]}, not divisible by {what} ({why})",
            where=f"{role.name} (shape {list(val.shape)})",
            fix=f"use a sequence length that is a multiple of {parts} (pad it), or {instead}")
    return Shard(1)


def _param_placements(gm: fx.GraphModule, options) -> dict[str, M.Placements]:
    """FQN -> placements for the parameters the request shards; the rest are replicated (under
    "auto", until ``auto_shard`` decides them)."""
    shard, mesh = options.shard, options.mesh
    axes = [a for a, _ in mesh.axes]
    shapes = _param_shapes(gm)
    if shard in ("auto", "replicate"):
        return {}
    if shard in ("megatron", "megatron-sp"):
        request = _megatron(shapes, options.module_types, axes, expert_splits(gm))
    elif isinstance(shard, dict):
        request = _from_globs(shard, shapes, axes)
    else:
        raise ShardingError(f"unknown shard request {shard!r}", where="partition(..., shard=...)",
                            fix='use "auto", "megatron", "megatron-sp", "replicate" or '
                            "{param glob: placements}")
    for fqn, placements in request.items():
        if placements != AUTO:
            _check_divisible(fqn, shapes[fqn][0], placements, mesh)
    return request


def _param_shapes(gm: fx.GraphModule) -> dict[str, tuple]:
    return {n.meta[M.ROLE].name: (tuple(n.meta[M.VAL].shape), n.meta[M.ROLE].aliases)
            for n in gm.graph.find_nodes(op="placeholder")
            if n.meta[M.ROLE].kind is M.InputKind.PARAM}


def megatron_placements(gm: fx.GraphModule, options) -> dict[str, M.Placements]:
    """FQN -> placements of Megatron's plan by module name (``shard="megatron"``)."""
    return _megatron(_param_shapes(gm), options.module_types, [a for a, _ in options.mesh.axes],
                     expert_splits(gm))


def user_placed(gm: fx.GraphModule, options) -> dict[str, M.Placements]:
    """FQN -> placements the user gave in a ``shard={glob: placements}`` that also has "auto"
    values: the parameters ``auto_shard`` keeps as they are."""
    return {fqn: p for fqn, p in _param_placements(gm, options).items() if p != AUTO}


AUTO = "auto"  # a glob's value in ``shard={...}``: the parameters it matches are the solver's


def _from_globs(spec: dict, shapes: dict, axes: list[str]) -> dict[str, M.Placements]:
    out: dict[str, M.Placements] = {}
    for glob, placements in spec.items():
        if placements != AUTO:
            placements = _check_placements(glob, placements, axes)
        hits = [fqn for fqn, (_, aliases) in shapes.items()
                if any(fnmatch.fnmatchcase(name, glob) for name in (fqn, *aliases))]
        if not hits:
            close = sorted(shapes)[:5]
            raise ShardingError(f"shard glob {glob!r} matches no parameter",
                                where=f"shard[{glob!r}]",
                                fix=f"globs match parameter FQNs such as {', '.join(close)}")
        for fqn in hits:
            out.setdefault(fqn, placements)  # the first matching glob wins
    return out


def _check_placements(glob: str, placements, axes: list[str]) -> M.Placements:
    if isinstance(placements, Placement):
        placements = [placements]
    if isinstance(placements, str) or not isinstance(placements, (list, tuple)):
        raise ShardingError(
            f"shard[{glob!r}] is {placements!r}: a list of placements is expected, one per "
            f"mesh axis ({', '.join(axes) or 'none'})", where=f"shard[{glob!r}]",
            fix="e.g. [Replicate(), Shard(0)] with Shard and Replicate from "
            "torch.distributed.tensor")
    placements = tuple(placements)
    if len(placements) != len(axes):
        raise ShardingError(
            f"shard[{glob!r}] gives {len(placements)} placements for a mesh of {len(axes)} axes "
            f"({', '.join(axes) or 'none'})", where=f"shard[{glob!r}]",
            fix="give one placement per mesh axis, in mesh order, e.g. [Replicate(), Shard(0)]")
    for p in placements:
        if type(p) not in (Shard, Replicate, _StridedShard):
            kind = "Partial is not a parameter placement" if isinstance(p, Partial) else \
                f"unknown placement {p!r}"
            raise ShardingError(f"{kind}", where=f"shard[{glob!r}]",
                                fix="parameters take Shard(dim) or Replicate() "
                                "(from torch.distributed.tensor)")
    return placements


def _megatron(shapes: dict, module_types: dict[str, str], axes: list[str],
              experts: dict[str, Placement] | None = None) -> dict:
    if "tp" not in axes:
        return {}
    tp = axes.index("tp")
    out = {}
    for fqn, p in (experts or {}).items():  # Megatron's MLP inside each expert
        placements = [Replicate() for _ in axes]
        placements[tp] = p
        out[fqn] = tuple(placements)
    for fqn, (shape, _) in shapes.items():
        module, _, leaf = fqn.rpartition(".")
        name = module.rpartition(".")[2]
        kind = "col" if re.fullmatch(COLUMN, name) else "row" if re.fullmatch(ROW, name) else None
        if kind is None or leaf not in ("weight", "bias") or len(shape) > 2:
            continue
        transposed = module_types.get(module, "") in TRANSPOSED
        if leaf == "weight":
            dim = (0 if kind == "col" else 1) ^ int(transposed)
        elif kind == "col":
            dim = 0
        else:
            continue  # a row-parallel bias is added after the all-reduce: replicated
        placements = [Replicate() for _ in axes]
        placements[tp] = Shard(dim)
        weight = shapes.get(f"{module}.weight", (None,))[0]
        if re.fullmatch(FUSED, name) and weight is not None and len(weight) == 2 and \
                weight[int(transposed)] == 3 * weight[int(not transposed)]:  # out = 3 in
            placements[tp] = _StridedShard(dim, split_factor=3)
        out[fqn] = tuple(placements)
    return out


def _check_divisible(fqn: str, shape: tuple, placements: M.Placements, mesh) -> None:
    for (axis, n), p in zip(mesh.axes, placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        if p.dim >= len(shape) or p.dim < -len(shape):
            raise ShardingError(f"{fqn} has {len(shape)} dims; cannot shard dim {p.dim}",
                                where=f"{fqn} (shape {list(shape)})",
                                fix="shard a dimension the parameter has")
        size = shape[p.dim]
        k = strided.factor(p)  # a strided split: each of its k parts split over the axis
        if size % (n * k):
            parts = f" in {k} parts, each" if k > 1 else ""
            raise ShardingError(
                f"{fqn} dim {p.dim} has size {size}, not divisible{parts} by mesh axis "
                f"{axis}={n}",
                where=f"{fqn} (shape {list(shape)})",
                fix=f"replicate it on {axis}, shard another dim, or use a {axis} size "
                f"dividing {size}")
