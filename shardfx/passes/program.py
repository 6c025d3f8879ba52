"""Program passes: rewrites of the generated per-device program, in the order they run.

A program pass is a function ``(program, options) -> program`` over a ``codegen.program.Program``
(the module every rank of a role runs, its input and output roles, and the collectives it
issues), like an IR pass over the IR: its docstring says what it requires and ensures, the pass
manager (``compiler.manager.run_program_passes``) verifies the program after it in debug runs and
keeps its text for ``plan.dump``. Under pp the program is cut into per-stage parts by one of
them (``split_stages``): the passes after it see the cut program, whose ``module`` calls one
submodule per (stage, part), and treat each part as a program of its own (``graphs``).

``program_passes(options)`` is the one list, in order, with why each runs where it does.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from shardfx.codegen.bucketing import bucket_gradients
from shardfx.codegen.program import Program
from shardfx.codegen.replicas import cut, replica_program
from shardfx.codegen.zero import zero_gather_programs
from shardfx.codegen.stages import split_stages as _split
from shardfx.codegen.step_in_backward import step_in_backward
from shardfx.codegen.gradients_to_host import send_gradients_to_host
from shardfx.codegen.activation_offload import offload_activations
from shardfx.cost.device_model import default_model
from shardfx.cost.optimizer import optimizer_model, optimizer_temporaries, stepped_value
from shardfx.passes.fused_loss import fuse_loss
from shardfx.passes.fusion import fuse
from shardfx.passes.zero import zero_gather, zero_layouts, zero_reduce_scatter
from shardfx.codegen.program import graphs
from shardfx.codegen.stages import whole_backward
from shardfx.codegen.steps import source, stage_of
from shardfx.codegen.program import (BUCKETED, NO_KERNEL, no_parts,
                                     returned_gradient)
from shardfx.ir import meta as M
from shardfx.ir.contract import contract, holds, on_ops


def program_passes(options) -> list:
    """The program passes a plan with ``options`` runs, in order."""
    spmd = options.stages == 1 and options.mesh.size > 1  # one program for a dp/tp mesh
    zero = options.zero if spmd else 0  # a pipeline's ZeRO-2: in replica_reductions
    #                                     (ZeRO-1/2's gathers after the step: the runner's)
    replicas = options.stages > 1 and options.mesh.axis("dp") > 1
    return [
        *([chunked_loss] if options.fused_loss else []),  # LM head + loss in chunks: first,
        #                                          while the ATen ops it replaces are all there
        *([zero_reduce_scatter] if zero >= 2 else []),  # ZeRO-2/3: each rank gets its rows of
        #                                            each gradient, not the whole sum
        *([bucket_gradients_pass] if spmd else []),  # DDP's buckets: fewer, larger gradient
        #                                        collectives, issued as gradients are ready
        *([zero_gather] if zero == 3 else []),  # ZeRO-3: parameters come in as shards, gathered
        #                          before first use in forward and again in backward, prefetched
        *([optimizer_in_backward] if options.optimizer_in_backward else []),  # after the
        #             buckets: a gradient is final once its bucket's reduction is waited for
        *([gradients_to_host] if options.offload_optimizer and options.stages == 1 else []),
        #   there too, for the same reason: each gradient leaves when it is final (a
        #   pipeline's runner sends a stage's gradients, summed over its microbatches)
        *([activation_offload] if offloads_activations(options) else []),  # the values remat
        #          sends to host memory: after the passes that add readers, before triton
        *([split_stages] if options.stages > 1 else []),  # a pipeline: F, B, W parts per stage
        *([replica_reductions] if replicas else []),  # a pipeline's dp: each stage's gradients
        #      summed (or ZeRO-2's rows) by the passes above, in parts the runner issues as the
        #      stage's gradients become final
        *([triton_fusion] if uses_triton(options) else []),  # memory-bound ops in Triton
        #                                      kernels: last, on the ops that will really run
    ]


def uses_triton(options) -> bool:
    """Fused Triton kernels: when asked for (``kernels="triton"``). ``"auto"`` runs ATen ops on
    every device: measured on an H200 (bench/RESULTS.md, bench/gpu.py), the fused kernels made
    nanoGPT's step no faster in fp32 (161-162 ms either way) and slower in bf16 (34.6-48.5 ms
    against 34.0-35.0), so they are not a default until they win."""
    return options.kernels == "triton"


@contract(requires=[NO_KERNEL])
def chunked_loss(program: Program, options) -> Program:
    """Requires/Ensures: ``passes.fused_loss`` (the LM head and its cross-entropy, forward and
    backward, one op over chunks of rows sized for the plan's device model; the logits never
    materialised). On any device, before Triton fusion, so the ATen ops it replaces are still
    there. Its gradients are computed in the forward where the head's backward follows its
    forward at once: no pipeline, or 1F1B's last stage (not GPipe's, nor zero-bubble's split
    backward)."""
    early = options.stages == 1 or (options.schedule == "1f1b" and options.virtual_stages == 1)
    if fuse_loss(program.module.graph, early, default_model(options)):
        program.module.recompile()
    return program


@contract(ensures=[BUCKETED])
def bucket_gradients_pass(program: Program, options) -> Program:
    """Requires/Ensures: ``codegen.bucketing`` (gradient all-reduces, and ZeRO's gradient
    reduce-scatters, in buckets started as soon as their last gradient exists)."""
    return bucket_gradients(program, reduce_dtype=options.precision.narrower_reduce,
                            in_place=True)


bucket_gradients_pass.__name__ = "bucket_gradients"


@contract(requires=[BUCKETED],
          ensures=[holds("no gradient returned: each is stepped where it is final",
                         "not returned", returned_gradient)])
def optimizer_in_backward(program: Program, options) -> Program:
    """Requires/Ensures: ``codegen.step_in_backward`` (each block's parameters stepped where
    their gradients are final and nothing reads them any more; the gradients not returned)."""
    model = optimizer_model(options.optimizer)
    layouts = zero_layouts(program, options.mesh.axis("dp")) if options.zero else {}

    def temporaries(params: list[tuple[str, fx.Node]]) -> int:
        """The optimizer's temporaries on what it steps (ZeRO: this rank's rows); zero=1
        also cuts those rows from each whole gradient (``runtime.zero.ZeroRows.grad``)."""
        stepped = [stepped_value(node, layouts.get(name)) for name, node in params]
        rows = sum(v.numel() * v.element_size() for v in stepped) if options.zero == 1 else 0
        return optimizer_temporaries(stepped, model, options.device) + rows

    step_in_backward(program.module, program.outputs, program.inputs, temporaries)
    return program


@contract(requires=[BUCKETED],
          ensures=[holds("no gradient returned: each is sent to the host where it is final",
                         "not returned", returned_gradient)])
def gradients_to_host(program: Program, options) -> Program:
    """Requires/Ensures: ``codegen.gradients_to_host`` (each block's gradients handed to the
    host where they are final; the gradients not returned)."""
    layouts = zero_layouts(program, options.mesh.axis("dp")) if options.zero == 1 else {}

    def workspace(params: list[tuple[str, fx.Node]]) -> int:
        """zero=1 cuts this rank's rows from each whole gradient on the device first."""
        stepped = [stepped_value(node, layouts.get(name)) for name, node in params]
        return sum(v.numel() * v.element_size() for v in stepped) if options.zero == 1 else 0

    send_gradients_to_host(program.module, program.outputs, program.inputs, workspace)
    return program


def offloads_activations(options) -> bool:
    """Whether remat may offload activations (``auto.remat``): under a memory budget, on a
    device model with host memory."""
    host = default_model(options).host
    return options.memory_budget is not None and host is not None and host.memory > 0


def activation_offload(program: Program, options) -> Program:
    """Requires/Ensures: ``codegen.activation_offload`` (each value ``auto.remat`` marked for
    offload copied to host memory after its last forward reader and back before the backward
    reads it; a program without marks unchanged)."""
    offload_activations(program.module)
    return program


@contract(requires=[holds("STAGE on every op", "STAGE",
                         lambda program: on_ops(M.STAGE).failing(program.module))],
          ensures=[holds("a forward part per stage (stage{s}_F)", "stage{s}_F", no_parts)])
def split_stages(program: Program, options) -> Program:
    """Requires: STAGE and PHASE on every op (``codegen.stages.inherit_stages`` for a tp
    program). Ensures: ``codegen.stages.split_stages``: the program's module calls one part per
    (stage, F|B|W); inputs, outputs and collectives unchanged."""
    return dataclasses.replace(program, module=_split(program.module, whole_backward(options)))


@contract(requires=[holds("a forward part per stage (stage{s}_F)", "stage{s}_F", no_parts)])
def replica_reductions(program: Program, options) -> Program:
    """Requires: the program split into stages (``split_stages``), a dp axis.
    Ensures: ``module.meta[REPLICAS]``: per stage that makes gradients, a
    ``codegen.replicas.Reduction`` of them over dp: its ``replica_program`` (the gradients in
    the order the stage's parts make them) through the passes an SPMD program's gradients go
    through (``zero_reduce_scatter`` under ZeRO-2, ``bucket_gradients``), cut into parts
    (its ``collectives`` one per bucket); under ZeRO-1/2, the programs gathering every rank's
    updated rows of the stage's parameters after the step (``codegen.zero.gather_programs``).
    The parts themselves are unchanged. The tangent the runner feeds is the batch's share of
    the loss over every replica, so the sum over dp is the gradient (as in an SPMD program)."""
    split = program.module
    outputs = split.graph.output_node().args[0]
    params = {n.meta[M.ROLE].name: n.meta[M.VAL] for n in split.graph.find_nodes(op="placeholder")
              if n.meta[M.ROLE].kind is M.InputKind.PARAM}
    made: dict[int, list] = {}  # stage -> ((part, position), fqn, value)
    order: dict[str, dict[fx.Node, int]] = {}  # part -> its nodes' positions
    for value, role in zip(outputs, program.outputs):
        if role.kind is not M.OutputKind.GRAD:
            continue
        part, index = source(value)
        graph = getattr(split, part).graph
        if part not in order:
            order[part] = {n: i for i, n in enumerate(graph.nodes)}
        node = graph.output_node().args[0][index]
        made.setdefault(stage_of(part), []).append(((part, order[part][node]), role.name,
                                                    node.meta[M.VAL]))
    reductions = {}
    for stage, grads in sorted(made.items()):
        in_order = sorted(grads, key=lambda g: g[0])
        replicas = replica_program([(fqn, val) for _, fqn, val in in_order])
        if options.zero >= 2:
            replicas = zero_reduce_scatter(replicas, options)
        gathers = zero_gather_programs({fqn: params[fqn] for _, fqn, _ in grads},
                                       options.mesh.axis("dp")) if options.zero in (1, 2) else []
        reductions[stage] = dataclasses.replace(cut(bucket_gradients_pass(replicas, options)),
                                                gathers=tuple(gathers))
    split.meta[M.REPLICAS] = reductions
    return program


def triton_fusion(program: Program, options) -> Program:
    """Requires/Ensures: ``passes.fusion``, on each module the program runs (a pipeline's
    parts one by one: a kernel never spans two parts, so never a stage cut)."""
    for name, module in graphs(program):
        fuse(module.graph, prefix="fused" if name == "program" else f"{name}_fused")
        module.recompile()
    return program
