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

import dataclasses
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
from torch.distributed.tensor._sharding_prop import _select_min_cost_strategy
from torch.distributed.tensor.placement_types import _StridedShard

import shardfx.rules  # noqa: F401  (registers our rules with DTensor's propagator)
from shardfx.ir import cp_layout
from shardfx.rules import attention as attention_rules, strided as strided_rules
from shardfx.errors import ShardingError, user_line
from shardfx.request.hints import HINT, PIPE_SPLIT, decode
from shardfx.ir import meta as M
from shardfx.ir.graph import hashable, map_nodes, op_nodes, operands
from shardfx.kernels.experts import EXPERTS_BACKWARD
from shardfx.passes.shard_annotate import sequence_parallel, sequence_shape
from shardfx.ir.contract import contract, on_inputs, on_ops, on_output

log = logging.getLogger("shardfx.passes.shard_propagate")


@contract(requires=[on_inputs(M.ANNOTATION, "ANNOTATION"), on_ops(M.VAL, "VAL")],
          ensures=[on_ops(M.SHARDING, "SHARDING"), on_output(M.SHARDING, "SHARDING")])
def shard_propagate(gm: fx.GraphModule, options) -> fx.GraphModule:
    mesh = planning_mesh(options.mesh.axes)
    split = _sequence_split(gm, options)
    spec: dict[fx.Node, object] = {}  # node -> DTensorSpec, or tuple of them for multi-output ops
    memo: dict = {}  # what _propagate answered, by what determines the answer
    for node in gm.graph.find_nodes(op="placeholder"):
        if M.ANNOTATION in node.meta:
            spec[node] = _spec(mesh, node.meta[M.ANNOTATION], node.meta[M.VAL])
    for node in op_nodes(gm.graph):
        if node.target is HINT:
            node.meta[M.SHARDING], spec[node] = _hint(node, spec, mesh)
            continue
        if node.target is PIPE_SPLIT:  # a marker: the value passes through as it is
            src = spec[node.args[0]]
            node.meta[M.SHARDING] = M.NodeSharding(out=src.placements, inputs=(src.placements,))
            spec[node] = src
            continue
        if node.target is operator.getitem:
            src, i = node.args
            out = spec[src][i]
            node.meta[M.SHARDING] = M.NodeSharding(out=out.placements if out else None,
                                                   inputs=(None,))
            spec[node] = out
            continue
        given = node.meta.get(M.CHOICE)  # the solver's (auto.shard)
        block = _block_key(node, given, spec)
        if block in memo:
            sharding, out = _rebound(node, *memo[block])
        else:
            sharding, out = _remembered(node, spec if given is None else chosen(node, given, mesh),
                                        mesh, memo, split)
            if block is not None:
                memo[block] = sharding, out
        node.meta[M.SHARDING] = sharding
        spec[node] = out
    _require_outputs(gm, mesh)
    _mark_chunks(gm, options.mesh)
    return gm


def _mark_chunks(gm: fx.GraphModule, mesh) -> None:
    """Every split on the cp axis, of an input, an op's result or what an op needs, as the
    balanced chunks it is (``ir.cp_layout.Chunks``): propagated as plain splits, said once."""
    names = [a for a, _ in mesh.axes]
    if mesh.axis(cp_layout.AXIS) == 1:
        return
    axis = names.index(cp_layout.AXIS)
    for node in gm.graph.nodes:
        if M.ANNOTATION in node.meta:
            node.meta[M.ANNOTATION] = cp_layout.mark(node.meta[M.ANNOTATION], axis)
        s = node.meta.get(M.SHARDING)
        if s is not None:
            node.meta[M.SHARDING] = dataclasses.replace(
                s, out=cp_layout.mark(s.out, axis),
                inputs=tuple(cp_layout.mark(p, axis) for p in s.inputs))


def chosen(node: fx.Node, given: tuple, mesh: DeviceMesh) -> dict:
    """The operands' specs with placements ``given`` (one per operand, None for a non-tensor):
    the question ``auto.candidates`` asks the rule for each strategy it prices, and the one
    asked again here with the solver's choice, so the answer is the strategy it priced."""
    return {u: _spec(mesh, p, u.meta[M.VAL])
            if p is not None and isinstance(u.meta[M.VAL], torch.Tensor) else None
            for u, p in zip(operands(node), given)}


aten = torch.ops.aten
# Ops through which a partial sum stays a partial sum at no extra cost: views, sums, additions.
CARRIES_PARTIAL = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.alias.default, aten.detach.default, aten.expand.default,
    aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.sum.dim_IntList, aten.sum.default,
    aten.mul.Scalar, aten.div.Scalar, operator.getitem,
    EXPERTS_BACKWARD,  # reads its forward's partial zs, when tp splits each expert (rules.experts)
}


@lru_cache(maxsize=None)
def planning_mesh(axes: tuple[tuple[str, int], ...]) -> DeviceMesh:
    """A DeviceMesh with the right shape and names but no process groups: rules need only that."""
    sizes = [n for _, n in axes] or [1]
    names = tuple(a for a, _ in axes) or ("dp",)
    mesh = DeviceMesh("cpu", torch.arange(max(1, torch.Size(sizes).numel())).view(sizes),
                      mesh_dim_names=names, _init_backend=False, _rank=0)
    attention_rules.planning(mesh)
    return mesh


def _spec(mesh: DeviceMesh, placements: M.Placements, val: torch.Tensor) -> DTensorSpec:
    """(A chunked split as the plain one DTensor's rules know: ``_mark_chunks`` says it again.)"""
    return DTensorSpec(mesh, tuple(map(cp_layout.plain, placements)),
                       TensorMeta(val.shape, val.stride(), val.dtype))


def _hint(node: fx.Node, spec: dict, mesh: DeviceMesh):
    """A user's shard_hint: the value takes the placements asked on the axes named."""
    src, text = node.args
    have = spec[src]
    where = f"shard_hint at {user_line(node.meta.get('stack_trace')) or node.name}"
    asked = decode(text, list(mesh.mesh_dim_names), where=where)
    want = tuple(asked.get(i, p) for i, p in enumerate(have.placements))
    val = node.meta[M.VAL]
    for (i, p), n in zip(enumerate(want), mesh.shape):
        if type(p) is Shard and val.shape[p.dim] % n:
            raise ShardingError(
                f"shard_hint asks {M.placements_str((p,))} on {mesh.mesh_dim_names[i]}={n}, "
                f"but dim {p.dim} has size {val.shape[p.dim]}",
                where=f"{where} (shape {list(val.shape)})",
                fix="hint a dimension divisible by the axis size")
    sharding = M.NodeSharding(out=want, inputs=(want,))
    return sharding, _spec(mesh, want, val)


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Sequence parallelism's rule for partial sums on ``tp`` (mesh axis ``axis``): a value of
    leading shape ``tokens`` (batch, sequence) is reduce-scattered onto its sequence dimension
    rather than all-reduced (Megatron-SP: the row-parallel output's reduction, whose result
    the norms, dropout and residual adds then split by sequence)."""

    axis: int
    tokens: tuple[int, int]

    def placement(self, i: int, s: DTensorSpec):
        """What a partial sum on mesh axis ``i`` of a value with spec ``s`` is reduced to."""
        if i == self.axis and tuple(s.tensor_meta.shape[:2]) == self.tokens and not any(
                type(p) is Shard and p.dim == 1 for p in s.placements[self.axis:]):
            return Shard(1)  # within an outer axis's split of it (cp's) if there is one
        return Replicate()

    def flattens(self, node: fx.Node) -> bool:
        """``node`` reshapes a (batch, sequence) value into one of another leading shape."""
        if node.target not in _RESHAPES or not isinstance(node.args[0], fx.Node):
            return False
        src, out = node.args[0].meta.get(M.VAL), node.meta.get(M.VAL)
        return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and \
            tuple(src.shape[:2]) == self.tokens and tuple(out.shape[:2]) != self.tokens

    def gathered(self, s: DTensorSpec) -> DTensorSpec:
        """``s`` with its sequence split on ``tp`` gathered (itself if it has none)."""
        p = s.placements[self.axis]
        if type(p) is not Shard or p.dim != 1 or tuple(s.tensor_meta.shape[:2]) != self.tokens:
            return s
        placements = tuple(Replicate() if i == self.axis else q for i, q in enumerate(s.placements))
        return DTensorSpec(s.mesh, placements, s.tensor_meta)


def _sequence_split(gm: fx.GraphModule, options) -> SequenceSplit | None:
    tokens = sequence_shape(gm) if sequence_parallel(options) else None
    if tokens is None:
        return None
    return SequenceSplit([a for a, _ in options.mesh.axes].index("tp"), tokens)


def _remembered(node: fx.Node, spec: dict, mesh: DeviceMesh, memo: dict,
                split: SequenceSplit | None = None):
    """``_propagate``'s answer, asked once per distinct (op, arguments, operand specs): the
    answer depends on nothing else, so the 80 layers of a deep model ask the rules as often as
    one does. The remembered answer's local arguments name the first node's operands; they are
    rebound to this node's, in the same order."""
    try:
        key = (node.target, hashable(map_nodes((node.args, node.kwargs), spec.__getitem__)))
        hash(key)
    except TypeError:
        return _propagate(node, spec, mesh, split)
    if key not in memo:
        memo[key] = _propagate(node, spec, mesh, split)
    return _rebound(node, *memo[key])


def _block_key(node: fx.Node, given: tuple | None, spec: dict) -> tuple | None:
    """For an op of a stamped block: its place and its operands' placements, which determine
    the answer as the full key of ``_remembered`` does (``partitioner.stamp`` proved the
    op, its other arguments and its operands' shapes the same at that place in every block),
    without making and hashing a spec per operand: most of the walk on a deep model."""
    place = node.meta.get(M.BLOCK)
    if place is None:
        return None
    if given is None:
        given = tuple(_placements(spec.get(u)) for u in operands(node))
    return ("block", place, given)


def _placements(s):
    if isinstance(s, DTensorSpec):
        return s.placements
    return tuple(map(_placements, s)) if isinstance(s, tuple) else None


def _rebound(node: fx.Node, sharding: M.NodeSharding, out):
    """A remembered answer for ``node``: its local arguments, which name the operands of the
    node first asked, rebound to ``node``'s, in the same order."""
    if sharding.local_args is None and sharding.local_kwargs is None:
        return sharding, out
    rebound = iter(operands(node))
    local_args, local_kwargs = map_nodes((sharding.local_args, sharding.local_kwargs),
                                         lambda _: next(rebound))
    return dataclasses.replace(sharding, local_args=local_args, local_kwargs=local_kwargs), out


def _propagate(node: fx.Node, spec: dict, mesh: DeviceMesh, split: SequenceSplit | None = None):
    """Ask the rule, under one policy on partial sums (P): they flow only through views, sums,
    widening casts and additions of other partial sums, and are all-reduced before any other
    op, and before the rule would split a replicated operand into partial shares to match them
    (``add(P, R)`` -> ``add(P, R/n)``). That is Megatron's placement: a row-parallel matmul's output is reduced
    once, before the residual add; a column-parallel layer's input gradient once, before the
    norm's backward. Left to itself the min-cost rule defers the reduction into every branch
    after it and pays several collectives instead of one. Under sequence parallelism
    (``split``) a partial activation is reduce-scattered onto its sequence split instead."""
    operands = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    have = {n: spec[n] for n in operands}
    flattens = split is not None and split.flattens(node)
    answer = None if flattens else _answer(node, operands, have, split)
    if answer is None and split is not None:
        # The sequence split gathered, the rest kept: the all-gather before a column-parallel
        # matmul, whose input is flattened (batch, sequence) -> tokens (with a batch of 1
        # DTensor would keep the tokens split, and gather before each matmul reading them).
        gathered = {n: split.gathered(s) for n, s in have.items()}
        if any(gathered[n] is not have[n] for n in operands):
            answer = _answer(node, operands, gathered, split)
        elif flattens:
            answer = _answer(node, operands, have, split)
    if answer is None:
        return _replicated(node, operands, mesh)
    result, target_specs, target = answer
    out_specs = result.output_spec
    local_args = local_kwargs = local_op = None
    if result.use_val_from_redistribute_schema:
        local_args, local_kwargs = _localize(node, target)
        local_op = target.op if target.op != node.target else None
    out = tuple(s.placements if s is not None else None for s in out_specs) \
        if isinstance(out_specs, (tuple, list)) else out_specs.placements
    sharding = M.NodeSharding(out=out, inputs=tuple(s.placements for s in target_specs),
                              local_args=local_args, local_kwargs=local_kwargs, local_op=local_op)
    return sharding, _with_meta(mesh, out_specs, node.meta[M.VAL])


def _answer(node: fx.Node, operands: list[fx.Node], have: dict,
            split: SequenceSplit | None):
    """The rule's answer for ``node`` with operands ``have`` under the policy on partial sums
    (``_propagate``), or None where there is no rule or codegen cannot run its answer."""
    answer = _ask(node, have)
    if answer is not None:
        axes = _replicated_to_partial(operands, have, answer[1])
        if node.target not in CARRIES_PARTIAL and not _widens(node):
            axes |= {i for n in operands for i, p in enumerate(have[n].placements)
                     if type(p) is Partial}
        if axes:
            reduced = {n: _reduce_partials(s, axes, split) for n, s in have.items()}
            answer = _ask(node, reduced) or answer
    if answer is None or not _supported(node, answer[0].output_spec, answer[1]):
        return None
    return answer


def _widens(node: fx.Node) -> bool:
    """A cast to a wider floating dtype (``passes.mixed_precision``'s bf16 gradient to fp32):
    a partial sum crosses it, so the sum is taken in the wider dtype (gradients reduced across
    dp in fp32)."""
    if node.target is not aten._to_copy.default:
        return False
    src, dst = node.args[0].meta[M.VAL].dtype, node.kwargs.get("dtype")
    return dst is not None and src.is_floating_point and dst.is_floating_point \
        and dst.itemsize > src.itemsize


def _ask(node: fx.Node, have: dict):
    """The rule for ``node`` given its operands' specs: (result, the specs each tensor operand
    must have, the schema to take local arguments from), or None without a rule. DTensor's,
    or where a strided split is made, kept or undone, ``rules.strided``'s."""
    return strided_rules.answer(node, have, _dtensor_rule) or _dtensor_rule(node, have)


def _dtensor_rule(node: fx.Node, have: dict):
    """DTensor's rule for ``node`` (``_ask``)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    # As DTensor's dispatcher builds it: plain containers, and the op's schema info, without
    # which the propagator's cache key ignores non-tensor arguments such as view sizes.
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: have[n],
                                        _plain((tuple(node.args), dict(node.kwargs))))
    info = prop.op_to_schema_info.get(node.target) or \
        prop.op_to_schema_info_for_single_dim_strategy.get(node.target)
    schema = OpSchema(node.target, args, kwargs, schema_info=info)
    if not _has_rule(prop, node.target):
        # DTensor would derive a strategy by decomposing the op, with the decomposition's
        # constants taken from global shapes; we emit the op itself on local shapes, where
        # those constants differ (mse_loss_backward's 2/numel). No rule: replicated.
        return None
    try:
        ask = prop.propagate_op_sharding_non_cached if node.target in shardfx.rules.UNCACHED \
            else prop.propagate_op_sharding  # answered unlike DTensor's dispatch: not shared
        result = ask(schema)
    except Exception as e:  # no rule, or a rule that cannot take these placements
        log.debug("%s: no sharding rule (%s); replicated", node.name, e)
        return None
    target = schema
    if result.needs_redistribute and result.redistribute_schema is not None:
        target = result.redistribute_schema
    target_specs = [a for a in pytree.tree_leaves((target.args_schema, target.kwargs_schema))
                    if isinstance(a, DTensorSpec)]
    if any(isinstance(v, DTensorSpec) for v in schema.kwargs_schema.values()):
        target_specs = _with_kwarg_inputs(prop, schema, target_specs)
    n_operands = sum(isinstance(a, fx.Node) for a in pytree.tree_leaves((node.args, node.kwargs)))
    if len(target_specs) != n_operands:
        return None
    return result, target_specs, target


def _has_rule(prop, op) -> bool:
    return op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs or \
        op in prop.op_to_rules


def _replicated_to_partial(operands: list[fx.Node], have: dict, want: list[DTensorSpec]) -> set[int]:
    """Mesh axes on which the rule turns a replicated operand into a partial one."""
    return {i for n, w in zip(operands, want)
            for i, (h, p) in enumerate(zip(have[n].placements, w.placements))
            if type(h) is Replicate and type(p) is Partial}


def _reduce_partials(s: DTensorSpec, axes: set[int],
                     split: SequenceSplit | None = None) -> DTensorSpec:
    placements = tuple((split.placement(i, s) if split else Replicate())
                       if i in axes and type(p) is Partial else p
                       for i, p in enumerate(s.placements))
    return DTensorSpec(s.mesh, placements, s.tensor_meta)


def _with_kwarg_inputs(prop, schema: OpSchema, target_specs: list[DTensorSpec]):
    """DTensor's propagator redistributes positional tensors only; a rule's requirement on a
    tensor keyword argument (``attn_mask=``) is dropped. Ask the op's strategy directly and take
    the selected strategy's placement for each keyword tensor."""
    func = prop.op_strategy_funcs.get(schema.op)
    if func is None:
        return target_specs
    chosen = _select_min_cost_strategy(func(prop._wrap_with_op_strategy(schema)), schema)
    wanted = list(chosen.input_specs or ())
    n_args = sum(isinstance(a, DTensorSpec) for a in pytree.tree_leaves(schema.args_schema))
    kw_specs = [v for v in schema.kwargs_schema.values() if isinstance(v, DTensorSpec)]
    if len(wanted) != n_args + len(kw_specs):
        return target_specs
    fixed = [DTensorSpec(k.mesh, w.placements, k.tensor_meta) for k, w in zip(kw_specs, wanted[n_args:])]
    return target_specs[:n_args] + fixed


def _plain(x):
    """fx's immutable_list/immutable_dict as the list/dict an eager call would pass."""
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


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


def _plain_shard(p) -> bool:
    """``Shard``, or a ``_StridedShard`` of split factor 1 (the same split): DTensor writes so
    the tokens flattened from (batch, sequence), one sequence per rank, the sequence split over
    ``cp`` -- and unflattens them back to the sequence split, which it could not from a
    ``Shard(0)`` nested inside dp's."""
    return type(p) is Shard or (type(p) is _StridedShard and p.split_factor == 1)


def _supported(node: fx.Node, out_specs, target_specs: list[DTensorSpec]) -> bool:
    """Only placements codegen implements: Shard, Replicate, Partial(sum|avg) (a dim may be
    split over several axes, nested in mesh order), on cp the ``_StridedShard`` of tokens
    flattened from several sequences (each one's chunks: ``cp_layout``), and on other axes a
    strided split of fused parts (``strided``); even shards only (same shapes on every
    rank)."""
    outs = out_specs if isinstance(out_specs, (tuple, list)) else [out_specs]
    vals = node.meta[M.VAL] if isinstance(node.meta[M.VAL], (tuple, list)) else [node.meta[M.VAL]]
    pairs = [(s, tuple(v.shape)) for s, v in zip(outs, vals)
             if s is not None and isinstance(v, torch.Tensor)]
    pairs += [(s, tuple(s.tensor_meta.shape)) for s in target_specs]
    for s, shape in pairs:
        size = dict(enumerate(shape))
        for p, n, axis in zip(s.placements, s.mesh.shape, s.mesh.mesh_dim_names):
            if isinstance(p, Shard) and p.dim not in size:  # a dim the value lacks: cat's
                return False  # empty 1-D operand (a cache of no keys yet) asked to split
            if type(p) is _StridedShard and axis == cp_layout.AXIS:  # sequences flattened
                if size[p.dim] % (2 * n * p.split_factor):
                    return False
                size[p.dim] //= n
            elif type(p) is _StridedShard:  # fused parts, each split
                if size[p.dim] % (n * p.split_factor):
                    return False
                size[p.dim] //= n
            elif _plain_shard(p):  # a dim on several axes: split in mesh order
                if size[p.dim] % (2 * n if axis == cp_layout.AXIS else n):  # cp: 2 chunks each
                    return False
                size[p.dim] //= n
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
