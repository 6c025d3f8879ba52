"""The sharding problem as an integer program, solved by HiGHS (``scipy.optimize.milp``).

One binary ``x[c, s]`` per class ``c`` and strategy ``s`` (``candidates``), one chosen per class.
The objective is seconds of one training step on one device:

    sum over classes      members(c) * op seconds of s                      (``costs.op_seconds``)
  + sum over edges        multiplicity * redistribution seconds from the producer's result
                          to the placement the consumer's strategy needs   (``costs.redistribute_seconds``;
                          a gradient's, ``costs.reduced_seconds``)
  + sum over axes         a gradient bucket's latency, where any gradient is reduced on the
                          axis: a continuous ``y`` at least each such choice (``costs.bucket_latency``)
  + per parameter byte    the ZeRO stage's traffic over dp, the optimizer's step and the
                          gradients' copy into their buckets                (``Problem.at``)

An edge is an operand of an op (or a returned value: a gradient must end as its parameter is
placed, the loss replicated); the edges between the same classes at the same operand are one
edge with a multiplicity, so a stamped list of 80 blocks is the problem of one block. An edge
whose two ends both choose is priced through continuous ``z[p, q]`` (producer's placement
``p``, consumer's need ``q``) whose row and column sums are the two ends' choices: with the
``x`` integral the one nonzero ``z`` is the pair chosen, so the program is exact.

Memory, where a budget is given, is a constraint: parameters with their gradients and optimizer
state, and the forward values the backward reads, each at its local size under the strategy
chosen (``Problem.memory``), must fit. The ZeRO stage (``auto.zero_stage``) sets what a
parameter's byte keeps on a device and costs over dp (``Problem.at``): the problem is built once
and priced at each stage asked.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import scipy.sparse as sparse
import torch.fx as fx
from scipy.optimize import Bounds, LinearConstraint, milp
from torch.distributed.tensor import Replicate

from shardfx.auto import costs
from shardfx.auto.candidates import Candidates
from shardfx.cost.device_model import DeviceModel
from shardfx.ir import meta as M
from shardfx.ir.graph import is_getitem, op_nodes, operands
from shardfx.auto.candidates import element


@dataclasses.dataclass
class Problem:
    cands: Candidates
    index: dict[object, list[int]]  # class -> the column of each of its strategies
    columns: int  # x and z together
    binary: int  # the first ``binary`` columns are the x
    cost: np.ndarray  # seconds per column
    compute: np.ndarray  # of them, the ops' own (x only); the rest is communication
    memory: np.ndarray  # bytes per column (x only): parameters, gradients, optimizer state
    weights: np.ndarray  # bytes per column (x only): the parameters alone, on one device
    activations: np.ndarray  # bytes per column (x only): forward values the backward reads
    rows: list  # (coefficients {column: value}, low, high)
    edges: int  # distinct edges
    priced: int  # edges priced through z
    synced: np.ndarray  # of ``cost``, the gradients' and parameters' traffic over dp (``at``)

    def at(self, stage) -> "Problem":
        """The problem under ZeRO ``stage`` (an ``auto.zero_stage.Stage``): each parameter byte
        keeps ``stage.state`` bytes and costs ``stage.per_byte`` seconds over dp, ``stage.copy``
        into its bucket, and ``stage.step`` of the optimizer's (all its rows: the stages compare as the traffic they
        need; ``auto_shard._finish`` takes off what ZeRO's rows save)."""
        per_byte = stage.per_byte + stage.step + stage.copy
        cost = self.cost - self.synced + self.weights * per_byte
        return dataclasses.replace(self, memory=self.weights * stage.state, cost=cost,
                                   synced=self.weights * per_byte)

    def size(self) -> str:
        return f"{self.binary} binary and {self.columns - self.binary} continuous variables, " \
               f"{len(self.rows)} constraints, {len(self.cands.classes)} classes, " \
               f"{self.edges} edges"


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: dict[object, int]  # class -> strategy index
    seconds: float  # the objective: predicted compute + communication seconds of a step
    compute: float  # of them, the ops' own
    memory: float  # bytes per device the memory term counts
    solve_seconds: float
    gap: float  # proved: the cheapest possible is at least (1 - gap) x seconds


def build(gm: fx.GraphModule, cands: Candidates, axes: tuple, model: DeviceModel) -> Problem:
    """The problem with no state but the parameters, nothing over dp: price it with ``at``."""
    sizes = [n for _, n in axes]
    index, col = {}, 0
    for key, strategies in cands.classes.items():
        index[key] = list(range(col, col + len(strategies)))
        col += len(strategies)
    binary = col
    cost = [0.0] * binary
    compute = [0.0] * binary
    memory = [0.0] * binary
    held = [0.0] * binary
    rows = [({i: 1.0 for i in cols}, 1.0, 1.0) for cols in index.values()]
    for key, strategies in cands.classes.items():
        rep = cands.members[key][0]
        count = len(cands.members[key])
        for i, s in zip(index[key], strategies):
            if rep.op == "call_function":
                compute[i] += count * costs.op_seconds(rep, s.out, s.inputs, sizes, model)
            elif rep.meta[M.ROLE].kind is M.InputKind.PARAM:
                memory[i] += count * costs.local_bytes(rep.meta[M.VAL], s.out, sizes)
            else:
                cost[i] += count * costs.fed_seconds(rep, s.out, sizes, model)
    for node in op_nodes(gm.graph):
        if costs.saved(node):
            outs = cands.outs(node)
            for i, out in zip(index[cands.of[node]], outs):
                if not is_getitem(node):
                    held[i] += sum(costs.local_bytes(v, p, sizes) for v, p in
                                     zip(_vals(node), costs.flat(out)))
                elif out is not None:
                    held[i] += costs.local_bytes(node.meta[M.VAL], out, sizes)
    edges = _edges(gm, cands)
    extra_cost: list[float] = []
    priced = 0
    bucketed: dict[int, list[int]] = {}  # axis -> the columns that reduce a gradient on it
    for (src, dst, k), (m, u) in edges.items():
        src_outs = cands.outs(src) if src is not None else None
        need = _needs(cands, dst, k)
        col, added = _price(index, cands, src, src_outs, dst, need, m, u, axes, model,
                            cost, rows, extra_cost, binary, bucketed)
        priced += added
    _buckets(bucketed, axes, model, rows, extra_cost, binary)
    pad = [0.0] * len(extra_cost)  # the z and the buckets: no work, no memory of their own
    compute = np.array(compute + pad)
    cost = np.array(cost + extra_cost) + compute
    weights = np.array(memory + pad)
    return Problem(cands, index, len(cost), binary, cost, compute, weights, weights, np.array(held + pad),
                   rows, len(edges), priced, np.zeros(len(cost)))


def _vals(node: fx.Node) -> list:
    val = node.meta.get(M.VAL)
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _edges(gm: fx.GraphModule, cands: Candidates) -> dict:
    """(producer node of the class, consumer class or ('param', class) or 'replicated', operand
    position) -> (multiplicity, a producer node). The producer is named by a node so getitems
    read their element; nodes of one class and element are one producer."""
    out: dict = {}
    rep: dict = {}
    for node in op_nodes(gm.graph):
        if is_getitem(node):
            continue
        for k, u in enumerate(operands(node)):
            if u not in cands.of:
                continue
            src = rep.setdefault(_producer_key(cands, u), u)
            key = (src, cands.of[node], k)
            m, _ = out.get(key, (0, u))
            out[key] = (m + 1, u)
    output = gm.graph.output_node()
    params = {n.meta[M.ROLE].name: n for n in gm.graph.find_nodes(op="placeholder")}
    for value, role in zip(output.args[0], output.meta[M.OUTPUTS]):
        if not isinstance(value, fx.Node) or value not in cands.of:
            continue
        src = rep.setdefault(_producer_key(cands, value), value)
        if role.kind in (M.OutputKind.GRAD, M.OutputKind.BUFFER_UPDATE):
            dst = ("param", cands.of[params[role.name]])
        else:
            dst = "replicated"
        m, _ = out.get((src, dst, 0), (0, value))
        out[(src, dst, 0)] = (m + 1, value)
    return out


def _producer_key(cands: Candidates, u: fx.Node):
    item = u.args[1] if is_getitem(u) else None
    return cands.of[u], item


def _needs(cands: Candidates, dst, k: int) -> list | None:
    """What each strategy of the consumer needs of operand ``k`` (None: one fixed need)."""
    if dst == "replicated":
        return None
    if isinstance(dst, tuple) and dst and dst[0] == "param":
        return [s.out for s in cands.classes[dst[1]]]
    return [s.inputs[k] if k < len(s.inputs) else None for s in cands.classes[dst]]


def _buckets(bucketed: dict, axes: tuple, model: DeviceModel, rows: list, extra: list,
             start: int) -> None:
    """A gradient bucket's latency on each axis (not dp: the ZeRO stage's) where any column
    of ``bucketed`` reduces a gradient on it: one more column per axis, at least each of them
    (``costs.bucket_latency``)."""
    for i, cols in bucketed.items():
        y = start + len(extra)
        extra.append(costs.bucket_latency(i, axes, model))
        for c in set(cols):
            rows.append(({y: 1.0, c: -1.0}, 0.0, np.inf))


def _price(index, cands, src, src_outs, dst, need, m, u, axes, model, cost, rows, extra, start,
           bucketed: dict):
    """Add the edge's seconds to the objective; returns (columns added, 1 if priced by z).
    A gradient's edge notes in ``bucketed`` (axis -> columns) the columns whose choice reduces
    it in a bucket."""
    val = u.meta[M.VAL]
    src_cols = index[cands.of[src]]
    if need is None:  # the loss or an output: replicated
        rep = tuple(Replicate() for _ in axes)
        for i, p in zip(src_cols, src_outs):
            cost[i] += m * costs.redistribute_seconds(p, rep, val, axes, model)
        return 0, 0
    grad = isinstance(dst, tuple) and bool(dst) and dst[0] == "param"
    move = costs.reduced_seconds if grad else costs.redistribute_seconds
    dst_key = dst[1] if grad else dst
    dst_cols = index[dst_key]
    ps = _groups(src_cols, src_outs)
    qs = _groups(dst_cols, need)
    def note(p, q, cols):
        for axis in costs.bucketed_axes(p, q, axes) if grad else ():
            bucketed.setdefault(axis, []).extend(cols)

    if len(ps) == 1 or len(qs) == 1:
        ((p, p_cols),) = ps.items() if len(ps) == 1 else ((None, None),)
        if len(ps) == 1:
            for q, cols in qs.items():
                c = m * move(p, q, val, axes, model)
                note(p, q, cols)
                for i in cols:
                    cost[i] += c
        else:
            ((q, _),) = qs.items()
            for p, cols in ps.items():
                c = m * move(p, q, val, axes, model)
                note(p, q, cols)
                for i in cols:
                    cost[i] += c
        return 0, 0
    z = {}
    for p in ps:
        for q in qs:
            z[p, q] = start + len(extra)
            note(p, q, [z[p, q]])
            extra.append(m * move(p, q, val, axes, model))
    for p, cols in ps.items():  # sum_q z[p, q] = x's with result p
        coeffs = {z[p, q]: 1.0 for q in qs}
        for i in cols:
            coeffs[i] = coeffs.get(i, 0.0) - 1.0
        rows.append((coeffs, 0.0, 0.0))
    for q, cols in qs.items():  # sum_p z[p, q] = x's needing q
        coeffs = {z[p, q]: 1.0 for p in ps}
        for i in cols:
            coeffs[i] = coeffs.get(i, 0.0) - 1.0
        rows.append((coeffs, 0.0, 0.0))
    return len(z), 1


def _groups(cols: list[int], values: list) -> dict:
    out: dict = {}
    for i, v in zip(cols, values):
        out.setdefault(v, []).append(i)
    return out


GAP = 0.01  # a solution proved within 1% of the cheapest is taken
# At most this many branch-and-bound nodes, then the best found: a limit of work, not of time,
# so every rank, planning on its own, stops at the same solution (a time limit would not).
NODES = 500
ROUNDS = 12  # prices of memory tried under a budget


def solve(problem: Problem, budget: float | None = None, fixed: dict | None = None,
          activations: bool = True, above: float = np.inf) -> Solution | None:
    """The cheapest choice (None where none fits ``budget``); ``fixed``: class -> strategy
    indices allowed (a partial plan); ``activations``: whether the saved activations count
    against the budget (not where remat will cut them); ``above``: seconds a choice must beat
    (None where even the cheapest ignoring the budget does not: no search).

    Under a budget the memory is a constraint every answer is checked against; the search for
    the cheapest answer that meets it prices memory (a Lagrange multiplier, at most ``ROUNDS``
    prices between the cheapest plan and the one holding least: ``_priced``), each price a
    problem as easy as the unconstrained one, where the budget as a row would be a knapsack
    HiGHS takes seconds to close. Each price also proves a lower bound on the cheapest plan that fits: the
    gap reported is against the best of them. The search stops once that gap is within
    ``GAP``, or once the bound proves the budget's answer no cheaper than ``above``."""
    memory = problem.memory + problem.activations if activations else problem.memory
    start = time.perf_counter()
    if budget is not None and sum(min(memory[c] for c in cols)
                                  for cols in problem.index.values()) > budget:
        return None  # even each op's least is over: no program to solve
    program = _Program(problem, fixed)
    cost = problem.cost * 1e6  # microseconds: HiGHS's tolerances fit them
    x, bound = program.run(cost)
    if x is None or bound / 1e6 >= above:
        return None
    if budget is not None and memory @ x > budget:
        share = memory / budget
        least, _ = program.run(share * 1e6 + cost * 1e-6)
        if share @ least > 1.0:
            return None
        x, bound = _priced(program, cost, share, x, least, above)
        if x is None:
            return None
    choice = {key: int(np.argmax(x[cols])) for key, cols in problem.index.items()}
    seconds = float(problem.cost @ x)
    gap = max(0.0, 1 - bound / 1e6 / seconds) if seconds > 0 else 0.0
    return Solution(choice, seconds, float(problem.compute @ x), float(memory @ x),
                    time.perf_counter() - start, gap)


def _priced(program, cost, share, over, least, above: float):
    """(the cheapest answer found that fits, the best lower bound) of the search over memory's
    price ``p``, where each run minimises ``cost + p * share`` (``share`` of the budget: an
    answer fits where it is at most 1); (None, bound) where the bound reaches ``above``.

    Each answer ``y`` is a line ``cost(y) + p * (share(y) - 1)`` over the price, and the bound at
    ``p`` is the lowest of all of them: a concave function whose highest point is the best
    bound. It lies where the line of the last answer over the budget (``over``) meets that of
    the last one under it (``under``), so each price tried is where they meet (Kelley's cutting
    planes in one dimension). If the run there finds no answer below both lines, that meeting
    point is the highest bound there is: more prices cannot prove more, and the search ends with
    the cheapest answer under the budget seen. Else the new answer replaces the line on its
    side. At most ``ROUNDS`` prices."""
    under = best = least
    best_cost = cost @ least
    bound = -np.inf
    for _ in range(ROUNDS):
        price = max((cost @ under - cost @ over) / (share @ over - share @ under), 1e-6)
        meet = cost @ under + price * share @ under
        y, low = program.run(cost + price * share)
        bound = max(bound, low - price)  # min over all of cost + price * (share - 1)
        if bound / 1e6 >= above:
            return None, bound  # proved no cheaper than the choice to beat
        if share @ y <= 1.0 and cost @ y < best_cost:
            best, best_cost = y, cost @ y
        if best_cost <= bound + GAP * abs(best_cost):
            break  # proved within GAP of the cheapest that fits
        if cost @ y + price * share @ y >= meet - 1e-9 * abs(meet):
            break  # no answer below the two lines: no price proves more
        if share @ y <= 1.0:
            under = y
        else:
            over = y
    return best, bound


class _Program:
    """The problem's rows and bounds as HiGHS takes them, for one objective after another."""

    def __init__(self, problem: Problem, fixed: dict | None):
        data, ri, ci, self.low, self.high = [], [], [], [], []
        for r, (coeffs, lo, hi) in enumerate(problem.rows):
            for c, v in coeffs.items():
                ri.append(r), ci.append(c), data.append(v)
            self.low.append(lo), self.high.append(hi)
        n = problem.columns
        self.a = sparse.csr_array((data, (ri, ci)), shape=(len(self.low), n))
        upper = np.ones(n)
        upper[problem.binary:] = np.inf
        for key, allowed in (fixed or {}).items():
            for j, col in enumerate(problem.index[key]):
                if j not in allowed:
                    upper[col] = 0.0
        self.bounds = Bounds(np.zeros(n), upper)
        self.rows = LinearConstraint(self.a, self.low, self.high)
        self.binary = problem.binary
        self.integrality = np.zeros(n)
        self.integrality[:problem.binary] = 1

    def run(self, objective: np.ndarray) -> tuple[np.ndarray | None, float]:
        """The best x for ``objective`` (None: infeasible) and the proved lower bound.

        The linear relaxation first: on these problems it is most often integral already (the
        edge variables make it tight), and an integral optimum of the relaxation is the
        program's optimum, proved, at a fraction of branch and bound's setup."""
        relaxed = milp(objective, constraints=self.rows, bounds=self.bounds)
        if relaxed.x is None:
            return None, -np.inf  # the relaxation infeasible: so is the program
        x = relaxed.x[:self.binary]
        if np.all(np.abs(x - np.round(x)) <= 1e-9):
            return np.round(relaxed.x, 9), float(relaxed.fun)
        result = milp(objective, constraints=self.rows,
                      integrality=self.integrality, bounds=self.bounds,
                      options={"node_limit": NODES, "mip_rel_gap": GAP})
        if result.x is None:
            return None, -np.inf
        x = np.round(result.x, 9)
        low = getattr(result, "mip_dual_bound", None)
        return x, float(low if low is not None else result.fun)


def least_memory(problem: Problem) -> float:
    """The fewest bytes of parameters, gradients and optimizer state any choice holds."""
    return sum(min(problem.memory[c] for c in cols) for cols in problem.index.values())


def follow(gm: fx.GraphModule, cands: Candidates, seeds: dict, axes: tuple,
           model: DeviceModel) -> tuple[float, float]:
    """(seconds, of them compute) of the plan ``shard_propagate`` makes from the placeholder
    placements ``seeds`` (node -> placements; the others as annotated), priced as the program
    prices its choices, except that a value needed in one placement by several ops is
    redistributed once, as codegen does: how a named plan (megatron, replicate) compares."""
    sizes = [n for _, n in axes]
    place: dict[fx.Node, object] = {}
    moved = 0.0
    for node in gm.graph.find_nodes(op="placeholder"):
        if M.ANNOTATION in node.meta:
            place[node] = seeds.get(node, node.meta[M.ANNOTATION])
            moved += costs.fed_seconds(node, place[node], sizes, model)
    compute = 0.0
    priced: dict[tuple, tuple] = {}  # (class, operand placements) -> its answer and seconds
    made: set[tuple] = set()  # (value, placements) redistributed: codegen makes each once
    for node in op_nodes(gm.graph):
        if is_getitem(node):
            place[node] = element(place[node.args[0]], node.args[1])
            continue
        ops = operands(node)
        given = tuple(place.get(u) for u in ops)
        key = (cands.of[node], given)
        if key not in priced:  # a stamped block's ops are priced once
            s = cands.answer(node, given)
            priced[key] = s, costs.op_seconds(node, s.out, s.inputs, sizes, model), [
                costs.redistribute_seconds(p, q, u.meta[M.VAL], axes, model)
                for u, p, q in zip(ops, given, s.inputs)]
        s, op_s, moved_s = priced[key]
        compute += op_s
        for u, q, seconds in zip(ops, s.inputs, moved_s):
            if seconds and (u, q) not in made:
                made.add((u, q))
                moved += seconds
        place[node] = s.out
    output = gm.graph.output_node()
    params = {n.meta[M.ROLE].name: n for n in gm.graph.find_nodes(op="placeholder")}
    rep = tuple(Replicate() for _ in axes)
    bucketed: set[int] = set()
    for value, role in zip(output.args[0], output.meta[M.OUTPUTS]):
        if isinstance(value, fx.Node) and value in place:
            grad = role.kind in (M.OutputKind.GRAD, M.OutputKind.BUFFER_UPDATE)
            want = place[params[role.name]] if grad else rep
            move = costs.reduced_seconds if grad else costs.redistribute_seconds
            moved += move(place[value], want, value.meta[M.VAL], axes, model)
            if grad:
                bucketed |= set(costs.bucketed_axes(place[value], want, axes))
    moved += sum(costs.bucket_latency(i, axes, model) for i in bucketed)
    return compute + moved, compute
