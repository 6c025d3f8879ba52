"""The pipeline runner: each rank runs its stage's F, B and W programs as the schedule orders.

The plan holds the joint graph split into per-stage parts (``codegen.stages``) and a schedule
(``shardfx.schedule``): one ordered action list per rank, ``0F1`` = stage 0 forward of
microbatch 1. Pipeline rank r (its place on the pp axis) runs stage r (and r + pp, ... with
virtual stages); with a dp axis, each replica of the pipeline takes its rows of the batch and
the replicas average their gradients (and the loss) after the last microbatch.

For each action the runner gathers the part's inputs: this rank's parameters; the action's
microbatch slice of the global inputs and targets; values an earlier action of the same rank
left (saved activations, dropped after their last reader, so a rank holds what
``schedule.check.in_flight`` counts); values another rank sends, received point-to-point
(tagged by producer, output and microbatch). What a part produces for other ranks is sent with
``isend`` at once; a B without W actions sends its input gradient before it computes the weight
gradient (``simulate(..., send_early=True)``).

Every receive of a step is posted when the step starts, into a buffer of its own (as
torch.distributed.pipelining allocates one per microbatch): posting a gloo receive costs a
fraction of a millisecond, which between two actions would be idle time on the critical path.
Gloo matches a message to its receive by tag, so the order of posting does not matter; NCCL
matches in order and would need each action's sends and receives batched in a matching order
instead (not done). The timeline records compute only: time waiting for data is idle, as the
schedule simulator counts it.

Gradients are summed over microbatches (the tangent is 1/m: the loss of the whole batch is the
mean of the microbatch losses), the optimizer steps each rank's own parameters, and a parameter
read by several stages (a tied embedding) is sent from the stage that owns its gradient to the
others after each step.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx

from shardfx.runtime.mesh import coordinate, device_mesh
from shardfx.runtime.shards import Shards
from torch.distributed.tensor import Shard

from shardfx.errors import PipelineError
from shardfx.ir import meta as M
from shardfx.schedule import Kind

if TYPE_CHECKING:
    from shardfx.plan import Plan


class PipelineRunner:
    def __init__(self, plan: "Plan", optimizer=None):
        mesh = device_mesh(plan.mesh)  # raises MeshError when the world does not match
        coord = coordinate(mesh)
        self._plan, self.rank = plan, coord["pp"]  # rank: this process's place in its pipeline
        self._pp = mesh.get_group("pp")
        self._ranks = dist.get_process_group_ranks(self._pp)  # pipeline rank -> global rank
        self._dp = mesh.get_group("dp") if plan.mesh.axis("dp") > 1 else None
        self._dp_size, self._dp_index = plan.mesh.axis("dp"), coord.get("dp", 0)
        inner = plan.mesh.only("tp")  # what each stage is sharded over
        self._tp = Shards(inner, mesh["tp"]) if inner.size > 1 else None
        self.schedule = plan.schedule
        self.m = self.schedule.microbatches
        split: fx.GraphModule = plan.stage_program
        self._parts = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
        self._module = split
        self._stage_of = {name: int(name[5:].split("_")[0]) for name in self._parts}
        inputs = split.graph.find_nodes(op="placeholder")
        self._roles = {n.name: n.meta[M.ROLE] for n in inputs}
        self._placements = {n.name: n.meta.get(M.ANNOTATION, ()) for n in inputs}
        self._vals = {n.name: n.meta[M.VAL] for n in plan.ir.graph.nodes if M.VAL in n.meta}
        self._vals |= {n.name: n.meta[M.VAL] for n in inputs}
        out = split.graph.output_node()
        self._finals = defaultdict(list)  # (part, index) -> output roles it provides
        for value, role in zip(out.args[0], plan.ir.graph.output_node().meta[M.OUTPUTS]):
            self._finals[_source(value)].append(role)
        mine = [p for p in self._parts if self._rank_of(p) == self.rank]
        reads = {a.name for p in mine for a in self._parts[p].args if a.op == "placeholder"}
        model = plan.model
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        self._params = {name: self._local(name, params[r.name]) for name, r in self._roles.items()
                        if name in reads and r.kind is M.InputKind.PARAM}
        self._buffers = {name: buffers[r.name] for name, r in self._roles.items()
                         if name in reads and r.kind is M.InputKind.BUFFER}
        self._owned = {r.name for (p, _), roles in self._finals.items() if self._rank_of(p) ==
                       self.rank for r in roles if r.kind is M.OutputKind.GRAD}
        owned = [p for name, p in self._params.items() if self._roles[name].name in self._owned]
        self.optimizer = optimizer(owned) if optimizer and owned else None
        self._tied = self._tied_parameters()
        self._order = {name: i for i, name in enumerate(self._parts)}
        self._steps = self._compile()

    def _local(self, name: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """This rank's tp shard of a parameter, or the model's own when the stage is whole."""
        placements = self._placements.get(name, ())
        if self._tp is None or not any(isinstance(p, Shard) for p in placements):
            return param
        local = self._tp.local(param.detach(), placements).clone()
        return torch.nn.Parameter(local, requires_grad=param.requires_grad)

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from this stage's tp shards (a collective over the tp group)."""
        return local if self._tp is None else self._tp.full(local, self._placements.get(name, ()))

    def _rank_of(self, part: str) -> int:
        return self.schedule.rank_of(self._stage_of[part])

    def forward(self, args: tuple):
        raise PipelineError("inference through a pipeline plan does not run yet",
                            where="runner.forward", fix="plan the model without pp for "
                            "inference: shardfx.partition(model, args, mesh={'tp': ...})")

    # --- a training step -------------------------------------------------------------------

    def step(self, args: tuple, targets: tuple = ()) -> torch.Tensor:
        flat = self._plan.check_inputs(args, targets)
        self._store: dict[tuple, Any] = {}  # (part, output, microbatch) -> value on this rank
        self._pending: dict[tuple, tuple] = {}  # posted receives: key -> (work, buffer)
        self._sends: list = []
        self._grads: dict[str, torch.Tensor] = {}
        self._spans: list[tuple[str, float, float]] = []  # (action, start, end) for the trace
        self._held: list[int] = []
        loss = torch.zeros(())
        steps = self._steps
        for step in steps:  # every receive of the step, before any compute (see the docstring)
            self._post(step)
        for step in steps:
            for key in step.receives:  # other ranks' data first: the span is compute only
                work, buf = self._pending.pop(key)
                work.wait()
                self._store[key] = buf
            start = time.perf_counter()
            for call in step.calls:
                loss += self._run(call, step.action.microbatch, flat)
            self._spans.append((step.name, start, time.perf_counter()))
            for key in step.frees:  # its last reader on this rank ran: let it go
                del self._store[key]
            self._held.append(len({mb for part, _, mb in self._store if part.endswith("_F")}))
            self._sends = [w for w in self._sends if not w.is_completed()]
        for work in self._sends:
            work.wait()
        if self._dp is not None:  # replicas average their gradients, as DDP does
            for g in self._grads.values():
                dist.all_reduce(g, group=self._dp)
                g /= self._dp_size
        for name, p in self._params.items():
            fqn = self._roles[name].name
            p.grad = self._grads.get(fqn) if fqn in self._owned else None
        if self.optimizer is not None:
            self.optimizer.step()
        self._share_tied()
        return self._broadcast_loss(loss)

    def _parts_of(self, action) -> list[str]:
        parts = [f"stage{action.stage}_{action.kind.value}"]
        if action.kind is Kind.B and not self.schedule.split_backward:
            parts.append(f"stage{action.stage}_W")  # B without W: the whole backward
        return [p for p in parts if p in self._parts]

    def _compile(self) -> list["_Step"]:
        """This rank's actions with everything the step loop needs worked out once: each part's
        input sources and output destinations, the values to receive (each once, posted for the
        first action that reads it) and the values to drop after their last reader."""
        self._calls = {name: self._compile_part(name) for name in self._parts}
        steps, first, last = [], {}, {}
        for i, action in enumerate(self.schedule.actions[self.rank]):
            calls = [self._calls[p] for p in self._parts_of(action)]
            steps.append(_Step(action, str(action), calls))
            for call in calls:
                for source in call.inputs:
                    if source[0] == "value":
                        key = (*source[1:], action.microbatch)
                        first.setdefault(key, i)
                        last[key] = i
        for key, i in first.items():
            if self._rank_of(key[0]) != self.rank:
                steps[i].receives.append(key)
        for key, i in last.items():
            steps[i].frees.append(key)
        return steps

    def _compile_part(self, part: str) -> "_Call":
        call = self._parts[part]
        inputs = []
        for arg in call.args:
            if arg.op == "placeholder":
                role = self._roles[arg.name]
                inputs.append(("input", arg.name, role))
            else:
                inputs.append(("value", *_source(arg)))
        outputs = []
        consumers = _consumers(call)
        for index in sorted(set(consumers) | {i for (p, i) in self._finals if p == part},
                            key=lambda i: -1 if i is None else i):
            ranks = sorted({self._rank_of(c) for c in consumers.get(index, ())})
            outputs.append(_Output(index, tuple(self._finals.get((part, index), ())),
                                   self.rank in ranks,
                                   [(self._ranks[r], self._tag(part, index)) for r in ranks
                                    if r != self.rank]))
        return _Call(part, getattr(self._module, part), inputs, outputs)

    def _post(self, step: "_Step") -> None:
        for key in step.receives:
            part, index, mb = key
            val = self._out_val(part, index)
            buf = torch.empty(val.shape, dtype=val.dtype)
            work = dist.irecv(buf, self._ranks[self._rank_of(part)],
                              tag=self._tag(part, index) + mb)
            self._pending[key] = (work, buf)

    def _run(self, call: "_Call", mb: int, flat: list) -> torch.Tensor:
        inputs = [self._input(source, mb, flat) for source in call.inputs]
        with torch.no_grad():
            out = call.module(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        loss = torch.zeros(())
        for o in call.outputs:
            value = outs[o.index if o.index is not None else 0]
            for role in o.roles:
                if role.kind is M.OutputKind.GRAD:
                    g = self._grads.get(role.name)
                    if g is None:  # a copy of its own: it accumulates in place from here on
                        self._grads[role.name] = value.clone()
                    else:
                        g.add_(value)
                elif role.kind is M.OutputKind.LOSS:
                    loss = value.detach() / self.m
                elif role.kind is M.OutputKind.BUFFER_UPDATE:
                    self._buffer(role.name).copy_(value)
            if o.local:
                self._store[(call.part, o.index, mb)] = value
            if o.sends:
                value = value.contiguous()
                for dst, tag in o.sends:
                    self._sends.append(dist.isend(value, dst, tag=tag + mb))
        return loss

    def _input(self, source: tuple, mb: int, flat: list):
        if source[0] == "value":
            return self._store[(source[1], source[2], mb)]
        _, name, role = source
        if role.kind is M.InputKind.PARAM:
            return self._params[name].detach()
        if role.kind is M.InputKind.BUFFER:
            return self._buffers[name]
        if role.kind is M.InputKind.TANGENT:  # d(mean of m losses)/d(one of them)
            return torch.full((), 1.0 / self.m, dtype=self._vals[name].dtype)
        if role.kind is M.InputKind.MESH:  # group(tp) / coord(tp)
            return self._tp.mesh_input(role)
        mine = flat[role.index].chunk(self._dp_size)[self._dp_index]  # this replica's rows
        return mine.chunk(self.m)[mb]

    def _out_val(self, part: str, index: int | None):
        """The fake value (shape, dtype) of a part's output, to receive it into."""
        out = getattr(self._module, part).graph.output_node().args[0]
        node = out[index] if index is not None else out
        return node.meta.get(M.VAL, self._vals.get(node.name))

    def _tag(self, part: str, index: int | None) -> int:
        """The tag of a part's output, plus the microbatch: unique within a step."""
        return (self._order[part] * 4096 + (index or 0)) * 1024

    def _buffer(self, fqn: str) -> torch.Tensor:
        return next(b for n, b in self._buffers.items() if self._roles[n].name == fqn)

    def _tied_parameters(self) -> list[tuple[str, int, list[int]]]:
        """(placeholder, owning pipeline rank, reading ranks) of each parameter several ranks
        read; worked out once, used after every step."""
        out = []
        for name, role in sorted(self._roles.items()):
            if role.kind is not M.InputKind.PARAM:
                continue
            readers = sorted({self._rank_of(p) for p, c in self._parts.items()
                              if any(a.name == name for a in c.args)})
            owner = next((self._rank_of(p) for (p, _), rs in self._finals.items()
                          if any(r.kind is M.OutputKind.GRAD and r.name == role.name for r in rs)),
                         None)
            if owner is not None and len(readers) > 1:
                out.append((name, owner, readers))
        return out

    def _share_tied(self) -> None:
        """A parameter several stages read is updated by its owner, then sent to the others."""
        for name, owner, readers in self._tied:
            p = self._params.get(name)
            for r in readers:
                if r != owner and self.rank == owner:
                    dist.send(p.detach().contiguous(), self._ranks[r], tag=1 << 30)
                elif r == self.rank and r != owner:
                    buf = torch.empty_like(p)
                    dist.recv(buf, self._ranks[owner], tag=1 << 30)
                    with torch.no_grad():
                        p.copy_(buf)

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        last = self.schedule.rank_of(self.schedule.stages - 1)
        dist.broadcast(loss, src=self._ranks[last], group=self._pp)
        if self._dp is not None:  # the batch's loss: the mean over data-parallel replicas
            dist.all_reduce(loss, group=self._dp)
            loss /= self._dp_size
        return loss

    # --- the timeline -----------------------------------------------------------------------

    def timeline(self) -> list[list[tuple[str, float, float]]]:
        """Every rank's (action, start, end) of the last step, in seconds from the step's start
        (a collective: call it on every rank)."""
        spans: list = [None] * len(self._ranks)
        dist.all_gather_object(spans, self._spans, group=self._pp)
        t0 = min(s[1] for rank in spans for s in rank)  # clocks of one machine; see trace()
        return [[(a, b - t0, e - t0) for a, b, e in rank] for rank in spans]

    def held(self) -> list[int]:
        """After each of this rank's actions in the last step, how many microbatches' forward
        values (saved activations) it still held: what ``schedule.check.in_flight`` predicts."""
        return list(self._held)

    def bubble(self) -> float:
        """Measured idle time over busy time, summed over ranks (the schedule's own terms)."""
        spans = self.timeline()
        end = max(e for rank in spans for _, _, e in rank)
        busy = sum(e - b for rank in spans for _, b, e in rank)
        return (end * len(spans) - busy) / busy

    def trace(self, path: str) -> None:
        """Write the last step as a Chrome trace / Perfetto JSON (rank 0 writes; call on all).
        Times come from each rank's clock, which on one machine is one clock."""
        spans = self.timeline()
        if dist.get_rank() != 0:
            return
        events = [{"name": a, "ph": "X", "pid": 0, "tid": r, "ts": b * 1e6, "dur": (e - b) * 1e6,
                   "cat": a.lstrip("0123456789")[0]}
                  for r, rank in enumerate(spans) for a, b, e in rank]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                    "args": {"name": f"rank {r}"}} for r in range(len(spans))]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    # --- state --------------------------------------------------------------------------------

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's full gradients, on every rank (each sent by its owner)."""
        names = {r.name: n for n, r in self._roles.items()}
        return self._gather({fqn: self._full(names[fqn], g) for fqn, g in self._grads.items()
                             if fqn in self._owned}, self._grad_shapes())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors on every rank, each sent by the rank that trains it. (The runner
        updates the model's own tensors in place, so a rank's copy of what it owns is current.)"""
        model = self._plan.model
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        tensors |= {self._roles[n].name: self._full(n, p) for n, p in self._params.items()}
        mine = {fqn: t for fqn, t in tensors.items() if self._roles_owner(fqn) == self.rank}
        full = self._gather(mine, self._state_shapes())
        return {fqn: full[self._plan.canonical(fqn)] for fqn in self._plan.state_names}

    def _roles_owner(self, fqn: str) -> int:
        """The rank that holds ``fqn`` for state_dict: its gradient's owner, else its reader."""
        for (part, _), roles in self._finals.items():
            if any(r.name == fqn and r.kind in (M.OutputKind.GRAD, M.OutputKind.BUFFER_UPDATE)
                   for r in roles):
                return self._rank_of(part)
        name = next((n for n, r in self._roles.items() if r.name == fqn), None)
        return min((self._rank_of(p) for p, c in self._parts.items()
                    if any(a.name == name for a in c.args)), default=0)

    def _state_shapes(self) -> dict[str, torch.Tensor]:
        model = self._plan.model
        return dict(model.named_parameters()) | dict(model.named_buffers())

    def _grad_shapes(self) -> dict[str, torch.Tensor]:
        model = dict(self._plan.model.named_parameters())
        return {r.name: model[r.name] for n, r in self._roles.items()
                if r.kind is M.InputKind.PARAM and any(
                    x.kind is M.OutputKind.GRAD and x.name == r.name
                    for rs in self._finals.values() for x in rs)}

    def _gather(self, mine: dict, shapes: dict) -> dict[str, torch.Tensor]:
        out = {}
        for fqn in sorted(shapes):
            owner = self._roles_owner(fqn)
            val = shapes[fqn]
            t = mine[fqn].detach().clone() if self.rank == owner and mine.get(fqn) is not None \
                else torch.empty(val.shape, dtype=val.dtype)
            dist.broadcast(t, src=self._ranks[owner], group=self._pp)
            out[fqn] = t
        return out


@dataclass
class _Output:
    index: int | None  # which output of the part; None: its only one
    roles: tuple  # the program outputs it is (a gradient, the loss, a buffer update)
    local: bool  # read by a later part on this rank
    sends: list[tuple[int, int]]  # (global rank, tag without the microbatch) to send it to


@dataclass
class _Call:
    part: str
    module: Any
    inputs: list[tuple]  # ("input", placeholder, role) or ("value", part, output index)
    outputs: list[_Output]


@dataclass
class _Step:
    """One action of this rank, compiled: its parts, the values it waits for first (their
    first reader on this rank) and those it drops after (their last)."""

    action: Any
    name: str
    calls: list[_Call]
    receives: list[tuple] = field(default_factory=list)
    frees: list[tuple] = field(default_factory=list)


def _source(value: fx.Node) -> tuple[str, int | None]:
    """(part, output index) a value of the split graph comes from; index None: a part's only
    output."""
    if value.op == "call_module":
        return value.target, None
    src, index = value.args
    return src.target, index


def _consumers(call: fx.Node) -> dict[int | None, list[str]]:
    """Output index -> the parts that read it."""
    out: dict[int | None, list[str]] = defaultdict(list)
    for user in call.users:
        if user.op == "call_function":  # getitem(call, i)
            out[user.args[1]] += [u.target for u in user.users if u.op == "call_module"]
        elif user.op == "call_module":
            out[None].append(user.target)
    return out
