"""A plan: what shardfx decided for a model and mesh, ready to print, dump, and run."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.estimate.analysis import Summary, device_flops, summarize
from shardfx.auto import zero_stage
from shardfx.compiler.budget import Candidate, fit_budget, fit_zero_stage
from shardfx.kernels.linear_ce import LinearCrossEntropy
from shardfx.codegen import zero as zero_codegen
from shardfx.codegen.program import Program
from shardfx.kernels.triton import FusedKernel
from shardfx.cost.device_model import DeviceModel, default_model
from shardfx.errors import InputError, MemoryBudgetError, PipelineError
from shardfx.report.html import plan_html
from shardfx.ir import meta as M
from shardfx.cost.optimizer import optimizer_model
from shardfx.estimate.memory import DeviceMemory, spmd_memory
from shardfx.estimate.memory_pipeline import pipeline_memory
from shardfx.mesh import MeshSpec
from shardfx.report.experts import expert_layers, notes as expert_notes
from shardfx.report.notes import memory_notes
from shardfx.partitioner.capture import (Captured, canonical_names, capture, describe,
                                        microbatch)
from shardfx.partitioner.microbatching import check_rows_independent
from shardfx.passes.fused_loss import FusedLoss, fusable, fusing_reason
from shardfx.ir.frozen import freeze
from shardfx.compiler.manager import PassRecord, record
from shardfx.request.options import Options
from shardfx.auto.remat import Choice
from shardfx.passes.shard_annotate import sequence_split
from shardfx.passes.stage_cut import stage_report, weight_stages
from shardfx.passes.zero import zero_layouts
from shardfx.kernels.device import place
from shardfx.compiler.driver import compile_ir, deferred_codegen
from shardfx.report.summary import render
from shardfx.runtime.compiled import StageProgram
from shardfx.runtime.loss_scale import LossScaling
from shardfx.runtime.pipeline import PipelineRunner
from shardfx.runtime.runner import OptimizerFactory, Runner
from shardfx.schedule import GENERATORS, Schedule, check, forward_only, generate
from shardfx.estimate.step_time import PredictedStep, predict_step
from shardfx.compiler.budget import _evaluate
from shardfx.report.explain import notes
from shardfx.auto.shard import AUTO
from shardfx.passes.shard_annotate import megatron_placements


class Plan:
    def __init__(self, model: torch.nn.Module, example_args: tuple, captured: Captured,
                 mesh: MeshSpec, options: Options):
        self.model = model
        self.mesh = mesh
        self.options = options
        self._example_args = example_args
        self._captured = captured
        auto_fused = options.fused_loss == "auto"
        if auto_fused:  # planned without, then fused if the memory it saves matters
            options = self.options = dataclasses.replace(options, fused_loss=False)
        self.fused_loss_reason = ""  # why "auto" fused the LM head ("" if it did not)
        self.ir, program, self.history, self.collectives = compile_ir(captured.gm, options)
        self.zero_chosen = options.zero == "auto"  # the stage below chosen by the plan
        options = self.options = zero_stage.resolve(self.ir, options)
        self.program: Program | None = program
        self.stage_program = self.schedule = None
        self.mode: M.Mode = self.ir.meta[M.GRAPH].mode
        if options.stages > 1 and self.mode is M.Mode.TRAIN and options.slices > 1:
            check_rows_independent(self.ir, options.slices)  # each slice's forward sees its rows only
        if options.stages > 1:  # per-stage parts, run in the order of a schedule
            self.program, self.stage_program = None, program
            pp, m, v = self.mesh.axis("pp"), options.microbatches, options.virtual_stages
            self.schedule = forward_only(pp, m, v) if self.mode is M.Mode.INFER else \
                pipeline_schedule(options.schedule, pp, m, v)
        self.remat: Choice | None = None
        # (scope, {layer: moe.load.Routed}) of the last step a runner took, for print(plan)
        self.routing: tuple[str, dict] | None = None
        self.budget_candidates: list[Candidate] = []  # a pipeline's schedules tried
        self.program_records: list[PassRecord] = []  # the budget's last emission's passes
        self._memory: dict[int, DeviceMemory] | None = None
        if auto_fused and self.mode is M.Mode.TRAIN:
            self._choose_fused_loss()
        if options.memory_budget is not None:
            self._fit_budget(options.memory_budget)
        state = model.state_dict()
        self.state_names = tuple(state)
        self.state_shapes = {fqn: tuple(t.shape) for fqn, t in state.items()}  # full, unsharded
        self._canonical = canonical_names(model)
        self._inference: tuple[Program, pytree.TreeSpec] | None = None
        self._inference_stages: tuple | None = None
        if self.mode is M.Mode.INFER:
            self._inference = (self.program, captured.out_spec)

    @property
    def device(self) -> torch.device:
        """Where this process's programs run, weights and batch slices included
        (``runtime.device``: ``partition(..., device=)``, else ``cuda:LOCAL_RANK`` under NCCL,
        else the model's device when it was planned)."""
        return self.options.device

    # --- running ----------------------------------------------------------------------------

    @cached_property
    def zero_layouts(self) -> dict[str, M.ZeroShard]:
        """Under ``zero=k``: each parameter the optimizer steps, by FQN, and how ZeRO holds it
        over dp (``passes.zero``); empty otherwise."""
        if not self.options.zero or self.program is None:
            return {}
        return zero_layouts(self.program, self.mesh.axis("dp"))

    @cached_property
    def zero_gather_programs(self) -> list[Program]:
        """zero=1, 2: the programs that gather every rank's updated rows after the optimizer
        step, one per bucket (``codegen.zero.gather_programs``); none otherwise."""
        if self.options.zero not in (1, 2) or self.program is None:
            return []
        programs = zero_codegen.program_gathers(self.program, self.zero_layouts,
                                                self.mesh.axis("dp"))
        for program in programs:
            place(program.module, self.device)
        return programs

    def runner(self, optimizer: OptimizerFactory | None = None,
               loss_scaling: "LossScaling | bool | None" = None,
               clip_grad_norm: float | None = None, keep_grads: bool = False) -> Runner:
        """A runner for this plan; ``optimizer`` maps the parameters to a torch optimizer.
        ``loss_scaling``: dynamic loss scaling (``runtime.loss_scale``); None scales fp16
        plans only, False never, True or a ``LossScaling`` always. ``clip_grad_norm``: clip
        the global gradient norm to it before each optimizer step, as
        ``torch.nn.utils.clip_grad_norm_`` on one device (``runtime.optimizer_step``; the norm
        before clipping is ``runner.grad_norm``). Each step's gradients are freed after its
        optimizer step, as ``zero_grad(set_to_none=True)``; ``keep_grads=True`` keeps them in
        each parameter's ``.grad`` until the next step (and for ``runner.grads()``)."""
        if self.stage_program is not None:
            return PipelineRunner(self, optimizer, loss_scaling, clip_grad_norm, keep_grads)
        return Runner(self, optimizer, loss_scaling, clip_grad_norm, keep_grads)

    def inference_program(self) -> tuple[Program, pytree.TreeSpec]:
        """The forward-only program (captured on first use for a training plan)."""
        if self._inference is None:
            with deferred_codegen():
                captured = capture(self.model, self._example_args,
                                   capacity=self.options.capacity_factor)
                _, program, _, _ = compile_ir(captured.gm, self.options)
            self._inference = (program, captured.out_spec)
        return self._inference

    def inference_stages(self) -> tuple[fx.GraphModule, fx.GraphModule, pytree.TreeSpec]:
        """A pipeline plan's forward-only per-stage program, the IR it was split from and the
        model output's structure. For a training plan it is captured on first use and cut where the
        training plan keeps each weight (``Options.follow_stages``), so every rank runs it on
        the parameters it trains."""
        if self._inference_stages is None:
            if self.mode is M.Mode.INFER:
                split, ir, spec = self.stage_program, self.ir, self._captured.out_spec
            else:
                options = dataclasses.replace(self.options, follow_stages=weight_stages(self.ir))
                with deferred_codegen():
                    captured = capture(self.model, microbatch(self._example_args, (),
                                                              self.options.slices)[0],
                                       capacity=self.options.capacity_factor)
                    ir, split, _, _ = compile_ir(captured.gm, options)
                spec = captured.out_spec
            self._inference_stages = (split, ir, spec)
        return self._inference_stages

    @property
    def input_names(self) -> tuple[str, ...]:
        """A step's flat inputs by name: ``args[0]``, ..., ``targets[0]``, ..."""
        return tuple(s.name for s in self._captured.leaves)

    def check_inputs(self, args: Any, targets: Any, inference: bool = False) -> list[torch.Tensor]:
        """Flatten a step's inputs, checking them against what the plan was captured with:
        structure, then each tensor's shape, dtype and device (the plan's, or the CPU), and that
        a training step has a training plan."""
        where = "runner.forward" if inference else "runner.step"
        if not inference and self.mode is not M.Mode.TRAIN:
            raise InputError("this plan was built for inference (no loss_fn)",
                             where=where, fix="call partition(..., loss_fn=...) to "
                             "train, or use runner.forward(args)")
        want_args, want_targets = self._captured.in_spec.children()
        self._check_structure("args", args, want_args, where)
        if not inference:
            self._check_structure("targets", targets, want_targets, where)
        leaves = [s for s in self._captured.leaves
                  if not (inference and s.name.startswith("targets"))]
        flat = pytree.tree_leaves((args, () if inference else targets))
        for t, s in zip(flat, leaves):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != s.shape or t.dtype != s.dtype:
                got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(
                    f"{s.name} is {got}; the plan was built for {list(s.shape)} {s.dtype}",
                    where=s.name,
                    fix="shapes are static: call partition() again with example inputs of this "
                    "shape (or pad/batch your data to the planned shape)")
            if t.device != self.device and t.device.type != "cpu":  # the runner moves CPU ones
                raise InputError(
                    f"{s.name} is on {t.device}; the plan runs on {self.device}",
                    where=f"{where}, {s.name}",
                    fix=f"pass CPU tensors (each rank moves its slice) or tensors on "
                        f"{self.device}: x.to({str(self.device)!r})")
        return flat

    @staticmethod
    def _check_structure(what: str, value: Any, want: pytree.TreeSpec, where: str) -> None:
        """``value`` (a step's args or targets) is structured as the example was, or an
        InputError says how, in plain words."""
        example = f"{where}((x,))" if where == "runner.forward" else f"{where}((x,), (y,))"
        if not isinstance(value, tuple):
            raise InputError(f"{what} must be a tuple, got {describe(value)}",
                             where=f"{where}, {what}",
                             fix=f"wrap a single tensor in a tuple: {example}")
        spec = pytree.tree_flatten(value)[1]
        if spec == want:
            return
        if what == "targets" and value == ():
            n = want.num_leaves
            raise InputError(
                f"targets missing: the plan was built with {n} example target{'s' * (n > 1)} "
                f"{_structure(want)}", where=f"{where}, targets",
                fix=f"pass the targets loss_fn takes, as partition's example_targets: {example}")
        raise InputError(
            f"{what} are structured as {_structure(spec)}; the plan was built with "
            f"{_structure(want)}", where=f"{where}, {what}",
            fix=f"pass {what} as the same tuples/lists/dicts of tensors as the example {what}")

    # --- inspecting -------------------------------------------------------------------------

    @property
    def capture_path(self) -> str:
        """How the model was traced: ``"full trace"`` (with why, when repeated blocks were
        found but could not be stamped), or ``"stamped model.layers: 2 of 80 blocks traced, 78
        stamped"``: the others copied from the second (``partitioner.stamp``)."""
        return self._captured.path

    @cached_property
    def summary(self) -> Summary:
        return summarize(self.ir)

    def _choose_fused_loss(self) -> None:
        """``fused_loss="auto"``: fuse the LM head with its loss only where the memory it
        saves matters (``passes.fused_loss.fusing_reason``) and the peak drops."""
        peak = max(self.memory_estimate().values())
        reason = fusing_reason(peak, self.options.memory_budget,
                               default_model(self.options).memory)
        if not reason or not fusable(self.ir.graph):
            return
        unfused = self.options
        emitted = [self.program, self.stage_program, self.collectives, self._memory,
                   self.program_records]
        self.options = dataclasses.replace(unfused, fused_loss=True)
        _evaluate(self)
        if self.fused_losses() and max(self.memory_estimate().values()) < peak:
            self.fused_loss_reason = reason
            return
        self.options = unfused  # the unfused emission back, as it was: not emitted again
        self.program, self.stage_program, self.collectives, self._memory, \
            self.program_records = emitted

    def _fit_budget(self, budget: int) -> None:
        """Recompute activations (and in a pipeline, keep fewer microbatches in flight) until
        every device's predicted peak is under ``budget`` (``shardfx.compiler.budget``); a budget no
        plan meets is a ``MemoryBudgetError``."""
        if self.mode is not M.Mode.TRAIN:
            need = max(self.memory_estimate().values())
            if need > budget:
                raise MemoryBudgetError(
                    f"inference needs {need} bytes per device; memory_budget is {budget}",
                    where="partition(..., memory_budget=...)",
                    fix="a larger budget, or shard the model over a tp or pp axis")
            return
        if self.zero_chosen:
            fit_zero_stage(self, budget)  # the stage against the memory model, before remat
        before = freeze(self.ir)
        fit_budget(self, budget)
        if self.remat is not None:  # the IR recomputes: its program passes ran again
            self.history.append(record("remat", before, freeze(self.ir, before)))
            self.history += self.program_records

    def memory_estimate(self) -> dict[int, int]:
        """Predicted peak bytes per device (global rank): ``memory_breakdown()``'s totals."""
        return {rank: m.total for rank, m in self.memory_breakdown().items()}

    def memory_breakdown(self) -> dict[int, DeviceMemory]:
        """Per device (global rank), the predicted peak of a training step (or of inference)
        by what holds it: parameters, buffers, the optimizer's state (``optimizer=`` of
        ``partition``), gradients, saved activations, temporaries, communication buffers, and
        when the peak happens (``shardfx.estimate.memory``). On a dp/tp mesh every device runs one
        program, so every device is the same; in a pipeline, each pp rank's action list is
        walked as the runner runs it, microbatches in flight included."""
        if self._memory is None:
            train = self.mode is M.Mode.TRAIN
            opt = optimizer_model(self.options.optimizer)
            if self.program is not None:
                one = spmd_memory(self.program, self.options, train, self.zero_layouts,
                                  self.zero_gather_programs)
                self._memory = {rank: one for rank in range(self.mesh.size)}
            else:
                program = self.compiled_stages()
                per_pp = {r: pipeline_memory(program, r, train, opt, self.mesh.axis("dp"),
                                             self.device, self.options.zero)
                          for r in range(self.mesh.axis("pp"))}
                pp = [a for a, _ in self.mesh.axes].index("pp")  # ranks: row-major over axes
                coords = itertools.product(*(range(n) for _, n in self.mesh.axes))
                self._memory = {rank: per_pp[coord[pp]] for rank, coord in enumerate(coords)}
        return self._memory

    def compiled_stages(self) -> StageProgram:
        """The per-stage parts and the schedule, compiled into each pipeline rank's steps
        (``runtime.compiled``)."""
        return StageProgram.of(self.stage_program, self.ir, self.schedule)

    def __str__(self) -> str:
        return render(self.summary, str(self.mesh), self.collectives, self.replicated_ops(),
                      stage_report(self.ir) if self.options.stages > 1 else (),
                      traced=self.capture_path, memory=self.memory_rows(),
                      notes=self._auto_notes() + memory_notes(self) + self._sequence_notes()
                      + expert_notes(self) + self._random_notes(),
                      compute=self.compute_rows(),
                      slices=self.options.slices if self.stage_program is not None else 1,
                      predicted=str(self.predicted_step))

    @property
    def expert_layers(self) -> list:
        """Each mixture-of-experts layer: its name, experts, the ranks they are spread over
        and its capacity factor (``moe.report.ExpertLayer``)."""
        return expert_layers(self)

    def _auto_notes(self) -> list[str]:
        """What ``shard="auto"`` chose and why (``auto.explain``)."""
        report = self.ir.meta.get(AUTO)
        if report is None:
            return []
        megatron = megatron_placements(self.ir, self.options) if "tp" in report.axes else None
        return notes(report, megatron)

    def _random_notes(self) -> list[str]:
        report = self.ir.meta.get(M.RANDOM)  # passes.rng: what draws random values, and how
        return [str(report)] if report is not None else []

    def _sequence_notes(self) -> list[str]:
        split = sequence_split(self.options)
        return [f"Sequence: {split}"] if split else []

    @property
    def device_model(self) -> DeviceModel:
        """The ``DeviceModel`` the plan traded time on and predicts its step with
        (``partition(..., device_model=)``)."""
        return default_model(self.options)

    @cached_property
    def predicted_step(self) -> PredictedStep:
        """One step's predicted seconds on ``device_model``: compute (ops of the generated
        programs, fused kernels as one, and the optimizer's step), communication (collectives
        on their axis's link, a pipeline's sends) and the total (``shardfx.estimate.step_time``)."""
        return predict_step(self)

    def memory_rows(self) -> dict[str, DeviceMemory]:
        """``memory_breakdown`` grouped: one row for an SPMD plan's devices, one per pp rank."""
        per_rank = self.memory_breakdown()
        if self.stage_program is None:
            return {f"each of {self.mesh.size}" if self.mesh.size > 1 else "the device":
                    per_rank[0]}
        pp = [a for a, _ in self.mesh.axes].index("pp")
        rows: dict[str, DeviceMemory] = {}
        coords = itertools.product(*(range(n) for _, n in self.mesh.axes))
        for rank, coord in enumerate(coords):
            rows.setdefault(f"pp rank {coord[pp]}", per_rank[rank])
        return rows

    def state_rows(self) -> dict[str, tuple[int, int, int]]:
        """What a device keeps through a training step, grouped as ``memory_rows``: the bytes of
        its parameters, of its gradients as the optimizer steps them and of the optimizer's
        state (under ZeRO, its rows of them: ``passes.zero``)."""
        memory = self.memory_rows()
        if self.stage_program is None:
            held = trained = 0
            grads = {r.name for r in self.program.outputs if r.kind is M.OutputKind.GRAD}
            for node in self.program.module.graph.find_nodes(op="placeholder"):
                role, val = node.meta[M.ROLE], node.meta[M.VAL]
                if role.kind is M.InputKind.PARAM:
                    held += val.numel() * val.element_size()
                    z = self.zero_layouts.get(role.name)
                    rows = val.numel() if z is None or M.ZERO in node.meta else \
                        z.per_rank * z.row_numel
                    trained += rows * val.element_size() if role.name in grads else 0
            return {label: (held, trained, m.optimizer) for label, m in memory.items()}
        program, out = self.compiled_stages(), {}
        for r in range(self.mesh.axis("pp")):
            reads = [(program.input_val(n), role) for n, role in program.reads(r).items()
                     if role.kind is M.InputKind.PARAM]
            owned = [v for v, role in reads
                     if program.producer(M.OutputKind.GRAD, role.name) == r]
            dp = self.mesh.axis("dp") if self.options.zero else 1  # ZeRO: this replica's rows
            trained = sum(math.prod(M.ZeroShard(tuple(v.shape), dp).shard_shape)
                          * v.element_size() for v in owned)
            m = memory[f"pp rank {r}"]
            out[f"pp rank {r}"] = (m.parameters, trained, m.optimizer)
        return out

    def compute_rows(self) -> dict[str, tuple[int, int]]:
        """Estimated FLOPs of one step, forward and backward: the whole model's (every slice of
        the batch), then one device's, grouped as the memory table groups them (a pipeline: per
        pp rank, its stages' ops for each of its microbatches; tp: each op's share)."""
        s = self.summary
        if self.stage_program is None:
            rows = {"whole model": (s.flops_fwd, s.flops_bwd)}
            if self.mesh.size > 1:
                rows[f"each of {self.mesh.size}"] = device_flops(self.ir)[0]
            return rows
        slices, m = self.options.slices, self.options.microbatches  # traced on one slice
        rows = {"whole model": (s.flops_fwd * slices, s.flops_bwd * slices)}
        for rank, (fwd, bwd) in device_flops(self.ir, self.schedule.rank_of).items():
            rows[f"pp rank {rank}"] = (fwd * m, bwd * m)
        return rows

    def kernels(self) -> list[FusedKernel]:
        """The fused Triton kernels the programs call (``passes.fusion``), in program order."""
        return [n.target for n in self._program_nodes() if isinstance(n.target, FusedKernel)]

    def fused_losses(self) -> list[FusedLoss]:
        """The LM heads computed with their cross-entropy in chunks (``passes.fused_loss``)."""
        return [FusedLoss.of(n) for n in self._program_nodes()
                if isinstance(n.target, LinearCrossEntropy)]

    def _program_nodes(self):
        modules = [self.program.module] if self.program is not None else \
            [m for _, m in self.stage_program.named_children()]
        return (n for m in modules for n in m.graph.nodes)

    @property
    def precision(self):
        """What ops compute in: a ``PrecisionReport`` (how many ops really compute in the low
        dtype, how many stay in their own (fp32; fp64 values are not cast), the casts, ops kept
        in fp32 for want of a kernel), or the fp32 ``Precision``."""
        return self.ir.meta.get(M.PRECISION, self.options.precision)

    def replicated_ops(self) -> list[str]:
        """Ops no sharding rule covered: they run on full tensors (correct, costlier)."""
        return [n.name for n in self.ir.graph.nodes
                if M.SHARDING in n.meta and n.meta[M.SHARDING].replicated]

    def __repr__(self) -> str:
        return f"<shardfx.Plan {self.summary.model} {self.mode} mesh={self.mesh}>"

    def dump(self, directory: str | os.PathLike) -> Path:
        """Write the IR after every pass (each file headed by what that pass changed; each op
        with its cost, module path and source line), the generated program (for a pipeline
        plan: each stage's F, B and W parts and the schedule), the summary (``plan.txt``) and
        ``plan.html``: one self-contained page with the layers and their placements, the
        stages, the memory, the collectives and the schedule."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for i, done in enumerate(self.history):
            (out / f"{i:02d}-{done.name}.txt").write_text(done.text)
        if self.program is not None:
            (out / f"program_{self.mode}.py").write_text(self.program.source)
        for i, program in enumerate(self.zero_gather_programs):  # ZeRO-1/2, after each step
            (out / f"program_zero_gather{i}.py").write_text(program.source)
        if self.stage_program is not None:
            for name, part in self.stage_program.named_children():  # stage0_F, stage1_B, ...
                (out / f"{name}.py").write_text(part.code)
            (out / "stages.py").write_text(self.stage_program.code)  # the order parts feed
            (out / "schedule.txt").write_text(f"{self.schedule}\n\n"
                                              f"{self.schedule.format_lists()}\n")
        (out / "plan.txt").write_text(str(self))
        (out / "plan.html").write_text(plan_html(self))  # one page, no network: open it
        kernels = self.kernels()
        if kernels:
            (out / "kernels").mkdir(exist_ok=True)
            for k in kernels:
                (out / "kernels" / f"{k.group.name}.py").write_text(k.source)
            (out / "kernels.txt").write_text("".join(f"{_kernel_line(k)}\n" for k in kernels))
        if self.collectives:
            (out / "collectives.txt").write_text("".join(
                f"{c.kind} {c.axis} {c.nbytes} B  {c.reason}\n" for c in self.collectives))
        return out

    def canonical(self, fqn: str) -> str:
        return self._canonical.get(fqn, fqn)


def _kernel_line(k: FusedKernel) -> str:
    """One fused kernel for ``kernels.txt``: its shape, its ops, the bytes it moves."""
    g = k.group
    ops = ", ".join(f"{o.source}={str(o.target).removeprefix('aten.')}" for o in g.ops)
    return f"{g.name} {list(g.shape)}: {ops}; moves {g.fused_bytes} B, unfused {g.unfused_bytes} B"


def _structure(spec: pytree.TreeSpec) -> str:
    """A pytree structure in Python's own notation: ``(Tensor, [Tensor], {'mask': Tensor})``."""
    if spec.is_leaf():
        return "Tensor"
    kids = [_structure(c) for c in spec.children()]
    if spec.type is tuple:
        return f"({', '.join(kids)}{',' if len(kids) == 1 else ''})"
    if spec.type is list:
        return f"[{', '.join(kids)}]"
    if spec.type is dict:
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(spec.context, kids)) + "}"
    return f"{getattr(spec.type, '__name__', spec.type)}({', '.join(kids)})"


def pipeline_schedule(name: "str | Schedule", ranks: int, microbatches: int, virtual: int = 1):
    """The schedule's action lists, checked (deadlock, completeness) before anything runs:
    a generated one by name, or the user's own (a ``Schedule`` or its text form)."""
    if isinstance(name, str) and name in GENERATORS:
        schedule = generate(name, ranks, microbatches, virtual)
    else:
        schedule = name if isinstance(name, Schedule) else Schedule.parse(name)
        if (schedule.ranks, schedule.microbatches) != (ranks, microbatches) or \
                schedule.stages != ranks * virtual:
            raise PipelineError(
                f"the schedule has {schedule.ranks} ranks, {schedule.stages} stages and "
                f"{schedule.microbatches} microbatches; the plan has {ranks}, "
                f"{ranks * virtual} and {microbatches}", where="partition(..., schedule=...)",
                fix="write one action list per pp rank covering every stage and microbatch")
    check(schedule)
    return schedule
