"""The memory model: what one device holds at the fullest moment of a training step, by what
holds it.

A step's memory is a walk over what runs, in the order it runs:

- **State** lives through the step: the device's parameters (its tp shards), buffers, and the
  optimizer's state (``OPTIMIZERS``: AdamW keeps two fp32 moments per parameter element, SGD
  with momentum one, plain SGD none, each with a step count).
- **A program** (one device, or the SPMD program of a dp/tp mesh) is walked op by op: a tensor
  is live from the op that makes it to its last reader (a view keeps its base alive; a
  ``reshape`` is a view only where its input's traced strides allow one, else a copy); at each
  op the live bytes are split into *gradients* (values the program returns as a parameter's
  gradient), *saved* (forward values a backward op reads: the activations), *communication*
  (collectives' and gradient buckets' buffers) and *transient* (everything else: temporaries
  inside forward and backward). The runner drops the last step's gradients before the program
  runs, so a step holds one set.
- **A pipeline rank** is walked action by action, as ``runtime.pipeline`` runs its action list
  (``shardfx.estimate.memory_pipeline``).
- **The optimizer's step** comes last (or, with ``optimizer_in_backward``, inside the program,
  a block at a time: its temporaries at each ``step_parameters`` op, the gradients gone after
  it; ``codegen.step_in_backward``): state, gradients and its own temporaries (on CPU torch
  updates one parameter at a time: two temporaries the size of a parameter, with the
  previous one's ``denom`` still bound, at the largest such pair; on
  CUDA the foreach kernels make one the size of all of them).

With ``offload_optimizer`` (``runtime.offload``) the optimizer's state, what it steps, its
gradients and its step are the host's: the device's moments hold no optimizer state, each
gradient only until its ``gradients_to_host`` op, and the step after the program none of them;
``DeviceMemory.host`` is what the host holds at that moment (its copies and the state; at the
step, the gradients and the step's temporaries, priced as torch's CPU optimizers make them),
beside the device's bytes, not in ``total``. An activation offloaded (``kernels.host_copy``:
``to_host``'s result, until ``from_host`` last reads it) is the host's too: the walk counts it
apart, and ``host`` adds the most such bytes live at once, with the gradients already handed
to the host by then.

With techniques assumed (``plan.memory_breakdown(assume=...)``: a published system's weights
kept in the compute dtype with an fp32 main copy in the optimizer, its vocabulary split over
tp, its optimizer's state over dp x cp), each value, parameter and optimizer row is counted as
that system holds it (``cost.techniques.Sizing``); without, as the program holds it.

The peak is the largest of these moments. ``shardfx.runtime.measure`` measures the same quantity (live
tensor storage) on a real step, and the tests hold the two within 5%.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from shardfx.ir import meta as M
from shardfx.ir.graph import arg_values, phases
from shardfx.cost.optimizer import (OptimizerModel, optimizer_model, optimizer_temporaries,
                                    stepped_value)
from shardfx.cost.techniques import Sizing
from shardfx.cost.values import bases, is_collective, readers, tensor_bytes, value_bytes

log = logging.getLogger("shardfx.estimate.memory")

_WAIT = torch.ops._c10d_functional.wait_tensor.default  # returns the tensor it waits for
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


KINDS = ("parameters", "buffers", "optimizer", "gradients", "saved", "transient",
         "communication")


@dataclass(frozen=True)
class DeviceMemory:
    """One device's predicted peak bytes, by what holds them at that moment."""

    parameters: int = 0
    buffers: int = 0
    optimizer: int = 0  # the optimizer's state
    gradients: int = 0
    saved: int = 0  # activations kept for the backward (all microbatches in flight)
    transient: int = 0  # temporaries: inside forward, backward, the optimizer's update
    communication: int = 0  # receive buffers, collectives' and gradient buckets' buffers
    host: int = 0  # offload_optimizer: what the host holds then (not in total); in a
    # plan's breakdown (spmd_memory), the host's own peak over the step
    when: str = ""  # the moment of the peak: "backward, at mm_12", "1B0 (stage1_B)", ...

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in KINDS)

    @property
    def state(self) -> int:
        return self.parameters + self.buffers + self.optimizer


# --- one program -------------------------------------------------------------------------------

def spmd_memory(program, options, train: bool, layouts: dict, gathers: list,
                summed: frozenset | None = None, sizing: Sizing = Sizing()) -> DeviceMemory:
    """The peak of a generated program run by ``runtime.runner`` (one device, or the SPMD
    program every device of a dp/tp mesh runs: its values have this device's local shapes),
    the fullest of ``spmd_moments``, with the host's own peak over them. ``summed``: under
    accumulation, the gradients a later microbatch's run adds into their accumulators rather
    than makes (``codegen.accumulate_into.summable``). ``sizing``: the bytes of values and
    state with the techniques assumed (``cost.techniques``; the program as is: ``Sizing()``)."""
    moments = spmd_moments(program, options, train, None, layouts, gathers, summed, sizing)
    peak = max(moments.values(), key=lambda m: m.total)  # the first of equals
    return dataclasses.replace(peak, host=max(m.host for m in moments.values()))


def spmd_moments(program, options, train: bool, moment, layouts: dict, gathers: list,
                 summed: frozenset | None = None, sizing: Sizing = Sizing()
                 ) -> dict[object, DeviceMemory]:
    """``program_moments`` of the ``program`` (``codegen.program.Program``) a plan with
    ``options`` runs. Under ZeRO the optimizer's state and, at its step, the gradients are this
    rank's rows (``layouts``: FQN -> ``ZeroShard``, ``passes.zero.zero_layouts``); stages 1 and
    2 then run ``gathers`` (the gather programs, a bucket at a time: ``runtime.zero``), as the
    compiler emitted them. With ``microbatches`` (no pp) the program runs once per microbatch,
    the gradients of the earlier ones held throughout the later ones (``summed``:
    ``spmd_memory``)."""
    later = (summed or frozenset()) if train and options.microbatches > 1 else None
    return program_moments(program.module, train, optimizer_model(options.optimizer),
                           options.device, layouts, options.zero, gathers, moment,
                           options.offload_optimizer, later, sizing)


def program_moments(program: fx.GraphModule, train: bool, optimizer: OptimizerModel,
                    device: torch.device = torch.device("cpu"), zero: dict | None = None,
                    stage: int = 0, gather: list | None = None, moment=None,
                    offload: bool = False, later: frozenset | None = None,
                    sizing: Sizing = Sizing()) -> dict[object, DeviceMemory]:
    """A program's peak in each part of a step: the program's own ops (one part, or
    one per ``moment(op)``, as ``walk_moments``), "optimizer step" and "ZeRO gather".
    ``offload``: the optimizer's state, step and gradients on the host (module docstring).
    ``later``: the program also runs again within the step (accumulation), holding every
    gradient the optimizer steps from the start, and making none of ``later`` (the gradients
    it adds into their accumulators): its peak is the moment "a later microbatch".
    ``sizing``: each value's, parameter's and optimizer row's bytes (``cost.techniques``: with
    low-precision-weights the optimizer keeps an fp32 main copy of what it steps)."""
    params, buffers, stepped = [], 0, []
    for node in program.graph.find_nodes(op="placeholder"):
        role, val = node.meta[M.ROLE], node.meta[M.VAL]
        if role.kind is M.InputKind.PARAM:
            params.append(sizing.weight(val))
            stepped.append(sizing.tensor(stepped_value(node, sizing.layout(
                (zero or {}).get(role.name)))))
        elif role.kind is M.InputKind.BUFFER:
            buffers += tensor_bytes(val)
    state = dict(parameters=sum(map(tensor_bytes, params)), buffers=buffers)
    opt_state = sizing.optimizer(stepped, optimizer) if train else 0
    offload = offload and train
    host = 0
    if offload:  # the host's copies and the state; the device's state without them
        host, opt_state = opt_state + sum(map(tensor_bytes, stepped)), 0
    kind = kind_of(program.graph)
    sent = _host_gradients(program.graph, stepped) if offload else None
    walked = {None: walk(program.graph, kind, sizing.value, sent)} if moment is None else \
        walk_moments(program.graph, kind, moment, sizing.value, sent)
    moments: dict[object, DeviceMemory] = {
        at: DeviceMemory(**state, optimizer=opt_state, **(peak | {"host": host + peak["host"]}),
                         when=when)
        for at, (peak, _, when) in walked.items()}
    if later is not None:  # a later microbatch: the earlier ones' gradients held throughout
        held = 0 if offload else sum(map(tensor_bytes, stepped))
        peak, _, when = walk(program.graph, kind,
                             lambda n: 0 if n in later else sizing.value(n), sent)
        moments["a later microbatch"] = DeviceMemory(
            **state, optimizer=opt_state, **(peak | {"gradients": peak["gradients"] + held,
                                                    "host": host + peak["host"]}),
            when=f"a later microbatch: {when}")
    in_backward = bool(_steps_in_backward(program.graph))  # no step after the program
    if offload:  # the step on the host: every gradient there, the step's temporaries
        moments["optimizer step"] = DeviceMemory(
            **state, transient=_loss_bytes(program.graph), when="optimizer step (on the host)",
            host=host + sum(map(tensor_bytes, stepped))
            + optimizer_temporaries(stepped, optimizer, torch.device("cpu")))
    elif train and optimizer.name != "none" and not in_backward:
        grads = sum(map(tensor_bytes, stepped)) if stage == 1 else \
            _graph_grads(program.graph, sizing.value)
        moments["optimizer step"] = DeviceMemory(
            **state, optimizer=opt_state, gradients=grads,
            transient=optimizer_temporaries(stepped, optimizer, device)
            + _loss_bytes(program.graph), when="optimizer step")
    if train and stage == 1 and not in_backward and not offload:  # the runner cuts this
        # rank's rows from the whole gradients, which the program returned and still holds
        # (``runner._set_grads``)
        whole = _graph_grads(program.graph, sizing.value)
        moments["ZeRO-1 rows"] = DeviceMemory(
            **state, optimizer=opt_state, gradients=whole + sum(map(tensor_bytes, stepped)),
            when="ZeRO-1: this rank's rows cut from the whole gradients")
    if train and gather:  # ZeRO-1/2: every rank's updated rows, gathered
        held = 0 if in_backward or offload else sum(map(tensor_bytes, stepped))
        moments["ZeRO gather"] = DeviceMemory(  # (stepped in the backward: gradients gone)
            **state, optimizer=opt_state, gradients=held, host=host,
            transient=zero_gather_peak(gather), when="ZeRO gather after the optimizer step")
    return moments


def _steps_in_backward(graph: fx.Graph) -> list[fx.Node]:
    """The optimizer's steps inside the program (``codegen.step_in_backward``): there the
    walk counts their temporaries (the op's ``workspace``), and there is no step after it."""
    return [n for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "steps_optimizer", False)]


def _host_gradients(graph: fx.Graph, stepped: list) -> Callable[[fx.Node], int]:
    """For ``walk_moments``: the host bytes each ``gradients_to_host`` op fills (its
    parameters' gradients, as what the optimizer steps: ZeRO's rows), from there on."""
    names = [n.meta[M.ROLE].name for n in graph.find_nodes(op="placeholder")
             if n.meta[M.ROLE].kind is M.InputKind.PARAM]
    size = dict(zip(names, map(tensor_bytes, stepped)))
    sends = set(_sent_to_host(graph))
    return lambda node: sum(size.get(name, 0) for name in node.args[1]) if node in sends else 0


def _sent_to_host(graph: fx.Graph) -> list[fx.Node]:
    """The ops handing gradients to the host (``codegen.gradients_to_host``)."""
    return [n for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "moves_to_host", False)]


def zero_gather_peak(programs: list) -> int:
    """Bytes ZeRO-1/2's gather programs (``codegen.zero.gather_programs``) hold at their
    fullest: the largest bucket's input and gathered buffer (the runner copies each bucket out,
    in place, before the next). Buckets of the same shapes are walked once."""
    peaks: dict[tuple, int] = {}
    for p in programs:
        shapes = tuple((tuple(v.shape), v.dtype) for n in p.module.graph.find_nodes(
            op="placeholder") if isinstance(v := n.meta[M.VAL], torch.Tensor))
        if shapes not in peaks:
            peaks[shapes] = walk(p.module.graph, lambda n: "transient")[0]["transient"]
    return max(peaks.values(), default=0)


def kind_of(graph: fx.Graph) -> Callable[[fx.Node], str]:
    """The memory kind of each op's value: gradients, saved, communication or transient."""
    out = graph.output_node()
    grads = {v for v, r in zip(out.args[0], out.meta.get(M.OUTPUTS, ()))
             if isinstance(v, fx.Node) and r.kind is M.OutputKind.GRAD}
    grads |= {g for step in _steps_in_backward(graph) for g in step.args[2:]}
    grads |= {g for send in _sent_to_host(graph) for g in send.args[2:]}
    phase = phases(graph)  # ops codegen inserted take the phase of the op before them

    def kind(node: fx.Node) -> str:
        if getattr(node.target, "on_host", False):
            return "host"  # an offloaded activation (codegen.activation_offload)
        if node in grads:
            return "gradients"
        if is_collective(node) or (node.users and all(map(is_collective, node.users))):
            return "communication"  # a collective's result, or a buffer made only for one
        if phase[node] is M.Phase.FORWARD and any(
                phase.get(u) is M.Phase.BACKWARD for u in readers(node)):
            return "saved"
        return "transient"

    return kind


def walk(graph: fx.Graph, kind: Callable[[fx.Node], str], size=None, sent=None
         ) -> tuple[dict[str, int], fx.Node | None, str]:
    """Live bytes at the fullest op of ``graph`` by kind, that op, and a line naming it.
    Placeholders are the caller's and not counted; a value is live from its op to its last
    reader (the output node keeps what the graph returns)."""
    none = {k: 0 for k in ("gradients", "saved", "transient", "communication", "host")}
    return walk_moments(graph, kind, lambda node: None, size, sent).get(None, (none, None, ""))


def walk_moments(graph: fx.Graph, kind: Callable[[fx.Node], str], moment, size=None,
                 sent: Callable[[fx.Node], int] | None = None) -> dict:
    """``walk``'s peak within each moment of ``graph``: ``moment(op)`` names the part of the
    program an op is in; per part, (live bytes by kind, the fullest op, a line naming it).
    ``sent(op)``: host bytes the op puts there for the rest of the program (the gradients
    ``gradients_to_host`` hands over), counted in the moments' ``host``."""
    size = size or value_bytes
    kept_on_host = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    base = bases(graph)
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        # an all-gather in flight holds its input until it is waited for (an all-reduce works
        # on its own copy; measured: tests/test_memory.py)
        started = node.all_input_nodes[0] if node.target is _WAIT else None
        reads = node.all_input_nodes + (started.all_input_nodes if started is not None
                                        and started.target is _ALL_GATHER else [])
        for src in reads:
            owner = base.get(src, src)
            last_use[owner] = max(last_use.get(owner, 0), order[node])
    # an element of a multi-output result exists from the op that made it: it is counted
    # there, and lives to the last reader of its getitem (or of the result, which holds it)
    born: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and \
                node not in base and isinstance(node.args[0], fx.Node):
            born.setdefault(node.args[0], []).append(node)
    live: Counter = Counter()
    host: dict = {}  # moment -> the most bytes offloaded activations held on the host in it
    frees: dict[int, list] = {}
    best: dict = {}  # moment -> (bytes, live by kind, op)
    total = 0
    for node in graph.nodes:
        i = order[node]
        if node.op == "call_function":
            if node in base or node.target is operator.getitem:
                made = []  # a view of a value counted at its owner; an element, at its producer
            else:
                made = [node, *born.get(node, ())]
            for value in made:
                nbytes, k = size(value), kind(value)
                if nbytes:
                    live[k] += nbytes
                    total += nbytes if k != "host" else 0  # the host's: not the device's
                    end = max(last_use.get(value, order[value]), last_use.get(node, i))
                    frees.setdefault(end, []).append((k, nbytes))
            work = _workspace(node)  # what the op allocates for itself while it runs
            at = moment(node)
            kept_on_host += sent(node) if sent is not None else 0
            host[at] = max(host.get(at, 0), live["host"] + kept_on_host)
            if total + work > best.get(at, (0,))[0]:
                fullest = Counter(live)
                fullest["transient"] += work
                best[at] = (total + work, fullest, node)
        for k, nbytes in frees.pop(i, ()):
            live[k] -= nbytes
            total -= nbytes if k != "host" else 0
    out = {}
    for at, (_, fullest, node) in best.items():
        when = f"{node.meta.get(M.PHASE) or 'program'}, at {node.name}"
        out[at] = ({k: fullest[k] for k in ("gradients", "saved", "transient", "communication")}
                   | {"host": host[at]}, node, when)
    return out


def _workspace(node: fx.Node) -> int:
    """Bytes an op allocates beyond its inputs and outputs, where it says so: a
    ``workspace(*operand values)`` method (``kernels.linear_ce``'s ops: a chunk of logits)."""
    workspace = getattr(node.target, "workspace", None) if node.op == "call_function" else None
    if workspace is None:
        return 0
    return workspace(*arg_values(node))


def _loss_bytes(graph: fx.Graph) -> int:
    """The step's loss, which the runner returns and holds through the optimizer's step."""
    out = graph.output_node()
    return sum(tensor_bytes(v.meta.get(M.VAL)) for v, r in zip(out.args[0], out.meta.get(M.OUTPUTS, ()))
               if isinstance(v, fx.Node) and r.kind is M.OutputKind.LOSS)


def _graph_grads(graph: fx.Graph, size=value_bytes) -> int:
    """Bytes of the gradients ``graph`` returns, each storage once (``size``: a value's)."""
    out = graph.output_node()
    seen = {v for v, r in zip(out.args[0], out.meta.get(M.OUTPUTS, ()))
            if isinstance(v, fx.Node) and r.kind is M.OutputKind.GRAD}
    base = bases(graph)
    return sum(size(o) for o in {base.get(v, v) for v in seen})


