"""codegen.spmd: the per-device program of a sharded plan.

Requires: ROLE, ANNOTATION on placeholders; SHARDING on ops and on the output node.
Ensures:  a new GraphModule over local shapes, with explicit collectives, whose inputs are the
          local shards of the parameters and inputs plus, per mesh axis, the process-group
          name and this rank's coordinate; one program for every rank.

Walking the global graph in order, every operand is first redistributed to the placements the
op's rule asked for (``codegen.redistribute``), then the op is emitted with its arguments made
local (view sizes and the like, from the rule), layout-free as on one device (views as
reshapes, ``codegen.program.layout_free``). Every emitted node gets its local FakeTensor by
running the op on its operands' local fake values, so the program's shapes are checked as it is
built. Returned values are redistributed to what the runner expects: each gradient like its
parameter, the loss and model outputs replicated.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.codegen.expert_parallel import experts_op
from shardfx.codegen.program import RESHAPES, Program, layout_free
from shardfx.codegen.redistribute import Collective, MeshInputs, Purpose, redistribute
from shardfx.codegen.ring_attention import drop_unread_masks, ring_op
from shardfx.errors import PassError, ShardingError
from shardfx.request.hints import MARKERS
from shardfx.ir import meta as M
from shardfx.ir.graph import arg_values, fake_value, map_nodes, op_nodes, operands
from shardfx.ir.text import module_of


# One FakeTensorMode per IR: a memory budget generates an IR's program again for every
# candidate it tries, and ``fake_value`` remembers each op's value per mode.
_MODES: "weakref.WeakKeyDictionary[fx.GraphModule, FakeTensorMode]" = weakref.WeakKeyDictionary()


def generate_spmd(gm: fx.GraphModule) -> Program:
    info = gm.meta[M.GRAPH]
    graph = fx.Graph()
    if gm not in _MODES:
        _MODES[gm] = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _MODES[gm]
    env: dict[fx.Node, fx.Node] = {}
    have: dict[fx.Node, M.Placements] = {}
    log: list[Collective] = []
    moved: dict[tuple[fx.Node, M.Placements], fx.Node] = {}  # each value redistributed once

    def to(node: fx.Node, want: M.Placements | None, reason: str,
           reader: fx.Node | None = None, output: M.OutputRole | None = None) -> fx.Node:
        """``node``'s local value with placements ``want``, emitted on first use (for the op
        ``reason``, ``reader`` in the IR: its module is recorded with the collectives)."""
        if want is None or want == have[node]:
            return env[node]
        if (node, want) not in moved:
            module = (module_of(reader), str(reader.meta.get(M.PHASE, ""))) \
                if reader is not None else ("", "")
            moved[node, want] = redistribute(emit, env[node], have[node], want, mesh, reason, log,
                                             module, output)
        return moved[node, want]

    def emit(op, *args, **kwargs) -> fx.Node:
        node = graph.call_function(op, args, kwargs)
        node.meta[M.VAL] = fake_value(fake, op, args, kwargs)
        return node

    for node in gm.graph.find_nodes(op="placeholder"):
        local = graph.placeholder(node.name)
        local.meta.update({k: node.meta[k] for k in (M.ROLE, M.ANNOTATION, M.CONSTANT)
                           if k in node.meta})
        placements = node.meta.get(M.ANNOTATION, ())
        local.meta[M.VAL] = _local_fake(fake, node.meta[M.VAL], placements, info.mesh)
        env[node], have[node] = local, placements
    mesh = _mesh_inputs(graph, info.mesh)

    for node in op_nodes(gm.graph):
        try:
            _emit_op(node, emit, to, env, have, mesh, log)
        except ShardingError:  # the user's request (an attention the ring cannot run)
            raise
        except Exception as e:
            raise PassError(f"{type(e).__name__}: {e}", where=f"codegen.spmd at {node.format_node()}"
                            f" with sharding {node.meta[M.SHARDING]!r}",
                            fix="this is a shardfx bug; report it with SHARDFX_DUMP") from e

    out = gm.graph.output_node()
    wants = out.meta[M.SHARDING].inputs
    values = [to(v, want, f"return {role}", output=role)
              for v, want, role in zip(out.args[0], wants, out.meta[M.OUTPUTS])]
    graph.output(tuple(values)).meta[M.OUTPUTS] = out.meta[M.OUTPUTS]
    drop_unread_masks(graph)  # what ring attention took the place of
    for m in mesh:  # keep only the mesh inputs the program reads
        for p in (m.group, m.coord):
            if not p.users:
                graph.erase_node(p)
    layout_free(graph)  # values independent of the layouts kernels give (codegen.program)
    module = _make_graph_module(gm, graph, class_name="ShardfxSpmdProgram")
    inputs = tuple(n.meta[M.ROLE] for n in graph.find_nodes(op="placeholder"))
    return Program(module, inputs, tuple(out.meta[M.OUTPUTS]), tuple(log))


def _emit_op(node: fx.Node, emit, to, env: dict, have: dict, mesh: list[MeshInputs],
             log: list[Collective]) -> None:
    """Redistribute ``node``'s operands as its rule asks, then emit it with local arguments
    (attention split on the sequence over cp: as ring attention, ``codegen.ring_attention``;
    experts split over ep: as expert parallelism, ``codegen.expert_parallel``, whose
    collectives go to ``log``)."""
    sharding: M.NodeSharding = node.meta[M.SHARDING]
    local_operands = iter([to(a, want, node.name, node)
                           for a, want in zip(operands(node), sharding.inputs)])
    if node.target in MARKERS:  # the redistribution was the point; the op itself is identity
        env[node], have[node] = next(local_operands), sharding.out
        return
    args = sharding.local_args if sharding.local_args is not None else node.args
    kwargs = sharding.local_kwargs if sharding.local_kwargs is not None else node.kwargs
    args, kwargs = map_nodes((args, kwargs), lambda _: next(local_operands))
    target = sharding.local_op or node.target
    special = ring_op(node, sharding.inputs, mesh, args, kwargs) or \
        experts_op(node, sharding.inputs, mesh, args, kwargs)
    if special is not None:
        target, args, kwargs = special
    # A local operand may be laid out unlike the global one (redistributed, a batch slice):
    # a view becomes a reshape here, so the fake value is computed as the program will run.
    target = RESHAPES.get(target, target)
    local = emit(target, *args, **kwargs)
    local._rename(node.name)
    local.meta.update({k: node.meta[k] for k in (M.PHASE, M.STAGE, M.OFFLOAD)
                       if k in node.meta})
    env[node], have[node] = local, sharding.out
    if hasattr(target, "exchanges"):
        module = module_of(node), str(node.meta.get(M.PHASE, ""))
        log += [Collective(e.kind, e.axis, e.nbytes, f"{node.name}: experts' {e.what}", *module,
                           purpose=Purpose.EXPERTS)
                for e in target.exchanges(*arg_values(local))]


def _mesh_inputs(graph: fx.Graph, axes) -> list[MeshInputs]:
    out = []
    for axis, n in axes:
        group = graph.placeholder(f"group_{axis}")
        group.meta[M.ROLE] = M.InputRole(M.InputKind.MESH, f"group({axis})")
        group.meta[M.VAL] = f"<{axis} group>"
        coord = graph.placeholder(f"coord_{axis}")
        coord.meta[M.ROLE] = M.InputRole(M.InputKind.MESH, f"coord({axis})")
        coord.meta[M.VAL] = 0
        out.append(MeshInputs(axis, n, group, coord))
    return out


def _local_fake(fake: FakeTensorMode, val: torch.Tensor, placements: M.Placements, axes):
    with fake:
        return torch.empty(local_shape(val.shape, placements, axes), dtype=val.dtype,
                           device=val.device)


def local_shape(shape, placements: M.Placements, axes) -> tuple[int, ...]:
    shape = list(shape)
    for p, (_, n) in zip(placements, axes):
        if isinstance(p, (Shard, _StridedShard)):
            shape[p.dim] //= n
    return tuple(shape)

