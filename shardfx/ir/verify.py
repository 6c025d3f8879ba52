"""``verify(gm)``: the invariants of the IR, checked after every pass in tests and debug runs.

Always:
  - the graph lints (torch.fx's own structural check);
  - ``gm.meta[GRAPH]`` is a ``GraphInfo``;
  - every placeholder has a ``ROLE``; parameter and buffer FQNs appear once;
  - a CONSTANT input has its value in ``CONSTANT``, of the shape and dtype of its ``VAL``, and
    once placed, is replicated on every mesh axis (every device holds the whole constant); no
    tensor is read with ``get_attr`` (constants are inputs);
  - every node that yields a tensor has a ``VAL`` (getitem of a tuple included);
  - the output node has one ``OUTPUTS`` role per returned value; a training graph returns
    exactly one ``LOSS`` and takes exactly one ``TANGENT``; an inference graph neither.
Once a pass has written a per-node key (``PHASE``, ``COST``), every call_function node has it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from shardfx.errors import VerifyError
from shardfx.ir import meta as M

PER_NODE_KEYS = (M.PHASE, M.COST)


def verify(gm: fx.GraphModule) -> None:
    graph = gm.graph
    try:
        graph.lint()
    except Exception as e:  # fx raises RuntimeError with the node in the message
        raise VerifyError(f"graph does not lint: {e}", where="torch.fx lint") from e
    info = gm.meta.get(M.GRAPH)
    if not isinstance(info, M.GraphInfo):
        raise VerifyError("gm.meta[GRAPH] is missing", where="graph",
                          fix="the IR must come from partitioner.capture")

    seen: dict[str, fx.Node] = {}
    kinds: dict[M.InputKind, int] = {}
    for node in graph.find_nodes(op="placeholder"):
        role = node.meta.get(M.ROLE)
        if not isinstance(role, M.InputRole):
            raise VerifyError("placeholder has no ROLE", where=node.format_node())
        kinds[role.kind] = kinds.get(role.kind, 0) + 1
        if role.kind is M.InputKind.CONSTANT:
            _verify_constant(node)
        if role.kind in (M.InputKind.PARAM, M.InputKind.BUFFER):
            if role.name in seen:
                raise VerifyError(f"{role.kind} {role.name} is bound to two placeholders",
                                  where=f"{seen[role.name].name} and {node.name}")
            seen[role.name] = node

    for node in graph.find_nodes(op="get_attr"):
        owner, _, attr = str(node.target).rpartition(".")
        if isinstance(getattr(gm.get_submodule(owner), attr, None), torch.Tensor):
            raise VerifyError("a tensor constant is read as a module attribute, not an input",
                              where=node.format_node(),
                              fix="constants are CONSTANT inputs (partitioner.capture lifts them)")

    present = {k for k in PER_NODE_KEYS if any(k in n.meta for n in graph.nodes)}
    for node in graph.nodes:
        if node.op in ("placeholder", "call_function", "get_attr") and M.VAL not in node.meta:
            raise VerifyError("node has no meta['val']", where=node.format_node(),
                              fix="a pass that inserts nodes must fill in their values "
                              "(shardfx.ir.graph.insert_op does)")
        if node.op == "call_function":
            for key in present:
                if key not in node.meta:
                    raise VerifyError(f"node lacks {key} while other nodes have it",
                                      where=node.format_node())

    out = graph.output_node()
    roles = out.meta.get(M.OUTPUTS)
    values = out.args[0]
    if roles is None or len(roles) != len(values):
        raise VerifyError(
            f"output node has {len(values)} values but "
            f"{'no' if roles is None else len(roles)} OUTPUTS roles", where=out.format_node())
    n_loss = sum(r.kind is M.OutputKind.LOSS for r in roles)
    n_tangent = kinds.get(M.InputKind.TANGENT, 0)
    want = 1 if info.mode is M.Mode.TRAIN else 0
    if n_loss != want or n_tangent != want:
        raise VerifyError(
            f"a {info.mode} graph must have {want} loss output and {want} tangent input, "
            f"has {n_loss} and {n_tangent}", where="graph inputs/outputs")


def _verify_constant(node: fx.Node) -> None:
    const, val = node.meta.get(M.CONSTANT), node.meta.get(M.VAL)
    if not isinstance(const, M.Constant) or not isinstance(const.value, torch.Tensor):
        raise VerifyError("constant input has no CONSTANT value", where=node.format_node(),
                          fix="constants come from partitioner.capture, which records the value")
    if val is not None and (const.value.shape != val.shape or const.value.dtype != val.dtype):
        raise VerifyError(f"constant value is {list(const.value.shape)} {const.value.dtype}, its "
                          f"VAL {list(val.shape)} {val.dtype}", where=node.format_node())
    placements = node.meta.get(M.ANNOTATION, ())
    if any(not isinstance(p, Replicate) for p in placements):
        raise VerifyError(f"constant placed {M.placements_str(placements)}, not replicated",
                          where=node.format_node(),
                          fix="a constant is the same on every device: annotate it Replicate()")


