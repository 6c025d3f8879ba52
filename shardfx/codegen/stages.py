"""codegen.stages: the joint graph split into per-stage forward, backward-input and backward-weight
programs, the units a pipeline schedule runs (``0F1``, ``0B1``, ``0W1``).

Requires: STAGE and PHASE on every op.
Ensures:  ``split_stages(gm)`` returns a GraphModule whose body calls one submodule per
          (stage, part) in an order every schedule respects: F0 .. F(S-1), then for s from the
          last stage down, B(s) and W(s). Running it computes exactly what ``gm`` computes: the
          same nodes, regrouped (torch.fx's ``split_module`` finds each part's inputs and
          outputs). Submodules are named ``stage{s}_{F|B|W}``.

The backward of a stage is split as zero-bubble schedules need: B is what the gradient sent to
the previous stage depends on (the input gradient); W is the rest of that stage's backward
(the weight gradients), which a schedule may defer to fill bubbles.
"""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes

PARTS = ("F", "B", "W")


def backward_parts(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each op's part: F for forward ops; for a stage's backward ops, B if a gradient sent to an
    earlier stage (or the gradient of a batch input) needs it, W otherwise."""
    part: dict[fx.Node, str] = {}
    ops = op_nodes(gm.graph)
    for node in ops:
        part[node] = "F" if node.meta[M.PHASE] is M.Phase.FORWARD else "W"
    stack = []
    for node in ops:  # seeds: backward values read by an earlier stage's backward
        if part[node] == "F":
            continue
        if any(u.op == "call_function" and u.meta[M.PHASE] is M.Phase.BACKWARD
               and u.meta[M.STAGE] < node.meta[M.STAGE] for u in node.users):
            stack.append(node)
    while stack:  # ... and, within its stage, everything backward they depend on
        node = stack.pop()
        if part[node] == "B":
            continue
        part[node] = "B"
        stack.extend(a for a in node.all_input_nodes if a in part and part[a] == "W"
                     and a.meta[M.STAGE] == node.meta[M.STAGE])
    return part


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
