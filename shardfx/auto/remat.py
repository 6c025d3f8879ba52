"""remat: under ``memory_budget``, choose which forward values are kept for the backward,
which are recomputed in it and which wait in host memory, at the least time recomputing and
copying add.

Requires: PHASE, COST on every op; SHARDING on a tp mesh; STAGE in a pipeline.
Ensures:  (applied by ``auto.remat_choice.apply``) a forward value chosen for recomputation is
          copied into the backward (PHASE BACKWARD, ``REMAT`` = the original's name, the
          original's STAGE and SHARDING), right before its first backward reader, which reads
          the copy; the original is then dead after its last forward reader. A value chosen
          for offload is marked ``OFFLOAD``. ``auto.remat_choice.undo`` removes both again.

**The choice is an ILP** (``scipy.optimize.milp``, HiGHS). For each forward value v: keep it
(``s_v``) or recompute it (``r_v``) (or offload it: below). A value the backward reads is
kept or recomputed; a value recomputed needs each forward input kept or recomputed
(parameters and batch inputs are always there; across the edge of a repeated block it must be
kept, so a block recomputes on its own, unless it is a view, recomputed for free); the kept
bytes of each budget group (a device; a pipeline rank, each stage's bytes times the
microbatches its schedule keeps in flight) stay under a limit; minimise the recompute time (each op's roofline time on the plan's
device model, ``DeviceModel.node_seconds``: a memory-bound pointwise chain and a matmul are
weighed by what they cost in time, not by FLOPs).
A min-cut (PyTorch's default partitioner) finds the fewest saved bytes for a fixed set of
recomputable ops, but has no budget and no cost to trade against it; a budgeted choice is a
knapsack with precedence constraints, which an ILP states exactly and HiGHS solves in
milliseconds at block size.

**Repeated blocks are solved once**: the ops of ``model.layers.i`` (``stage_cut.block_of``)
that match another block op for op (target, shape, dtype, wiring) share its variables, with
the bytes and the time of all of them; the ILP has one block's variables however deep the
model is, and every block gets the same choice.

**Through collectives**: an op whose operand a collective brings (``NodeSharding.inputs``: a
row-parallel matmul's partial sums all-reduced into the residual add) is recomputed only
with that operand recomputed too (``r_v <= r_u``), in the same block: the collective then runs
again in the backward, on the recomputed copy, and its time (``auto.costs``) is part of the
op's recompute time. A block under tp can so be recomputed whole, as Megatron's and
TorchTitan's full activation checkpointing do.

Never recomputed: random ops (``nondeterministic_seeded``; shardfx's dropout masks are a
hash of fixed inputs and recompute exactly, ``passes.rng``), ops that mutate, ops that read
a parameter, an input or a value of another block through a collective, and in a pipeline
ops that read a value from another stage or that another stage reads (it would be sent
again).
Under a schedule that splits the backward (zero-bubble), values the W parts read are kept:
recomputed in B they would wait for W with every block's at once (a view W reads comes back
for free from its base, which is kept); under the others a stage's
backward is one part (``codegen.stages.split_stages(whole_backward=True)``). How the limits
are searched until the generated program fits the budget: ``auto.remat_search``; how a choice
is applied to the IR, and undone: ``auto.remat_choice``.

**Offload, the third choice** (vDNN): where the device model has a host tier with memory
(``DeviceModel.host``; the ``cpu`` preset's is the same DRAM and has none), a value the
backward reads may instead go to host memory after its last forward reader and come back
before its first backward reader (``o_v``; ``codegen.activation_offload`` emits the copies).
It is kept, recomputed or offloaded (``s_v + r_v + o_v >= 1``, offloading excluding the
other two), and its price is the copy time that does not hide behind compute: per budget
group, ``e_f >= sum(o_v * d2h_v) - T_f`` and ``e_b >= sum(o_v * h2d_v) - T_b``, where
``d2h_v``/``h2d_v`` are its bytes over the host link each way (``Host.copy_seconds``) and
``T_f``/``T_b`` the group's forward and backward compute (a copy engine runs beside the
kernels); the offloaded bytes (per microbatch in flight) stay under the host memory left
(``host_free``). Offloaded are values that own their storage (not views, not a tuple of
results), that the program does not return, and in a pipeline that only their own stage reads
and no W part (the host copy waits in the pipeline's runner from the forward to the backward,
per microbatch, as a saved value does). A value recomputed from an offloaded one reads it
back from the host (its copy in the backward is a backward reader like any other): a block's
input offloaded and the block recomputed from it, as activation checkpointing with offloaded
checkpoints does.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from shardfx.codegen.spmd import local_shape
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.cost.values import bases, value_bytes
from shardfx.cost.node import is_view
from shardfx.cost.device_model import DeviceModel, model_of
from shardfx.passes.stage_cut import block_of
from shardfx.auto.costs import redistribute_seconds
from shardfx.codegen.stages import backward_parts


@dataclass(frozen=True)
class Choice:
    """What remat decided: the forward values recomputed, their cost, the kept bytes."""

    recomputed: tuple[str, ...]  # forward ops recomputed in the backward, by name
    flops: int  # FLOPs the recomputation adds per step (every microbatch)
    seconds: float  # estimated time it adds
    saved_before: dict  # budget group -> bytes kept for the backward without remat
    saved_after: dict  # ... and with it
    offloaded: tuple[str, ...] = ()  # forward values sent to host memory and back, by name
    offloaded_bytes: int = 0  # their bytes on one device (every block's), per microbatch


def forward_values(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in op_nodes(gm.graph) if n.meta[M.PHASE] is M.Phase.FORWARD]


def needed(node: fx.Node) -> bool:
    """Is ``node`` read by a backward op (or kept to the end: returned)?"""
    return any(u.op == "call_function" and u.meta.get(M.PHASE) is M.Phase.BACKWARD
               for u in node.users)


def local_bytes(node: fx.Node, axes) -> int:
    """Bytes of the storage ``node`` owns on one device (its shard under tp)."""
    nbytes = value_bytes(node)
    if not nbytes or not axes:
        return nbytes
    owner = node.args[0] if node.target is operator.getitem else node
    sharding = owner.meta.get(M.SHARDING)
    val = node.meta[M.VAL]
    if sharding is None or not isinstance(val, torch.Tensor):
        return nbytes
    out = sharding.out
    if node is not owner and out and isinstance(out[0], tuple):
        out = out[node.args[1]]
    if out and isinstance(out[0], tuple):
        return nbytes
    return math.prod(local_shape(val.shape, out, axes)) * val.element_size()


def offloadable(node: fx.Node, base: dict) -> bool:
    """Whether ``node`` may go to host memory and back (module docstring): the backward reads
    it (or a view of it, then recomputed from the copy brought back), it owns its storage, the
    program does not return it, and in a pipeline only its own stage reads it."""
    stage = node.meta.get(M.STAGE)
    return (isinstance(node.meta.get(M.VAL), torch.Tensor) and node not in base
            and not is_view(node) and value_bytes(node) > 0
            and (needed(node) or any(base.get(u) is node and needed(u) for u in node.users))
            and all(u.op == "call_function" and u.meta.get(M.STAGE) == stage
                    for u in node.users))


def recompute_seconds(node: fx.Node, model: DeviceModel) -> float:
    """Seconds recomputing ``node`` takes on ``model`` (``DeviceModel.node_seconds``)."""
    return model.node_seconds(node)


def moved_seconds(node: fx.Node, axes, model: DeviceModel, moves=None) -> float:
    """Seconds of the collectives that bring ``node`` its operands, run again when it is
    recomputed (``auto.costs.redistribute_seconds`` on the plan's device model); ``moves``:
    ``redistributed(node)``, where the caller has it."""
    return sum(redistribute_seconds(have, want, src.meta[M.VAL], axes, model)
               for src, have, want in (redistributed(node) if moves is None else moves))


def recomputable(node: fx.Node, moves=None) -> bool:
    """Whether ``node`` may be recomputed in the backward; ``moves``: ``redistributed(node)``,
    where the caller has it."""
    target = node.target
    tags = getattr(target, "tags", ())
    schema = getattr(target, "_schema", None)
    if torch.Tag.nondeterministic_seeded in tags and not _no_dropout(node, schema):
        return False
    if schema is not None and (schema.is_mutable or any(
            r.alias_info is not None and r.alias_info.is_write for r in schema.returns)):
        return False
    if any(not _recomputed_with(src)
           for src, _, _ in (redistributed(node) if moves is None else moves)):
        return False  # the collective would re-send the forward's value, kept to the backward
    stage = node.meta.get(M.STAGE)
    if stage is not None and any(a.meta.get(M.STAGE, stage) != stage
                                 for a in [*node.all_input_nodes, *node.users]
                                 if a.op == "call_function"):
        return False  # a value another stage sends, or one another stage's backward reads
    return True


def redistributed(node: fx.Node) -> list[tuple[fx.Node, M.Placements, M.Placements]]:
    """(operand, its placements, the placements ``node`` reads it in) of each operand a
    collective brings to ``node`` (``NodeSharding.inputs``)."""
    sharding = node.meta.get(M.SHARDING)
    if sharding is None:
        return []
    out = []
    for src, want in zip(node.all_input_nodes, sharding.inputs):
        have = src.meta[M.SHARDING].out if M.SHARDING in src.meta else \
            src.meta.get(M.ANNOTATION)
        if want is not None and have is not None and tuple(want) != tuple(have):
            out.append((src, have, want))
    return out


def _recomputed_with(src: fx.Node) -> bool:
    """Whether an op reading ``src`` through a collective may be recomputed: only where
    ``src`` is a forward op's value, recomputed too (``Problem.through``). Code generation
    redistributes each value once per placement (``codegen.spmd``): recomputed from the
    forward's ``src``, the op would read the forward's redistributed value, kept to the
    backward, and save nothing; from a recomputed copy, the collective runs again in the
    backward, as Megatron's and TorchTitan's activation checkpointing run it."""
    return src.op == "call_function" and src.meta.get(M.PHASE) is M.Phase.FORWARD


def _no_dropout(node: fx.Node, schema) -> bool:
    """An op tagged random only for its ``dropout_p`` (attention), called with 0."""
    if schema is None:
        return False
    names = [a.name for a in schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else
                        schema.arguments[i].default_value)
    return p == 0


# --- the ILP ----------------------------------------------------------------------------------

class Problem:
    """Variables of the ILP: one per forward value, shared by the same op of every block
    that repeats another."""

    def __init__(self, gm: fx.GraphModule, group_of, weight_of, split_backward: bool = False,
                 host_used: int = 0):
        """``group_of(node)``: its budget group; ``weight_of(node)``: how many copies of its
        bytes the group holds (microbatches in flight); ``host_used``: the host bytes a rank
        holds already (``offload_optimizer``'s), which offloaded values do not get."""
        self.gm = gm
        self.forward = forward_values(gm)
        axes = gm.meta[M.GRAPH].mesh
        model = model_of(gm)
        self.var = _shared_variables(self.forward)
        n = 1 + max(self.var.values(), default=-1)
        self.n = n
        self.cost = np.zeros(n)
        self.bytes: dict = defaultdict(lambda: np.zeros(n))
        self.must = np.zeros(n, dtype=bool)  # read by the backward
        self.can_recompute = np.ones(n, dtype=bool)
        self.can_keep = np.ones(n, dtype=bool)
        self.needs: set[tuple[int, int]] = set()  # (v, u): recomputing v needs u
        self.keeps: set[tuple[int, int]] = set()  # (v, u): recomputing v needs u kept
        self.through: set[tuple[int, int]] = set()  # (v, u): recomputing v needs u recomputed
        host = model.host
        self.host_free = max(0.0, host.memory - host_used) if host is not None else 0.0
        self.can_offload = np.full(n, self.host_free > 0)
        self.host_bytes = np.zeros(n)  # bytes an offloaded variable puts in host memory
        self.copy = {way: np.zeros(n) for way in ("d2h", "h2d")}  # seconds each way
        self.group_of_var: dict[int, object] = {}
        self.compute: dict = defaultdict(lambda: {"d2h": 0.0, "h2d": 0.0})  # seconds a
        #                        group's copies may hide behind: forward (d2h), backward (h2d)
        base = bases(gm.graph)
        segment = _segments(self.forward)
        weight_part = _read_by_weight_gradients(gm, split_backward)
        for node in self.forward:
            i = self.var[node]
            moves = redistributed(node)
            may = recomputable(node, moves)
            self.cost[i] += recompute_seconds(node, model) + moved_seconds(node, axes, model,
                                                                           moves)
            nbytes = local_bytes(node, axes)
            if isinstance(node.meta.get(M.VAL), (tuple, list)):  # kept: all its elements
                nbytes = sum(local_bytes(u, axes) for u in node.users
                             if u.target is operator.getitem)
            if nbytes:
                self.bytes[group_of(node)][i] += nbytes * weight_of(node)
            if node in base and may and not moves:
                self.can_keep[i] = False  # a view: recomputed for free (keeping it keeps its base)
            self.must[i] |= needed(node)
            # a view a W part reads comes back for free from its base, which is kept (below)
            w_view = node in weight_part and node in base
            self.can_recompute[i] &= may and (node not in weight_part or w_view)
            group = self.group_of_var.setdefault(i, group_of(node))
            self.compute[group]["d2h"] += model.node_seconds(node)
            # every value sharing the variable may go, or none does
            self.can_offload[i] &= offloadable(node, base) and node not in weight_part
            if self.can_offload[i]:
                self.host_bytes[i] += nbytes * weight_of(node)
                for way in self.copy:
                    self.copy[way][i] += host.copy_seconds(nbytes, way)
            moved = {src for src, _, _ in moves}
            for u in node.all_input_nodes:
                if u in self.var:
                    j = self.var[u]
                    if u in moved:
                        self.through.add((i, j))
                        if segment[u] != segment[node]:
                            self.can_recompute[i] = False  # a block's edge is kept
                    elif segment[u] == segment[node] or not self.can_keep[j]:
                        self.needs.add((i, j))  # (a view is recomputed for free, anywhere)
                    else:  # across a block's edge: kept, so a block recomputes on its own
                        self.keeps.add((i, j))
            if w_view and base[node] in self.var:
                self.keeps.add((i, self.var[base[node]]))
        for node in op_nodes(gm.graph):
            if node.meta[M.PHASE] is M.Phase.BACKWARD and M.REMAT not in node.meta:
                self.compute[group_of(node)]["h2d"] += model.node_seconds(node)
        self.groups = sorted({self.group_of_var[i] for i in np.flatnonzero(self.can_offload)},
                             key=str)

    def solve(self, limits: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Keep, recompute and offload flags under ``limits`` (group -> bytes; a missing group
        is unlimited), at the least time recomputing and exposed copies add; None if no choice
        meets them."""
        n = self.n
        total = sum(self.bytes.values(), np.zeros(n))
        # free recomputation (a view) still costs a little; among equal times keep fewer bytes,
        # and of offloads that hide, copy fewer
        cost = np.concatenate([1e-18 * total, self.cost + 1e-12,
                               1e-6 * self.copy["d2h"] + 1e-12])
        return self._milp(cost, limits, exposed=1.0)

    def smallest(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The choice that keeps the fewest bytes (recomputing or offloading everything it
        may)."""
        n = self.n
        total = sum(self.bytes.values(), np.zeros(n))
        found = self._milp(np.concatenate([total + 1e-9, self.cost * 1e-12 + 1e-15,
                                           self.copy["d2h"] * 1e-12 + 2e-15]), {}, exposed=1e-12)
        if found is None:  # cannot happen: keeping what the backward reads always works
            return self.must.copy(), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        return found

    def _milp(self, cost: np.ndarray, limits: dict, exposed: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Variables ``[s_0 .. s_n-1, r_0 .. r_n-1, o_0 .. o_n-1]`` and, per budget group that
        may offload, its exposed copy seconds ``e_f, e_b`` (at ``exposed`` per second): the
        constraints of the module docstring."""
        n = self.n
        extra = 2 * len(self.groups)
        rows, cols, vals, lo, hi = [], [], [], [], []

        def row(entries, lower, upper):
            r = len(lo)
            for c, v in entries:
                rows.append(r), cols.append(c), vals.append(v)
            lo.append(lower), hi.append(upper)

        for i in np.flatnonzero(self.must):
            row([(i, 1), (n + i, 1), (2 * n + i, 1)], 1, np.inf)  # s_i + r_i + o_i >= 1
        offload = np.flatnonzero(self.can_offload)
        for i in offload:
            row([(i, 1), (2 * n + i, 1)], -np.inf, 1)  # offloaded: neither kept
            row([(n + i, 1), (2 * n + i, 1)], -np.inf, 1)  # ... nor recomputed
        if len(offload):
            row([(2 * n + i, self.host_bytes[i]) for i in offload], -np.inf, self.host_free)
        for g, group in enumerate(self.groups):  # sum(o * copy) - e <= compute, each way
            mine = [i for i in offload if self.group_of_var[i] == group]
            for k, way in enumerate(("d2h", "h2d")):
                row([(2 * n + i, self.copy[way][i]) for i in mine] + [(3 * n + 2 * g + k, -1)],
                    -np.inf, self.compute[group][way])
        for v, u in self.needs:
            row([(n + v, 1), (u, -1), (n + u, -1), (2 * n + u, -1)], -np.inf, 0)
            #                                                         r_v <= s_u + r_u + o_u
        for v, u in self.keeps:
            row([(n + v, 1), (u, -1), (2 * n + u, -1)], -np.inf, 0)  # r_v <= s_u + o_u
        for v, u in self.through:
            row([(n + v, 1), (n + u, -1)], -np.inf, 0)  # r_v <= r_u
        for group, limit in limits.items():
            b = self.bytes[group]
            row([(i, b[i]) for i in np.flatnonzero(b)], -np.inf, limit)
        upper = np.concatenate([self.can_keep, self.can_recompute, self.can_offload,
                                np.full(extra, np.inf)]).astype(float)
        cost = np.concatenate([cost, np.full(extra, exposed)])
        size = 3 * n + extra
        a = coo_matrix((vals, (rows, cols)), shape=(len(lo), size))
        result = milp(cost, constraints=LinearConstraint(a, lo, hi) if lo else None,
                      integrality=np.concatenate([np.ones(3 * n), np.zeros(extra)]),
                      bounds=Bounds(np.zeros(size), upper), options={"time_limit": 60})
        if result.x is None:
            return None
        x = np.round(result.x[:3 * n]).astype(bool)
        return x[:n], x[n:2 * n], x[2 * n:]

    def exposed_seconds(self, off: np.ndarray) -> float:
        """Copy seconds of the offloaded variables ``off`` that no compute hides (module
        docstring), summed over the budget groups."""
        out = 0.0
        for group in self.groups:
            mine = np.array([self.group_of_var.get(i) == group for i in range(self.n)])
            for way in ("d2h", "h2d"):
                out += max(0.0, float(self.copy[way][off & mine].sum())
                           - self.compute[group][way])
        return out

    def kept_bytes(self, keep: np.ndarray) -> dict:
        return {g: int(b[keep].sum()) for g, b in self.bytes.items()}


def _read_by_weight_gradients(gm: fx.GraphModule, split: bool) -> set[fx.Node]:
    """In a pipeline whose schedule splits the backward (``split``), forward values a W part (weight gradients, ``codegen.stages``) reads.
    Recomputed, they would be made in the B part and held until W runs, for every block of
    the stage at once: they are kept instead, and W reads them from the forward as before."""
    if not split:
        return set()

    part = backward_parts(gm)
    return {n for n in forward_values(gm)
            if any(part.get(u) == "W" for u in n.users if u.op == "call_function")}


def _segments(forward: list[fx.Node]) -> dict[fx.Node, object]:
    """Where a recomputation may reach back: the block an op is in (``model.layers.3``), or
    the ops before the first block, or those after it. Recomputing a value from a value of
    another segment would make the backward of a late block recompute the early ones, all
    live at once; values that cross are kept instead (as activation checkpointing keeps each
    block's input)."""
    out, seen_block = {}, False
    for node in forward:
        name = block_of(node)
        seen_block |= name is not None
        out[node] = name if name is not None else ("after" if seen_block else "before")
    return out


def _shared_variables(forward: list[fx.Node]) -> dict[fx.Node, int]:
    """A variable per forward value; the ops of a block that repeats an earlier one (same
    ops, shapes, dtypes and wiring, in the same stage) share that block's variables."""
    blocks: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in forward:
        name = block_of(node)
        if name is not None:
            blocks[(name, node.meta.get(M.STAGE))].append(node)
    first: dict[tuple, list[fx.Node]] = {}
    var: dict[fx.Node, int] = {}
    for key, nodes in blocks.items():
        sig = (key[1], _signature(nodes))
        if sig in first:
            for node, twin in zip(nodes, first[sig]):
                var[node] = twin
        else:
            first[sig] = nodes
    index: dict[fx.Node, int] = {}
    count = 0
    for node in forward:
        twin = var.get(node, node)
        if twin not in index:
            index[twin], count = count, count + 1
        index[node] = index[twin]
    return index


def _signature(nodes: list[fx.Node]) -> tuple:
    where = {n: i for i, n in enumerate(nodes)}

    def arg(a):
        if isinstance(a, fx.Node):
            if a in where:
                return ("b", where[a])
            return ("p", str(a.meta[M.ROLE].kind)) if a.op == "placeholder" else ("x",)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return repr(a)

    out = []
    for n in nodes:
        val = n.meta.get(M.VAL)
        layout = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        out.append((str(n.target), layout, arg(n.args), arg(tuple(n.kwargs.items())),
                    needed(n)))
    return tuple(out)
