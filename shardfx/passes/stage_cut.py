"""stage_cut: cut the forward into pipeline stages of balanced cost.

Requires: PHASE, COST on ops; ROLE on placeholders; ``options.stages`` (pp x virtual stages);
          ``options.device_model`` (None: the ``cpu`` preset) for the time of each op;
          torch's ``seq_nr`` on ops (the joint trace pairs each backward op with the forward op
          it differentiates by this number).
Ensures:  STAGE (0 .. stages-1) on every op and on every placeholder an op reads (a parameter
          read by several stages, like GPT-2's tied embedding and LM head, gets the first; the
          runtime sends it on). A backward op runs in the stage of the forward op it
          differentiates, or earlier when it reads a gradient made in an earlier stage: in the
          backward, values flow from later stages to earlier ones only.

With ``options.follow_stages`` (weight FQN -> the stages that read it in another plan, as an
inference graph follows its training plan) nothing is cut: each op goes to the first stage that
holds its weights and comes after its inputs (``_follow``).

Where the cuts go:
  - with ``shardfx.pipe_split(x)`` markers in the model, right after each marker: there must be
    exactly ``stages - 1`` of them;
  - otherwise where a repeated block starts (``layers.3``: the module path's first numbered
    component changes; between two transformer blocks only the residual stream crosses), or,
    for models without numbered blocks, where few bytes cross; among those, the cuts that
    minimize the most expensive stage: binary search on that cost, each stage filled greedily
    up to the farthest candidate that stays under it.
A stage's cost is an estimate of its forward and backward time: each op's
``DeviceModel.node_seconds`` on ``options.device_model`` (FLOPs at the dtype's peak, or bytes
read and written at the memory bandwidth, whichever takes longer), times three for its share of
the backward. ``stage_report`` prints each stage's cost, parameter and activation bytes, and
the tensors crossing each cut.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from shardfx.codegen.spmd import local_shape
from shardfx.cost.device_model import DeviceModel, default_model, model_of
from shardfx.errors import PipelineError
from shardfx.request.hints import PIPE_SPLIT
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.ir.contract import contract, on_inputs, on_ops

CANDIDATE_SLACK = 1.5  # a cut may carry up to this many times the cheapest cut's bytes


@contract(requires=[on_ops(M.PHASE, "PHASE"), on_ops(M.COST, "COST"), on_inputs(M.ROLE, "ROLE")],
          ensures=[on_ops(M.STAGE, "STAGE")])
def stage_cut(gm: fx.GraphModule, options) -> fx.GraphModule:
    stages = options.stages
    forward = [n for n in op_nodes(gm.graph) if n.meta[M.PHASE] is M.Phase.FORWARD]
    if options.follow_stages is not None:  # another plan's cut, by where its weights live
        _follow(gm, forward, options.follow_stages)
        return gm
    if stages <= 1:
        cuts: list[int] = []
    elif markers := [i for i, n in enumerate(forward) if n.target is PIPE_SPLIT]:
        if len(markers) != stages - 1:
            raise PipelineError(
                f"the model has {len(markers)} pipe_split markers but the plan needs "
                f"{stages - 1} cuts for {stages} stages",
                where=", ".join(forward[i].name for i in markers),
                fix=f"place exactly {stages - 1} pipe_split markers, or none to let shardfx "
                "choose the cuts")
        cuts = [i + 1 for i in markers]
        for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(forward)])):
            if not any(n.target is not PIPE_SPLIT for n in forward[a:b]):
                raise PipelineError(
                    f"pipe_split markers leave stage {k} without any op",
                    where=", ".join(forward[i].name for i in markers),
                    fix="put work between markers, and none at the very start or end of forward")
    else:
        cuts = _balanced_cuts(forward, stages, default_model(options))
    bounds = [0, *cuts, len(forward)]
    for s in range(stages if stages > 1 else 1):
        for node in forward[bounds[s]:bounds[s + 1]]:
            node.meta[M.STAGE] = s
    _backward_stages(gm, forward)
    for node in gm.graph.find_nodes(op="placeholder"):
        used = [u.meta[M.STAGE] for u in node.users if M.STAGE in u.meta]
        if used:
            node.meta[M.STAGE] = min(used)
    return gm


def _follow(gm: fx.GraphModule, forward: list[fx.Node], readers: dict[str, tuple[int, ...]]):
    """Stages that keep every parameter and buffer where another plan of the same model (its
    training plan) reads it: each op runs in the first stage, not before its inputs' stages,
    that holds the weights it reads; an op of weights alone (``t(W)``, a cast) runs where its
    first reader does. The forward of a model is the same dataflow in both graphs, so no op
    lands where its weights are not."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    held = {n: set(readers[n.meta[M.ROLE].name]) for n in placeholders
            if n.meta[M.ROLE].kind in (M.InputKind.PARAM, M.InputKind.BUFFER)
            and n.meta[M.ROLE].name in readers}
    for node in forward:
        inputs = node.all_input_nodes
        weights = [held[a] for a in inputs if a in held]
        allowed = set.intersection(*weights) if weights else None
        if inputs and len(weights) == len(inputs):
            held[node] = allowed  # weights alone: placed below, by its readers
            continue
        lo = max((a.meta[M.STAGE] for a in inputs if a.op != "placeholder" and a not in held),
                 default=0)
        fits = [lo] if allowed is None else sorted(s for s in allowed if s >= lo)
        if not fits:
            raise PipelineError(
                f"{node.name} reads weights held by stages {sorted(allowed)} but its inputs are "
                f"made in stage {lo}", where=node.name,
                fix="plan inference on its own: shardfx.partition(model, args, mesh=...) "
                    "without loss_fn")
        node.meta[M.STAGE] = fits[0]
    for node in reversed(forward):
        if M.STAGE not in node.meta:
            used = [u.meta[M.STAGE] for u in node.users if M.STAGE in u.meta]
            node.meta[M.STAGE] = min(used) if used else min(held[node])
    for node in placeholders:
        used = [u.meta[M.STAGE] for u in node.users if M.STAGE in u.meta]
        if used:
            node.meta[M.STAGE] = min(used)


def weight_stages(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Parameter and buffer FQN -> the stages whose forward reads it (``follow_stages``)."""
    out = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        role = node.meta[M.ROLE]
        if role.kind in (M.InputKind.PARAM, M.InputKind.BUFFER):
            stages = {u.meta[M.STAGE] for u in node.users
                      if u.meta.get(M.PHASE) is M.Phase.FORWARD and M.STAGE in u.meta}
            out[role.name] = tuple(sorted(stages))
    return out


def _backward_stages(gm: fx.GraphModule, forward: list[fx.Node]) -> None:
    of_seq = {}
    for node in forward:
        if "seq_nr" in node.meta:
            of_seq.setdefault(node.meta["seq_nr"], node.meta[M.STAGE])
    last = max((n.meta[M.STAGE] for n in forward), default=0)
    weights_only = []  # backward ops of no forward op that read only inputs (t(W), a cast)
    for node in op_nodes(gm.graph):
        if node.meta[M.PHASE] is not M.Phase.BACKWARD:
            continue
        stage = of_seq.get(node.meta.get("seq_nr"))
        from_bwd = [a.meta[M.STAGE] for a in node.all_input_nodes
                    if a.meta.get(M.PHASE) is M.Phase.BACKWARD and M.STAGE in a.meta]
        if stage is None:  # not paired with a forward op: where what it reads is made
            made = [a.meta[M.STAGE] for a in node.all_input_nodes
                    if a.meta.get(M.PHASE) is M.Phase.FORWARD and M.STAGE in a.meta]
            if not made and not from_bwd:
                weights_only.append(node)
                continue
            stage = max(made, default=last)
        node.meta[M.STAGE] = min([stage, *from_bwd])
    for node in reversed(weights_only):  # where its first reader runs
        used = [u.meta[M.STAGE] for u in node.users if M.STAGE in u.meta]
        node.meta[M.STAGE] = min(used, default=last)


def node_time(node: fx.Node, model: DeviceModel) -> float:
    """Estimated seconds of a forward op on ``model`` and of its share of the backward (about
    twice the forward)."""
    return 3 * model.node_seconds(node)


def crossing_bytes(forward: list[fx.Node]) -> list[int]:
    """Bytes of values made before position i and read at or after it, for each position."""
    where = {n: i for i, n in enumerate(forward)}
    delta = [0] * (len(forward) + 1)
    for i, node in enumerate(forward):
        uses = [where[u] for u in node.users if u in where]
        if uses and max(uses) > i:
            size = tensor_bytes(node)  # a view crosses with its data, whatever COST counts
            delta[i + 1] += size
            delta[max(uses) + 1] -= size
    out, running = [], 0
    for d in delta[:-1]:
        running += d
        out.append(running)
    return out


def tensor_bytes(node: fx.Node) -> int:
    vals = node.meta[M.VAL] if isinstance(node.meta[M.VAL], (tuple, list)) else [node.meta[M.VAL]]
    return sum(v.numel() * v.element_size() for v in vals if hasattr(v, "numel"))


def block_of(node: fx.Node) -> str | None:
    """``model.layers.3`` for any op inside that block: the module path up to its first number."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return block_of_path(list(stack.values())[-1][0])


def block_of_path(path: str) -> str | None:
    """``model.layers.3`` of ``model.layers.3.mlp``: a module path up to its first number."""
    parts = path.split(".")
    numbered = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[:numbered[0] + 1]) if numbered else None


def _candidates(forward: list[fx.Node]) -> list[int]:
    blocks = [block_of(n) for n in forward]
    starts = [i for i in range(1, len(forward))
              if blocks[i] is not None and blocks[i] != blocks[i - 1]
              and blocks[i] not in blocks[:i]]  # a block starts (not resumed after a detour)
    if starts:
        return starts
    crossing = crossing_bytes(forward)
    if len(crossing) < 2:
        return []
    cheapest = min(crossing[1:])
    return [i for i in range(1, len(forward)) if crossing[i] <= CANDIDATE_SLACK * cheapest]


def _balanced_cuts(forward: list[fx.Node], stages: int, model: DeviceModel) -> list[int]:
    candidates = _candidates(forward)
    if len(candidates) < stages - 1:
        raise _too_many(stages, len(candidates))
    prefix = [0.0]
    for node in forward:
        prefix.append(prefix[-1] + node_time(node, model))
    lo, hi = max(prefix[i + 1] - prefix[i] for i in range(len(forward))), prefix[-1]
    best = _greedy(candidates, prefix, stages, hi)
    for _ in range(50):  # binary search on the largest stage cost
        mid = (lo + hi) / 2
        cuts = _greedy(candidates, prefix, stages, mid)
        if cuts is None:
            lo = mid
        else:
            best, hi = cuts, mid
    if best is None:
        raise _too_many(stages, len(candidates))
    return best


def _greedy(candidates: list[int], prefix: list[float], stages: int, limit: float):
    """Cut positions so every stage costs at most ``limit``, or None if that cannot be done."""
    cuts, start = [], 0
    for k in range(stages - 1):
        last = candidates[len(candidates) - (stages - 2 - k) - 1]  # leave one per later cut
        fits = [c for c in candidates
                if start < c <= last and prefix[c] - prefix[start] <= limit]
        if not fits:
            return None
        start = max(fits)
        cuts.append(start)
    if prefix[-1] - prefix[start] > limit:
        return None
    return cuts


def _too_many(stages: int, cut_points: int) -> PipelineError:
    return PipelineError(
        f"cannot cut the model into {stages} stages: it has {cut_points} places where a cut "
        "passes little data (between layers)",
        where="passes.stage_cut",
        fix=f"use at most {cut_points + 1} pipeline stages, or mark cuts with shardfx.pipe_split")


def _local_bytes(val, placements, axes) -> int:
    """Bytes of this device's shard of a tensor placed so on the mesh ``axes``."""
    return math.prod(local_shape(val.shape, placements, axes)) * val.element_size()


def stage_report(gm: fx.GraphModule) -> list[dict]:
    """Per stage: forward ops, estimated time (on the IR's device model, ``model_of``),
    parameter bytes, activation bytes one microbatch leaves for the backward, and what it sends
    to later stages. Bytes are per device: a stage sharded over tp holds its shards
    (placements from shard_propagate)."""
    axes = gm.meta[M.GRAPH].mesh
    model = model_of(gm)
    rows: dict[int, dict] = {}
    for node in gm.graph.nodes:
        if M.STAGE not in node.meta:
            continue
        row = rows.setdefault(node.meta[M.STAGE], {"ops": 0, "time": 0.0, "param_bytes": 0,
                                                   "saved_bytes": 0, "sends": []})
        if node.op == "placeholder":
            if node.meta[M.ROLE].kind is M.InputKind.PARAM:
                row["param_bytes"] += _local_bytes(node.meta[M.VAL],
                                                   node.meta.get(M.ANNOTATION, ()), axes)
            continue
        if node.meta[M.PHASE] is not M.Phase.FORWARD:
            continue
        row["ops"] += 1
        row["time"] += node_time(node, model)
        if any(u.meta.get(M.PHASE) is M.Phase.BACKWARD for u in node.users):
            saved = node.meta[M.COST].out_bytes  # kept for the backward; views own nothing
            sharding, val = node.meta.get(M.SHARDING), node.meta[M.VAL]
            if saved and sharding is not None and isinstance(val, torch.Tensor):
                saved = _local_bytes(val, sharding.out, axes)  # this device's shard
            row["saved_bytes"] += saved
        later = {u.meta[M.STAGE] for u in node.users if u.meta.get(M.STAGE, -1) > node.meta[M.STAGE]}
        if later:
            row["sends"].append((node.name, tensor_bytes(node), sorted(later)))
    return [rows[s] | {"stage": s} for s in sorted(rows)]
