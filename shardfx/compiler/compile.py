"""The compiler: from a model to what every device runs.

``compile_model`` captures the model (``partitioner.capture``) and compiles it; under
``shard="auto"`` it also compiles the named plans the solver's price cannot tell from its
choice, and keeps the fastest (``compiler.finalists``). ``compile_captured`` runs the IR passes and emits the program(s) (``compiler.driver``), then
makes every decision that needs a program to judge: the ZeRO stage under ``zero="auto"``
(``auto.zero_stage``), the fused LM head under ``fused_loss="auto"`` (emitted again with it
where the memory it saves matters), and, under ``memory_budget``, the ZeRO stage against the
memory model, what to recompute and a pipeline's schedule (``compiler.budget``). Its result,
``Compiled``, is what ``Plan`` is made from.

Requires: ``captured`` from ``partitioner.capture``; ``options`` checked by ``partition``.
Ensures:  a ``Compiled`` whose program(s) are the ones every device runs and whose options are
          resolved (``zero`` an int, ``fused_loss`` a bool); ``history`` records every pass,
          remat's and its re-emitted program passes included.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

import torch
import torch.utils._pytree as pytree

from shardfx.auto import zero_stage
from shardfx.auto.shard import solver
from shardfx.compiler.budget import (apply_recompute, check_budget, evaluate, fit_budget,
                                     fit_zero_stage)
from shardfx.compiler.compiled import Compiled
from shardfx.compiler.driver import compile_ir
from shardfx.compiler.finalists import fall_back, keep_best
from shardfx.compiler.manager import PassRecord, dump_failure, record
from shardfx.cost.device_model import default_model
from shardfx.errors import InputError, LossError, MemoryBudgetError, PassError, ShardfxError
from shardfx.ir import meta as M
from shardfx.ir.frozen import freeze
from shardfx.ir.graph import copy_ir
from shardfx.ir.text import ir_to_text
from shardfx.kernels.experts import EXPERTS
from shardfx.mesh import MeshSpec
from shardfx.partitioner.capture import Captured, capture, capture_leaves
from shardfx.partitioner.experts_hf import recognise
from shardfx.partitioner.microbatching import check_one_row, check_rows_independent, loss_reduction
from shardfx.passes.fused_loss import fusable, fusing_reason
from shardfx.request.hints import check_hint_axes
from shardfx.request.options import Options


def compile_model(model: torch.nn.Module, example_args: tuple, loss_fn: Callable | None,
                  example_targets: tuple, mb_args: tuple, mb_targets: tuple, spec: MeshSpec,
                  options: Options) -> Compiled:
    """The whole compilation from the model: capture (on one slice of the batch, ``mb_args``
    and ``mb_targets``), then ``compile_captured``; under ``shard="auto"``, the named plans
    the solver's price cannot tell from its choice compiled too (``compiler.finalists``)."""
    slices = options.slices
    captured = _capture(model, mb_args, loss_fn, mb_targets, options)
    if slices > 1:  # steps take the whole batch: check them against its shapes
        captured.leaves = capture_leaves(example_args, example_targets)
        if loss_fn is not None:  # and the slices' losses must make the batch's
            reduction = loss_reduction(loss_fn, captured.output, example_targets, slices)
            options = dataclasses.replace(options, loss_reduction=reduction)
    # hints name mesh axes: check them while the user's line of each is known
    sharded = spec.stage() if options.stages > 1 else spec
    if sharded.size > 1:
        check_hint_axes(captured.gm, [a for a, _ in sharded.axes], [a for a, _ in spec.axes])
    dump = os.environ.get("SHARDFX_DUMP")
    captured_ir = [PassRecord("capture", ir_to_text(captured.gm))] if dump else []
    # shard="auto": the named plans the solver cannot tell from its choice are planned too,
    # each from its own copy of the captured IR (planning rewrites the one it is given)
    pristine = copy_ir(captured.gm) if options.shard == "auto" and solver(options) else None
    def named(name: str) -> Compiled:
        return compile_captured(dataclasses.replace(captured, gm=copy_ir(pristine)),
                                dataclasses.replace(options, shard=name))

    try:
        try:
            compiled = compile_captured(captured, options)
        except MemoryBudgetError as e:  # the solver's choice, planned, is over: a named one?
            if pristine is None:
                raise
            compiled = fall_back(e, captured.gm.meta.get(M.AUTO), named)
        else:
            if pristine is not None:
                compiled = keep_best(compiled, named)
    except PassError as e:  # shardfx's fault: write what exists for the report
        dump_failure(e, captured_ir, captured.gm)
        raise
    return compiled


def compile_captured(captured: Captured, options: Options) -> Compiled:
    auto_fused = options.fused_loss == "auto"
    if auto_fused:  # planned without, then fused if the memory it saves matters
        options = dataclasses.replace(options, fused_loss=False)
    ir, program, history, collectives = compile_ir(captured.gm, options)
    zero_chosen = options.zero == "auto"
    options = zero_stage.resolve(ir, options)
    train = ir.meta[M.GRAPH].mode is M.Mode.TRAIN
    if train and options.slices > 1:
        check_rows_independent(ir, options.slices)  # each slice's forward sees its rows only
    compiled = Compiled(captured, options, ir, program, history, collectives)
    compiled.zero_chosen = zero_chosen
    if auto_fused and train:
        choose_fused_loss(compiled)
    if train and options.recompute in ("selective", "full"):
        before = freeze(compiled.ir)
        if apply_recompute(compiled) is not None:  # the IR recomputes: its program passes again
            compiled.history.append(record("recompute", before, freeze(compiled.ir, before)))
            compiled.history += compiled.program_records
    if options.memory_budget is not None:
        fit_memory_budget(compiled, options.memory_budget)
    return compiled


def choose_fused_loss(compiled: Compiled) -> None:
    """``fused_loss="auto"``: fuse the LM head with its loss only where the memory it
    saves matters (``passes.fused_loss.fusing_reason``) and the peak drops."""
    peak = max(compiled.memory_estimate().values())
    reason = fusing_reason(peak, compiled.options.memory_budget,
                           default_model(compiled.options).memory)
    if not reason or not fusable(compiled.ir.graph):
        return
    unfused = compiled.options
    program = compiled.program if compiled.program is not None else compiled.stage_program
    emitted = (program, compiled.collectives, compiled.program_records)
    compiled.options = dataclasses.replace(unfused, fused_loss=True)
    evaluate(compiled)
    if compiled.fused_losses() and max(compiled.memory_estimate().values()) < peak:
        compiled.fused_loss_reason = reason
        return
    compiled.options = unfused  # the unfused emission back, as it was: not emitted again
    compiled.emitted(*emitted)


def fit_memory_budget(compiled: Compiled, budget: int) -> None:
    """Recompute activations (and in a pipeline, keep fewer microbatches in flight) until
    every device's predicted peak is under ``budget`` (``compiler.budget``); a budget no
    plan meets is a ``MemoryBudgetError``."""
    if compiled.mode is not M.Mode.TRAIN:
        need = max(compiled.memory_estimate().values())
        if need > budget:
            raise MemoryBudgetError(
                f"inference needs {need} bytes per device; memory_budget is {budget}",
                where="partition(..., memory_budget=...)",
                fix="a larger budget, or shard the model over a tp or pp axis")
        return
    if compiled.zero_chosen:
        fit_zero_stage(compiled, budget)  # the stage against the memory model, before remat
    if compiled.options.recompute != "auto":  # the user's policy: checked, not changed
        check_budget(compiled, budget)
        return
    before = freeze(compiled.ir)
    fit_budget(compiled, budget)
    if compiled.remat is not None:  # the IR recomputes: its program passes ran again
        compiled.history.append(record("remat", before, freeze(compiled.ir, before)))
        compiled.history += compiled.program_records


def _capture(model: torch.nn.Module, args: tuple, loss_fn: Callable | None, targets: tuple,
             options: Options) -> Captured:
    """``capture`` on one slice of the batch; a slice too small for the model, or a failure
    that missing targets explain, is said in those terms."""
    rows = next((t.shape[0] for t in pytree.tree_leaves(args)
                 if isinstance(t, torch.Tensor) and t.dim()), 0)
    check_one_row(model, rows, options.microbatches, options.slices // options.microbatches)
    _check_experts_modules(model, options)
    try:
        captured = capture(model, args, loss_fn, targets, capacity=options.capacity_factor)
    except ShardfxError as e:
        if isinstance(e, LossError) and targets == () and \
                re.search(r"missing \d+ required positional argument", str(e.__cause__)):
            raise LossError(
                f"example_targets missing: loss_fn was called on the model output alone and "
                f"raised {type(e.__cause__).__name__}: {e.__cause__}",
                where="partition(..., example_targets=...)",
                fix="pass the targets loss_fn takes as a tuple: "
                    "partition(model, example_args, loss_fn, (targets,))") from e.__cause__
        raise
    _check_experts(captured, options)
    return captured


def _asked_of_experts(options: Options) -> list[str]:
    """The settings that need the model's experts to run as ``shardfx::experts``."""
    asked = [f"capacity_factor={options.capacity_factor}"] if options.capacity_factor else []
    return asked + ([f"ep={options.mesh.axis('ep')}"] if options.mesh.axis("ep") > 1 else [])


def _check_experts_modules(model: torch.nn.Module, options: Options) -> None:
    """Before tracing: with a capacity or an ep axis, an experts module shardfx cannot run as
    its op (``partitioner.experts_hf.why_not``) is named, with why."""
    asked = _asked_of_experts(options)
    if not asked:
        return
    _, missed = recognise(model)
    if missed:
        path, why = missed[0]
        kind = type(model.get_submodule(path)).__name__
        raise InputError(
            f"{' and '.join(asked)} asked, and {path} is a mixture-of-experts layer shardfx "
            f"cannot run as its experts op: {why}", where=f"{path} ({kind})",
            fix="drop the ep axis and the capacity (its experts then run on every rank that "
                "holds the layer), or compute the experts with shardfx.experts(...) "
                "(docs/experts.md)")


def _check_experts(captured: Captured, options: Options) -> None:
    """After tracing: a capacity needs a mixture-of-experts layer (the ep axis says so in
    ``shard_annotate``)."""
    if options.capacity_factor and \
            not captured.gm.graph.find_nodes(op="call_function", target=EXPERTS):
        raise InputError(
            f"capacity_factor={options.capacity_factor} asked, and the model has no "
            "mixture-of-experts layer shardfx recognises",
            where="partition(..., capacity_factor=...)",
            fix="drop capacity_factor, or mark the model's experts with shardfx.experts(...) "
                "(docs/experts.md)")
