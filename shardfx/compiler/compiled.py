"""What the compiler made of a captured model: the IR after its passes, the program each device
runs (or a pipeline's parts and schedule), the passes' history and the collectives, with what
the cost model predicts of them (memory per device, the step's time). ``Plan`` is this plus
the methods users call; the compiler's re-emits (``compiler.budget``, ``compiler.compile``)
work on it before any Plan exists.

A re-emit replaces the program through ``emitted``, which forgets what was derived from the
program before (the memory estimate, the predicted step); ZeRO's layouts and gather programs are
the parameters', kept per ZeRO stage.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.fx as fx

from shardfx.codegen import zero as zero_codegen
from shardfx.codegen.accumulate_into import summable
from shardfx.codegen.program import Program
from shardfx.codegen.redistribute import Collective
from shardfx.codegen.steps import Output, StageProgram
from shardfx.cost.device_model import DeviceModel, default_model
from shardfx.cost.optimizer import optimizer_model
from shardfx.cost.techniques import sizing
from shardfx.errors import PipelineError
from shardfx.estimate.analysis import Summary, device_flops, summarize
from shardfx.estimate.memory import DeviceMemory, spmd_memory
from shardfx.estimate.memory_pipeline import pipeline_memory
from shardfx.estimate.step_time import PredictedStep, predict_step
from shardfx.ir import meta as M
from shardfx.kernels.device import place
from shardfx.kernels.linear_ce import LinearCrossEntropy
from shardfx.kernels.triton import FusedKernel
from shardfx.partitioner.capture import Captured
from shardfx.passes.fused_loss import FusedLoss
from shardfx.passes.zero import zero_layouts
from shardfx.request.options import Options
from shardfx.schedule import GENERATORS, Schedule, check, forward_only, generate


class Compiled:
    def __init__(self, captured: Captured, options: Options, ir: fx.GraphModule,
                 program: Program | fx.GraphModule, history: list, collectives: list[Collective]):
        self.captured = captured  # the traced model: its IR before the passes, its inputs' spec
        self.options = options
        self.mesh = options.mesh
        self.ir = ir
        self.history = history  # each pass's record (``plan.dump``)
        self.collectives = collectives
        self.mode: M.Mode = ir.meta[M.GRAPH].mode
        self.program: Program | None = program
        self.stage_program: fx.GraphModule | None = None
        self.schedule: Schedule | None = None
        if options.stages > 1:  # per-stage parts, run in the order of a schedule
            self.program, self.stage_program = None, program
            pp, m, v = self.mesh.axis("pp"), options.microbatches, options.virtual_stages
            self.schedule = forward_only(pp, m, v) if self.mode is M.Mode.INFER else \
                pipeline_schedule(options.schedule, pp, m, v)
        self.remat = None  # ``auto.remat.Choice`` under a memory budget
        self.budget_candidates: list = []  # a pipeline's schedules tried (``compiler.budget``)
        self.program_records: list = []  # the program passes of the last emission
        self.fused_loss_reason = ""  # why fused_loss="auto" fused the LM head ("" if it did not)
        self.zero_chosen = False  # the ZeRO stage chosen by the compiler (zero="auto")
        self._derived: dict = {}  # from the program and options: forgotten when they change

    def emitted(self, program: Program | fx.GraphModule, collectives: list[Collective],
                records: list | None = None) -> None:
        """The program(s) emitted again (under new options, or from a rewritten IR)."""
        self.program_records = records or []
        if self.stage_program is not None:
            self.stage_program = program
        else:
            self.program = program
        self.collectives = collectives
        # ZeRO's layouts are the parameters': kept while the stage is (remat does not change them)
        self._forget("memory", "predicted", "summary", "stages")

    def forget_memory(self) -> None:
        """After a change the memory estimate depends on but the program does not show (the
        schedule a pipeline runs)."""
        self._forget("memory", "predicted", "stages")

    def _forget(self, *names: str) -> None:
        """Drop what was derived under ``names`` (a key, or a tuple keyed by its first)."""
        for key in [k for k in self._derived
                    if (k[0] if isinstance(k, tuple) else k) in names]:
            del self._derived[key]

    def _derive(self, key, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @property
    def device(self) -> torch.device:
        """Where this process's programs run, weights and batch slices included
        (``kernels.device``: ``partition(..., device=)``, else ``cuda:LOCAL_RANK`` under NCCL,
        else the model's device when it was planned)."""
        return self.options.device

    @property
    def device_model(self) -> DeviceModel:
        """The ``DeviceModel`` the plan traded time on and predicts its step with
        (``partition(..., device_model=)``)."""
        return default_model(self.options)

    @property
    def zero_layouts(self) -> dict[str, M.ZeroShard]:
        """Under ``zero=k``: each parameter the optimizer steps, by FQN, and how ZeRO holds it
        over dp (``passes.zero``); empty otherwise."""
        if not self.options.zero or self.program is None:
            return {}
        return self._derive(("zero_layouts", self.options.zero),
                            lambda: zero_layouts(self.program, self.mesh.axis("dp")))

    @property
    def zero_gather_programs(self) -> list[Program]:
        """zero=1, 2: the programs that gather every rank's updated rows after the optimizer
        step, one per bucket (``codegen.zero.gather_programs``); none otherwise."""
        if self.options.zero not in (1, 2) or self.program is None:
            return []

        def make():
            programs = zero_codegen.program_gathers(self.program, self.zero_layouts,
                                                    self.mesh.axis("dp"))
            for program in programs:
                place(program.module, self.device)
            return programs
        return self._derive(("zero_gathers", self.options.zero), make)

    def compiled_stages(self) -> StageProgram:
        """The per-stage parts and the schedule, compiled into each pipeline rank's steps
        (``codegen.steps``); made once for the memory estimates and the predicted step (its
        messages checked once: ``StageProgram.p2p``), forgotten with them."""
        return self._derive("stages", lambda: StageProgram.of(self.stage_program, self.ir,
                                                              self.schedule))

    @property
    def summary(self) -> Summary:
        return self._derive("summary", lambda: summarize(self.ir))

    # --- what the cost model predicts ---------------------------------------------------------

    def memory_estimate(self) -> dict[int, int]:
        """Predicted peak bytes per device (global rank): ``memory_breakdown()``'s totals."""
        return {rank: m.total for rank, m in self.memory_breakdown().items()}

    def memory_breakdown(self, transport: str | None = None,
                         assume=()) -> dict[int, DeviceMemory]:
        """Per device (global rank), the predicted peak of a training step (or of inference)
        by what holds it: parameters, buffers, the optimizer's state (``optimizer=`` of
        ``partition``), gradients, saved activations, temporaries, communication buffers, and
        when the peak happens (``shardfx.estimate.memory``). On a dp/tp mesh every device runs one
        program, so every device is the same; in a pipeline, each pp rank's action list is
        walked as the runner runs it, microbatches in flight included. ``transport``: how
        long a pipeline's sends hold their buffers, ``"gloo"`` or ``"nccl"`` (None: the
        plan's device's, ``memory_pipeline.pipeline_memory``). ``assume``: names of
        ``step_time.TECHNIQUES`` whose memory to count as if the program had them (the
        weights in the compute dtype, the vocabulary split over tp, the optimizer over dp x
        cp: ``cost.techniques``), as ``predict_step(assume=)`` prices their time."""
        assume = tuple(assume)
        key = "memory" if transport is None and not assume else ("memory", transport, assume)
        return self._derive(key, lambda: self._memory_breakdown(transport, assume))

    def _memory_breakdown(self, transport: str | None = None,
                          assume: tuple = ()) -> dict[int, DeviceMemory]:
        train = self.mode is M.Mode.TRAIN
        size = sizing(assume, self.ir.graph, self.options.precision.dtype,
                      self.mesh.axis("tp"), self.mesh.axis("cp"), self.options.zero)
        if self.program is not None:
            one = spmd_memory(self.program, self.options, train, self.zero_layouts,
                              self.zero_gather_programs, self._summed(), size)
            return {rank: one for rank in range(self.mesh.size)}
        program, opt = self.compiled_stages(), optimizer_model(self.options.optimizer)
        per_pp = {r: pipeline_memory(program, r, train, opt, self.mesh.axis("dp"), self.device,
                                     self.options.zero, self.options.offload_optimizer,
                                     transport, size)
                  for r in range(self.mesh.axis("pp"))}
        return {rank: per_pp[coord] for rank, coord in self.pp_coordinates().items()}

    def _summed(self) -> frozenset:
        """Under accumulation, the gradients the program's later runs add into their
        accumulators instead of making (``codegen.accumulate_into``; the runner's
        ``_accumulators``: none under ZeRO or optimizer offload)."""
        if self.options.microbatches == 1 or self.options.zero or \
                self.options.offload_optimizer:
            return frozenset()
        grads = [Output(i, (r,), False, []) for i, r in enumerate(self.program.outputs)
                 if r.kind is M.OutputKind.GRAD]
        return frozenset(node for _, node in summable(self.program.module, grads).values())

    def pp_coordinates(self) -> dict[int, int]:
        """Each global rank's pp coordinate (ranks are row-major over the mesh's axes)."""
        pp = [a for a, _ in self.mesh.axes].index("pp")
        coords = itertools.product(*(range(n) for _, n in self.mesh.axes))
        return {rank: coord[pp] for rank, coord in enumerate(coords)}

    @property
    def predicted_step(self) -> PredictedStep:
        """One step's predicted seconds on ``device_model``: compute (ops of the generated
        programs, fused kernels as one, and the optimizer's step), communication (collectives
        on their axis's link, a pipeline's sends) and the total (``shardfx.estimate.step_time``)."""
        return self._derive("predicted", lambda: predict_step(self))

    def memory_rows(self) -> dict[str, DeviceMemory]:
        """``memory_breakdown`` grouped: one row for an SPMD plan's devices, one per pp rank."""
        per_rank = self.memory_breakdown()
        if self.stage_program is None:
            return {f"each of {self.mesh.size}" if self.mesh.size > 1 else "the device":
                    per_rank[0]}
        rows: dict[str, DeviceMemory] = {}
        for rank, pp in self.pp_coordinates().items():
            rows.setdefault(f"pp rank {pp}", per_rank[rank])
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
        return [n.target for n in self.program_nodes() if isinstance(n.target, FusedKernel)]

    def fused_losses(self) -> list[FusedLoss]:
        """The LM heads computed with their cross-entropy in chunks (``passes.fused_loss``)."""
        return [FusedLoss.of(n) for n in self.program_nodes()
                if isinstance(n.target, LinearCrossEntropy)]

    def program_nodes(self):
        """Every node of the program(s) every device runs: the program, or a pipeline's parts."""
        modules = [self.program.module] if self.program is not None else \
            [m for _, m in self.stage_program.named_children()]
        return (n for m in modules for n in m.graph.nodes)


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
