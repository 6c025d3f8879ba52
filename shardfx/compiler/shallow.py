"""A memory budget's candidates judged on shallow copies of a deep model.

A model of L interchangeable blocks (``capture`` traced two and stamped the rest) gets one
remat choice for all of them: ``auto.remat`` shares their variables. The budget's search
(``remat_search.search``) tries some twenty choices, and judging one by the whole program's
estimate means generating the program of all L blocks and walking it: on a 32-layer
hidden-1024 Llama over dp=2 x tp=2, 0.9 s a candidate, 20 s for a plan whose planning without
a budget takes 4.

Here a candidate is judged on the same model with its list cut to d1 and d2 = d1 + 2 blocks
(``Captured.at_depth``), each planned by the same passes, the choice applied to it (its
variables are the whole model's, one per op of a block), and the peak of each part of the
step (the forward, the first and the second half of the backward, the optimizer step) extended
to L blocks, part by part of what holds it (``DeviceMemory``: parameters, gradients, optimizer
state, kept activations, temporaries, buffers), along the line through the two depths. What a
block adds repeats with every block, and the fullest moment of each part stays at the same
place (the end of the forward; the start of the backward, where every block's activations are
kept, or its middle; the step, with every gradient): the line is exact while it does.

Where it is not, the whole program says so: the choice found is applied to the whole model and
its program generated once. Over the budget, the search runs again against the budget less what
the line fell short by (at most ``CORRECTIONS`` times, then it judges on the whole program as
``remat_search.fit`` does); under it by less than the line said, once more against the budget
plus the surplus, keeping the cheaper choice that fits. ZeRO's and dp's buckets are why: a
bucket falls a little differently across blocks at each depth (on a 16-layer Llama with zero=3 the line was
0.1% over, and at the lowest peak that was the difference between 468 and 657 GFLOPs
recomputed). When no candidate fits, the one with the lowest extended peak is measured on the
whole program: under the budget after all, it is the choice; otherwise its real peak is the
lowest the ``MemoryBudgetError`` states.

Not pipelines: a pipeline's copy keeps its p stages, each of k blocks. Copies of 1 and 3 blocks
a stage (4p blocks) were tried on the 70B shape at 80 layers over pp=8 x tp=8: most of a stage
program's emission and walk does not shrink with its blocks (the split into parts, the
embedding's and the 128k head's stages), and the search took 81 s against 77 s on the whole
stage programs.

Requires: a plan for one device, dp, tp or ZeRO (not pp) whose model ``capture`` stamped one list
          of at least ``DEEP`` blocks; its IR planned without recomputation, its program emitted.
Ensures:  what ``remat_search.fit`` ensures: the IR recomputes the choice returned (None: nothing)
          and the plan's program is generated from it, or ``MemoryBudgetError`` with the lowest
          peak of the whole program that the search found.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.codegen.zero import program_gathers
from shardfx.errors import MemoryBudgetError
from shardfx.ir import meta as M
from shardfx.ir.graph import phases
from shardfx.passes.zero import zero_layouts
from shardfx.estimate.memory import KINDS, DeviceMemory, spmd_moments
from shardfx.auto.remat import Choice, Problem
from shardfx.auto.remat_choice import apply, undo
from shardfx.auto.remat_search import (choose, device_group, fit as fit_whole, held_once,
                                         infeasible, search)
from shardfx.compiler.driver import compile_ir, emit

log = logging.getLogger("shardfx.compiler.budget")

DEEP = 16  # blocks from which judging on shallow copies pays (copies of 2 and 4 blocks)
CORRECTIONS = 2  # searches again against a budget moved by what the line missed


def deep_enough(plan) -> bool:
    """Whether ``fit`` applies to ``plan`` (the module docstring's Requires)."""
    return plan.stage_program is None and plan.captured.depth >= DEEP


def fit(plan, budget: int, evaluate) -> Choice | None:
    """``remat_search.fit`` for ``plan``'s IR, its candidates judged on shallow copies (module
    docstring). ``evaluate(record=False)`` generates the plan's program and returns its
    memory; ``record``: with its program passes' text (``budget.evaluate``)."""
    memory = {"device": plan.memory_breakdown()[0]}
    if memory["device"].total <= budget:
        return None
    problem = Problem(plan.ir, device_group, held_once, host_used=memory["device"].host)
    shallow = _Shallow.of(plan, problem)
    if shallow is None:
        return fit_whole(plan.ir, budget, device_group, held_once, evaluate)
    target, relaxed, lowest_found = budget, False, False
    fitting: tuple | None = None  # (choice, flags): the cheapest that fits the whole program
    lowest = (memory, None)  # the lowest peak measured on the whole program, and its flags
    applied = None  # the flags the IR recomputes now (its Python code is regenerated once)
    for _ in range(1 + CORRECTIONS):
        if applied is not None:
            undo(plan.ir, recompile=False)
            applied = None
        try:
            best = search(problem, target, shallow.judge(None), shallow.judge)
        except MemoryBudgetError as e:  # no candidate fits: measure the lowest
            best, lowest_found = e.solution, target == budget
            if best is None:
                break
        predicted = shallow.judge(best)["device"].total
        choice, applied = choose(plan.ir, problem, best, recompile=False), best
        real = evaluate(record=True)  # the plan's program, if it fits
        total = real["device"].total
        log.info("shallow copies predicted %d bytes for the whole program: %d", predicted, total)
        if total < lowest[0]["device"].total:
            lowest = (real, best)
        if total <= budget:
            if fitting is None or choice.seconds < fitting[0].seconds:
                fitting = (choice, best)
            if relaxed or total >= predicted:
                break
            target, relaxed = budget + predicted - total, True  # overstated: cheaper may fit
        elif fitting is not None or lowest_found:  # a cheaper try missed; or nothing fits
            break
        else:
            target -= total - predicted
    if fitting is not None:
        if applied is not fitting[1]:
            if applied is not None:
                undo(plan.ir, recompile=False)
            choose(plan.ir, problem, fitting[1], recompile=False)
            evaluate(record=True)
        plan.ir.recompile()
        return fitting[0]
    if applied is not None:
        undo(plan.ir, recompile=False)
    evaluate()  # the program as it was
    if lowest_found:
        raise infeasible(budget, lowest[0], lowest[1])
    log.info("judging on the whole program after %d corrections", CORRECTIONS)
    return fit_whole(plan.ir, budget, device_group, held_once, evaluate)


class _Shallow:
    """The plan's model at two shallow depths, planned; judges the whole model's choices."""

    def __init__(self, plan, copies: list, depths: tuple[int, int]):
        self.options, self.copies, self.depths = plan.options, copies, depths
        self.depth = plan.captured.depth

    @classmethod
    def of(cls, plan, problem: Problem) -> "_Shallow | None":
        """None where a shallow copy's variables are not the whole model's (a block that
        differs from the others past the traced pair)."""
        captured = plan.captured
        depths = _depths(plan, captured.pair[1])
        if 2 * depths[1] > captured.depth:  # not worth it: judged on the whole program
            return None
        copies = []
        for blocks in depths:
            ir, program, _, _ = compile_ir(captured.at_depth(blocks), plan.options, record=False)
            sub = Problem(ir, device_group, held_once)
            if _variables(sub) != _variables(problem):
                return None
            copies.append((ir, sub, _moments(program, plan.options)))
        return cls(plan, copies, depths)

    def judge(self, solution: tuple | None) -> dict:
        """The predicted peak of the whole model with ``solution`` (keep, recompute flags of
        its variables; None: recompute nothing): each part of the step's peak extended from
        the shallow copies, the fullest of them."""
        near, far = (unrecomputed if solution is None else self._moments(ir, sub, solution)
                     for ir, sub, unrecomputed in self.copies)
        extended = [_extend(near[at], far[at], *self.depths, self.depth)
                    for at in far if at in near]
        return {"device": max(extended, key=lambda m: m.total)}

    def _moments(self, ir, sub: Problem, solution: tuple) -> dict:
        apply(ir, sub, *solution, recompile=False)  # the copy's Python code is never run
        try:
            return _moments(emit(ir, self.options)[0], self.options)
        finally:
            undo(ir, recompile=False)


def _depths(plan, repeat) -> tuple[int, int]:
    """The traced pair and two blocks more; or, where the pair's gradients would not fill two
    gradient buckets (``codegen.bucketing``: at most ``BUCKET_BYTES`` each), as many blocks as
    do and two more. A shallow copy whose gradients fit in one bucket reduces them all at once,
    in a buffer the deep program never holds (it holds a full bucket's). Two blocks apart, the
    middle of the backward (``_moments``) moves by one whole block, the same place in it."""
    prefix = repeat.instance(0) + "."
    block = sum(n.meta[M.VAL].numel() * n.meta[M.VAL].element_size()
                for n in plan.program.module.graph.find_nodes(op="placeholder")
                if n.meta[M.ROLE].kind is M.InputKind.PARAM
                and n.meta[M.ROLE].name.startswith(prefix))
    first = repeat.traced
    if plan.options.zero == 3:  # the program's parameters are this rank's rows; buckets whole
        block *= plan.options.mesh.axis("dp")
    if block and plan.options.mesh.axis("dp") > 1:
        first = max(first, math.ceil(2 * BUCKET_BYTES / block))
    return first, first + 2


def _variables(problem: Problem) -> list:
    """Each variable's first op (target, shape, dtype), in the order the variables number."""
    firsts: dict[int, object] = {}
    for node in problem.forward:
        i = problem.var[node]
        if i not in firsts:
            val = node.meta.get(M.VAL)
            layout = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
            firsts[i] = (str(node.target), layout)
    return [firsts[i] for i in range(problem.n)]


def _moments(program, options) -> dict:
    """The predicted peak of a training step of one SPMD ``program`` (as
    ``Plan.memory_breakdown``) in each part of the step: the forward, each half of the
    backward (its start holds every block's kept activations, its end every block's
    gradients), the optimizer step, ZeRO's gather."""
    phase = phases(program.module.graph)
    backward = [n for n, p in phase.items() if p is M.Phase.BACKWARD]
    half = {n: ("backward", 2 * i // len(backward)) for i, n in enumerate(backward)}
    dp = options.mesh.axis("dp")
    layouts = zero_layouts(program, dp) if options.zero else {}
    gathers = program_gathers(program, layouts, dp) if options.zero in (1, 2) else []
    return spmd_moments(program, options, True, lambda node: half.get(node, "forward"),
                        layouts, gathers)


def _extend(near: DeviceMemory, far: DeviceMemory, d1: int, d2: int, depth: int
            ) -> DeviceMemory:
    """Each part of the peak at ``depth`` blocks on the line through its values at d1 and d2."""
    steps = (depth - d2) / (d2 - d1)
    parts = {k: int(np.rint(getattr(far, k) + (getattr(far, k) - getattr(near, k)) * steps))
             for k in KINDS}
    host = int(np.rint(far.host + (far.host - near.host) * steps))
    return DeviceMemory(**parts, host=host, when=far.when)
