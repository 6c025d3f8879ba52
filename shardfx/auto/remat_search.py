"""remat_search: the recomputation that fits ``memory_budget``, searched on the generated program.

Requires: what ``auto.remat`` requires; ``evaluate()`` (or ``trial``) generates the program(s)
          from the IR as it stands and returns each budget group's predicted ``DeviceMemory``
          (``shardfx.estimate.memory``).
Ensures:  ``fit`` leaves the IR recomputing the choice it returns (None: nothing, the plan fits
          as it is), whose every group's predicted peak is under the budget, and the programs
          generated from it; or raises ``MemoryBudgetError`` with the lowest peak any choice
          reaches (searched, not assumed), what it is made of and the flags that reach it
          (``error.solution``), the IR and the programs as they were.

``auto.remat``'s ILP bounds the bytes kept for the backward; the peak also holds what does not
depend on that choice (state, gradients, temporaries) and what recomputation adds in the
backward, so the search adjusts each group's limit until the generated program's estimate fits
(``search``). Each candidate is judged by a function, so the same search runs on the whole
program (``fit``, ``trial_memory``) or on shallow copies of a deep model (``shardfx.compiler.shallow``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch.fx as fx

from shardfx.errors import MemoryBudgetError
from shardfx.estimate.memory import KINDS
from shardfx.auto.remat import Choice, Problem
from shardfx.auto.remat_choice import apply, group_name, undo


def device_group(node: fx.Node) -> str:
    """The budget group of every op of a dp/tp plan: its one SPMD program, on every device."""
    return "device"


def held_once(node: fx.Node) -> int:
    """How many copies of an op's kept value a device holds outside a pipeline: one."""
    return 1


def fit(gm: fx.GraphModule, budget: int, group_of, weight_of, evaluate,
        split_backward: bool = False) -> Choice | None:
    """Recompute the least that brings every group's peak under ``budget``. ``evaluate()``
    generates the program(s) from ``gm`` as it stands and returns each group's predicted
    ``DeviceMemory``. Returns None when the plan fits without recomputing anything; each
    candidate is judged by its generated program's estimate (``search``)."""
    memory = evaluate()
    if _fits(memory, budget):
        return None
    host_used = max((m.host for m in memory.values()), default=0)
    problem = Problem(gm, group_of, weight_of, split_backward, host_used)
    try:
        best = search(problem, budget, memory, lambda solution: trial_memory(gm, problem, solution,
                                                                       evaluate))
    except MemoryBudgetError:
        evaluate()  # the programs as they were
        raise
    choice = choose(gm, problem, best)
    evaluate()
    return choice


def choose(gm: fx.GraphModule, problem: Problem, best: tuple, recompile: bool = True
           ) -> Choice:
    """Apply ``best`` (keep, recompute, offload flags) to ``gm``; what it recomputes and
    offloads."""
    choice = apply(gm, problem, *best, recompile=recompile)
    before = problem.kept_bytes(problem.must & problem.can_keep)
    seconds = choice.seconds + problem.exposed_seconds(best[2])
    return dataclasses.replace(choice, seconds=seconds, saved_before=before,
                               saved_after=problem.kept_bytes(best[0]))


def search(problem: Problem, budget: int, memory: dict, trial) -> tuple:
    """The (keep, recompute, offload) flags that recompute (and copy) the least and whose
    peak, ``trial(flags)``
    (each group's ``DeviceMemory``), is under ``budget``; ``memory``: each group's peak
    recomputing nothing, which does not fit.

    The ILP bounds the bytes kept for the backward; the peak also holds what does not depend
    on that choice (state, gradients, temporaries) and what recomputation adds (recomputed
    values and their temporaries in the backward). So each group's limit is searched by
    bisection between the fewest bytes it can keep and what it keeps without remat, judging
    each candidate by ``trial``: the largest limits that fit recompute the least. (The peak is
    not monotone in the limit: a larger limit can pick a cheaper recomputation with a larger
    temporary in the backward. Interpolating between the ends, which assumes it is, settled
    on twice bisection's recompute FLOPs for a 2-layer Llama at full AC's peak, so bisection
    it is.)

    Recomputing the most is not always the lowest peak (a recomputed value's transient can
    outweigh what keeping it cost), so when it does not fit, ``lowest`` searches the limits
    for the lowest peak: the ``MemoryBudgetError`` raised then states that peak, reached by
    the flags it carries (``error.solution``, None for recomputing nothing), which this search
    finds again at that budget."""
    before = problem.kept_bytes(problem.must & problem.can_keep)
    best = problem.smallest()
    fewest = problem.kept_bytes(best[0])
    best_limits = dict(fewest)
    most = trial(best)
    if not _fits(most, budget):
        found = lowest(problem, {0.0: (most, best, fewest), 1.0: (memory, None, before)}, trial)
        if not _fits(found[0], budget):
            raise infeasible(budget, found[0], found[1])
        best, best_limits = found[1], found[2]
    lo = {g: best_limits.get(g, 0) for g in memory}  # fits
    hi = {g: max(before.get(g, 0), lo[g]) for g in memory}  # may not
    tol = {g: max(1, before.get(g, 0) // 100) for g in memory}
    for g in memory:
        if memory[g].total <= budget:
            lo[g] = hi[g]  # this group fits keeping everything
    for _ in range(10):
        searching = [g for g in memory if hi[g] - lo[g] > tol[g]]
        if not searching:
            break
        mid = dict(lo) | {g: (lo[g] + hi[g]) // 2 for g in searching}
        solution = problem.solve(mid)
        if solution is None:  # the solver's time limit: treat as not fitting
            hi.update({g: mid[g] for g in searching})
            continue
        memory = trial(solution)
        for g in searching:
            if memory[g].total <= budget:
                lo[g] = mid[g]
            else:
                hi[g] = mid[g]
        if _fits(memory, budget):
            best, best_limits = solution, mid
    if best_limits != lo:  # each group's largest limit that fitted, together
        solution = problem.solve(lo)
        if solution is not None and _fits(trial(solution), budget):
            best = solution
    return _keep_what_fits(problem, best, budget, trial)


# Where ``lowest`` tries the limits first, as a share of the way from the fewest kept bytes
# to all of them; it then halves the step around the best until it is 1/64.
SHARES = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


def lowest(problem: Problem, ends: dict, trial) -> tuple[dict, tuple | None, dict]:
    """The lowest peak any choice reaches, searched: ``ends`` holds recomputing the most
    (share 0.0) and nothing (1.0), each as (memory per group, choice or None, limits); between
    them the ILP's choice at limits a share of the way from the fewest kept bytes to all of
    them (every group at the same share), refined around the best. Returns the lowest as
    ``ends`` holds them. Deterministic: the same search at the budget it states finds the
    same plan."""
    fewest, before = ends[0.0][2], ends[1.0][2]

    def at(share: float) -> dict:
        return {g: int(fewest.get(g, 0) + share * (before.get(g, 0) - fewest.get(g, 0)))
                for g in ends[1.0][0]}

    def peak(memory: dict) -> int:
        return max(m.total for m in memory.values())

    tried = dict(ends)

    def attempt(share: float) -> None:
        if share in tried or not 0 < share < 1:
            return
        solution = problem.solve(at(share))
        if solution is not None:
            tried[share] = (trial(solution), solution, at(share))

    for share in SHARES:
        attempt(share)
    step = SHARES[0]
    while step > 1 / 64:
        step /= 2
        centre = min(tried, key=lambda s: (peak(tried[s][0]), -s))
        attempt(centre - step)
        attempt(centre + step)
    return min(tried.values(), key=lambda t: peak(t[0]))


def trial_memory(gm: fx.GraphModule, problem: Problem, solution: tuple, evaluate) -> dict:
    """Each group's memory with ``solution`` applied; the IR is left as it was."""
    apply(gm, problem, *solution, recompile=False)
    try:
        return evaluate()
    finally:
        undo(gm, recompile=False)


def _fits(memory: dict, budget: int) -> bool:
    return all(m.total <= budget for m in memory.values())


def _keep_what_fits(problem: Problem, best: tuple, budget: int, trial, tries: int = 8
                    ) -> tuple:
    """Keep again, costliest first, recomputed values whose keeping still fits. The ILP counts
    every kept byte against the limit, wherever in the backward the value dies; one the
    backward reads first (the loss head's log-softmax and the LM head's matmul before it)
    is gone before the backward's own peak, so keeping it may cost nothing."""
    keep, again, off = best
    redo = [i for i in np.flatnonzero(again & ~keep) if problem.can_keep[i] and problem.cost[i] > 0]
    for i in sorted(redo, key=lambda i: -problem.cost[i])[:tries]:
        trial_keep, trial_again = keep.copy(), again.copy()
        trial_keep[i], trial_again[i] = True, False
        if _fits(trial((trial_keep, trial_again, off)), budget):
            keep, again = trial_keep, trial_again
    return keep, again, off


def infeasible(budget: int, memory: dict, solution: tuple | None = None):
    group, least = max(memory.items(), key=lambda kv: kv[1].total)
    error = MemoryBudgetError(
        f"no plan fits memory_budget={budget} bytes: the lowest peak found (recomputing from "
        f"nothing to every activation it may) is {least.total} bytes on the fullest device"
        f"{'' if len(memory) == 1 else f' ({group_name(group)})'} ({_parts(least)})",
        where="partition(..., memory_budget=...)",
        fix=f"a budget of at least {least.total} bytes; {advice(least)}")
    error.least = least  # the smallest peak found: shardfx.compiler.budget names a ZeRO stage from it
    error.solution = solution  # the flags that reach it (None: recomputing nothing)
    return error


def _parts(m) -> str:
    kinds = sorted(((getattr(m, k), k) for k in KINDS if getattr(m, k)), reverse=True)
    return ", ".join(f"{k} {b}" for b, k in kinds)


def advice(m, zero: int = 0, dp: int = 1, chosen: bool = False) -> str:
    """What would shrink the part of the peak that dominates it (``zero``: the ZeRO stage
    over ``dp`` the plan already has; ``chosen``: by ``zero="auto"``, every stage tried)."""
    state = m.parameters + m.optimizer + m.gradients
    if state >= m.saved + m.transient and zero:
        how = " (the lightest zero=\"auto\" found)" if chosen else ""
        higher = "" if chosen or zero == 3 else \
            f"a higher stage (zero={'|'.join(map(str, range(zero + 1, 4)))}), "
        return (f"parameters, gradients and optimizer state dominate, already split over "
                f"dp={dp} by ZeRO-{zero}{how}: {higher}more dp ranks, a tp or pp axis, or a "
                "lighter optimizer (optimizer='sgd')")
    if state >= m.saved + m.transient:
        return ("parameters, gradients and optimizer state dominate: shard them over dp "
                "(partition(..., zero=1|2|3)) or over a tp or pp axis, or plan with a lighter "
                "optimizer (optimizer='sgd')")
    return ("activations dominate: a smaller batch or more microbatches, or shard them over "
            "a tp or pp axis")
