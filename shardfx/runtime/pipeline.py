"""The pipeline runner: each rank runs its stage's F, B and W programs as the schedule orders.

The plan holds the joint graph split into per-stage parts (``codegen.stages``) and a schedule
(``shardfx.schedule``): one ordered action list per rank, ``0F1`` = stage 0 forward of
microbatch 1. Pipeline rank r (its place on the pp axis) runs stage r (and r + pp, ... with
virtual stages); with a dp axis, each replica of the pipeline takes its rows of the batch and
the replicas combine their gradients (and the loss) after the last microbatch.

For each action the runner gathers the part's inputs: this rank's parameters; the action's
microbatch slice of the global inputs and targets; values an earlier action of the same rank
left (saved activations, dropped after their last reader, so a rank holds what
``schedule.check.in_flight`` counts); values another rank sends, received point-to-point.
What a part produces for other ranks is sent with ``isend`` at once; a B without W actions
sends its input gradient before it computes the weight gradient (``simulate(...,
send_early=True)``).

Messages go in the order an in-order transport needs (NCCL matches the k-th send of a pair of
ranks with the k-th receive), on gloo as on NCCL, so CI runs the code GPUs run: a rank posts
the receives of what an action reads from other ranks, each after those its sender sent this
rank earlier (``schedule.p2p``, checked for every rank when the runner is made: an order that
would hang is a ``ScheduleError`` then, never a hang), one action ahead: while it computes
an action, the next one's data comes in (posting is not waiting, so the order of waits, and
the check, are unchanged); sends go on a
process group of their own per direction (``runtime.mesh.channels``), so a send waiting for
its receiver holds up nothing else. The timeline records compute only, on the device's clock
(``runtime.timing``: CUDA events on a GPU): time waiting for data is idle, as the schedule
simulator counts it.

Gradients are summed over microbatches, in place: into the first microbatch's output itself
where no other tensor holds its storage (``memory_pipeline.owned_gradients``: no copy), else
into a copy of it; once every accumulator a part writes exists, the part's accumulating
variant adds each matmul's and embedding's weight gradient into it where it is made
(``codegen.accumulate_into``: no fresh gradient per microbatch, no separate add). The tangent
is 1/m when the batch's loss is the mean of the microbatch losses and 1 when it is their sum (``Options.loss_reduction``, found at planning
time); dp replicas sum their gradients in the buckets the compiler emitted for each stage
(``runtime.buckets``), each replica's tangent its share of the whole batch's loss. The optimizer steps each rank's
own parameters, and a parameter read by several stages (a tied embedding) is sent from the
stage that owns its gradient to the others after each step. Its training state, for
checkpoints and as full tensors on every rank: ``runtime.pipeline_state``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.errors import PipelineError
from shardfx.ir import meta as M
from shardfx.runtime.measure import mark
from shardfx.runtime.offload import Offload, stepping_on_host
from shardfx.kernels import expert_load as load
from shardfx.kernels.expert_load import BATCH_SPLIT
from shardfx.cost.optimizer import check_optimizer
from shardfx.estimate.memory_pipeline import owned_gradients
from shardfx.runtime.accumulate import accumulated, mean_loss
from shardfx.runtime.loss_scale import loss_scaler, seed
from shardfx.runtime.optimizer_step import Grad, clip_limit, counted, finish_step, release
from shardfx.passes.rng import draw_seed, reads_rng, rng_value
from shardfx.estimate.memory_pipeline import final_gradients
from shardfx.runtime.buckets import ReplicaBuckets
from shardfx.runtime.checks import SameBatch, check_step_inputs, make_optimizer, same_plan
from shardfx.codegen.steps import StageProgram, Step
from shardfx.kernels.device import check_weights, place
from shardfx.runtime.materialize import InitFn, Initializer, Unmade, settle
from shardfx.runtime.heap import keep_freed_memory
from shardfx.runtime.lowered import Compiling, runnable
from shardfx.runtime.mesh import channels, coordinate, device_mesh
from shardfx.runtime.shards import Shards
from shardfx.runtime.timing import Clock
from shardfx.runtime.pipeline_state import PipelineState
from shardfx.runtime.zero import ZeroRows
from shardfx.schedule import forward_only

if TYPE_CHECKING:
    from shardfx.plan import Plan


class PipelineRunner(PipelineState):
    def __init__(self, plan: "Plan", optimizer=None, loss_scaling=None, clip_grad_norm=None,
                 keep_grads: bool = False, init_seed: int = 0, init: InitFn | None = None):
        mesh = device_mesh(plan.mesh)  # raises MeshError when the world does not match
        coord = coordinate(mesh)
        self.plan, self.rank = plan, coord["pp"]  # rank: this process's place in its pipeline
        self._compiled = plan.options.kernels == "compiled"  # runtime.lowered
        self._compiling = Compiling(self._compiled, plan.mesh.size)  # its calls that compile
        self.pp = mesh.get_group("pp")
        self._channels = channels(mesh, "pp")  # (from, to) pipeline ranks -> its group
        self.ranks = dist.get_process_group_ranks(self.pp)  # pipeline rank -> global rank
        self._dp = mesh.get_group("dp") if plan.mesh.axis("dp") > 1 else None
        self.routed: dict[str, load.Routed] = {}  # the last step's MoE routing, this rank's
        self._dp_size, self.dp_index = plan.mesh.axis("dp"), coord.get("dp", 0)
        inner = plan.mesh.stage()  # what each stage is sharded over: cp, tp and ep
        names = tuple(a for a, _ in inner.axes)
        self.tp = Shards(inner, mesh[names]) if inner.size > 1 else None
        self.schedule = plan.schedule
        self.m = self.schedule.microbatches
        self._mean = plan.options.loss_reduction == "mean"  # else the slices' losses add up
        self.program = StageProgram.of(plan.stage_program, plan.ir, self.schedule)
        self._steps = self.program.steps(self.rank)
        self.device = plan.device
        model = plan.model
        check_weights(model, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # runtime.heap
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        # a meta model's parameters this rank has not made yet, and how (materialize.settle)
        self.unmade = Unmade(Initializer(model, init_seed, init))
        reads = self.program.reads(self.rank).values()
        # this rank's weights, by FQN, on its device: its tp shards, or the model's own tensors
        self.params = {r.name: self._local(r.name, params[r.name]) for r in reads
                        if r.kind is M.InputKind.PARAM}
        self.buffers = {r.name: self._whole(r.name, buffers[r.name]).to(self.device)
                        for r in reads if r.kind is M.InputKind.BUFFER}
        self._constants: dict[tuple, torch.Tensor] = {}  # (program, name) -> on this device
        self.owned = {fqn for fqn in self.params
                       if self.program.producer(M.OutputKind.GRAD, fqn) == self.rank}
        self.zero, self.stepped = self._zero_rows(plan), {}  # ZeRO-1/2 over dp
        for fqn in self.zero.layouts if self.zero is not None else ():
            self.params[fqn], self.stepped[fqn] = self.zero.hold(fqn, self.params[fqn].detach(),
                                                                 fqn in self.unmade.names)
        # offload_optimizer: what the optimizer steps, its gradients and its state on the host
        self.offload = Offload({fqn: self.device_trained()[fqn] for fqn in sorted(self.owned)},
                               self.device) \
            if plan.options.offload_optimizer and plan.mode is M.Mode.TRAIN else None
        owned = [self.trained()[fqn] for fqn in sorted(self.owned)]
        self.optimizer = make_optimizer(optimizer, owned)
        if self.optimizer is not None and plan.mode is M.Mode.TRAIN:
            check_optimizer(plan.options.optimizer, self.optimizer)
        self.loss_scaler = loss_scaler(plan.options.precision, loss_scaling)
        self._same_batch = SameBatch(plan)
        same_plan(plan)  # runtime.checks: every rank would issue the same collectives
        # random draws (dropout, noise): [seed, step, slice] (passes.rng); the seed agreed once by every rank
        # the seed of this runner's random stream (``passes.rng``; 0 when the program draws
        # nothing): with ``step_count``, what ``random_draws.on_stream_eagerly`` replays
        self.rng_seed = draw_seed() if reads_rng(plan.stage_program) else 0
        self.step_count = 0  # steps taken: random draws depend on it; set it when resuming
        self.clip_grad_norm = clip_limit(clip_grad_norm)
        self.keep_grads = keep_grads  # .grad after the step; freed with it otherwise
        self.grad_norm: float | None = None  # the last step's, before clipping (when clipping)
        self._tangent, self._batch = 1.0, 0  # of the batch running: its share, its index
        self._counted: dict[str, bool] | None = None  # per owned tensor, for the norm
        self._tied = self._tied_parameters()
        self._grads: dict[str, torch.Tensor] = {}
        self._kept = self._kept_outputs()  # part -> gradients taken as accumulators, no copy
        self._final = final_gradients(self._steps)  # step index -> gradients done there
        self._buckets = self._replica_buckets()  # the stages' gradients over dp
        self.all_reduces = 0  # dp buckets the last step reduced
        self._clock = Clock(self.device)  # device time: CUDA events on a GPU
        self._spans: list[tuple[str, Any, Any]] = []  # (action, start, end) marks of the clock
        self._held: list[int] = []
        self._forward: tuple | None = None  # the inference program, compiled on first use

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (fp16 plans; ``shardfx.runtime.loss_scale``), else None."""
        return None if self.loss_scaler is None else self.loss_scaler.scale

    def _local(self, fqn: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """This rank's tp shard of a parameter, or the model's own when the stage is whole
        and on this rank's device (else a copy there: the stage's weights alone move)."""
        placements = self.program.placements.get(fqn, ())
        whole = self.tp is None or not any(isinstance(p, (Shard, _StridedShard))
                                           for p in placements)
        if param.is_meta:  # made on first use (materialize.settle), or filled by a load
            self.unmade.names.add(fqn)
            shape = param.shape if whole else self.tp.local(param.detach(), placements).shape
            return torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device=self.device),
                                      requires_grad=param.requires_grad)
        if whole:
            if param.device == self.device:
                return param
            local = param.detach()
        else:
            local = self.tp.local(param.detach(), placements)
        return torch.nn.Parameter(local.to(self.device, copy=True),
                                  requires_grad=param.requires_grad)

    def _whole(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        """The model's tensor ``fqn``, or on meta its value made now (``runtime.materialize``)."""
        return self.unmade.initializer.value(fqn) if t.is_meta else t.detach()

    def full(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from this stage's tp shards (a collective over the tp group)."""
        if self.tp is None:
            return local
        return self.tp.full(local, self.program.placements.get(fqn, ()))

    # --- a training step -------------------------------------------------------------------

    def step(self, args: tuple, targets: tuple = ()) -> torch.Tensor:
        return self.step_batches([(args, targets)])

    def step_batches(self, batches) -> torch.Tensor:
        """One optimizer step over several global batches (``runtime.accumulate``): each runs
        the schedule; their gradients add up, each reduced over dp as the schedule ends."""
        batches = accumulated(batches)
        with self._compiling("train" if len(batches) == 1 else "accumulate", batches[0]):
            return self._step(batches)

    def _step(self, batches: list[tuple[tuple, tuple]]) -> torch.Tensor:
        settle(self)  # a meta model's weights, on first use
        if self.offload is not None:  # the host's copies, after a load or a first use
            self.offload.pull(self.device_trained())
        trained = self.trained()
        for p in trained.values():  # the last step's gradients go now, not at the end
            p.grad = None
        load.start()
        self._tangent = 1.0 / len(batches)
        losses = []
        for index, (args, targets) in enumerate(batches):
            self._batch = index
            losses.append(self._backward(args, targets, trained))
        self.step_count += 1
        self.routed = load.stepped(self.plan)
        mark("fwd+bwd")  # the peak so far, under shardfx.runtime.measure.measured_peak
        with stepping_on_host(self.offload, self.device_trained()):  # offloaded: there
            self.grad_norm = finish_step(self.optimizer, self.loss_scaler,
                                         self._norm_terms(trained), self.clip_grad_norm)
        if self.zero is not None:  # every replica's updated rows, gathered
            self.zero.after_step(self.stepped, self._dp.group_name)
        self._share_tied()
        release(trained.values(), self.keep_grads)
        return self._broadcast_loss(mean_loss(losses))

    def expert_load(self) -> dict[str, load.Routed]:
        """The last step's routing of this stage's mixture-of-experts layers over the whole
        batch (``Runner.expert_load``): every rank calls it."""
        groups = [self._dp] if self._dp is not None else []
        if self.tp is not None:
            groups += [self.tp.mesh.get_group(a) for a in BATCH_SPLIT
                       if self.tp.spec.axis(a) > 1]
        return load.over_batch(self.plan, self.routed, groups)

    def _backward(self, args: tuple, targets: tuple, trained: dict) -> torch.Tensor:
        """One batch through the schedule: its gradients added to the ``.grad`` of what this
        rank owns (ZeRO: its rows); returns its loss (this rank's part of it)."""
        flat = check_step_inputs(self.plan, args, targets)
        self._same_batch(flat)
        self._grads = {}
        weights = {fqn: p.detach() for fqn, p in self.params.items()} | self.buffers
        # replicas sum their gradients (each replica's tangent its share of the whole
        # batch's loss), each bucket issued as soon as its gradients are final
        # (runtime.buckets); ZeRO-2 reduce-scatters them into each replica's rows
        zero2 = self.zero is not None and self.zero.stage == 2
        if self._buckets is not None:
            self._buckets.start()
        loss = self._execute(self.program, self._steps, flat, weights)
        rows = {}
        if self._buckets is not None:
            reduced = self._buckets.finish()
            self.all_reduces = self._buckets.collectives
            if zero2:
                rows = reduced
            else:
                self._grads.update(reduced)
        for fqn, p in trained.items():
            g = self._grads.get(fqn) if fqn in self.owned else None
            if g is None:
                continue
            if fqn in self.stepped:  # this replica's rows
                g = rows[fqn] if zero2 else self.zero.rows(fqn, g)
            if self.offload is not None:  # to the host (added to an earlier batch's there)
                self.offload.receive(fqn, g)
            elif p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self._grads = {}  # ZeRO: the whole gradients go before the optimizer steps
        return loss

    def _norm_terms(self, trained: dict) -> list[Grad]:
        """The gradients this rank owns, each with whether it counts it in the global norm:
        over dp every replica holds the same (ZeRO: its rows), over tp as placed (decided
        once: the layouts do not change)."""
        if self._counted is None:
            axes = (("dp", self._dp_size),) + (self.tp.spec.axes if self.tp else ())
            coord = {"dp": self.dp_index, **(self.tp.coord if self.tp else {})}
            self._counted = {
                fqn: counted((Replicate(), *self.program.placements.get(fqn, ())), axes, coord,
                             "dp" if fqn in self.stepped else None) for fqn in self.owned}
        return [Grad(p.grad, self._counted[fqn]) for fqn, p in trained.items()
                if fqn in self.owned and p.grad is not None]

    def _execute(self, program: StageProgram, steps: list[Step], flat: list,
                 weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run this rank's steps once: each action's receives posted one action ahead and
        waited for before it (see the module docstring), then its parts, the span timed once
        its inputs are here."""
        self._store: dict[tuple, Any] = {}  # (part, output, microbatch) -> value on this rank
        self._sends: list = []
        self._outputs: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self._spans, self._held = [], []
        self._clock.start()
        loss = torch.zeros((), device=self.device)
        posted: dict[tuple, tuple] = {}  # key -> (buffer, work) of receives under way
        if steps:
            self._post(steps[0], posted)
        for index, step in enumerate(steps):
            for r in step.receives:  # other ranks' data first: the span is compute only
                self._store[r.key] = _arrived(*posted.pop(r.key))  # no name left holding it
            if index + 1 < len(steps):  # the next action's data comes in during this one
                self._post(steps[index + 1], posted)
            start = self._clock.now()
            for call in step.calls:
                loss += self._run(program, call, step.action.microbatch, flat, weights)
            self._spans.append((step.name, start, self._clock.now()))
            for key in step.frees:  # its last reader on this rank ran: let it go
                del self._store[key]
            self._sends = [w for w in self._sends if not w.is_completed()]
            if program is self.program and self._buckets is not None:
                for fqn in self._final[index]:  # no later action adds to them
                    self._buckets.final(fqn, self._grads)
            self._held.append(len({mb for part, _, mb in self._store if part.endswith("_F")}))
        for work in self._sends:
            work.wait()
        self._sends = []  # a finished send's work still holds its tensor: not to the step
        return loss

    def _post(self, step: Step, posted: dict[tuple, tuple]) -> None:
        """Post ``step``'s receives, each into a buffer of its own."""
        for r in step.receives:
            buf = torch.empty(r.shape, dtype=r.dtype, device=self.device)
            posted[r.key] = (buf, self._recv(buf, r.src))

    def _send(self, value: torch.Tensor, dst: int):
        """Post a send to pipeline rank ``dst`` on this direction's own group."""
        return dist.isend(value, self.ranks[dst], group=self._channels[(self.rank, dst)])

    def _recv(self, buf: torch.Tensor, src: int):
        return dist.irecv(buf, self.ranks[src], group=self._channels[(src, self.rank)])

    def _run(self, program: StageProgram, call, mb: int, flat: list,
             weights: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = [self._input(program, src, mb, flat, weights) for src in call.inputs]
        module, summed = self._summing(program, call)
        inputs += [self._grads[name] for name in summed.values()]
        with torch.no_grad():
            outs = runnable(module, self.device, self._compiled)(*inputs)  # a tuple, even of one
        loss = torch.zeros((), device=self.device)
        for o in call.outputs:
            value = outs[o.index]
            for role in o.roles:
                if role.kind is M.OutputKind.GRAD:
                    g = self._grads.get(role.name)
                    if g is None:  # the accumulator: later microbatches add in place
                        self._grads[role.name] = self._accumulator(program, call, o.index, value)
                    elif o.index not in summed:  # else the part added into it
                        g.add_(value)
                elif role.kind is M.OutputKind.LOSS:
                    loss = value.detach() / self.m if self._mean else value.detach()
                elif role.kind is M.OutputKind.BUFFER_UPDATE:
                    self.buffers[role.name].copy_(value)
                elif role.kind is M.OutputKind.OUTPUT:
                    self._outputs[role.index][mb] = value
            if o.local:
                self._store[(call.part, o.index, mb)] = value
            if o.sends:
                value = value.contiguous()
                self._sends += [self._send(value, dst) for dst in o.sends]
        return loss

    def _summing(self, program: StageProgram, call) -> tuple[Any, dict[int, str]]:
        """The module to run for ``call`` and the outputs it sums into their accumulators
        (output index -> parameter): the part's accumulating variant once every one of them
        exists (``codegen.accumulate_into``), else the part."""
        variant = program.accumulating(call.part)
        if variant is None or any(name not in self._grads for name in variant.names):
            return call.module, {}
        return variant.module, dict(zip(variant.indices, variant.names))

    def _kept_outputs(self) -> dict[str, frozenset[int]]:
        """Per part this rank runs, the gradient outputs it keeps as they are (decided once:
        ``memory_pipeline.owned_gradients``, which the memory model counts the same way)."""
        calls = {c.part: c for step in self._steps for c in step.calls}
        return {part: owned_gradients(getattr(self.program.module, part), c.outputs)
                for part, c in calls.items()}

    def _accumulator(self, program: StageProgram, call, index: int,
                     value: torch.Tensor) -> torch.Tensor:
        """A gradient's accumulator from its first microbatch's ``value``: the tensor itself
        where nothing else holds its storage, else a copy of its own (the sum must not show
        through a view, an input, another output or what a later part reads)."""
        if program is self.program and index in self._kept.get(call.part, ()):
            return value
        return value.clone()

    def _input(self, program: StageProgram, src: tuple, mb: int, flat: list,
               weights: dict[str, torch.Tensor]):
        if src[0] == "value":
            return self._store[(src[1], src[2], mb)]
        _, name, role = src
        if role.kind in (M.InputKind.PARAM, M.InputKind.BUFFER):
            return weights[role.name]
        if role.kind is M.InputKind.TANGENT:  # d(mean, or sum, of m losses)/d(one of them)
            # (and of every dp replica's: their gradients are summed)
            share = (1.0 / (self.m * self._dp_size) if self._mean else 1.0) * self._tangent
            return torch.full((), share * seed(self.loss_scaler),
                              dtype=program.input_val(name).dtype, device=self.device)
        if role.kind is M.InputKind.MESH:  # group(tp) / coord(tp)
            return self.tp.mesh_input(role)
        if role.kind is M.InputKind.CONSTANT:  # the same whole tensor on every device
            key = (id(program), name)
            if key not in self._constants:
                self._constants[key] = program.constants[name].to(self.device)
            return self._constants[key]
        if role.kind is M.InputKind.RNG:  # slice: this replica's microbatch mb, in batch order
            piece = (self._batch * self._dp_size + self.dp_index) * self.m + mb
            return rng_value(self.rng_seed, self.step_count, piece).to(self.device)
        mine = flat[role.index].chunk(self._dp_size)[self.dp_index]  # this replica's rows
        mine = mine.chunk(self.m)[mb]
        if self.tp is not None:  # megatron-sp: this tp rank's part of the sequence
            mine = self.tp.local(mine, program.placements.get(role.name, ()))
        return mine.to(self.device)  # moved: only this microbatch's

    # --- inference --------------------------------------------------------------------------

    def forward(self, args: tuple) -> Any:
        """The model's output for the global batch ``args``, on every rank: each microbatch
        through the stages' forward programs (a training plan's forward-only program, cut
        where the training plan keeps each weight), the outputs joined along the batch."""
        settle(self)
        flat = check_step_inputs(self.plan, args, (), inference=True)
        if self._forward is None:
            self._forward = self._compile_forward(flat[0].shape[0] // (self._dp_size * self.m))
        program, steps, spec, outputs = self._forward
        with self._compiling("infer", args):
            self._execute(program, steps, flat, self._inference_weights(program))
        leaves = []
        for role, owner, val in outputs:
            shape = (val.shape[0] * self.m, *val.shape[1:])
            if self.rank == owner:
                mine = torch.cat([self._outputs[role.index][mb] for mb in range(self.m)])
            else:
                mine = torch.empty(shape, dtype=val.dtype, device=self.device)
            dist.broadcast(mine, src=self.ranks[owner], group=self.pp)
            if self._dp is not None:  # every replica's rows, in order
                parts = [torch.empty_like(mine) for _ in range(self._dp_size)]
                dist.all_gather(parts, mine.contiguous(), group=self._dp)
                mine = torch.cat(parts)
            leaves.append(mine)
        return pytree.tree_unflatten(leaves, spec)

    def _compile_forward(self, rows: int) -> tuple:
        """The forward program, this rank's steps of it, the output structure, and per model
        output (role, producing rank, fake value of one microbatch's), checked batch-first."""
        split, ir, spec = self.plan.inference_stages()
        if split is self.plan.stage_program:  # an inference plan: its program is the one
            program, steps = self.program, self._steps
        else:
            schedule = forward_only(self.schedule.ranks, self.m,
                                    self.schedule.stages // self.schedule.ranks)
            program = StageProgram.of(split, ir, schedule)
            steps = program.steps(self.rank)
        outputs = []
        for (part, index), roles in program.finals.items():
            for role in (r for r in roles if r.kind is M.OutputKind.OUTPUT):
                val = program.out_val(part, index)
                if val.dim() == 0 or val.shape[0] != rows:
                    raise PipelineError(
                        f"model output {role.name} is {list(val.shape)} per microbatch, not "
                        f"batch-first ({rows} rows): its microbatches cannot be joined",
                        where="runner.forward", fix="return batch-first tensors from the model, "
                        "or plan inference without pp")
                outputs.append((role, program.rank_of(part), val))
        return program, steps, spec, sorted(outputs, key=lambda o: o[0].index)

    def _inference_weights(self, program: StageProgram) -> dict[str, torch.Tensor]:
        """The weights the forward program reads on this rank: the trained ones, resharded over
        tp where the forward program places them differently."""
        out, buffers = {}, dict(self.plan.model.named_buffers())
        for role in program.reads(self.rank).values():
            fqn = role.name
            if role.kind is M.InputKind.BUFFER:
                out[fqn] = self.buffers.get(fqn, buffers[fqn]).to(self.device)
            elif role.kind is M.InputKind.PARAM:
                if fqn not in self.params:
                    raise PipelineError(
                        f"the forward program reads {fqn} on pipeline rank {self.rank}, which "
                        "does not train it", where="runner.forward",
                        fix="plan inference on its own: shardfx.partition(model, args, mesh=...)")
                local = self.params[fqn].detach()
                want = program.placements.get(fqn, ())
                if self.tp is not None and want != self.program.placements.get(fqn, ()):
                    local = self.tp.local(self.full(fqn, local), want)
                out[fqn] = local
        return out

    # --- weights read by several stages, the loss -----------------------------------------------

    def _tied_parameters(self) -> list[tuple[str, int, list[int]]]:
        """(FQN, owning pipeline rank, reading ranks) of each parameter several ranks read;
        worked out once, used after every step."""
        out = []
        for fqn in sorted({r.name for r in self.program.roles.values()
                           if r.kind is M.InputKind.PARAM}):
            readers = self.program.readers(fqn)
            owner = self.program.producer(M.OutputKind.GRAD, fqn)
            if owner is not None and len(readers) > 1:
                out.append((fqn, owner, readers))
        return out

    def _share_tied(self) -> None:
        """A parameter several stages read is updated by its owner, then sent to the others."""
        for fqn, owner, readers in self._tied:
            p = self.params.get(fqn)
            for r in readers:
                if r != owner and self.rank == owner:
                    self._send(p.detach().contiguous(), r).wait()
                elif r == self.rank and r != owner:
                    buf = torch.empty_like(p)
                    self._recv(buf, owner).wait()
                    with torch.no_grad():
                        p.copy_(buf)

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        last = self.schedule.rank_of(self.schedule.stages - 1)
        dist.broadcast(loss, src=self.ranks[last], group=self.pp)
        if self._dp is not None:  # the batch's loss: over data-parallel replicas
            dist.all_reduce(loss, group=self._dp)
            if self._mean:
                loss /= self._dp_size
        return loss

    # --- the timeline -----------------------------------------------------------------------

    def timeline(self) -> list[list[tuple[str, float, float]]]:
        """Every rank's (action, start, end) of the last step, in seconds from the step's start
        (a collective: call it on every rank)."""
        mine = [(a, self._clock.seconds(b), self._clock.seconds(e)) for a, b, e in self._spans]
        spans: list = [None] * len(self.ranks)
        dist.all_gather_object(spans, mine, group=self.pp)
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

    def _replica_buckets(self) -> ReplicaBuckets | None:
        """The reductions over dp the compiler emitted for this rank's stages."""
        if self._dp is None or self.plan.mode is not M.Mode.TRAIN:
            return None
        return ReplicaBuckets(self._reductions(), self._dp.group_name, self.device)

    def _reductions(self) -> dict:
        """Stage -> its ``codegen.replicas.Reduction``, for this rank's stages."""
        return {s: r for s, r in self.plan.stage_program.meta.get(M.REPLICAS, {}).items()
                if self.schedule.rank_of(s) == self.rank}

    def _zero_rows(self, plan) -> ZeroRows | None:
        """ZeRO-1/2 over the dp replicas: the rows of each parameter this rank owns."""
        if not plan.options.zero:
            return None
        whole = {fqn: self.params[fqn] for fqn in self.owned}
        layouts = {fqn: M.ZeroShard(tuple(t.shape), self._dp_size) for fqn, t in whole.items()}
        gather = [g for _, r in sorted(self._reductions().items()) for g in r.gathers]
        for program in gather:
            place(program.module, self.device)
        return ZeroRows(layouts, plan.options.zero, self.dp_index, self._dp, gather)


def _arrived(buf: torch.Tensor, work) -> torch.Tensor:
    """``buf`` once its receive ``work`` is done."""
    work.wait()
    return buf
