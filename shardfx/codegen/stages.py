"""codegen.stages: the joint graph split into per-stage forward, backward-input and backward-weight
programs, the units a pipeline schedule runs (``0F1``, ``0B1``, ``0W1``).

Requires: STAGE and PHASE on every op.
Ensures:  ``split_stages(gm)`` returns a GraphModule whose body calls one submodule per
          (stage, part) in an order every schedule respects: F0 .. F(S-1), then for s from the
          last stage down, B(s) and W(s). Running it computes exactly what ``gm`` computes: the
          same nodes, regrouped (torch.fx's ``split_module`` finds each part's inputs and
          outputs). Submodules are named ``stage{s}_{F|B|W}``.

The backward of a stage is split as zero-bubble schedules need (Qi et al. 2023): B is the chain
of activation gradients, down to the gradient the previous stage is sent; W is the weight
gradients hanging off that chain, which a schedule may defer to fill bubbles.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes

PARTS = ("F", "B", "W")


def backward_parts(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each op's part: F for forward ops; for a stage's backward ops, B for the chain of
    activation gradients, W for the weight-gradient leaves hanging off it. This is zero-bubble's
    split: for a matmul layer ``dx = dy W^T`` is B and ``dW = x^T dy`` is W, each about one F,
    on the first stage too, where no input gradient is sent.

    An op is W when its value feeds one parameter's gradient and nothing else. It is B when it
    feeds more (several gradients, another stage, a non-gradient output), or when it carries a
    gradient through a parameter (reads a gradient and a value computed from parameters alone:
    ``dy W^T``, a norm's ``dy * weight``): that is how the chain reaches the layer below.
    """
    ops = op_nodes(gm.graph)
    part = {n: "F" if n.meta[M.PHASE] is M.Phase.FORWARD else None for n in ops}
    out = gm.graph.output_node()
    sinks_of: dict[fx.Node, set] = {}  # returned node -> the gradients it is returned as
    for value, role in zip(out.args[0], out.meta.get(M.OUTPUTS, ())):
        if isinstance(value, fx.Node):
            sinks_of.setdefault(value, set()).add(
                role.name if role.kind is M.OutputKind.GRAD else _CHAIN)
    params = _parameter_values(gm)
    feeds: dict[fx.Node, object] = {}  # backward op -> the one gradient it feeds, or _CHAIN
    for node in reversed(ops):
        if part[node] == "F":
            continue
        sinks = set(sinks_of.get(node, ()))
        for user in node.users:
            if user.op != "output":
                same = user in feeds and user.meta[M.STAGE] == node.meta[M.STAGE]
                sinks.add(feeds[user] if same else _CHAIN)
        inputs = node.all_input_nodes
        if any(a in params for a in inputs) and any(
                a.meta.get(M.PHASE) is M.Phase.BACKWARD for a in inputs):
            sinks.add(_CHAIN)  # a gradient carried through a weight: the chain goes on below
        feeds[node] = sinks.pop() if len(sinks) == 1 else _CHAIN
        part[node] = "B" if feeds[node] is _CHAIN else "W"
    return part


_CHAIN = object()  # the activation-gradient chain: what feeds more than one weight gradient


def _parameter_values(gm: fx.GraphModule) -> set[fx.Node]:
    """Parameters and the ops computed from parameters alone (``t(W)``, a cast, a view)."""
    out = {n for n in gm.graph.find_nodes(op="placeholder")
           if getattr(n.meta.get(M.ROLE), "kind", None) is M.InputKind.PARAM}
    for node in op_nodes(gm.graph):
        inputs = node.all_input_nodes
        if inputs and all(a in out for a in inputs):
            out.add(node)
    return out


def split_stages(gm: fx.GraphModule) -> fx.GraphModule:
    stages = 1 + max(n.meta[M.STAGE] for n in op_nodes(gm.graph))
    part = backward_parts(gm)

    def order(stage: int, kind: str) -> int:
        if kind == "F":
            return stage
        return stages + 2 * (stages - 1 - stage) + (kind == "W")

    names = {order(s, k): f"stage{s}_{k}" for s in range(stages) for k in PARTS}
    split = split_module(gm, gm, lambda n: order(n.meta[M.STAGE], part[n]),
                         keep_original_node_name=True,
                         partition_affix=None)
    for child_name, child in list(split.named_children()):  # submod_3 -> stage1_B
        index = int(child_name.rsplit("_", 1)[1])
        if index in names:
            split.add_submodule(names[index], child)
            delattr(split, child_name)
            for node in split.graph.find_nodes(op="call_module", target=child_name):
                node.target = names[index]
                node._rename(names[index])
    split.recompile()
    return split


def inherit_stages(gm: fx.GraphModule) -> fx.GraphModule:
    """Ops codegen inserted (collectives, reshapes) take the stage and phase of the op they feed,
    or, feeding only the outputs, of the value they move. Ensures STAGE, PHASE on every op."""
    ops = op_nodes(gm.graph)
    order = {n: i for i, n in enumerate(ops)}
    todo = [n for n in ops if M.STAGE not in n.meta]
    while todo:
        left = []
        for node in reversed(todo):  # redistribution runs just before the op that asked for it
            users = [u for u in node.users if M.STAGE in u.meta]
            srcs = [a for a in node.all_input_nodes if M.STAGE in a.meta and a.op != "placeholder"]
            if users:  # ... of the first op it feeds
                first = min(users, key=lambda u: order.get(u, len(order)))
                node.meta[M.STAGE], node.meta[M.PHASE] = first.meta[M.STAGE], first.meta[M.PHASE]
            elif srcs and all(u.op == "output" for u in node.users):  # ... or of what it returns
                last = max(srcs, key=lambda a: order[a])
                node.meta[M.STAGE], node.meta[M.PHASE] = last.meta[M.STAGE], last.meta[M.PHASE]
            else:
                left.append(node)
        if len(left) == len(todo):
            raise ValueError(f"cannot place {[n.name for n in left]} in a stage")
        todo = left[::-1]
    return gm


def stage_parts(split: fx.GraphModule) -> list[str]:
    """The submodules a split graph calls, in order: ['stage0_F', 'stage1_F', 'stage1_B', ...]."""
    return [n.target for n in split.graph.nodes if n.op == "call_module"]
