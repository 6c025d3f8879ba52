"""The solver's last word: its choice and the named plans it cannot tell apart, planned in full
and ranked by ``plan.predicted_step``.

The integer program prices a plan from the IR's ops and the redistributions their strategies
need (``auto.ilp``); ``plan.predicted_step`` prices the program planning emits (``step_time``):
the collectives codegen really issues (one per value and placement, gradients in buckets), the
program passes' own ops, the optimizer's step, a pipeline's schedule. They agree to a few
percent, not exactly, so where a named plan (``megatron``, ``replicate``) is priced within
``CLOSE`` of the program's choice (plus how far the program was off on its choice, once it is
planned) both are planned and the predictor ranks them: the plan
``shard="auto"`` returns is never one the predictor puts behind a named plan it planned.
A named plan priced further off is left as the program priced it (planning each one would
double a large model's planning time), and ``print(plan)`` says which figures are which. In a
pipeline the program prices a stage's ops, not the schedule's bubble and sends: its figures
are compared with each other alone, and the planned ones are the predictor's.

Requires: ``plan`` planned with ``shard="auto"`` (its IR's ``AUTO`` report, if the solver ran);
          ``make(name)`` plans the same model with ``shard=name``.
Ensures:  the plan kept, its IR's ``AUTO`` report with each planned figure (``planned``) and
          which plan was kept (``kept``). Where the choice itself is over the memory budget
          once planned, the fastest named plan that fits (``fall_back``).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Callable

from shardfx.errors import ShardfxError
from shardfx.auto.shard import AUTO

log = logging.getLogger("shardfx.compiler.finalists")

# A named plan the integer program prices within this factor of its choice is planned in full
# (the program's price of a named plan was within 0.2% of its plan's predicted step on the
# meshes tests/test_auto_shard plans, of its own choice within a few percent)
CLOSE = 1.1
TIE = 1e-9  # a named plan replaces the choice only if predicted faster by more than this


def keep_best(plan, make: Callable[[str], object]):
    """The fastest by ``predicted_step`` of ``plan`` and the named plans priced close to it."""
    report = plan.ir.meta.get(AUTO)
    if report is None:
        return plan
    step = plan.predicted_step
    plans = {"auto": plan}
    planned = {"auto": (step.total, step.compute)}
    # How far the program was off on its own choice widens the margin: a named plan it priced
    # within that of its choice may be the faster once planned. Not in a pipeline, where the
    # program prices a stage's ops and not the schedule: there its prices are compared alone.
    off = abs(step.total - report.seconds) if plan.stage_program is None else 0.0
    for name, (seconds, _) in report.named.items():
        if seconds <= CLOSE * report.seconds + off:
            _plan_named(name, make, plans, planned)
    return _keep(plans, planned, report, plan.mesh)


def fall_back(error, report, make: Callable[[str], object]):
    """Where the solver's choice, planned, does not fit the memory budget (its memory term
    counts the saved activations as the IR holds them, not the program's temporaries): the
    named plans that do, the fastest by ``predicted_step``; else ``error``."""
    plans, planned = {}, {}
    for name in (report.named if report is not None else ()):
        _plan_named(name, make, plans, planned)
    if not plans:
        raise error
    return _keep(plans, planned, report, next(iter(plans.values())).mesh)


def _plan_named(name: str, make, plans: dict, planned: dict) -> None:
    """Plan ``shard=name`` into ``plans``, its predicted (seconds, compute) into ``planned``;
    nothing where it cannot be planned (over the budget, not on this mesh: not a finalist)."""
    try:
        plans[name] = make(name)
    except ShardfxError as e:
        log.info("shard=%r not planned: %s", name, e)
        return
    step = plans[name].predicted_step
    planned[name] = (step.total, step.compute)


def _keep(plans: dict, planned: dict, report, mesh):
    """The plan predicted fastest (the first of ``plans`` unless another is faster by more
    than ``TIE``), its IR's report saying what was planned and kept; a warning where the plan
    kept splits nothing over an axis the solver decides."""
    kept = next(iter(planned))
    for name, (seconds, _) in planned.items():
        if seconds < planned[kept][0] * (1 - TIE):
            kept = name
    chosen = plans[kept]
    chosen.ir.meta[AUTO] = report = dataclasses.replace(report, planned=planned, kept=kept)
    if idle_axes(report):  # stack: _keep, keep_best or fall_back, compile.compile_model,
        #                    api._plan, partition, the caller (whom the warning names)
        warnings.warn(f'shard="auto" on mesh {mesh}: {idle_words(report)}', stacklevel=6)
    return chosen


def idle_axes(report) -> list[str]:
    """The axes the solver decided on which the plan kept splits nothing: every parameter
    whole and the batch not split either, so each rank of the axis does the same work."""
    if report.kept == "replicate":
        return list(report.axes)
    if report.kept != "auto":
        return []
    idle = []
    for i, axis in enumerate(report.mesh_axes):
        if axis not in report.axes:
            continue
        placed = [*report.params.values(), *report.inputs.values()]
        if all(type(p[i]).__name__ == "Replicate" for p in placed):
            idle.append(axis)
    return idle


def idle_words(report) -> str:
    """``print(plan)``'s line and the warning's text for ``idle_axes``."""
    axes = idle_axes(report)
    name = " and ".join(axes)
    return (f"the {name} axis buys nothing: no plan the solver found splits a weight or the "
            f"batch over it faster than keeping everything whole, so its ranks all do the same "
            f"work; use those devices as dp (a larger dp axis, or no {name} axis) or with a "
            f"model whose layers are wide enough to split") if axes else ""
