"""The compiler, in order: every pass one line, with why it runs where it does.

``capture`` has already turned the model into the IR (the joint forward+backward graph at ATen
level, parameters named by FQN). What follows reads and annotates that IR, then emits the
program each device runs.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from shardfx.codegen.bucketing import bucket_gradients
from shardfx.codegen.program import Program, generate
from shardfx.codegen.redistribute import Collective
from shardfx.codegen.spmd import generate_spmd
from shardfx.codegen.stages import inherit_stages, split_stages
from shardfx.ir import meta as M
from shardfx.ir.text import ir_to_text
from shardfx.passes.assign_phase import assign_phase
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.passes.fused_loss import fuse_loss
from shardfx.passes.fusion import fuse
from shardfx.passes.manager import Options, PassRecord, run_passes
from shardfx.passes.mixed_precision import mixed_precision
from shardfx.passes.rng import rng_dropout
from shardfx.passes.shard_annotate import shard_annotate
from shardfx.passes.shard_propagate import shard_propagate
from shardfx.passes.stage_cut import stage_cut
from shardfx.runtime.device import place


def deferred_codegen():
    """Within: every GraphModule built (the IR, the programs, a pipeline's parts) writes and
    compiles its Python code when it is first called or its ``code`` read, not each time its
    graph changes. Planning an 80-layer model would otherwise spend half its time generating
    the same code again and again (fx regenerates every submodule's with its parent's); a
    program's first step pays for its own once."""
    return _use_lazy_graph_module(True)


def compile_ir(gm: fx.GraphModule, options: Options
               ) -> tuple[fx.GraphModule, Program | fx.GraphModule, list[PassRecord], list[Collective]]:
    gm.meta[M.GRAPH] = dataclasses.replace(gm.meta[M.GRAPH], mesh=options.mesh.axes)
    history = [PassRecord("capture", ir_to_text(gm))]
    if options.stages > 1:
        return _compile_pipeline(gm, options, history)
    sharded = options.mesh.size > 1
    gm = run_passes(gm, [
        rng_dropout,      # dropout masks from each element's global place: the same on any mesh
        assign_phase,     # forward vs backward: the split remat and pipeline stages reason about
        mixed_precision,  # bf16/fp16 matmuls, fp32 where it matters: before costs and shards
        estimate_cost,    # FLOPs and bytes per op: the summary now, the stage cutter and solver later
        *([shard_annotate,   # the user's request -> placements of parameters and batch inputs
           shard_propagate,  # -> a placement for every tensor, and the redistributions ops need
           ] if sharded else []),
    ], options, history)
    program, collectives = emit(gm, options)
    return gm, program, history, collectives


def whole_backward(options: Options) -> bool:
    """A stage's backward as one part: under a memory budget, when the schedule runs W right
    after B (``codegen.stages.split_stages``)."""
    from shardfx.schedule import GENERATORS, Schedule

    if options.memory_budget is None:
        return False
    schedule = options.schedule
    if isinstance(schedule, str) and schedule in GENERATORS:
        return schedule != "zero-bubble"  # the one generated schedule with W actions
    parsed = schedule if isinstance(schedule, Schedule) else Schedule.parse(schedule)
    return not parsed.split_backward


def emit(gm: fx.GraphModule, options: Options) -> tuple[Program | fx.GraphModule, list[Collective]]:
    """The program(s) every device runs, from the planned IR: one program for one device or a
    dp/tp mesh; under pp, the per-stage parts (F, B, W). Run again after ``passes.remat``.
    Every tensor they make is made on ``options.device`` (``runtime.device.place``)."""
    program, collectives = _emit(gm, options)
    place(program if isinstance(program, fx.GraphModule) else program.module, options.device)
    return program, collectives


def _emit(gm: fx.GraphModule, options: Options) -> tuple[Program | fx.GraphModule, list[Collective]]:
    if options.stages > 1:
        whole = whole_backward(options)
        if options.mesh.only("tp").size == 1:
            program = chunked_loss(generate(gm), options)
            split = split_stages(program.module, whole)  # the program, cut: F, B, W
            return fused_parts(split, options), []
        program, collectives = generate_spmd(gm)  # one tp program for the whole model ...
        program = chunked_loss(program, options)
        split = split_stages(inherit_stages(program.module), whole)  # ... cut
        return fused_parts(split, options), collectives
    if options.mesh.size == 1:
        return fused(chunked_loss(generate(gm), options), options), []
    program, collectives = generate_spmd(gm)  # local shapes, explicit collectives, one program
    program = chunked_loss(program, options)  # the LM head and its loss, a chunk at a time
    # DDP's buckets: fewer, larger gradient all-reduces, issued as gradients become ready
    program, collectives = bucket_gradients(program, collectives,
                                            reduce_dtype=options.precision.narrower_reduce)
    return fused(program, options), collectives


def chunked_loss(program: Program, options: Options) -> Program:
    """``program`` with its LM head and cross-entropy one op over chunks of rows, forward
    and backward (``passes.fused_loss``), unless ``options.fused_loss`` is off: on any
    device, before the Triton fusion so the ATen ops it replaces are still there."""
    if options.fused_loss and fuse_loss(program.module.graph):
        program.module.recompile()
    return program


def fused(program: Program, options: Options) -> Program:
    """``program`` with its memory-bound ops in Triton kernels (``passes.fusion``), when
    ``options.kernels`` asks for them: "triton", or "auto" on CUDA."""
    _fuse_module(program.module, options, "fused")
    return program


def fused_parts(split: fx.GraphModule, options: Options) -> fx.GraphModule:
    """Each pipeline part's memory-bound ops in Triton kernels, as ``fused`` does a program's:
    a kernel never spans two parts, so never a stage cut."""
    for name, part in split.named_children():
        _fuse_module(part, options, f"{name}_fused")
    return split


def _fuse_module(module: fx.GraphModule, options: Options, prefix: str) -> None:
    if uses_triton(options):
        fuse(module.graph, prefix=prefix)
        module.recompile()


def uses_triton(options: Options) -> bool:
    """Fused Triton kernels: asked for, or "auto" on a plan that runs on CUDA."""
    if options.kernels == "auto":
        return options.device.type == "cuda"
    return options.kernels == "triton"


def _compile_pipeline(gm: fx.GraphModule, options: Options, history: list[PassRecord]):
    """Stages first planned as one graph: sharded over tp inside each stage (dp is the
    pipeline runner's: replicas of the whole pipeline), then cut, then split into parts."""
    inner = options.mesh.only("tp")
    gm.meta[M.GRAPH] = dataclasses.replace(gm.meta[M.GRAPH], mesh=inner.axes)
    sharded = inner.size > 1
    gm = run_passes(gm, [
        rng_dropout,     # dropout masks from each element's global place, per slice
        assign_phase,    # forward vs backward
        mixed_precision,  # each op's dtype: what the cutter, the shards and remat measure
        estimate_cost,   # what the stage cutter balances
        *([shard_annotate, shard_propagate] if sharded else []),  # tensor parallel in a stage
    ], dataclasses.replace(options, mesh=inner), history)
    gm = run_passes(gm, [
        stage_cut,       # a stage for every op: forward balanced, backward where its forward is
    ], options, history)
    split, collectives = emit(gm, options)
    return gm, split, history, collectives
