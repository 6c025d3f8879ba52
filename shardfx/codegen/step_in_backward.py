"""The optimizer's step in the backward: each block's parameters stepped as soon as their
gradients are final, the gradients freed there.

By default a step holds every gradient from the moment it is made until the optimizer has
stepped after the backward: at the end of the backward, a whole model's worth of gradients
(fp32: as much as the parameters) sits beside the optimizer's state. With
``partition(..., optimizer_in_backward=True)`` the program steps the optimizer on a group of
parameters (a repeated block's, ``model.layers.3.*``; any other parameter alone) right where the
last of their gradients is final and the last op reading them has run, and lets those
gradients go: at most the gradients of the blocks whose backward is under way exist at once
(as torchtune's ``optimizer_in_bwd`` does with autograd hooks).

``step_parameters(temporaries, names, *grads)`` is that op: ``names`` the parameters' FQNs,
``grads`` their gradients; it calls the stepper the runner installs around the program
(``stepping``), which sets ``.grad`` on those parameters alone, steps the user's optimizer
(whose step skips parameters without ``.grad``) and drops them again. ``temporaries``: the
bytes the optimizer allocates while it steps them (``cost.optimizer.optimizer_temporaries``), which the
memory model counts at the op (its ``workspace``).

Under ZeRO (``passes.zero``) the step is on this rank's rows: the stepper cuts them from a
whole gradient (zero=1) or takes the rows the program returns (zero=2, 3: after their bucket's
reduce-scatter is waited for); zero=1 and 2 gather every rank's updated rows after the
program, as without this option. A parameter is stepped only after the collectives reading it
are waited for (zero=3's all-gather in the backward reads the rows the step writes).

What stepping early rules out, each refused where it is asked (``check``): clipping by the
global norm and fp16's loss scaling need every gradient before any step; gradient accumulation
needs them summed over batches first; pipelines are not supported yet (their gradients are
summed over microbatches, final only in each stage's last microbatch's backward).

Requires: the generated program (one device, or a dp/tp mesh after ``codegen.bucketing`` and
the ZeRO passes: a gradient is final once its bucket's reduction is waited for), its outputs'
roles.
Ensures: every gradient output is None; each gradient bucket's wait (and the ops unpacking it)
right after the next bucket's reduction is issued (``wait_one_behind``); for each group of
parameters (a block's, split where its gradients are in two buckets), one ``step_parameters``
after their gradients and after the last op that reads them (through views); nothing else
changed.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import re
from typing import Callable

import torch
import torch.fx as fx

from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.cost.values import bases

c10d = torch.ops._c10d_functional

_stepper: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("stepper",
                                                                           default=None)


def step_parameters(temporaries: int, names: tuple[str, ...], *grads):
    """Step the optimizer on the parameters ``names`` with gradients ``grads`` (module
    docstring): the stepper the runner installed does it."""
    stepper = _stepper.get()
    if stepper is None:
        raise InputError("this program steps the optimizer in its backward, and no runner "
                         "installed a stepper", where="a plan made with "
                         "partition(..., optimizer_in_backward=True)",
                         fix="run it with plan.runner(optimizer)")
    stepper(names, grads)


step_parameters.workspace = lambda temporaries, names, *grads: temporaries  # memory model
step_parameters.steps_optimizer = True  # the memory model: no step after the program


@contextlib.contextmanager
def stepping(stepper: Callable[[tuple, tuple], None]):
    """Within: ``step_parameters`` calls ``stepper(names, grads)``."""
    token = _stepper.set(stepper)
    try:
        yield
    finally:
        _stepper.reset(token)


def group_of(name: str) -> str:
    """The parameters stepped together: a repeated block's (``model.layers.3``), or one."""
    match = re.match(r"(.*\.\d+)\.", name)
    return match.group(1) if match else name


def step_in_backward(module: fx.GraphModule, outputs: tuple[M.OutputRole, ...],
                     inputs: tuple[M.InputRole, ...],
                     temporaries: Callable[[list[tuple[str, fx.Node]]], int]) -> int:
    """Rewrite ``module``'s graph (module docstring); returns how many ``step_parameters`` it
    has. ``temporaries(params)``: the bytes stepping the parameters ``(FQN, placeholder)``
    allocates besides their gradients."""
    def step(names: tuple[str, ...], grads: list[fx.Node], params: list[tuple[str, fx.Node]]):
        return step_parameters, (temporaries(params), names, *grads)

    return hook_gradients(module, outputs, inputs, step, after_readers=True)


def hook_gradients(module: fx.GraphModule, outputs: tuple[M.OutputRole, ...],
                   inputs: tuple[M.InputRole, ...], hook: Callable, after_readers: bool) -> int:
    """Each group of gradients (a block's, split where they are in two buckets) handed to one
    op where the last of them is final (``after_readers``: and the last op reading their
    parameters has run), instead of being returned: ``hook(names, grads, params)`` gives the
    op's ``(target, args)``, ``params`` the group's ``(FQN, placeholder)``. Returns how many
    ops it inserted."""
    graph = module.graph
    out = graph.output_node()
    grads = {v for v, r in zip(out.args[0], outputs)
             if r.kind is M.OutputKind.GRAD and isinstance(v, fx.Node)}
    wait_one_behind(graph, grads)
    order = {n: i for i, n in enumerate(graph.nodes)}
    base = bases(graph)
    last_read: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op != "output":
            done = _finished(node)  # an async collective reads its input until its wait
            for src in node.all_input_nodes:
                last_read[base.get(src, src)] = done
    params = {r.name: n for r, n in zip(inputs, graph.find_nodes(op="placeholder"))
              if r.kind is M.InputKind.PARAM}
    groups: dict[tuple[str, fx.Node | None], list[tuple[int, str, fx.Node]]] = {}
    returned = list(out.args[0])
    for index, (value, role) in enumerate(zip(returned, outputs)):
        if role.kind is M.OutputKind.GRAD and isinstance(value, fx.Node):
            owner = base.get(value, value)  # a block's gradients in two buckets: two steps,
            bucket = owner if is_collective(owner) else None  # each freeing its bucket
            groups.setdefault((group_of(role.name), bucket), []).append(
                (index, role.name, value))
    for members in groups.values():
        after = [v for _, _, v in members]
        if after_readers:
            after += [last_read[params[name]] for _, name, _ in members
                      if params.get(name) in last_read]
        at = max(after, key=order.__getitem__)
        group = [(name, params[name]) for _, name, _ in members if name in params]
        target, args = hook(tuple(name for _, name, _ in members), [v for _, _, v in members],
                            group)
        with graph.inserting_after(at):
            op = graph.call_function(target, args)
        op.meta[M.PHASE] = M.Phase.BACKWARD
        op.meta[M.VAL] = None  # it returns nothing
        for index, _, _ in members:
            returned[index] = None
    out.args = (tuple(returned),)
    module.recompile()
    return len(groups)


# What unpacks a gradient bucket's reduced buffer into the gradients (codegen.bucketing,
# codegen.zero): moved with its wait.
_UNPACKING = {c10d.wait_tensor.default, torch.ops.aten._to_copy.default,
              torch.ops.aten.split_with_sizes.default, operator.getitem,
              torch.ops.aten.view.default, torch.ops.aten.reshape.default,
              torch.ops.aten.slice.Tensor}


def wait_one_behind(graph: fx.Graph, grads: set[fx.Node]) -> int:
    """Each gradient bucket's reduction (an all-reduce, ZeRO's reduce-scatter) waited for once
    the next bucket's is issued, with the ops unpacking its gradients moved after the wait:
    those gradients are final there, so their step and their freeing come then, not at the
    end of the backward, where ``codegen.bucketing`` waits for every bucket (nothing else
    reads a gradient; here its step does). One bucket stays in flight behind the backward's
    compute. Returns how many waits moved."""
    out = graph.output_node()
    order = {n: i for i, n in enumerate(graph.nodes)}
    buckets = []  # (collective, its wait and unpacking ops in graph order), in issue order
    for node in graph.nodes:
        if not is_collective(node) or node.target is c10d.wait_tensor.default:
            continue
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        unpacking = _unpacking(waits[0], out, order) \
            if len(node.users) == len(waits) == 1 else None
        if unpacking and grads.intersection(unpacking):
            buckets.append((node, unpacking))
    moved = 0  # (a move keeps the order of the nodes it does not move: ``order`` still holds)
    for (_, unpacking), (issued, _) in zip(buckets, buckets[1:]):
        if order[unpacking[0]] < order[issued] or any(
                order[i] > order[issued] for n in unpacking for i in n.all_input_nodes
                if i not in unpacking):
            continue  # already waited for earlier, or reads what is made later
        at = issued
        for node in unpacking:
            at.append(node)
            at = node
        moved += 1
    return moved


def _unpacking(wait: fx.Node, out: fx.Node, order: dict[fx.Node, int]
               ) -> list[fx.Node] | None:
    """``wait`` and every op after it up to the output, in graph order, if all of them only
    unpack its buffer (``_UNPACKING``); else None."""
    seen, todo = {wait}, [wait]
    while todo:
        for user in todo.pop().users:
            if user is out or user in seen:
                continue
            if user.op != "call_function" or user.target not in _UNPACKING:
                return None
            seen.add(user)
            todo.append(user)
    return sorted(seen, key=order.__getitem__)


def is_collective(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional"


def _finished(node: fx.Node) -> fx.Node:
    """Where ``node`` is done reading its inputs: an async collective (``_c10d_functional``)
    at the ``wait_tensor`` of its result; any other op where it runs."""
    if not is_collective(node) or node.target is c10d.wait_tensor.default:
        return node
    waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
    return waits[0] if waits else node


def check(options) -> None:
    """``optimizer_in_backward`` with what it cannot run with: a named error."""
    where = "partition(..., optimizer_in_backward=True)"
    if options.stages > 1:
        raise InputError("optimizer_in_backward is not supported in a pipeline yet: a "
                         "stage's gradients are summed over its microbatches, final only in "
                         "its last microbatch's backward", where=where,
                         fix="drop optimizer_in_backward, or the pp axis (zero=2 over dp "
                         "divides the gradients a pipeline holds)")
    if options.microbatches > 1:
        raise InputError(f"optimizer_in_backward with microbatches={options.microbatches}: the "
                         "gradients are summed over the microbatches, final only in the last "
                         "one's backward, after the steps would have run", where=where,
                         fix="drop optimizer_in_backward, or microbatches (a batch of fewer "
                             "rows per step)")
    if options.precision.scales_loss:
        raise InputError("optimizer_in_backward cannot run with fp16's loss scaling: an "
                         "overflow is found only once every gradient exists, after the steps",
                         where=where, fix='precision="bf16" needs no loss scale')
    if options.optimizer in (None, "none"):
        raise InputError("optimizer_in_backward with optimizer=None: there is no step to move",
                         where=where, fix='optimizer="adamw" (or the kind you will pass)')
