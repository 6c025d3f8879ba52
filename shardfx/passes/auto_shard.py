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
budget when one is given. A parameter the user placed (``shard={glob: placements, "*": "auto"}``)
keeps its placement: the solver completes the plan around it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch.fx as fx

from shardfx.auto import ilp
from shardfx.auto.candidates import enumerate_candidates
from shardfx.device_model import GRAPH_KEY, default_model
from shardfx.errors import ShardingError
from shardfx.ir import meta as M
from shardfx.hints import HINT, PIPE_SPLIT
from shardfx.ir.graph import is_getitem, op_nodes
from shardfx.memory import optimizer_model
from shardfx.passes.shard_propagate import planning_mesh
from shardfx.report import nbytes

log = logging.getLogger("shardfx.passes.auto_shard")

AUTO = "shardfx.auto"  # gm.meta: the AutoReport
FIXED_AXES = ("dp", "cp", "pp")


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


def solver(options) -> bool:
    """Whether the plan asks the solver: ``shard="auto"`` (or a glob's value "auto") on a mesh
    with an axis it decides."""
    shard = options.shard
    asked = shard == "auto" or isinstance(shard, dict) and "auto" in shard.values()
    return asked and bool(free_axes(options.mesh))


def free_axes(mesh) -> set[int]:
    return {i for i, (a, n) in enumerate(mesh.axes) if a not in FIXED_AXES and n > 1}


def auto_shard(gm: fx.GraphModule, options) -> fx.GraphModule:
    if not solver(options):
        return gm
    mesh = planning_mesh(options.mesh.axes)
    start = time.perf_counter()
    cands = enumerate_candidates(gm, mesh, free_axes(options.mesh), _fixed(gm, options))
    enumerated = time.perf_counter() - start
    model = gm.meta.get(GRAPH_KEY) or default_model(options)
    problem = ilp.build(gm, cands, options.mesh.axes, model, _state_factor(options))
    budget = options.memory_budget or model.memory or None  # the device's, where known
    named = {name: ilp.follow(gm, cands, seeds, options.mesh.axes, model)  # before _write
             for name, seeds in _named(gm, options).items()}
    solution, activations = ilp.solve(problem, budget), True
    if solution is None and budget is not None:  # remat may still fit the activations
        solution, activations = ilp.solve(problem, budget, activations=False), False
    if solution is None:
        raise _no_fit(problem, budget)
    _write(gm, cands, solution)
    gm.meta[AUTO] = _report(gm, cands, problem, solution, options, enumerated, named,
                            budget if activations else None)
    return gm


def _state_factor(options) -> float:
    """Bytes per parameter byte on one device: itself, its gradient, the optimizer's state,
    divided over dp as the ZeRO stage asks, and over a pipeline's stages (each device holds
    its stage's parameters)."""
    dp = options.mesh.axis("dp")
    states = optimizer_model(options.optimizer).states
    zero = options.zero
    return ((1 / dp if zero >= 3 else 1) + (1 / dp if zero >= 2 else 1) +
            states * (1 / dp if zero >= 1 else 1)) / options.held_by


def _fixed(gm: fx.GraphModule, options) -> dict[str, M.Placements]:
    """Parameters the user placed (a glob whose value is not "auto"): shard_annotate's."""
    if not isinstance(options.shard, dict):
        return {}
    from shardfx.passes.shard_annotate import user_placed

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
    from shardfx.passes.shard_annotate import megatron_placements

    plans = {"replicate": {}}
    if "tp" in [a for a, _ in options.mesh.axes]:
        plans["megatron"] = megatron_placements(gm, options)
    nodes = {n.meta[M.ROLE].name: n for n in gm.graph.find_nodes(op="placeholder")}
    return {name: {nodes[fqn]: p for fqn, p in params.items()} for name, params in plans.items()}


def _report(gm, cands, problem, solution, options, enumerated, named, budget) -> AutoReport:
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
                      params=params, inputs=inputs)


def _no_fit(problem, budget) -> ShardingError:
    least = ilp.least_memory(problem)
    return ShardingError(
        f"no placement of the parameters, their gradients and optimizer state fits the memory "
        f"budget of {nbytes(budget)} per device: the plan that holds the least needs "
        f"{nbytes(least)} for them",
        where="partition(..., shard=\"auto\", memory_budget=...)",
        fix="a larger tp axis (more ways to split the weights), zero=3 (parameters, gradients "
            "and optimizer state split over dp), or a larger memory_budget")
