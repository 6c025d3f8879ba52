"""codegen.stages: the joint graph split into per-stage forward, backward-input and backward-weight
programs, the units a pipeline schedule runs (``0F1``, ``0B1``, ``0W1``).

Requires: STAGE and PHASE on every op.
Ensures:  ``split_stages(gm)`` returns a GraphModule whose body calls one submodule per
          (stage, part), every forward first, then the backward parts in an order their
          data allows (torch.fx's ``split_module`` orders them by what each reads, so a stage's
          W may come after an earlier stage's B; the runner follows the schedule, not this
          order). Running it computes exactly what ``gm`` computes: the
          same nodes, regrouped (torch.fx's ``split_module`` finds each part's inputs and
          outputs). Submodules are named ``stage{s}_{F|B|W}``. Every part returns a tuple of
          its outputs, however many it has, and only tensors pass from part to part: an element
          of a multi-output op's result (``getitem``) is taken in the part that runs the op.

The backward of a stage is split as zero-bubble schedules need (Qi et al. 2023): B is the chain
of activation gradients, down to the gradient the previous stage is sent; W is the weight
gradients hanging off that chain, which a schedule may defer to fill bubbles.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from shardfx.errors import PassError
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.schedule import GENERATORS, Schedule

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
    An element of a multi-output op's result goes where the op goes (``_runs_with``).
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
    for node in ops:
        part[node] = part[_runs_with(node)]
    return part


def _runs_with(node: fx.Node) -> fx.Node:
    """The op whose result ``node`` is an element of (``getitem(native_layer_norm, 1)``), or
    ``node`` itself. An element is taken in the part that runs its op, so what passes between
    parts (and ranks) is a tensor, never a tuple: a tuple may hold None (``convolution_backward``
    without an input gradient), cannot be sent, and keeps its unused elements alive."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node


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


def split_stages(gm: fx.GraphModule, whole_backward: bool = False) -> fx.GraphModule:
    """``whole_backward``: one B part per stage, W's ops in it in graph order (no W parts),
    for schedules that run W right after B anyway when activations are recomputed
    (``auto.remat``): a block's recomputed values then die in its own backward, where a W
    part would need every block's at once. The input gradient leaves after the whole backward
    instead of before the weight gradients."""
    stages = 1 + max(n.meta[M.STAGE] for n in op_nodes(gm.graph))
    part = backward_parts(gm)
    if whole_backward:
        part = {n: "B" if p == "W" else p for n, p in part.items()}

    def order(stage: int, kind: str) -> int:
        if kind == "F":
            return stage
        return stages + 2 * (stages - 1 - stage) + (kind == "W")

    names = {order(s, k): f"stage{s}_{k}" for s in range(stages) for k in PARTS}
    split = split_module(gm, gm, lambda n: order(_runs_with(n).meta[M.STAGE], part[n]),
                         keep_original_node_name=True, partition_affix=None,
                         tuple_return=True)  # one output is out[0], as several are
    for child_name, child in list(split.named_children()):  # submod_3 -> stage1_B
        index = int(child_name.rsplit("_", 1)[1])
        if index in names:
            split.add_submodule(names[index], child)
            delattr(split, child_name)
            for node in split.graph.find_nodes(op="call_module", target=child_name):
                node.target = names[index]
                node._rename(names[index])
    split.recompile()
    _check_tensors_between_parts(split)
    return split


def _check_tensors_between_parts(split: fx.GraphModule) -> None:
    """Every value a part returns is a tensor: what the runner stores, sends and frees."""
    for call in split.graph.find_nodes(op="call_module"):
        for value in getattr(split, call.target).graph.output_node().args[0]:
            val = value.meta.get(M.VAL)
            if not isinstance(val, torch.Tensor):
                raise PassError(
                    f"part {call.target} returns {value.name}, a {type(val).__name__}, where "
                    "parts pass tensors", where=f"codegen.stages at {value.format_node()}",
                    fix="this is a shardfx bug; report it with SHARDFX_DUMP")


def inherit_stages(gm: fx.GraphModule) -> fx.GraphModule:
    """Ops codegen inserted (collectives, reshapes, index arithmetic) take a stage and phase from
    the ops around them, so each runs in one part, after what it reads and before what reads it:

      1. an op that feeds a staged op, directly or through other inserted ops, runs just before
         the first of those (a redistribution runs where the op that asked for it does);
      2. an op that feeds only the outputs runs right after what it moves: with its latest
         source (a weight gradient reduced or gathered over tp before it is returned runs in
         the backward of the stage that made it, so in that gradient's W or B part);
      3. an op that feeds only the outputs and reads only program inputs runs in the stage
         that first reads those inputs, in the backward if it is returned as gradients only.

    Arithmetic on mesh inputs alone (``coord * 16``, where a shard starts) runs with its first
    reader.

    Requires: STAGE and PHASE on the ops of the planned graph, ROLE on placeholders, OUTPUTS
              on the output node.
    Ensures:  STAGE, PHASE on every op; PassError naming the ops no rule places."""
    ops = op_nodes(gm.graph)
    where: dict[fx.Node, tuple[int, M.Phase]] = {
        n: (n.meta[M.STAGE], n.meta[M.PHASE]) for n in ops if M.STAGE in n.meta}
    todo = [n for n in ops if n not in where]
    feeds: dict[fx.Node, tuple[int, M.Phase]] = {}  # rule 1, found from the outputs up
    for node in reversed(todo):
        ahead = [where.get(u) or feeds.get(u) for u in node.users]
        if ahead := [w for w in ahead if w is not None]:
            feeds[node] = min(ahead, key=_run_order)
    free = []  # arithmetic on mesh inputs alone (``coord * 16``), placed with its reader last
    for node in todo:  # rules 2 and 3, found from the inputs down
        srcs = [where[a] for a in node.all_input_nodes if a in where and a.op != "placeholder"]
        if node in feeds:
            where[node] = feeds[node]
        elif srcs:
            where[node] = max(srcs, key=_run_order)
        elif (first := _first_reader(node, where)) is not None:
            where[node] = first
        else:
            free.append(node)
    left = []
    for node in reversed(free):
        if readers := [where[u] for u in node.users if u in where]:
            where[node] = min(readers, key=_run_order)
        else:
            left.append(node)
    if left:
        raise PassError(
            f"cannot place {len(left)} inserted op(s) in a pipeline stage: they read no value "
            "of any stage and feed no staged op", where="codegen.stages.inherit_stages at "
            + "; ".join(n.format_node() for n in left[:4]),
            fix="this is a shardfx bug; report it with SHARDFX_DUMP")
    for node in todo:
        node.meta[M.STAGE], node.meta[M.PHASE] = where[node]
    return gm


def _run_order(where: tuple[int, M.Phase]) -> tuple[bool, int]:
    """The order parts run in: forwards by stage, then backwards from the last stage down."""
    stage, phase = where
    backward = phase is M.Phase.BACKWARD
    return backward, -stage if backward else stage


def _first_reader(node: fx.Node, where: dict) -> tuple[int, M.Phase] | None:
    """Rule 3's place: the first stage whose ops read ``node``'s program inputs (mesh inputs
    aside: every stage reads those), in the backward when every output it reaches is a
    gradient."""
    inputs = [a for a in node.all_input_nodes
              if a.op == "placeholder" and a.meta[M.ROLE].kind is not M.InputKind.MESH]
    stages = [where[u][0] for a in inputs for u in a.users if u in where]
    if not stages:
        return None
    grads = all(role.kind is M.OutputKind.GRAD for role in _returned_as(node))
    return min(stages), M.Phase.BACKWARD if grads else M.Phase.FORWARD


def _returned_as(node: fx.Node) -> list[M.OutputRole]:
    """The roles of the program outputs ``node`` reaches."""
    out, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "output":
                roles = user.meta[M.OUTPUTS]
                out += [r for v, r in zip(user.args[0], roles) if v is n]
            elif user not in seen:
                seen.add(user)
                stack.append(user)
    return out


def stage_parts(split: fx.GraphModule) -> list[str]:
    """The submodules a split graph calls, in order: ['stage0_F', 'stage1_F', 'stage1_B', ...]."""
    return [n.target for n in split.graph.nodes if n.op == "call_module"]


def whole_backward(options) -> bool:
    """A stage's backward as one part: under a memory budget, when the schedule runs W right
    after B (``codegen.stages.split_stages``)."""
    if options.memory_budget is None:
        return False
    schedule = options.schedule
    if isinstance(schedule, str) and schedule in GENERATORS:
        return schedule != "zero-bubble"  # the one generated schedule with W actions
    parsed = schedule if isinstance(schedule, Schedule) else Schedule.parse(schedule)
    return not parsed.split_backward
