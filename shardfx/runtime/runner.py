"""The runner: executes a plan's generated program for training steps and inference.

On one device the runner binds the program's parameter and buffer inputs to the model's own
tensors and updates them in place, as an eager training loop would: the user's optimizer gets
the model's ``nn.Parameter`` objects, their ``.grad`` holds each step's gradients until its
optimizer step (the last step's after it, with ``keep_grads``), and the model sees the trained weights (moved to ``plan.device`` first, when they are elsewhere). On a
mesh each rank keeps its own shard of every parameter on its device (new ``nn.Parameter``
objects: the optimizer steps on shards), cuts its slice of each global batch and moves it
there, and ``state_dict`` gathers full tensors. The program itself, not the original module,
computes the step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.codegen.accumulate_into import Accumulating, accumulating
from shardfx.codegen.gradients_to_host import receiving
from shardfx.codegen.program import Program
from shardfx.codegen.step_in_backward import stepping
from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.runtime.measure import mark
from shardfx.runtime.offload import Offload, stepping_on_host
from shardfx.kernels import expert_load as load
from shardfx.kernels.expert_load import BATCH_SPLIT
from shardfx.runtime.accumulate import accumulated, mean_loss, slices, sum_loss
from shardfx.runtime.loss_scale import loss_scaler, seed
from shardfx.runtime.optimizer_step import (Grad, check_kept, clip_limit, counted, finish_step,
                                            release)
from shardfx.cost.optimizer import check_optimizer, grads_laid_out_as_params
from shardfx.passes.rng import draw_seed, reads_rng, rng_value
from shardfx.runtime.checks import SameBatch, check_step_inputs, make_optimizer, same_plan
from shardfx.codegen.steps import Output
from shardfx.kernels.device import check_weights, move
from shardfx.runtime.heap import keep_freed_memory
from shardfx.runtime.lowered import Compiling, runnable
from shardfx.runtime.materialize import (InitFn, Initializer, Unmade, made_later, on_meta,
                                         settle)
from shardfx.runtime.shards import Shards
from shardfx.runtime import hf_load, hf_save, saving
from shardfx.runtime.saving import Held, offsets, parts, zero_held
from shardfx.runtime.zero import ZeroRows

if TYPE_CHECKING:
    from pathlib import Path

    from shardfx.plan import Plan

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class Runner:
    def __init__(self, plan: "Plan", optimizer: OptimizerFactory | None = None,
                 loss_scaling=None, clip_grad_norm: float | None = None,
                 keep_grads: bool = False, init_seed: int = 0, init: InitFn | None = None):
        self.plan = plan
        self.keep_grads = keep_grads  # .grad after the step; freed with it otherwise
        self._in_backward = plan.options.optimizer_in_backward  # codegen.step_in_backward
        self._compiled = plan.options.kernels == "compiled"  # runtime.lowered
        self._compiling = Compiling(self._compiled, plan.mesh.size)  # its calls that compile
        self._stepped_grads: dict[str, torch.Tensor] = {}  # keep_grads: stepped in the backward
        if self._in_backward and clip_grad_norm is not None:
            raise InputError("this plan steps the optimizer in the backward, before the global "
                             "gradient norm could be known: it cannot clip by it",
                             where="plan.runner(..., clip_grad_norm=...)",
                             fix="clip_grad_norm=None, or a plan without optimizer_in_backward")
        model = plan.model
        self._params = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        self.device = plan.device
        check_weights(model, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # runtime.heap
        self._shards = Shards(plan.mesh) if plan.mesh.size > 1 else None
        same_plan(plan)  # runtime.checks: every rank would issue the same collectives
        self._placements = _placements(plan.program)
        self._zero = None if not plan.options.zero else ZeroRows(
            plan.zero_layouts, plan.options.zero, self._shards.coord["dp"],
            self._shards.mesh.get_group("dp"), plan.zero_gather_programs)
        self._stepped: dict[str, torch.nn.Parameter] = {}  # ZeRO: the rows the optimizer steps
        # a meta model's parameters this rank has not made yet, and how (materialize.settle)
        self.unmade = Unmade(Initializer(model, init_seed, init))
        if self._shards is None:
            if on_meta(model):  # one device holds the whole model: made in place, on first use
                self.unmade.names = made_later(model, self.unmade.initializer, self.device)
            if any(t.device != self.device for t in [*model.parameters(), *model.buffers()]):
                move(model, self.device)  # on CUDA the same Parameter objects
            self._params = dict(model.named_parameters())
            self._buffers = dict(model.named_buffers())
        else:
            self._params = {name: self._hold(name, p) for name, p in self._params.items()}
            self._buffers = {name: self._whole(name, b).to(self.device)
                             for name, b in self._buffers.items()}
        self._constants: dict[fx.Node, torch.Tensor] = {}  # on this device, made once
        # offload_optimizer: what the optimizer steps, its gradients and its state on the host
        self.offload = Offload(self._device_trained(), self.device) \
            if plan.options.offload_optimizer and plan.mode is M.Mode.TRAIN else None
        self.optimizer = make_optimizer(optimizer, list(self._trained().values()))
        if self.optimizer is not None and plan.mode is M.Mode.TRAIN:
            check_optimizer(plan.options.optimizer, self.optimizer)
        self.loss_scaler = loss_scaler(plan.options.precision, loss_scaling)
        self._same_batch = SameBatch(plan)
        # random draws (dropout, noise): [seed, step, 0] (passes.rng); the seed agreed once by every rank
        # the seed of this runner's random stream (``passes.rng``; 0 when the program draws
        # nothing): with ``step_count``, what ``random_draws.on_stream_eagerly`` replays
        self.rng_seed = draw_seed() if reads_rng(plan.program.module) else 0
        self.step_count = 0  # steps taken: random draws depend on it; set it when resuming
        self.clip_grad_norm = clip_limit(clip_grad_norm)
        self.grad_norm: float | None = None  # the last step's, before clipping (when clipping)
        self._tangent, self._batch = 1.0, 0  # of the batch running: its share, its index
        self._counted: dict[str, bool] | None = None  # per stepped tensor, for the norm
        self.routed: dict[str, load.Routed] = {}  # the last step's MoE routing, this rank's

    # --- training and inference -------------------------------------------------------------

    def step(self, args: tuple, targets: tuple = ()) -> torch.Tensor:
        """One training step on the global batch; returns the loss."""
        return self.step_batches([(args, targets)])

    def step_batches(self, batches) -> torch.Tensor:
        """One training step over several global batches (gradient accumulation): each
        batch's forward and backward, their gradients averaged, then one optimizer step;
        returns the mean of their losses (module ``runtime.accumulate``). A plan of
        ``microbatches=m`` runs each batch as m slices of its rows, one after the other,
        accumulated the same way (their losses' mean, or sum: ``Options.loss_reduction``)."""
        batches = accumulated(batches)
        with self._compiling("train" if len(batches) == 1 else "accumulate", batches[0]):
            return self._step(batches)

    def _step(self, batches: list[tuple[tuple, tuple]]) -> torch.Tensor:
        settle(self)  # a meta model's weights, on first use
        if self.offload is not None:  # the host's copies, after a load or a first use
            self.offload.pull(self._device_trained())
        if self._in_backward and len(batches) > 1:
            raise InputError(
                f"this plan steps the optimizer in the backward: it cannot accumulate "
                f"{len(batches)} batches into one step", where="runner.step_batches(batches)",
                fix="one batch per step, or a plan without optimizer_in_backward")
        trained = self._trained()
        for p in trained.values():  # the last step's gradients go before this one's come
            p.grad = None
        load.start()
        m = self.plan.options.microbatches  # slices of each batch, one after the other
        mean = self.plan.options.loss_reduction == "mean"  # else the slices' losses add up
        # d(mean of the batches' losses)/d(one slice's loss)
        self._tangent = (1.0 / m if mean else 1.0) / len(batches)
        losses = []
        for index, (args, targets) in enumerate(batches):
            flat = check_step_inputs(self.plan, args, targets)
            self._same_batch(flat)
            pieces = []
            for k, piece in enumerate(slices(flat, m)):
                self._batch = index * m + k  # its random draws: its rows' in the batch
                into = self._accumulators(trained) if self._batch else {}
                outs = self._run(self.plan.program, piece, into)
                pieces.append(next(v for r, v in outs if r.kind is M.OutputKind.LOSS))
                self._set_grads(trained, {r.name: v for r, v in outs
                                          if r.kind is M.OutputKind.GRAD and r.name not in into})
                del outs  # ZeRO-1: the whole gradients (views of their buckets) go before
            losses.append(mean_loss(pieces) if mean else sum_loss(pieces))  # the step
        self.step_count += 1
        self.routed = load.stepped(self.plan)
        mark("fwd+bwd")  # the peak so far, under shardfx.runtime.measure.measured_peak
        if not self._in_backward:  # else each block stepped in the program (step_in_backward)
            with stepping_on_host(self.offload, self._device_trained()):  # offloaded: there
                self.grad_norm = finish_step(self.optimizer, self.loss_scaler,
                                             self._norm_terms(trained), self.clip_grad_norm)
        for name, g in self._stepped_grads.items():
            trained[name].grad = g
        self._stepped_grads = {}
        if self._zero is not None:  # ZeRO-1, 2: every rank's updated rows, gathered
            self._zero.after_step(self._stepped, self._shards.groups["dp"])
        release(trained.values(), self.keep_grads)
        return mean_loss(losses)

    def _set_grads(self, trained: dict, grads: dict) -> None:
        """Each stepped tensor's ``.grad`` from the program's gradients (ZeRO: this rank's
        rows), added to an earlier batch's, in a call of its own: nothing here keeps a whole
        gradient alive after it."""
        for name, p in trained.items():
            g = grads.get(name)
            if g is None:
                continue
            if name in self._stepped:
                g = self._zero.grad(name, g)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def _norm_terms(self, trained: dict) -> list[Grad]:
        """This rank's gradients, each with whether it counts it in the global norm (decided
        once: the layouts do not change)."""
        if self._counted is None:
            axes = self.plan.mesh.axes
            coord = self._shards.coord if self._shards is not None else {}
            self._counted = {name: counted(self._placements.get(name, ()), axes, coord,
                                           "dp" if name in self._stepped else None)
                             for name in trained}
        return [Grad(p.grad, self._counted[name]) for name, p in trained.items()
                if p.grad is not None]

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (fp16 plans; ``shardfx.runtime.loss_scale``), else None."""
        return None if self.loss_scaler is None else self.loss_scaler.scale

    def forward(self, args: tuple) -> Any:
        """The model's output for ``args``, computed by the inference program."""
        settle(self)
        flat = check_step_inputs(self.plan, args, (), inference=True)
        program, out_spec = self.plan.inference_program()
        with self._compiling("infer", args):
            outs = sorted((r.index, v) for r, v in self._run(program, flat)
                          if r.kind is M.OutputKind.OUTPUT)
        return pytree.tree_unflatten([v for _, v in outs], out_spec)

    def _accumulators(self, trained: dict) -> dict[str, torch.Tensor]:
        """Gradient accumulation, after the first batch: the ``.grad`` of each parameter whose
        gradient the program's accumulating variant adds in place (``codegen.accumulate_into``:
        a matmul's or an embedding's, not made anew), when it has one and all of them exist.
        ZeRO steps rows of the gradients, which the program does not make: none there."""
        variant = self._summing
        if variant is None or self._zero is not None or self.offload is not None:
            return {}  # (offloaded: the host adds each batch's gradients)
        grads = {name: trained[name].grad for name in variant.names if name in trained}
        return grads if all(g is not None for g in grads.values()) and \
            len(grads) == len(variant.names) else {}

    @functools.cached_property
    def _summing(self) -> Accumulating | None:
        program = self.plan.program
        return accumulating(program.module, [Output(i, (r,), False, []) for i, r in
                                             enumerate(program.outputs)
                                             if r.kind is M.OutputKind.GRAD])

    def _run(self, program: Program, flat: list[torch.Tensor],
             into: dict[str, torch.Tensor] | None = None) -> list[tuple[M.OutputRole, Any]]:
        """Run ``program``; apply its buffer updates; return its other outputs with their roles.
        ``into``: accumulators, by gradient: run the program's accumulating variant, which adds
        those gradients into them."""
        placeholders = program.module.graph.find_nodes(op="placeholder")
        inputs = [self._input(r, n, flat) for r, n in zip(program.inputs, placeholders)]
        module = program.module
        if into:
            variant = self._summing
            module = variant.module
            inputs += [into[name] for name in variant.names]
        with torch.no_grad(), stepping(self._step_in_backward), receiving(self._receive):
            values = runnable(module, self.device, self._compiled)(*inputs)
        outs = []
        for role, value in zip(program.outputs, values):
            if role.kind is M.OutputKind.BUFFER_UPDATE:
                self._buffers[role.name].copy_(value)
            else:
                outs.append((role, value))
        return outs

    def _input(self, role: M.InputRole, node, flat: list[torch.Tensor]) -> torch.Tensor:
        if role.kind is M.InputKind.PARAM:
            value = self._params[role.name].detach()
            if role.name in self._stepped and self._zero.stage == 3 and M.ZERO not in node.meta:
                value = self._zero.whole(role.name, value)  # a program without ZeRO's gathers
            return value
        if role.kind is M.InputKind.BUFFER:
            return self._buffers[role.name]
        if role.kind is M.InputKind.TANGENT:  # d(loss)/d(loss), times the loss scale
            return torch.full((), seed(self.loss_scaler) * self._tangent,
                              dtype=node.meta[M.VAL].dtype, device=self.device)
        if role.kind is M.InputKind.MESH:
            return self._shards.mesh_input(role)
        if role.kind is M.InputKind.CONSTANT:  # the same whole tensor on every device
            if node not in self._constants:
                self._constants[node] = node.meta[M.CONSTANT].value.to(self.device)
            return self._constants[node]
        if role.kind is M.InputKind.RNG:  # the same on every device: masks follow global places
            return rng_value(self.rng_seed, self.step_count, self._batch).to(self.device)
        if self._shards is not None:  # this rank's slice, then moved: not the whole batch
            return self._shards.local(flat[role.index], node.meta[M.ANNOTATION]).to(self.device)
        return flat[role.index].to(self.device)

    # --- state ------------------------------------------------------------------------------

    def expert_load(self) -> dict[str, load.Routed]:
        """The last step's routing of each mixture-of-experts layer (tokens per expert, tokens
        dropped), over the whole batch: every rank calls it (``kernels.expert_load``)."""
        batch = [self._shards.mesh.get_group(a) for a in BATCH_SPLIT
                 if self.plan.mesh.axis(a) > 1]
        return load.over_batch(self.plan, self.routed, batch)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the model's own FQNs (tied weights under each of their names)."""
        settle(self)
        tensors = {**self._params, **self._buffers}
        return {fqn: self._full(self.plan.canonical(fqn), tensors) for fqn in self.plan.state_names}

    def whole(self, fqn: str) -> torch.Tensor:
        """The full tensor ``fqn`` of the model's state dict, on every rank: one tensor's
        collectives (``save_hf`` writes a model one tensor at a time)."""
        settle(self)
        return self._full(self.plan.canonical(fqn), {**self._params, **self._buffers})

    def _full(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        local = tensors[name].detach()
        if self._shards is None:
            return local
        if self._zero is not None and self._zero.stage == 3 and name in self._stepped \
                and tensors[name] is self._params[name]:
            local = self._zero.whole(name, local)  # every rank's rows
        return self._shards.full(local, self._placements.get(name, ()))

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's gradients, full tensors by parameter FQN (tied weights once):
        a runner made with ``keep_grads=True`` keeps them."""
        check_kept(self.keep_grads)
        out = {}
        for name, p in self._trained().items():
            if p.grad is not None:
                g = p.grad.to(self.device)  # (offloaded: from the host)
                g = self._zero.whole(name, g) if name in self._stepped else g
                out[name] = self._full(name, {name: g})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        tensors = {**self._params, **self._buffers}
        local = (lambda name, t: t) if self._shards is None else self._local
        load_state(self.plan, state, tensors, local)
        self.unmade.filled()  # every tensor filled (load_state checks the names first)
        self._changed()

    def _changed(self) -> None:
        """The device's tensors are changing other than by a step: offloaded, the host's
        copies are filled from them again before the next step."""
        if self.offload is not None:
            self.offload.stale = True

    def _local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full``: its tp shard, and under ZeRO-3 its rows of that."""
        local = self._shards.local(full, self._placements.get(name, ()))
        if self._zero is not None and self._zero.stage == 3 and name in self._stepped:
            local = self._zero.rows(name, local)
        return local

    def _hold(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        """What this rank keeps of the model's parameter ``p`` on its device: its tp shard, as
        a new ``nn.Parameter``; under ZeRO, its rows of it (``runtime.zero``)."""
        placements = self._placements.get(name, ())
        if p.is_meta:  # made on first use (materialize.settle), or filled by a load
            self.unmade.names.add(name)
            shape = self._shards.local(p.detach(), placements).shape
            local = torch.empty(shape, dtype=p.dtype, device=self.device)
        else:
            local = self._shards.local(p.detach(), placements)
        if self._zero is not None and name in self._zero.layouts:  # it copies the rows it keeps
            read, self._stepped[name] = self._zero.hold(name, local.to(self.device), p.is_meta)
            return read
        if not p.is_meta:  # a copy of its part, not a view of the model's tensor
            local = local.to(self.device, copy=True)
        return torch.nn.Parameter(local, requires_grad=p.requires_grad)

    def _whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The model's buffer ``name``, or on meta its value made now (``runtime.materialize``)."""
        return self.unmade.initializer.value(name) if t.is_meta else t.detach()

    def _step_in_backward(self, names: tuple[str, ...], grads: tuple) -> None:
        """The program's ``step_parameters`` (``codegen.step_in_backward``): the optimizer
        steps these parameters alone (its step skips those without ``.grad``), then their
        gradients go (``keep_grads``: set aside, their ``.grad`` after the step)."""
        if self.optimizer is None:
            return
        trained = self._trained()
        for name, g in zip(names, grads):
            trained[name].grad = self._zero.grad(name, g) if name in self._stepped else g
        grads_laid_out_as_params(self.optimizer)
        self.optimizer.step()
        for name in names:  # later steps must not step them again
            if self.keep_grads:  # given back as .grad once the step is over (step_batches)
                self._stepped_grads[name] = trained[name].grad
            trained[name].grad = None

    def _receive(self, names: tuple[str, ...], grads: tuple) -> None:
        """The program's ``gradients_to_host`` (``codegen.gradients_to_host``): each gradient
        (ZeRO-1: this rank's rows cut from it) into its host copy's ``.grad``."""
        for name, g in zip(names, grads):
            self.offload.receive(name, self._zero.grad(name, g) if name in self._stepped else g)

    def _trained(self) -> dict[str, torch.nn.Parameter]:
        """The tensors the optimizer steps, by FQN: the parameters, or ZeRO's rows of them;
        offloaded, their copies on the host."""
        return self.offload.masters if self.offload is not None else self._device_trained()

    def _device_trained(self) -> dict[str, torch.nn.Parameter]:
        """The device's tensors the optimizer's updates land in: the parameters, or ZeRO's
        rows of them."""
        return {**self._params, **self._stepped}

    def save(self, path, **meta) -> "Path":
        """Write this runner's training state to the checkpoint ``path``, on every rank, all
        or nothing (``runtime.saving``); ``meta``: JSON entries of your own, given back by
        ``load``."""
        return saving.save(self, path, meta)

    def load(self, path, allow_nonfinite: bool = False) -> dict:
        """Load the checkpoint at ``path`` (saved on any mesh) into this runner, on every rank;
        returns its meta (``runtime.saving``). NaN or Inf in a parameter or the optimizer's
        state is an error naming the tensors, unless ``allow_nonfinite``."""
        self._changed()
        return saving.load(self, path, allow_nonfinite)

    def load_hf(self, path, allow_nonfinite: bool = False) -> None:
        """Fill this rank's tensors from the Hugging Face checkpoint directory ``path``
        (``save_pretrained``'s safetensors), reading only its slices of each tensor
        (``runtime.hf_load``); on every rank. NaN or Inf in a tensor is an error naming it,
        unless ``allow_nonfinite``."""
        self._changed()
        hf_load.load_hf(self, path, allow_nonfinite)

    def save_hf(self, path, max_shard_bytes: int = hf_save.SHARD_BYTES) -> "Path":
        """Write the model as a Hugging Face checkpoint directory ``from_pretrained`` loads,
        each rank its share of the files, one whole tensor at a time (``runtime.hf_save``);
        on every rank, all or nothing."""
        return hf_save.save_hf(self, path, max_shard_bytes)

    def holdings(self, made: bool = True) -> tuple[dict, dict]:
        """What this rank holds, for a checkpoint: per FQN of a parameter or buffer, the tensor
        and where it sits in the whole one; per parameter the optimizer steps, that tensor and
        where (``runtime.saving``). ``made=False``: as they are, a meta model's weights maybe
        not made yet (to be filled)."""
        if made:
            settle(self)
        axes = self.plan.mesh.axes
        coord = self._shards.coord if self._shards is not None else {}
        zero = self._zero.layouts if self._zero is not None else {}
        model, stepped = {}, {}
        trained = self._trained()  # what the optimizer's state is kept for
        for name, t in {**self._params, **self._buffers}.items():
            placements = self._placements.get(name, ())
            shape = zero[name].shape if name in zero else t.shape
            at = offsets(shape, placements, axes, coord)
            split = parts(shape, placements, axes, coord)
            model[name] = zero_held(t, zero[name], self._zero.index, at, split) \
                if name in zero and self._zero.stage == 3 else Held(t, at, parts=split)
            if name in zero:
                stepped[name] = (trained[name],
                                 zero_held(self._stepped[name], zero[name], self._zero.index, at,
                                           split))
            elif name in self._params:
                stepped[name] = (trained[name], model[name])
        return model, stepped

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """What the optimizer steps: this rank's parameters (its tp shards; under ZeRO, its
        rows of them); offloaded, their copies on the host."""
        settle(self)
        return self._trained().values()

    def device_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The device's tensors the optimizer's updates land in (``parameters()`` unless the
        optimizer is offloaded: then those are the host's copies)."""
        settle(self)
        return self._device_trained().values()


def load_state(plan: "Plan", state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
               local: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """Copy a full state dict (the model's FQNs) into a runner's ``tensors`` (canonical FQN ->
    this rank's tensor; names it lacks are another rank's), ``local`` cutting this rank's
    shard. The whole state dict is checked against the model's full shapes before anything is
    cut or copied: a state dict of another model is an error naming the difference, and
    nothing is loaded."""
    where = "runner.load_state_dict"
    fix = "load a state dict of the same model configuration (runner.state_dict() or " \
          "model.state_dict())"
    if not isinstance(state, Mapping):
        raise InputError(f"a state dict maps names to tensors, got {type(state).__name__}",
                         where=where, fix=fix)
    names = set(plan.state_names)
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise InputError(
            f"state dict does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}", where=where, fix=fix)
    for fqn in plan.state_names:
        src, full = state[fqn], plan.state_shapes[fqn]
        if not isinstance(src, torch.Tensor):
            raise InputError(f"{fqn} is {type(src).__name__} {src!r:.40} in the state dict, not "
                             "a tensor", where=f"{where}, {fqn}", fix=fix)
        if tuple(src.shape) != full:
            raise InputError(f"{fqn} has shape {list(src.shape)} in the state dict, "
                             f"{list(full)} in the model", where=f"{where}, {fqn}", fix=fix)
    for fqn in plan.state_names:
        name = plan.canonical(fqn)
        if name in tensors:
            with torch.no_grad():
                tensors[name].copy_(local(name, state[fqn]))


def _placements(program: Program) -> dict[str, M.Placements]:
    """Parameter and buffer FQN -> placements, as the program's inputs declare them."""
    return {n.meta[M.ROLE].name: n.meta[M.ANNOTATION]
            for n in program.module.graph.find_nodes(op="placeholder") if M.ANNOTATION in n.meta}
