"""Meeting ``memory_budget``: what each device keeps for the backward, and, in a pipeline, how
many microbatches each rank keeps in flight.

One device, dp and tp: `auto.remat_search.fit` recomputes the least that brings the predicted
peak under the budget; in a model of many stamped blocks, each candidate is judged on two shallow
copies of it (`shardfx.compiler.shallow`), the choice on the whole program.

A pipeline rank holds its stage's saved activations once per microbatch in flight, so there
are two ways to fit: recompute, or keep fewer microbatches in flight. They are chosen together.
The candidates are the schedule asked for, then 1F1B capped at k microbatches in flight per
rank (`schedule.one_f_one_b(p, m, in_flight=k)`, k = p-1 .. 1: its warm-up cut to k-1
forwards, so the pipeline fills more slowly). GPipe keeps all m in flight; 1F1B at k = p has
its bubble with at most p, so it is a candidate there too. Each candidate is fitted by remat,
and each that fits has its step simulated (`schedule.simulate`) with the stage costs of
`estimate_cost`: a stage's forward, twice that for its backward, plus what it recomputes. The
fastest is kept, the schedule asked for on a tie. The first candidate that fits without
recomputing ends the search (fewer in flight would only add bubble). Where the schedule asked
for does not fit, 1F1B with one microbatch in flight is fitted next: a rank that keeps fewer
microbatches in flight holds no more at any moment, whatever is recomputed, so where that one
does not fit either none does, and its lowest peak is the one the error states (without it, a
budget no plan meets searched each candidate's lowest peak: over ten minutes for an 80-layer
pipeline of 8 ranks). A user's own schedule, interleaved 1F1B and zero bubble keep their order,
and remat alone fits them.

Requires: a ``compiler.compiled.Compiled`` with its IR planned and its program(s) emitted; ``plan.schedule`` in a pipeline.
Ensures:  ``plan.remat`` (None if nothing is recomputed), ``plan.schedule`` the one chosen,
          ``plan.budget_candidates`` (a pipeline's candidates and what each cost), or
          ``MemoryBudgetError`` naming the smallest peak any candidate reaches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardfx.compiler import shallow
from shardfx.cost.device_model import default_model, model_of
from shardfx.errors import MemoryBudgetError
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.auto.remat import Choice, recompute_seconds
from shardfx.auto.recompute import apply_policy
from shardfx.auto.remat_choice import undo
from shardfx.auto.remat_search import advice as remat_advice, device_group, fit, held_once
from shardfx.passes.stage_cut import node_time
from shardfx.compiler.driver import emit
from shardfx.codegen.activation_offload import offloaded
from shardfx.schedule import Action, Kind, Schedule, check, one_f_one_b, peak_in_flight, simulate
from shardfx.auto import zero_stage


@dataclass(frozen=True)
class Candidate:
    """One schedule tried under the budget, and what fitting it cost."""

    name: str  # "1f1b", or "1f1b, at most 2 in flight"
    schedule: Schedule
    fits: bool
    recompute_flops: int = 0  # per step, every microbatch
    step: float = 0.0  # simulated seconds of a step (on the plan's device model)
    skipped: bool = False  # not fitted: recomputing nothing, it is slower than one that fits
    choice: Choice | None = None  # what remat recomputes for it


def fit_budget(plan, budget: int) -> None:
    """Set ``plan.remat`` and, in a pipeline, ``plan.schedule`` so every device fits ``budget``.
    A budget no plan meets is a ``MemoryBudgetError``, whose fix names the ZeRO stage that
    would meet it, where one would (``zero_advice``), and optimizer offload where it would
    (``offload_advice``)."""
    try:
        _fit_budget(plan, budget)
        if plan.remat is not None and not plan.program_records:  # the chosen program again,
            evaluate(plan, record=True)  # its passes' text recorded
        if plan.remat is not None and plan.remat.offloaded:
            # what the program copies: a fused loss reads some values whole, forward and
            # backward in one op, and they stay (codegen.activation_offload)
            sent = offloaded(plan.stage_program or plan.program)
            plan.remat = dataclasses.replace(
                plan.remat, offloaded=tuple(n for n in plan.remat.offloaded if n in sent),
                offloaded_bytes=sum(sent.values()))
    except MemoryBudgetError as e:
        least = getattr(e, "least", None)
        advice = "; or ".join(filter(None, (zero_advice(plan, least, budget),
                                            offload_advice(plan, least, budget))))
        if advice:
            fix = f"{advice}; or {e.fix}"
        elif least is not None and plan.options.zero:  # the advice names the stage it has
            fix = f"a budget of at least {least.total} bytes; " + remat_advice(
                least, plan.options.zero, plan.mesh.axis("dp"), plan.zero_chosen)
        else:
            raise
        error = MemoryBudgetError(e.cause, where=e.where, fix=fix)
        error.least = least
        raise error from None


def apply_recompute(plan):
    """``recompute="selective"`` or ``"full"``: the policy's recomputation in the IR
    (``auto.recompute``), the program(s) emitted again; ``plan.remat`` its ``Choice`` (None:
    the policy found nothing to recompute)."""
    if plan.stage_program is None:
        group_of, weight_of, split = device_group, held_once, False
    else:
        in_flight = peak_in_flight(plan.schedule)

        def group_of(node) -> int:
            return plan.schedule.rank_of(node.meta[M.STAGE])

        def weight_of(node) -> int:
            return max(1, in_flight.get(group_of(node), 1))

        split = plan.schedule.split_backward
    plan.remat = apply_policy(plan.ir, plan.options.recompute, group_of, weight_of, split)
    if plan.remat is not None:
        evaluate(plan, record=True)
    return plan.remat


def check_budget(plan, budget: int) -> None:
    """Under a recompute policy the user named: every device's predicted peak within
    ``budget``, or a ``MemoryBudgetError`` saying what would fit."""
    need = max(plan.memory_estimate().values())
    if need <= budget:
        return
    policy = plan.options.recompute
    fixes = ['recompute="auto" recomputes or offloads what brings it under the budget']
    if policy != "full":
        fixes.append('recompute="full" keeps only each block\'s input')
    raise MemoryBudgetError(
        f"with recompute={policy!r} the plan's predicted peak is {need} bytes per device; "
        f"memory_budget is {budget}", where=f"partition(..., recompute={policy!r}, "
                                            "memory_budget=...)",
        fix="; or ".join(fixes + [f"a budget of at least {need} bytes"]))


def zero_advice(plan, least, budget: int) -> str:
    """The first ZeRO stage that would bring ``least`` (the smallest peak found, a
    ``DeviceMemory``) under ``budget``, with the state it would keep per device, or "". Stage k
    divides over dp: 1 the optimizer's state, 2 and the gradients, 3 and the parameters (ZeRO's
    own formulas; stage 3 also holds a block's gathered parameters at a time, not counted)."""
    dp = plan.mesh.axis("dp")
    if least is None or dp == 1 or plan.options.zero:
        return ""
    p, g, o = least.parameters, least.gradients, least.optimizer
    rest = least.total - p - g - o
    for k, state in ((1, p + g + o / dp), (2, p + (g + o) / dp), (3, (p + g + o) / dp)):
        if k == 3 and plan.mesh.axis("pp") > 1:
            break
        if rest + state <= budget:
            return (f"partition(..., zero={k}) would fit: parameters, gradients and optimizer "
                    f"state {int(state)} bytes per device instead of {p + g + o} (ZeRO-{k} "
                    f"over dp={dp})")
    return ""


def offload_advice(plan, least, budget: int) -> str:
    """Optimizer offload, where the smallest peak found (``least``) without the optimizer's
    state and the gradients, which it moves to the host (``runtime.offload``), would be under
    ``budget``; else "". (Offloaded, the device still holds the gradients of the blocks whose
    backward is under way: "about".)"""
    if least is None or plan.options.offload_optimizer or not least.optimizer:
        return ""
    device = least.total - least.optimizer - least.gradients
    if device > budget:
        return ""
    return (f"partition(..., offload_optimizer=True) would keep the optimizer's state "
            f"({least.optimizer} bytes) and the gradients ({least.gradients}) in host memory, "
            f"about {device} bytes per device")


def _fit_budget(plan, budget: int) -> None:
    pipeline = plan.stage_program is not None
    if not pipeline:
        if shallow.deep_enough(plan):  # candidates judged on shallow copies
            plan.remat = shallow.fit(plan, budget,
                                     lambda record=False: evaluate(plan, record))
        else:
            plan.remat = fit(plan.ir, budget, device_group, held_once, lambda: evaluate(plan))
        return
    candidates = _schedules(plan)
    tried: list[Candidate] = []
    error: MemoryBudgetError | None = None
    lowest_name = ""
    held = None  # the candidate whose recomputation the IR holds
    pending, fewest = list(candidates), candidates[-1][0]
    while pending:
        name, schedule = pending.pop(0)
        fastest = min((c.step for c in tried if c.fits), default=None)
        bound = _step_seconds(plan, schedule, recomputing=False)
        if fastest is not None and bound >= fastest:
            tried.append(Candidate(name, schedule, False, step=bound, skipped=True))
            continue
        plan.schedule, held = schedule, None
        undo(plan.ir)  # the last candidate's recomputation
        try:
            choice = _fit_schedule(plan, budget)
        except MemoryBudgetError as e:
            tried.append(Candidate(name, schedule, False))
            if error is None or _least(e) < _least(error):
                error, lowest_name = e, name  # the candidate that comes closest
            if name == fewest:
                break  # the others keep more in flight: none of them fits either
            if len(pending) > 1 and pending[-1][0] == fewest:
                pending.insert(0, pending.pop())  # the fewest in flight next (docstring)
            continue
        flops = choice.flops * schedule.microbatches if choice else 0
        tried.append(Candidate(name, schedule, True, flops, _step_seconds(plan, schedule),
                               choice=choice))
        held = tried[-1]
        if choice is None and name != fewest:
            break  # fits as it is: fewer in flight would only add bubble
    plan.budget_candidates = tried if len(candidates) > 1 else []
    fitting = [c for c in tried if c.fits]
    if not fitting:
        evaluate(plan)
        if len(candidates) > 1:  # the one that comes closest, named
            closest = MemoryBudgetError(f"{error.cause}, with {lowest_name}",
                                        where=error.where, fix=error.fix)
            closest.least = getattr(error, "least", None)
            raise closest
        raise error
    order = [n for n, _ in candidates]
    best = min(fitting, key=lambda c: (c.step, order.index(c.name)))  # the one asked on a tie
    plan.schedule = best.schedule
    plan.forget_memory()
    if best is held:
        plan.remat = best.choice
    else:
        undo(plan.ir)
        plan.remat = _fit_schedule(plan, budget)


def _least(error: MemoryBudgetError) -> int:
    least = getattr(error, "least", None)
    return least.total if least is not None else 2 ** 62


def _fit_schedule(plan, budget: int) -> Choice | None:
    in_flight = peak_in_flight(plan.schedule)

    def group_of(node) -> int:
        return plan.schedule.rank_of(node.meta[M.STAGE])

    return fit(plan.ir, budget, group_of, lambda node: max(1, in_flight.get(group_of(node), 1)),
               lambda: evaluate(plan), plan.schedule.split_backward)


def _schedules(plan) -> list[tuple[str, Schedule]]:
    """The schedule asked for, then 1F1B with fewer microbatches in flight (module docstring)."""
    asked = plan.options.schedule
    own = [(asked if isinstance(asked, str) else "the given schedule", plan.schedule)]
    if asked not in ("gpipe", "1f1b"):
        return own
    p, m = plan.schedule.ranks, plan.schedule.microbatches
    top = min(p, m) if asked == "gpipe" else min(p, m) - 1
    capped = []
    for k in range(top, 0, -1):
        schedule = one_f_one_b(p, m, in_flight=k)
        check(schedule)
        capped.append((f"1f1b, at most {k} in flight", schedule))
    return own + capped


def _step_seconds(plan, schedule: Schedule, recomputing: bool = True) -> float:
    """A step's simulated length on the plan's device model (``Options.device_model``): per
    stage, the forward's estimated time, twice that for the backward (``stage_cut.node_time``'s
    split), plus the recomputed ops (if ``recomputing``)."""
    model = default_model(plan.options)
    forward: dict[int, float] = {}
    redo: dict[int, float] = {}
    for node in op_nodes(plan.ir.graph):
        stage = node.meta.get(M.STAGE)
        if stage is None:
            continue
        if M.REMAT in node.meta:
            if recomputing:
                redo[stage] = redo.get(stage, 0.0) + recompute_seconds(node, model)
        elif node.meta[M.PHASE] is M.Phase.FORWARD:
            forward[stage] = forward.get(stage, 0.0) + node_time(node, model) / 3

    def seconds(action: Action) -> float:
        f = forward.get(action.stage, 0.0)
        return f if action.kind is Kind.F else 2 * f + redo.get(action.stage, 0.0)

    return simulate(schedule, seconds).makespan


def evaluate(plan, record: bool = False) -> dict:
    """Emit the program(s) from the IR as it stands; each budget group's predicted memory
    (one group for an SPMD plan, one per pp rank). ``record``: keep each program pass's text
    for ``plan.history`` (the chosen program's; a candidate's is not rendered: 0.11 s of an
    8-layer plan's 0.65 s emission)."""
    records = [] if record else None
    program, collectives = emit(plan.ir, plan.options, records)
    plan.emitted(program, collectives, records)
    per_rank = plan.memory_breakdown()
    if plan.stage_program is None:
        return {"device": per_rank[0]}
    return {pp: per_rank[rank] for rank, pp in plan.pp_coordinates().items()}


def fit_zero_stage(plan, budget: int) -> None:
    """Under ``memory_budget`` with ``zero="auto"``: the stage checked against the memory model
    (``plan.memory_estimate``) rather than the formulas above, which leave out the program's
    temporaries. The stages in order of cost, each emitted as the plan's program: the first
    whose predicted peak fits ``budget`` as it is; where none does, the one that holds least
    (remat then recomputes the rest: its budget search starts from the lowest peak). Sets
    ``plan.options`` and the plan's program to the stage's."""
    model = model_of(plan.ir)
    asked = dataclasses.replace(plan.options, zero="auto")
    order = zero_stage.by_cost(zero_stage.stages(asked, model))
    if len(order) < 2:
        return
    def emit(k: int) -> None:
        if k != plan.options.zero:
            plan.options = dataclasses.replace(plan.options, zero=k)
            evaluate(plan)

    peaks = {}
    for stage in order:
        emit(stage.k)
        peaks[stage.k] = max(plan.memory_estimate().values())
        if peaks[stage.k] <= budget:
            break
    else:
        emit(min(order, key=lambda s: (peaks[s.k], order.index(s))).k)
    plan.ir.meta[zero_stage.CHOSEN] = plan.options.zero
