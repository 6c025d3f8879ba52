"""auto_shard: the solver chooses every op's placement (``shard="auto"``).

Requires: ANNOTATION on placeholders (``shard_annotate``: the batch split over dp and cp, the
          parameters the user placed), VAL, PHASE, COST, ``gm.meta[device_model.GRAPH_KEY]``.
Ensures:  ANNOTATION rewritten on parameters and inputs to the solution's; CHOICE on every op the
          solver placed: the operand placements ``shard_propagate`` then asks the rule with, so
          the program it plans is the one the solver priced; ``gm.meta[AUTO]``: the ``AutoReport``.

The axes the solver decides are every mesh axis but ``dp`` and ``cp`` (which split the batch
and the sequence, as named) — in practice ``tp``. On them a parameter may be replicated or split
on any dimension, an input replicated or split on its batch (the axis then used as data
parallel), and every op takes any strategy DTensor's rules give for its operands' candidates
(``auto.candidates``). ``auto.ilp`` picks the cheapest by the device model, under the memory
budget when one is given, with each parameter's traffic over dp as the ZeRO stage moves it;
under ``zero="auto"`` the stage too (one program per stage, ``auto.zero_stage``; the report's
``zero``). A parameter the user placed (``shard={glob: placements, "*": "auto"}``) keeps its
placement: the solver completes the plan around it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch.fx as fx

from shardfx.auto import ilp

from shardfx.auto import zero_stage
from shardfx.auto.candidates import confirm, enumerate_candidates
from shardfx.cost.device_model import GRAPH_KEY, default_model
from shardfx.errors import ShardingError
from shardfx.ir import meta as M
from shardfx.request.hints import HINT, PIPE_SPLIT
from shardfx.ir.graph import is_getitem, op_nodes
from shardfx.passes.shard_propagate import planning_mesh
from shardfx.ir.units import nbytes
from shardfx.auto.costs import local_bytes
from shardfx.passes.shard_annotate import user_placed
from shardfx.passes.shard_annotate import megatron_placements
from shardfx.ir.contract import contract, on_graph, on_inputs, on_ops

log = logging.getLogger("shardfx.auto.shard")

AUTO = M.AUTO  # gm.meta: the AutoReport
FIXED_AXES = ("dp_replicate", "dp", "cp", "pp", "ep")
CONFIRM = 4  # solves at most, each after the chosen strategies the whole mesh answers otherwise
TIE = 1e-9  # a stage replaces one solved before it (``zero_stage.by_cost``) only if cheaper by
# more than this fraction: plain dp and ZeRO-2 cost the same, and rounding must not choose


@dataclasses.dataclass(frozen=True)
class AutoReport:
    """What the solver chose, and at what predicted cost, next to the named plans."""

    axes: tuple[str, ...]  # the axes it decided
    mesh_axes: tuple[str, ...]  # every axis of the mesh, in order
    seconds: float  # predicted seconds of the step's compute and communication
    memory: float  # bytes per device the memory term counts
    size: str  # the integer program's size
    enumerate_seconds: float
    solve_seconds: float
    gap: float  # proved distance from the cheapest plan of the candidates
    compute: float  # of ``seconds``, the ops' own; the rest is communication
    named: dict[str, tuple]  # "megatron", "replicate" -> (seconds, compute) as propagated
    budget: float | None  # the bytes the memory term had to fit (None: no budget, or remat's)
    params: dict[str, M.Placements]  # parameter FQN -> the placements chosen
    inputs: dict[str, M.Placements]
    zero: int = 0  # the ZeRO stage priced (chosen where ``zero="auto"``)
    zero_chosen: bool = False  # whether the solver chose it
    # ``compiler.finalists``: "auto" (the program's choice) and the named plans priced close to
    # it, planned in full -> (predicted seconds, compute); and the one kept
    planned: dict[str, tuple] = dataclasses.field(default_factory=dict)
    kept: str = "auto"


def solver(options) -> bool:
    """Whether the plan asks the solver: ``shard="auto"`` (or a glob's value "auto") on a mesh
    with an axis it decides."""
    shard = options.shard
    asked = shard == "auto" or isinstance(shard, dict) and "auto" in shard.values()
    return asked and bool(free_axes(options.mesh))


def free_axes(mesh) -> set[int]:
    return {i for i, (a, n) in enumerate(mesh.axes) if a not in FIXED_AXES and n > 1}


@contract(requires=[on_inputs(M.ANNOTATION, "ANNOTATION"),
                    on_ops(M.PHASE, "PHASE"),
                    on_ops(M.COST, "COST")],
          ensures=[on_inputs(M.ANNOTATION, "ANNOTATION"),
                   on_graph(M.AUTO, "AUTO")])
def auto_shard(gm: fx.GraphModule, options) -> fx.GraphModule:
    if not solver(options):
        return gm
    mesh = planning_mesh(options.mesh.axes)
    start = time.perf_counter()
    cands = enumerate_candidates(gm, mesh, free_axes(options.mesh), _fixed(gm, options))
    enumerated = time.perf_counter() - start
    model = gm.meta.get(GRAPH_KEY) or default_model(options)
    budget = options.memory_budget or model.memory or None  # the device's, where known
    start = time.perf_counter()
    stages = zero_stage.stages(options, model, gm.meta[M.GRAPH].mode is M.Mode.TRAIN)
    for _ in range(CONFIRM):  # until what it chose is what the whole mesh's rules answer
        problem = ilp.build(gm, cands, options.mesh.axes, model)
        stage, problem, solution, activations = _cheapest_stage(
            problem, stages, budget, (options.whole_mesh or options.mesh).axis("dp"))
        if not confirm(cands, solution.choice):
            break
    solution = dataclasses.replace(_stepped(solution, problem, stage),
                                   solve_seconds=time.perf_counter() - start)  # all
    named = {name: _with_stage(ilp.follow(gm, cands, seeds, options.mesh.axes, model),
                               _held(gm, seeds, options.mesh.axes), stage)
             for name, seeds in _named(gm, options).items()}  # before _write
    _write(gm, cands, solution)
    gm.meta[AUTO] = _report(gm, cands, problem, solution, options, enumerated, named,
                            budget if activations else None, stage.k)
    return gm


def _cheapest_stage(problem, stages, budget, dp: int):
    """(stage, the problem priced at it, its solution, whether the saved activations fit too)
    of the cheapest stage and placements that fit ``budget`` with the activations; else of
    those that fit without them (remat will cut them); a ``ShardingError`` where none fits.
    One stage unless ``zero="auto"`` (``auto.zero_stage``)."""
    for activations in (True, False):
        best, solved = None, []
        # The cheaper first; under a budget, of two as cheap, the one holding less: its answer
        # bounds the other's search sooner (ZeRO-2 before plain dp, which can only tie it).
        order = zero_stage.by_cost(stages, least_state=budget is not None)
        for stage in order:
            if budget is None and any(_dominates(s, stage) for s in solved):
                continue  # every plan costs at least as much under it: no solve can win
            priced = problem.at(stage)
            above = best[2].seconds * (1 + TIE) if best is not None else np.inf
            solution = _finish(ilp.solve(priced, budget, activations=activations, above=above),
                               priced, stage, budget)
            if solution is None:
                continue
            solved.append(stage)
            if best is None or _better(solution.seconds, stage.k, best[2].seconds, best[0].k):
                best = stage, priced, solution, activations
        if best is not None:
            return best
        if budget is None:
            break
    least = min(stages, key=lambda s: s.state)
    raise _no_fit(problem.at(least), budget, least, len(stages) > 1, dp)


def _dominates(a, b) -> bool:
    """Whether stage ``a`` costs no more than ``b`` over dp for any bytes held (to ``TIE``):
    with no budget (memory free) the plan ``a`` found is then as good as any ``b`` could find,
    and ``b``, later in ``by_cost``'s order, could only tie it (plain dp and ZeRO-2's
    reduce-scatter + all-gather; ZeRO-1 and 3 move half as much again)."""
    return a.per_byte <= b.per_byte * (1 + TIE) and a.latency <= b.latency * (1 + TIE)


def _better(seconds: float, k: int, best: float, best_k: int) -> bool:
    """Whether a stage ``k`` whose plan takes ``seconds`` replaces the best so far: cheaper by
    more than ``TIE``, or as cheap and a lower stage (plain dp before ZeRO-2 at one price)."""
    return seconds < best * (1 - TIE) or (seconds <= best * (1 + TIE) and k < best_k)


def _finish(solution, problem, stage, budget):
    """The solution with its stage's terms the integer program leaves out: the latency of the
    collectives over dp, a bucket at a time, in its seconds, ZeRO-3's gathered buckets in its
    memory (None where they take it over ``budget``)."""
    if solution is None:
        return None
    held = _held_of(problem, solution)
    gathered = stage.gathered(held, _largest(problem, solution))
    if budget is not None and solution.memory + gathered > budget:
        return None
    return dataclasses.replace(solution, seconds=solution.seconds + stage.seconds(held)
                               - held * stage.per_byte, memory=solution.memory + gathered)


def _stepped(solution, problem, stage):
    """The solution with the optimizer's step as the stage runs it: the objective counts it
    over every row (so the stages compare by their traffic alone, ZeRO used where memory
    needs it), a ZeRO rank steps its rows; the step and the bucket copies are compute, as
    ``plan.predicted_step`` counts them."""
    held = _held_of(problem, solution)
    return dataclasses.replace(solution,
                               seconds=solution.seconds - held * stage.step * (1 - stage.rows),
                               compute=solution.compute + stage.compute(held))


def _held_of(problem, solution) -> float:
    x = np.zeros(problem.columns)
    for key, cols in problem.index.items():
        x[cols[solution.choice[key]]] = 1.0
    return float(problem.weights @ x)


def _largest(problem, solution) -> float:
    """The bytes of the largest parameter one device holds under ``solution``."""
    largest = 0.0
    for key, cols in problem.index.items():
        rep = problem.cands.members[key][0]
        if rep.op == "placeholder" and rep.meta[M.ROLE].kind is M.InputKind.PARAM:
            members = len(problem.cands.members[key])
            largest = max(largest, problem.weights[cols[solution.choice[key]]] / members)
    return largest


def _held(gm, seeds: dict, axes) -> float:
    """Bytes of parameters one device holds when they are placed as ``seeds`` (the others as
    annotated)."""
    sizes = [n for _, n in axes]
    return sum(local_bytes(n.meta[M.VAL], seeds.get(n, n.meta.get(M.ANNOTATION)) or (), sizes)
               for n in gm.graph.find_nodes(op="placeholder")
               if n.meta[M.ROLE].kind is M.InputKind.PARAM)


def _with_stage(priced: tuple[float, float], held: float, stage) -> tuple[float, float]:
    """A named plan's (seconds, compute) with its traffic over dp at ``stage``."""
    seconds, compute = priced
    return seconds + stage.total(held), compute + stage.compute(held)


def _fixed(gm: fx.GraphModule, options) -> dict[str, M.Placements]:
    """Parameters the user placed (a glob whose value is not "auto"): shard_annotate's."""
    if not isinstance(options.shard, dict):
        return {}

    return user_placed(gm, options)


def _write(gm: fx.GraphModule, cands, solution) -> None:
    for node in gm.graph.find_nodes(op="placeholder"):
        if node in cands.of:
            node.meta[M.ANNOTATION] = cands.classes[cands.of[node]][solution.choice[cands.of[node]]].out
    for node in op_nodes(gm.graph):
        key = cands.of.get(node)
        if key is None or is_getitem(node) or node.target in (HINT, PIPE_SPLIT):
            continue  # a hint or a cut is propagated by its own rule, not by a choice
        node.meta[M.CHOICE] = cands.given[key][solution.choice[key]]


def _named(gm, options) -> dict[str, dict]:
    """The named plans' parameter placements: 'replicate', and 'megatron' where the mesh has
    tp (node -> placements)."""
    plans = {"replicate": {}}
    if "tp" in [a for a, _ in options.mesh.axes]:
        plans["megatron"] = megatron_placements(gm, options)
    nodes = {n.meta[M.ROLE].name: n for n in gm.graph.find_nodes(op="placeholder")}
    return {name: {nodes[fqn]: p for fqn, p in params.items()} for name, params in plans.items()}


def _report(gm, cands, problem, solution, options, enumerated, named, budget,
            zero: int) -> AutoReport:
    params, inputs = {}, {}
    for node in gm.graph.find_nodes(op="placeholder"):
        role = node.meta[M.ROLE]
        if node in cands.of and role.kind is M.InputKind.PARAM:
            params[role.name] = node.meta[M.ANNOTATION]
        elif node in cands.of and role.kind in (M.InputKind.INPUT, M.InputKind.TARGET):
            inputs[role.name] = node.meta[M.ANNOTATION]
    axes = tuple(options.mesh.axes[i][0] for i in sorted(free_axes(options.mesh)))
    return AutoReport(axes=axes, mesh_axes=tuple(a for a, _ in options.mesh.axes), seconds=solution.seconds, compute=solution.compute,
                      memory=solution.memory, size=problem.size(), enumerate_seconds=enumerated,
                      solve_seconds=solution.solve_seconds, gap=solution.gap, named=named, budget=budget,
                      params=params, inputs=inputs, zero=zero,
                      zero_chosen=options.zero == "auto")


def _no_fit(problem, budget, stage, chose: bool, dp: int) -> ShardingError:
    """``chose``: zero="auto" tried every stage, ``stage`` the one holding least."""
    least = ilp.least_memory(problem)
    zero = f"even under ZeRO-{stage.k}" if chose else \
        (f"under ZeRO-{stage.k}" if stage.k else "without ZeRO")
    split = "zero=\"auto\" or zero=3" if dp > 1 else "a dp axis with zero=\"auto\" or zero=3"
    fix = "a larger tp axis (more ways to split the weights)" + \
        ("" if chose or stage.k == 3 else f", {split} (parameters, gradients and optimizer "
         "state split over dp)") + ", or a larger memory_budget"
    return ShardingError(
        f"no placement of the parameters, their gradients and optimizer state fits the memory "
        f"budget of {nbytes(budget)} per device {zero}: the plan that holds the least needs "
        f"{nbytes(least)} for them",
        where="partition(..., shard=\"auto\", memory_budget=...)", fix=fix)
