"""``plan.predicted_step``: how long one step of a plan should take on its device model.

Requires: a Plan with its program(s) emitted (``plan.program``, or ``plan.stage_program`` and
          ``plan.schedule``) and ``plan.options.device_model`` (None: the ``cpu`` preset).
Ensures:  a ``PredictedStep``: compute, communication (and the part of it not hidden behind
          compute) and total seconds, on the model named.

What is counted, per device (one rank; in a pipeline, its busiest one):

- **ops**: each op of the generated program(s), on their local shapes,
  ``DeviceModel.node_seconds``: the roofline of its FLOPs (a matmul at its shape's achievable
  rate, an attention at its kernel's) and the bytes it reads and writes. A fused Triton kernel
  counts as one op (what the kernel moves, not its parts); views move nothing.
- **collectives**: each one in the program (tp's redistributions, dp's gradient buckets,
  ZeRO's reduce-scatters and gathers, and ZeRO-1/2's gather after the optimizer step),
  ``DeviceModel.collective_seconds`` on the link of its mesh axis (``DeviceModel.link_of``).
  A pipeline's dp replicas reduce each stage's gradients in the buckets the compiler emitted
  for it (``codegen.replicas``: all-reduces, or ZeRO-2's reduce-scatters), then ZeRO-1/2
  gathers the updated parameters.
- **the optimizer's step**: memory-bound: each parameter (the rows this rank steps) read and
  written, its gradient read, each state tensor read and written.
- **a pipeline** is simulated over its schedule (``schedule.simulate``) with each action's
  parts' ops and collectives; the activations and gradients it sends another rank leave as
  isends while the sender goes on, and arrive a send's time later (``transfer``).
- **accumulation** (``microbatches`` without a pp axis): the program runs once per microbatch,
  its collectives too (each pass reduces its gradients, as it runs), and the optimizer once:
  one step prices the whole global batch.

What overlaps is what the program overlaps (``program_time``): ops run in program order on
one stream; a collective starts when the program issues it (and its axis's previous
collective is done: one NCCL stream per process group) and runs beside the ops after it until
the program waits for it (``wait_tensor``). tp's collectives are waited for at once, so they
add to the step; dp's gradient buckets are issued during the backward and waited for at its
end, so the backward hides them. Ring attention posts each step's exchange before it
computes the step before. In a pipeline, a stage's buckets start once its last microbatch's
backward is done (``runtime.buckets``) and run beside the rank's remaining actions. ZeRO's
gather of the updated rows runs after the optimizer's step, on its own.

``assume`` prices techniques the program lacks, as a published system used them (and, for a
system measured before the program's kernels existed, the kernel it ran), so a measured step
can be compared with the program and with what the technique would give (``TECHNIQUES``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from shardfx.cost.device_model import DeviceModel, default_model
from shardfx.cost.elementwise import chain_bytes, chains, compute_dtype
from shardfx.cost.node import attention_shape, matmul_shape
from shardfx.ir import meta as M
from shardfx.ir.graph import arg_values
from shardfx.cost.optimizer import optimizer_model
from shardfx.cost.techniques import TECHNIQUES, check, on_vocab, vocabulary, weight_cast
from shardfx.schedule import simulate

c10d = torch.ops._c10d_functional
_COLLECTIVES = {c10d.all_reduce.default: "all_reduce",
                c10d.all_gather_into_tensor.default: "all_gather",
                c10d.reduce_scatter_tensor.default: "reduce_scatter"}
_WAIT = c10d.wait_tensor.default

@dataclass(frozen=True)
class PredictedStep:
    """One step's predicted seconds on one device (a pipeline: its busiest rank)."""

    model: str  # the DeviceModel's name
    compute: float  # ops and the optimizer's step
    communication: float  # collectives, a pipeline's sends and dp reductions
    total: float  # the step: compute + exposed communication (+ a pipeline's idle time)
    optimizer: float = 0.0  # of compute: the optimizer's step
    idle: float = 0.0  # of total: the busiest pipeline rank waiting for others (the bubble)
    exposed: float | None = None  # of communication: what compute does not hide (None: all)
    assumed: tuple[str, ...] = ()  # techniques priced as if the program had them (TECHNIQUES)

    @property
    def waiting(self) -> float:
        """Seconds of the total spent waiting for communication."""
        return self.communication if self.exposed is None else self.exposed

    @property
    def duration(self) -> str:
        """The total in a readable unit: ``12.3 ms``."""
        unit, scale = _unit(self.total)
        return f"{self.total * scale:.3g} {unit}"

    def __str__(self) -> str:
        unit, scale = _unit(self.total)
        comm = f"communication {self.communication * scale:.3g}"
        if self.exposed is not None and self.exposed < 0.995 * self.communication:
            comm += f" ({self.exposed * scale:.3g} not overlapped)"
        parts = [f"compute {self.compute * scale:.3g}"
                 + (f" incl. optimizer {self.optimizer * scale:.3g}" if self.optimizer else ""),
                 comm]
        if self.idle > 0:
            parts.append(f"pipeline bubble {self.idle * scale:.3g}")
        if self.assumed:
            parts.append("assuming " + ", ".join(self.assumed))
        return f"predicted step {self.duration} on {self.model} ({', '.join(parts)})"


def _unit(seconds: float) -> tuple[str, float]:
    if seconds >= 1:
        return "s", 1.0
    return ("ms", 1e3) if seconds >= 1e-3 else ("us", 1e6)


@dataclass(frozen=True)
class ProgramTime:
    """One run of a program's graph on one device."""

    compute: float  # its ops, one after another
    communication: float  # its collectives' own times, hidden or not
    total: float  # until its last op and collective are done

    @property
    def exposed(self) -> float:
        return self.total - self.compute


def predict_step(plan, assume=(), model: DeviceModel | None = None) -> PredictedStep:
    """The step of ``plan`` (a ``shardfx.Plan``) on its device model, or on ``model``
    (module docstring); ``assume``: names of ``TECHNIQUES`` to price as if the program had
    them."""
    assume = check(assume, "predict_step(assume=...)")
    model = model or default_model(plan.options)
    if "vendor-attention" in assume and model.throughput is not None and \
            model.throughput.vendor_attention is not None:
        kernels = model.throughput
        model = dataclasses.replace(model, throughput=dataclasses.replace(
            kernels, attention=kernels.vendor_attention))
    optimizer = _optimizer_seconds(plan, model)
    if plan.stage_program is None:  # the program once per microbatch (accumulated)
        graph, axes = plan.program.module.graph, plan.mesh.axes
        passes = plan.options.microbatches
        runs = [program_time(graph, model, axes, assume)] * passes
        if passes > 1 and "grad-reduce-once" in assume:  # the earlier passes reduce nothing
            runs[:-1] = [program_time(graph, model, axes, assume,
                                      skip=("dp", "dp_replicate", "cp"))] * (passes - 1)
        compute = sum(r.compute for r in runs)
        comm = sum(r.communication for r in runs)
        total = sum(r.total for r in runs)
        for gather in plan.zero_gather_programs:  # after the optimizer step (ZeRO-1/2)
            g = program_time(gather.module.graph, model, axes, assume)
            compute, comm = compute + g.compute, comm + g.communication
            total += g.compute if "param-gather-overlap" in assume else g.total
        opt = max(optimizer.values(), default=0.0)
        return PredictedStep(model.name, compute + opt, comm, total + opt, opt,
                             exposed=total - compute, assumed=assume)
    return _pipeline(plan, model, optimizer, assume)


def program_seconds(graph: fx.Graph, model: DeviceModel, axes) -> tuple[float, float]:
    """(compute, communication) seconds of one run of a program's graph on one device; ``axes``:
    the whole mesh's (axis, size) pairs, for each collective's group size and link."""
    run = program_time(graph, model, axes)
    return run.compute, run.communication


def program_time(graph: fx.Graph, model: DeviceModel, axes, assume=(),
                 skip=()) -> ProgramTime:
    """One run of ``graph`` on one device, overlapped as the program overlaps (module
    docstring). ``skip``: axes whose collectives are left out (an accumulation's earlier
    passes under ``grad-reduce-once``)."""
    axes = tuple(axes)
    sizes = dict(axes)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    own = {n: model.node_seconds(n) for n in nodes if n.target not in _COLLECTIVES}
    if "fused-elementwise" in assume:  # each chain of memory-bound ops one bf16 kernel
        own = _fused(nodes, own, model)
    vocab = vocabulary(graph) if "vocab-parallel" in assume and sizes.get("tp", 1) > 1 else None
    if vocab:  # each rank's rows of the vocabulary
        own = {n: t / sizes["tp"] if on_vocab(n, vocab) else t for n, t in own.items()}
    if "low-precision-weights" in assume:  # the weights are already in the compute dtype
        own = {n: 0.0 if weight_cast(n) else t for n, t in own.items()}
    if "unfused-attention" in assume:  # the scores in memory
        own = {n: _core_attention(n, model, t) for n, t in own.items()}
    clock = compute = comm = 0.0
    free: dict[str, float] = {}  # axis -> when its stream is free
    done: dict[fx.Node, float] = {}  # collective -> when it ends
    last_mm = 0.0
    for i, node in enumerate(nodes):
        kind = _COLLECTIVES.get(node.target)
        if kind is not None:
            axis = _axis(node)
            if axis in skip or vocab and axis == "tp" and on_vocab(node, vocab):
                done[node] = clock
                continue
            n = sizes.get(axis, 1)
            val = node.args[0].meta[M.VAL]
            nbytes = val.numel() * val.element_size() * (n if kind == "all_gather" else 1)
            seconds = model.collective_seconds(kind, nbytes, n, model.link_of(axes, axis))
            comm += seconds
            if axis == "tp" and "tp-overlap" in assume:  # hidden behind the matmul beside it
                beside = _next_matmul(nodes, i, own) if kind == "all_gather" else last_mm
                seconds = max(seconds / n, seconds - beside)
            start = max(clock, free.get(axis, 0.0))
            free[axis] = done[node] = start + seconds
            continue
        if node.target is _WAIT:
            clock = max(clock, done.get(node.args[0], clock))
            continue
        seconds = own[node]
        compute += seconds
        if matmul_shape(node) is not None:
            last_mm = seconds
        if hasattr(node.target, "sends"):  # ring attention: each step's exchange beside it
            messages = node.target.sends(*arg_values(node))
            link = model.link_of(axes, "cp", p2p=True)
            sent = [model.collective_seconds("send", b, 2, link) for b in messages]
            comm += sum(sent)
            clock += _ring_seconds(seconds, sent, getattr(node.target, "name", ""))
            continue
        for e in getattr(node.target, "exchanges", lambda *_: [])(*arg_values(node)):
            if e.axis in skip:
                continue
            t = model.collective_seconds(e.kind, e.nbytes, sizes.get(e.axis, 1),
                                         model.link_of(axes, e.axis))
            comm += t
            clock += t  # an expert exchange waits for its data
        clock += seconds
    end = max([clock, *free.values()])
    return ProgramTime(compute, comm, end)


def _fused(nodes: list[fx.Node], own: dict[fx.Node, float],
           model: DeviceModel) -> dict[fx.Node, float]:
    """``own`` with each chain of memory-bound ops (``elementwise.chains``) priced as one kernel
    in the compute dtype (``elementwise.chain_bytes``), on its first op, the others 0; never more
    than the ops one by one."""
    dtype = compute_dtype(nodes)
    if dtype is None:
        return own
    own = dict(own)
    for chain in chains(nodes):
        apart = sum(own[n] for n in chain)
        for node in chain:
            own[node] = 0.0
        own[chain[0]] = min(apart, chain_bytes(chain, dtype) / model.memory_bandwidth)
    return own


def _core_attention(node: fx.Node, model: DeviceModel, seconds: float) -> float:
    """A flash attention op's seconds computed unfused (``unfused-attention``); any other op's
    ``seconds``."""
    shape = attention_shape(node)
    if shape is None:
        return seconds
    return model.core_attention_seconds(*shape, dtype=node.args[1 if shape[-1] else 0]
                                        .meta[M.VAL].dtype)


def _ring_seconds(compute: float, sent: list[float], name: str) -> float:
    """A ring attention op's time: its blocks computed one after another, each step's
    exchange beside the block before it (the backward sends keys and values, then their
    gradients back: two messages a step)."""
    per_step = 2 if name.endswith("backward") else 1
    steps = max(1, len(sent) // per_step)
    block = compute / (steps + 1)
    moved = [sum(sent[k::steps]) for k in range(steps)]  # what moves during step k
    return block + sum(max(block, m) for m in moved)


def _next_matmul(nodes: list[fx.Node], i: int, own: dict) -> float:
    for node in nodes[i + 1:]:
        if matmul_shape(node) is not None:
            return own[node]
    return 0.0


def _axis(node: fx.Node) -> str:
    """The mesh axis a collective runs on, from its group input (``group(tp)``, ``group_tp``)."""
    group = node.args[-1]
    role = group.meta.get(M.ROLE) if isinstance(group, fx.Node) else None
    if role is not None:
        return role.name.removeprefix("group(").removesuffix(")")
    return str(getattr(group, "name", group)).removeprefix("group_")


def _optimizer_seconds(plan, model: DeviceModel) -> dict[str, float]:
    """Per group of devices (``plan.state_rows``'s labels), the optimizer step's seconds."""
    if plan.mode is not M.Mode.TRAIN or optimizer_model(plan.options.optimizer).name == "none":
        return {}
    return {label: model.op_seconds(0, 3 * trained + 2 * state)
            for label, (_, trained, state) in plan.state_rows().items()}


def _pipeline(plan, model: DeviceModel, optimizer: dict[str, float], assume) -> PredictedStep:
    program = plan.compiled_stages()
    axes = plan.mesh.axes
    pp_link = model.link_of(axes, "pp", p2p=True)
    once = _reduced_once(plan, assume)
    parts = {name: program_time(getattr(plan.stage_program, name).graph, model, axes, assume,
                                skip=once[1:] if name.endswith("_W") else ())
             for name in program.parts}

    split = plan.mesh.axis("tp") if "p2p-scatter-gather" in assume else 1

    def sent(action) -> float:
        """Seconds the values ``action`` sends other ranks take to arrive."""
        return sum(_message_seconds(model, program.out_val(part, index), pp_link, axes, split)
                   for (part, index, _), _dst in program.messages(action)[0])

    costs, transfers = {}, {}
    for actions in plan.schedule.actions:
        for action in actions:
            runs = [parts[p] for p in program.parts_of(action)]
            costs[action] = (sum(r.total for r in runs), sum(r.compute for r in runs),
                             sum(r.communication for r in runs))
            transfers[action] = sent(action)
    timeline = simulate(plan.schedule, lambda a: costs[a][0], transfer=transfers.get)
    ends: dict[int, float] = {}  # stage -> when its last action ends
    finish: dict[int, float] = {}  # rank -> when its last action ends
    for span in timeline.spans:
        ends[span.action.stage] = max(ends.get(span.action.stage, 0.0), span.end)
        finish[span.rank] = max(finish.get(span.rank, 0.0), span.end)
    reduce, gather = _dp_reduce(plan, model, once)
    ranks = []
    for rank, actions in enumerate(plan.schedule.actions):
        opt = optimizer.get(f"pp rank {rank}", 0.0)
        free = 0.0  # each stage's buckets start as its last action ends, one after another
        for stage in sorted(reduce.get(rank, {}), key=lambda st: ends.get(st, 0.0)):
            free = max(free, ends.get(stage, 0.0)) + reduce[rank][stage]
        done = finish.get(rank, 0.0)
        tail = max(0.0, free - done) + \
            (0.0 if "param-gather-overlap" in assume else gather.get(rank, 0.0))
        busy = sum(costs[a][0] for a in actions) + opt  # computing, or waiting on its own
        compute = sum(costs[a][1] for a in actions) + opt
        comm = sum(costs[a][2] + transfers[a] for a in actions) + \
            sum(reduce.get(rank, {}).values()) + gather.get(rank, 0.0)
        ranks.append((busy, done + opt + tail, compute, comm, opt, tail))
    total = max(r[1] for r in ranks)
    busy, _, compute, comm, opt, tail = max(ranks)
    exposed = busy - compute + tail
    return PredictedStep(model.name, compute, comm, total, opt, max(0.0, total - compute - exposed),
                         exposed=exposed, assumed=assume)


def _message_seconds(model: DeviceModel, val, link, axes, split: int = 1) -> float:
    """Seconds one pipeline message ``val`` takes to reach the next rank over ``link``; with
    ``split`` tp ranks (``p2p-scatter-gather``), each sends its 1/tp of it through its own
    port and the receivers all-gather it over tp (Megatron's scatter/gather)."""
    nbytes = val.numel() * val.element_size()
    if split <= 1:
        return model.collective_seconds("send", nbytes, 2, link)
    return model.collective_seconds("send", nbytes / split, 2, link) + \
        model.collective_seconds("all_gather", nbytes, split, model.link_of(axes, "tp"))


def _reduced_once(plan, assume) -> tuple[str, ...]:
    """The axes a pipeline's gradients are reduced over once a step, as one group: dp, and
    under ``grad-reduce-once`` cp beside it (Megatron's dp x cp group: its W parts then
    reduce nothing over cp in each microbatch). cp's reduction joins dp's buckets, so it is
    deferred only where there are some (dp > 1)."""
    if "grad-reduce-once" in assume and plan.mesh.axis("dp") > 1 and plan.mesh.axis("cp") > 1:
        return ("dp", "cp")
    return ("dp",)


def _dp_reduce(plan, model: DeviceModel, group: tuple[str, ...] = ("dp",)
               ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """Per pp rank: its stages' gradient reductions over ``group`` (dp, or dp x cp:
    ``_reduced_once``), per stage (each bucket's collective, as the compiler emitted them:
    ``codegen.replicas``), and under ZeRO the gather of the updated rows over dp."""
    dp = plan.mesh.axis("dp")
    if dp == 1 or plan.mode is not M.Mode.TRAIN:
        return {}, {}
    ranks = math.prod(plan.mesh.axis(a) for a in group)
    link = model.link_of(plan.mesh.axes, group)
    reduce: dict[int, dict[int, float]] = {}
    for stage, reduction in plan.stage_program.meta[M.REPLICAS].items():
        rank = plan.schedule.rank_of(stage)
        reduce.setdefault(rank, {})[stage] = sum(
            model.collective_seconds(c.kind, c.nbytes, ranks, link)
            for c in reduction.collectives)
    gather: dict[int, float] = {}
    if plan.options.zero:  # the updated rows back to every replica
        link = model.link_of(plan.mesh.axes, "dp")
        for label, (params, _, _) in plan.state_rows().items():
            gather[int(label.removeprefix("pp rank "))] = \
                model.collective_seconds("all_gather", params, dp, link)
    return reduce, gather
