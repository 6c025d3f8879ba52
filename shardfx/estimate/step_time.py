"""``plan.predicted_step``: how long one step of a plan should take on its device model.

Requires: a Plan with its program(s) emitted (``plan.program``, or ``plan.stage_program`` and
          ``plan.schedule``) and ``plan.options.device_model`` (None: the ``cpu`` preset).
Ensures:  a ``PredictedStep``: compute, communication and total seconds, on the model named.

What is counted, per device (one rank; in a pipeline, its busiest one):

- **ops**: each op of the generated program(s), on their local shapes,
  ``DeviceModel.node_seconds``: the roofline of its FLOPs and the bytes it reads and writes. A
  fused Triton kernel counts as one op (what the kernel moves, not its parts); views move
  nothing.
- **collectives**: each one in the program (tp's redistributions, dp's gradient buckets,
  ZeRO's reduce-scatters and gathers, and ZeRO-1/2's gather after the optimizer step),
  ``DeviceModel.collective_seconds`` on the link of its mesh axis (``DeviceModel.link_of``).
  A pipeline's dp replicas reduce each stage's gradients in the buckets the compiler emitted
  for it (``codegen.replicas``: all-reduces, or ZeRO-2's reduce-scatters), then ZeRO-1/2
  gathers the updated parameters.
- **the optimizer's step**: memory-bound: each parameter (the rows this rank steps) read and
  written, its gradient read, each state tensor read and written.
- **a pipeline** is simulated over its schedule (``schedule.simulate``) with each action's
  parts' ops and collectives, plus the activations and gradients it sends to another rank
  (one send each, on the pp link).
- **accumulation** (``microbatches`` without a pp axis): the program runs once per microbatch,
  its collectives too (each pass reduces its gradients, as it runs), and the optimizer once:
  one step prices the whole global batch.

Nothing overlaps: communication is added to compute, as if each collective waited for the
one before it and compute waited for it. Real runs overlap some (dp buckets are issued during
the backward), so the prediction is an upper bound in that respect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from shardfx.cost.device_model import DeviceModel, default_model
from shardfx.ir import meta as M
from shardfx.ir.graph import arg_values
from shardfx.cost.optimizer import optimizer_model
from shardfx.schedule import simulate

c10d = torch.ops._c10d_functional
_COLLECTIVES = {c10d.all_reduce.default: "all_reduce",
                c10d.all_gather_into_tensor.default: "all_gather",
                c10d.reduce_scatter_tensor.default: "reduce_scatter"}


@dataclass(frozen=True)
class PredictedStep:
    """One step's predicted seconds on one device (a pipeline: its busiest rank)."""

    model: str  # the DeviceModel's name
    compute: float  # ops and the optimizer's step
    communication: float  # collectives, a pipeline's sends and dp reductions
    total: float  # the step: compute + communication (+ a pipeline's idle time)
    optimizer: float = 0.0  # of compute: the optimizer's step
    idle: float = 0.0  # of total: the busiest pipeline rank waiting for others (the bubble)

    @property
    def duration(self) -> str:
        """The total in a readable unit: ``12.3 ms``."""
        unit, scale = _unit(self.total)
        return f"{self.total * scale:.3g} {unit}"

    def __str__(self) -> str:
        unit, scale = _unit(self.total)
        parts = [f"compute {self.compute * scale:.3g}"
                 + (f" incl. optimizer {self.optimizer * scale:.3g}" if self.optimizer else ""),
                 f"communication {self.communication * scale:.3g}"]
        if self.idle > 0:
            parts.append(f"pipeline bubble {self.idle * scale:.3g}")
        return f"predicted step {self.duration} on {self.model} ({', '.join(parts)})"


def _unit(seconds: float) -> tuple[str, float]:
    if seconds >= 1:
        return "s", 1.0
    return ("ms", 1e3) if seconds >= 1e-3 else ("us", 1e6)


def predict_step(plan) -> PredictedStep:
    """The step of ``plan`` (a ``shardfx.Plan``) on its device model (module docstring)."""
    model = default_model(plan.options)
    optimizer = _optimizer_seconds(plan, model)
    if plan.stage_program is None:  # the program once per microbatch (accumulated)
        compute, comm = program_seconds(plan.program.module.graph, model, plan.mesh.axes)
        passes = plan.options.microbatches
        compute, comm = passes * compute, passes * comm
        for gather in plan.zero_gather_programs:  # after the optimizer step (ZeRO-1/2)
            c, m = program_seconds(gather.module.graph, model, plan.mesh.axes)
            compute, comm = compute + c, comm + m
        opt = max(optimizer.values(), default=0.0)
        return PredictedStep(model.name, compute + opt, comm, compute + opt + comm, opt)
    return _pipeline(plan, model, optimizer)


def program_seconds(graph: fx.Graph, model: DeviceModel, axes) -> tuple[float, float]:
    """(compute, communication) seconds of one run of a program's graph on one device; ``axes``:
    the whole mesh's (axis, size) pairs, for each collective's group size and link."""
    compute = comm = 0.0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        kind = _COLLECTIVES.get(node.target)
        if kind is None:
            compute += model.node_seconds(node)
            if hasattr(node.target, "sends"):  # ring attention's p2p, not overlapped here
                link = model.link_of(tuple(axes), "cp")
                comm += sum(model.collective_seconds("send", b, 2, link)
                            for b in node.target.sends(*arg_values(node)))
            for e in getattr(node.target, "exchanges", lambda *_: [])(*arg_values(node)):
                comm += model.collective_seconds(e.kind, e.nbytes, dict(axes).get(e.axis, 1),
                                                 model.link_of(tuple(axes), e.axis))
            continue
        axis = _axis(node)
        n = dict(axes).get(axis, 1)
        val = node.args[0].meta[M.VAL]
        nbytes = val.numel() * val.element_size() * (n if kind == "all_gather" else 1)
        comm += model.collective_seconds(kind, nbytes, n, model.link_of(tuple(axes), axis))
    return compute, comm


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


def _pipeline(plan, model: DeviceModel, optimizer: dict[str, float]) -> PredictedStep:
    program = plan.compiled_stages()
    axes = plan.mesh.axes
    pp_link = model.link_of(axes, "pp")
    parts = {name: program_seconds(getattr(plan.stage_program, name).graph, model, axes)
             for name in program.parts}

    def cost(action) -> tuple[float, float]:
        compute = sum(parts[p][0] for p in program.parts_of(action))
        comm = sum(parts[p][1] for p in program.parts_of(action))
        for (part, out, _), _dst in program.messages(action)[0]:
            val = program.out_val(part, out)
            comm += model.collective_seconds("send", val.numel() * val.element_size(), 2,
                                             pp_link)
        return compute, comm

    costs = {}
    for actions in plan.schedule.actions:
        for action in actions:
            costs[action] = cost(action)
    timeline = simulate(plan.schedule, lambda a: sum(costs[a]))
    after = _dp_reduce(plan, model)  # per pp rank, once every microbatch is done
    ranks = []
    for rank, actions in enumerate(plan.schedule.actions):
        opt = optimizer.get(f"pp rank {rank}", 0.0)
        compute = sum(costs[a][0] for a in actions) + opt
        comm = sum(costs[a][1] for a in actions) + after.get(rank, 0.0)
        ranks.append((compute + comm, compute, comm, opt, after.get(rank, 0.0) + opt))
    total = timeline.makespan + max(r[4] for r in ranks)
    _, compute, comm, opt, _ = max(ranks)
    return PredictedStep(model.name, compute, comm, total, opt, max(0.0, total - compute - comm))


def _dp_reduce(plan, model: DeviceModel) -> dict[int, float]:
    """Per pp rank, its stages' gradient reductions over dp (each bucket's collective, as the
    compiler emitted them: ``codegen.replicas``), then under ZeRO the gather of the updated
    rows."""
    dp = plan.mesh.axis("dp")
    if dp == 1 or plan.mode is not M.Mode.TRAIN:
        return {}
    link = model.link_of(plan.mesh.axes, "dp")
    out = {rank: 0.0 for rank in range(plan.mesh.axis("pp"))}
    for stage, reduction in plan.stage_program.meta[M.REPLICAS].items():
        out[plan.schedule.rank_of(stage)] += sum(
            model.collective_seconds(c.kind, c.nbytes, dp, link) for c in reduction.collectives)
    if plan.options.zero:  # the updated rows back to every replica
        for label, (params, _, _) in plan.state_rows().items():
            out[int(label.removeprefix("pp rank "))] += \
                model.collective_seconds("all_gather", params, dp, link)
    return out
