"""The compiler: from a captured model to what every device runs, in one function.

``compile_captured`` runs the IR passes and emits the program(s) (``compiler.driver``), then
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

from shardfx.auto import zero_stage
from shardfx.compiler.budget import evaluate, fit_budget, fit_zero_stage
from shardfx.compiler.compiled import Compiled
from shardfx.compiler.driver import compile_ir
from shardfx.compiler.manager import record
from shardfx.cost.device_model import default_model
from shardfx.errors import MemoryBudgetError
from shardfx.ir import meta as M
from shardfx.ir.frozen import freeze
from shardfx.partitioner.capture import Captured
from shardfx.partitioner.microbatching import check_rows_independent
from shardfx.passes.fused_loss import fusable, fusing_reason
from shardfx.request.options import Options


def compile_captured(captured: Captured, options: Options) -> Compiled:
    auto_fused = options.fused_loss == "auto"
    if auto_fused:  # planned without, then fused if the memory it saves matters
        options = dataclasses.replace(options, fused_loss=False)
    ir, program, history, collectives = compile_ir(captured.gm, options)
    zero_chosen = options.zero == "auto"
    options = zero_stage.resolve(ir, options)
    train = ir.meta[M.GRAPH].mode is M.Mode.TRAIN
    if options.stages > 1 and train and options.slices > 1:
        check_rows_independent(ir, options.slices)  # each slice's forward sees its rows only
    compiled = Compiled(captured, options, ir, program, history, collectives)
    compiled.zero_chosen = zero_chosen
    if auto_fused and train:
        choose_fused_loss(compiled)
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
    before = freeze(compiled.ir)
    fit_budget(compiled, budget)
    if compiled.remat is not None:  # the IR recomputes: its program passes ran again
        compiled.history.append(record("remat", before, freeze(compiled.ir, before)))
        compiled.history += compiled.program_records
