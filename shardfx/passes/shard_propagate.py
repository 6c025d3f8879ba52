"""shard_propagate: a placement for every tensor in the joint graph, and what each op needs.

Requires: ANNOTATION on placeholders, VAL everywhere, ``options.mesh``.
Ensures:  SHARDING (NodeSharding) on every call_function node and on the output node (whose
          ``inputs`` are the placements each returned value must have: a gradient its
          parameter's, the loss and model outputs replicated).

The per-op rules are DTensor's own sharding strategies (``torch.distributed.tensor._ops``, one
file per op family), asked through its sharding propagator on a mesh that has shape but no
processes, so planning runs in one process for any mesh size. Walking the graph in program
order, each op gets its operands' current placements; the rule answers with the output
placements, the placements the operands must be redistributed to, and the op's arguments with
global shapes rewritten to local ones. We keep the answer only when every placement is one our
codegen implements (Shard, Replicate, Partial sum/avg) and every sharded dimension divides
evenly (so every rank runs the same shapes: the SPMD property); otherwise — or when no rule
exists — the op runs replicated: correct, costlier, and listed in the dump.
"""

from __future__ import annotations

import logging
import operator
from functools import lru_cache

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes

log = logging.getLogger("shardfx.passes.shard_propagate")


def shard_propagate(gm: fx.GraphModule, options) -> fx.GraphModule:
    mesh = planning_mesh(options.mesh.axes)
    spec: dict[fx.Node, object] = {}  # node -> DTensorSpec, or tuple of them for multi-output ops
    for node in gm.graph.find_nodes(op="placeholder"):
        if M.ANNOTATION in node.meta:
            spec[node] = _spec(mesh, node.meta[M.ANNOTATION], node.meta[M.VAL])
    for node in op_nodes(gm.graph):
        if node.target is operator.getitem:
            src, i = node.args
            out = spec[src][i]
            node.meta[M.SHARDING] = M.NodeSharding(out=out.placements if out else None,
                                                   inputs=(None,))
            spec[node] = out
            continue
        sharding, out = _propagate(node, spec, mesh)
        node.meta[M.SHARDING] = sharding
        spec[node] = out
    _require_outputs(gm, mesh)
    return gm


@lru_cache(maxsize=None)
def planning_mesh(axes: tuple[tuple[str, int], ...]) -> DeviceMesh:
    """A DeviceMesh with the right shape and names but no process groups: rules need only that."""
    sizes = [n for _, n in axes] or [1]
    names = tuple(a for a, _ in axes) or ("dp",)
    return DeviceMesh("cpu", torch.arange(max(1, torch.Size(sizes).numel())).view(sizes),
                      mesh_dim_names=names, _init_backend=False, _rank=0)


def _spec(mesh: DeviceMesh, placements: M.Placements, val: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), TensorMeta(val.shape, val.stride(), val.dtype))


def _propagate(node: fx.Node, spec: dict, mesh: DeviceMesh):
    operands = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    schema = OpSchema(node.target, *pytree.tree_map_only(fx.Node, lambda n: spec[n],
                                                        (node.args, node.kwargs)))
    try:
        result = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding(schema)
    except Exception as e:  # no rule, or a rule that cannot take these placements
        log.debug("%s: no sharding rule (%s); replicated", node.name, e)
        return _replicated(node, operands, mesh)
    target = schema
    if result.needs_redistribute and result.redistribute_schema is not None:
        target = result.redistribute_schema
    target_specs = [a for a in pytree.tree_leaves((target.args_schema, target.kwargs_schema))
                    if isinstance(a, DTensorSpec)]
    out_specs = result.output_spec
    if len(target_specs) != len(operands) or not _supported(node, out_specs, target_specs):
        return _replicated(node, operands, mesh)
    local_args = local_kwargs = None
    if result.use_val_from_redistribute_schema:
        local_args, local_kwargs = _localize(node, target)
    out = tuple(s.placements if s is not None else None for s in out_specs) \
        if isinstance(out_specs, (tuple, list)) else out_specs.placements
    sharding = M.NodeSharding(out=out, inputs=tuple(s.placements for s in target_specs),
                              local_args=local_args, local_kwargs=local_kwargs)
    return sharding, _with_meta(mesh, out_specs, node.meta[M.VAL])


def _replicated(node: fx.Node, operands: list[fx.Node], mesh: DeviceMesh):
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    val = node.meta[M.VAL]
    if isinstance(val, (tuple, list)):
        out = tuple(rep if isinstance(v, torch.Tensor) else None for v in val)
        specs = tuple(_spec(mesh, rep, v) if isinstance(v, torch.Tensor) else None for v in val)
    else:
        out = rep
        specs = _spec(mesh, rep, val) if isinstance(val, torch.Tensor) else None
    sharding = M.NodeSharding(out=out, inputs=tuple(rep for _ in operands), replicated=True)
    return sharding, specs


def _with_meta(mesh, out_specs, val):
    """Output specs carrying the tensor metadata the next rules read."""
    if isinstance(out_specs, (tuple, list)):
        return tuple(_spec(mesh, s.placements, v) if s is not None and isinstance(v, torch.Tensor)
                     else None for s, v in zip(out_specs, val))
    return _spec(mesh, out_specs.placements, val)


def _supported(node: fx.Node, out_specs, target_specs: list[DTensorSpec]) -> bool:
    """Only placements codegen implements, and only even shards (same shapes on every rank)."""
    outs = out_specs if isinstance(out_specs, (tuple, list)) else [out_specs]
    vals = node.meta[M.VAL] if isinstance(node.meta[M.VAL], (tuple, list)) else [node.meta[M.VAL]]
    pairs = [(s, tuple(v.shape)) for s, v in zip(outs, vals)
             if s is not None and isinstance(v, torch.Tensor)]
    pairs += [(s, tuple(s.tensor_meta.shape)) for s in target_specs]
    for s, shape in pairs:
        for p, n in zip(s.placements, s.mesh.shape):
            if type(p) is Shard:
                if shape[p.dim] % n:
                    return False
            elif type(p) is Partial:
                if p.reduce_op not in ("sum", "avg"):
                    return False
            elif type(p) is not Replicate:
                return False
    return True


def _localize(node: fx.Node, target: OpSchema) -> tuple[tuple, dict]:
    """The rule's rewritten arguments, with our nodes back in place of its specs."""
    operands = iter(a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node))
    args, kwargs = pytree.tree_map_only(DTensorSpec, lambda _: next(operands),
                                        (tuple(target.args_schema), dict(target.kwargs_schema)))
    return args, kwargs


def _require_outputs(gm: fx.GraphModule, mesh: DeviceMesh) -> None:
    """Each returned value's required placement: a gradient matches its parameter."""
    rep = tuple(Replicate() for _ in range(mesh.ndim))
    params = {n.meta[M.ROLE].name: n.meta[M.ANNOTATION] for n in gm.graph.find_nodes(op="placeholder")
              if M.ANNOTATION in n.meta}
    out = gm.graph.output_node()
    need = tuple(params[r.name] if r.kind in (M.OutputKind.GRAD, M.OutputKind.BUFFER_UPDATE) else rep
                 for r in out.meta[M.OUTPUTS])
    out.meta[M.SHARDING] = M.NodeSharding(out=(), inputs=need)
