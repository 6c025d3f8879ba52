"""The compiler, in order: every pass one line, with why it runs where it does.

``capture`` has already turned the model into the IR (the joint forward+backward graph at ATen
level, parameters named by FQN). What follows reads and annotates that IR, then emits the
program each device runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch.fx as fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from shardfx.auto import zero_stage
from shardfx.codegen.program import Program, generate
from shardfx.codegen.redistribute import Collective
from shardfx.codegen.spmd import generate_spmd
from shardfx.codegen.stages import inherit_stages
from shardfx.ir import meta as M
from shardfx.passes.assign_phase import assign_phase
from shardfx.auto.shard import auto_shard, solver
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.compiler.manager import PassRecord, captured_record, run_passes, run_program_passes
from shardfx.request.options import Options
from shardfx.passes.mixed_precision import mixed_precision
from shardfx.passes.program import program_passes
from shardfx.passes.causal_mask import causal_mask
from shardfx.passes.rng import rng_stream
from shardfx.passes.shard_annotate import shard_annotate
from shardfx.passes.shard_propagate import shard_propagate
from shardfx.passes.stage_cut import stage_cut
from shardfx.kernels.device import place


def deferred_codegen():
    """Within: every GraphModule built (the IR, the programs, a pipeline's parts) writes and
    compiles its Python code when it is first called or its ``code`` read, not each time its
    graph changes. Planning an 80-layer model would otherwise spend half its time generating
    the same code again and again (fx regenerates every submodule's with its parent's); a
    program's first step pays for its own once."""
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def paused_gc():
    """Within: Python's cyclic garbage collector does not run (reference counting frees as
    ever). Planning makes millions of objects that live until it ends (graphs of 20k nodes,
    their fake values, each pass's record), and every full collection walked all of them
    again: a third of a 70B-shaped Llama's 80-layer plan on dp=8 x tp=8 (10.0 -> 6.8 s of
    CPU). Cycles planning drops are collected by the first collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:  # the outermost restores it
            gc.enable()


def compile_ir(gm: fx.GraphModule, options: Options, record: bool = True
               ) -> tuple[fx.GraphModule, Program | fx.GraphModule, list[PassRecord], list[Collective]]:
    """``record=False``: no pass's text rendered (an empty history), for a copy planned only
    to be measured (``shardfx.compiler.shallow``)."""
    gm.meta[M.GRAPH] = dataclasses.replace(gm.meta[M.GRAPH], mesh=options.mesh.axes)
    history = [captured_record(gm)] if record else None
    if options.stages > 1:
        return _compile_pipeline(gm, options, history)
    gm = run_passes(gm, ir_passes(options, options.mesh), options, history)
    options = zero_stage.resolve(gm, options)
    program, collectives = emit(gm, options, history)
    return gm, program, history or [], collectives


def ir_passes(options: Options, mesh) -> list:
    """The IR passes, in order, over ``mesh`` (a pipeline's: one stage's cp and tp; its dp
    replicas are the runner's, and ``stage_cut`` follows these)."""
    return [
        rng_stream,       # random values from each element's global place: the same on any mesh
        *([causal_mask]   # a traced causal mask as is_causal: ring attention needs to know
          if mesh.axis("cp") > 1 else []),
        assign_phase,     # forward vs backward: the split remat and pipeline stages reason about
        mixed_precision,  # bf16/fp16 matmuls, fp32 where it matters: before costs and shards
        estimate_cost,    # FLOPs and bytes per op: the summary, the stage cutter and the solver
        *([shard_annotate,   # the user's request -> placements of parameters and batch inputs
           *([auto_shard]    # shard="auto": the solver places the rest, every op priced
             if solver(options) else []),
           shard_propagate,  # -> a placement for every tensor, and the redistributions ops need
           ] if mesh.size > 1 else []),
    ]


def emit(gm: fx.GraphModule, options: Options, history: list[PassRecord] | None = None
         ) -> tuple[Program | fx.GraphModule, list[Collective]]:
    """The program(s) every device runs, from the planned IR: code generation, then the program
    passes (``passes.program.program_passes``), each one's program text appended to
    ``history``. One program for one device or a dp/tp mesh; under pp, the per-stage parts
    (F, B, W). Run again after ``auto.remat`` (``history`` None: no text rendered). Every tensor they make is made on
    ``options.device`` (``kernels.device.place``)."""
    program = run_program_passes(generate_program(gm, options), program_passes(options),
                                 options, history)
    module = program.module
    place(module, options.device)
    return (module if options.stages > 1 else program), list(program.collectives)


def generate_program(gm: fx.GraphModule, options: Options) -> Program:
    """Code generation: the IR as the program one device runs (``codegen.program``), or, over a
    dp/tp mesh (a pipeline's tp), with local shapes and explicit collectives (``codegen.spmd``);
    a pipeline's ops inserted by codegen given a stage to run in (``codegen.stages``)."""
    sharded = options.mesh.stage() if options.stages > 1 else options.mesh
    if sharded.size == 1:
        return generate(gm)
    program = generate_spmd(gm)
    if options.stages > 1:
        inherit_stages(program.module)
    return program


def _compile_pipeline(gm: fx.GraphModule, options: Options, history: list[PassRecord]):
    """Stages first planned as one graph: sharded over cp and tp inside each stage (dp is the
    pipeline runner's: replicas of the whole pipeline), then cut, then split into parts."""
    inner = options.mesh.stage()
    gm.meta[M.GRAPH] = dataclasses.replace(gm.meta[M.GRAPH], mesh=inner.axes)
    staged = dataclasses.replace(options, mesh=inner, held_by=options.stages, whole_mesh=options.mesh)
    gm = run_passes(gm, ir_passes(options, inner), staged, history)  # cp and tp in a stage
    options = dataclasses.replace(options, zero=zero_stage.resolve(gm, staged).zero)
    gm = run_passes(gm, [
        stage_cut,       # a stage for every op: forward balanced, backward where its forward is
    ], options, history)
    split, collectives = emit(gm, options, history)
    return gm, split, history or [], collectives
