"""Every op's candidate strategies: how it may run on the mesh, by the rules shard_propagate uses.

A strategy of an op is what ``shard_propagate`` answers for one choice of its operands'
placements (``given``): the placements its operands must then have (``inputs``, where the
rule redistributes) and its result's (``out``). The candidates of an operand are the results
of its producer's strategies, so the walk goes in program order, asking the propagator (with
its policy on partial sums, and its memo) once per distinct choice. A placeholder's candidates
are seeded: a parameter replicated or split on any dimension its size divides, on each axis the
solver decides (``free``); an input also split on its batch dimension there (that axis used as
data parallel); the rest as ``shard_annotate`` placed them. A parameter whose product is split
into k equal parts (GPT-2's ``c_attn``: q, k and v side by side, ``fused``) is also seeded
with each rank's slice of every part (``_StridedShard(d, k)``, see ``shardfx.ir.strided``).

Ops of a stamped list at the same place in their block (``BLOCK``) are one *class*, with one
set of strategies: the union of what any of them was given. A class is asked again only for
operand choices it has not seen, and a member whose operands are of the classes (with as many
strategies) another member's were is not looked at again: past the first blocks the walk does
almost nothing.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.request.hints import HINT, PIPE_SPLIT
from shardfx.ir import meta as M
from shardfx.ir.graph import is_getitem, op_nodes, operands
from shardfx.passes import shard_propagate as SP

MAX_CHOICES = 32  # operand choices asked per op (``_combinations``)
aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Strategy:
    out: M.Placements | tuple  # a tuple of them (None for a non-tensor) for a multi-output op
    inputs: tuple  # placements each tensor operand must have, in operand order
    replicated: bool = False  # no rule took them: the op runs on whole tensors


@dataclasses.dataclass
class Candidates:
    """The classes, their strategies, and which class each node of the graph belongs to."""

    classes: dict[object, list[Strategy]]
    given: dict[object, list[tuple | None]]  # class -> per strategy, operand placements giving it
    answers: dict[object, dict[tuple, int]]  # class -> operand placements -> strategy index
    of: dict[fx.Node, object]  # node -> its class key (a getitem: its producer's)
    members: dict[object, list[fx.Node]]
    mesh: object
    memo: dict

    def outs(self, node: fx.Node) -> list:
        """The result placements of ``node`` under each strategy of its class, in order."""
        return _outs(node, self.of, self.classes)

    def answer(self, node: fx.Node, given: tuple) -> Strategy:
        """The strategy ``shard_propagate`` takes for ``node`` given its operands' placements."""
        key = self.of[node]
        j = self.answers[key].get(given)
        if j is not None:
            return self.classes[key][j]
        return _ask(node, operands(node), given, self.mesh, self.memo)


def confirm(cands: Candidates, choice: dict) -> int:
    """Each chosen strategy asked of the whole mesh, as ``shard_propagate`` will ask it; where
    the answer differs from the one priced (asked one axis at a time, ``_ask_by_axis``: a rule
    whose strategies do not combine across axes, as the loss's over dp and tp), the whole
    mesh's answer replaces it, so the program prices what planning will emit. Returns how many
    were replaced: the choice is solved again while any is."""
    replaced = 0
    for key, j in choice.items():
        given = cands.given[key][j]
        node = cands.members[key][0]
        if given is None or node.op != "call_function" or node.target in (HINT, PIPE_SPLIT):
            continue
        sharding, _ = SP._remembered(node, SP.chosen(node, given, cands.mesh), cands.mesh,
                                     cands.memo)
        whole = Strategy(sharding.out, tuple(sharding.inputs), sharding.replicated)
        if whole != cands.classes[key][j]:
            cands.classes[key][j] = whole
            replaced += 1
    return replaced


def class_key(node: fx.Node, lists: set[str] = frozenset()):
    """Ops: their place in a stamped block, else themselves. Parameters: the same parameter of
    every block of a stamped list (``layers.{i}.mlp.up_proj.weight``, by name and shape)."""
    place = node.meta.get(M.BLOCK)
    if place is not None:
        return place
    if node.op == "placeholder" and node.meta[M.ROLE].kind is M.InputKind.PARAM:
        name = node.meta[M.ROLE].name
        for path in lists:
            head, _, rest = name.partition(path + ".")
            index, _, rel = rest.partition(".")
            if not head and index.isdigit() and rel:
                return ("param", path, rel, tuple(node.meta[M.VAL].shape))
    return node


def enumerate_candidates(gm: fx.GraphModule, mesh, free: set[int], fixed: dict[str, M.Placements]
                         ) -> Candidates:
    """``mesh``: the planning DeviceMesh; ``free``: indices of the axes the solver decides;
    ``fixed``: parameter FQN -> placements the user asked (a partial plan)."""
    classes: dict[object, list[Strategy]] = {}
    givens: dict[object, list] = {}
    answers: dict[object, dict[tuple, int]] = {}
    of: dict[fx.Node, object] = {}
    members: dict[object, list[fx.Node]] = {}
    memo: dict = {}
    seen: dict[object, set[tuple]] = {}  # class -> the operand choices it was walked with
    lists = {n.meta[M.BLOCK].path for n in op_nodes(gm.graph) if M.BLOCK in n.meta}
    parts = fused(gm)
    for node in gm.graph.find_nodes(op="placeholder"):
        if M.ANNOTATION not in node.meta:
            continue
        key = class_key(node, lists)
        of[node] = key
        members.setdefault(key, []).append(node)
        seeds = [Strategy(p, ()) for p in _seeds(node, mesh, free, fixed, parts.get(node))]
        if classes.setdefault(key, seeds) != seeds:  # a block's parameter fixed unlike another's
            of[node] = key = node
            members[key].pop()
            members[node], classes[node] = [node], seeds
        givens[key], answers[key] = [None] * len(seeds), {}
    for node in op_nodes(gm.graph):
        if is_getitem(node):
            of[node] = of[node.args[0]]
            continue
        key = class_key(node)
        of[node] = key
        members.setdefault(key, []).append(node)
        strategies = classes.setdefault(key, [])
        tried = answers.setdefault(key, {})
        first = givens.setdefault(key, [])
        ops = operands(node)
        offered = tuple((of[u], u.args[1] if is_getitem(u) else None, len(classes[of[u]]))
                        for u in ops)  # what _outs reads: the same again, the same choices
        if offered in seen.setdefault(key, set()):
            continue
        seen[key].add(offered)
        choices = [_distinct(_outs(u, of, classes)) for u in ops]
        for given in _combinations(choices):
            if given in tried:
                continue
            strategy = _ask(node, ops, given, mesh, memo)
            if strategy not in strategies:
                strategies.append(strategy)
                first.append(given)
            tried[given] = strategies.index(strategy)
    return Candidates(classes, givens, answers, of, members, mesh, memo)


def _outs(u: fx.Node, of: dict, classes: dict) -> list:
    strategies = classes[of[u]]
    if is_getitem(u):
        return [element(s.out, u.args[1]) for s in strategies]
    return [s.out for s in strategies]


def element(out, i: int):
    """The placements of element ``i`` of a multi-output op's result (None: not a tensor)."""
    return out[i] if out and not isinstance(out[0], Placement) else None


def _distinct(values: list) -> list:
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def _combinations(choices: list[list]) -> list[tuple]:
    """Every choice of one placement per operand, at most MAX_CHOICES of them: past that, the
    all-first choice, then the uniform ones (every operand that can takes the same placement:
    attention's q, k, v and output all split on heads), then those that differ from the
    all-first in fewer operands."""
    total = 1
    for c in choices:
        total *= max(1, len(c))
    if total <= MAX_CHOICES:
        return list(itertools.product(*choices))
    first = tuple(c[0] for c in choices)
    out = {first: None}
    for c in choices:
        for p in c:
            out.setdefault(tuple(p if p in d else d[0] for d in choices), None)
    for changed in range(1, len(choices) + 1):
        for which in itertools.combinations(range(len(choices)), changed):
            pools = [c[1:] if i in which else c[:1] for i, c in enumerate(choices)]
            for combo in itertools.product(*pools):
                out.setdefault(combo, None)
                if len(out) >= MAX_CHOICES:
                    return list(out)
    return list(out)


def _ask(node: fx.Node, ops: list[fx.Node], given: tuple, mesh, memo: dict) -> Strategy:
    if node.target in (HINT, PIPE_SPLIT):
        sharding, _ = SP._hint(node, {ops[0]: SP._spec(mesh, given[0], ops[0].meta[M.VAL])}, mesh) \
            if node.target is HINT else (M.NodeSharding(out=given[0], inputs=(given[0],)), None)
        return Strategy(sharding.out, tuple(sharding.inputs))
    by_axis = _ask_by_axis(node, given, mesh, memo) if mesh.ndim > 1 else None
    if by_axis is not None:
        return by_axis
    sharding, _ = SP._remembered(node, SP.chosen(node, given, mesh), mesh, memo)
    return Strategy(sharding.out, tuple(sharding.inputs), sharding.replicated)


def _ask_by_axis(node: fx.Node, given: tuple, mesh, memo: dict) -> Strategy | None:
    """The strategy asked one mesh axis at a time, each on a mesh of that axis alone, and put
    together; None where that is not the question on the whole mesh (a rule missing on an
    axis, a strided split anywhere: how it nests depends on the other axes).

    DTensor expands an op's strategies over every combination of the mesh's dimensions and
    prices each: on dp x tp, ten times the work of one axis (candidates of a 70B-shaped Llama:
    5.5 s against 0.6 s on a pipeline stage's tp). Its choice costs the sum of each axis's
    redistributions, so the per-axis choices are the combination it picks; shard_propagate
    asks the whole mesh again with the chosen operand placements, so a plan never depends on
    this being exact, only its price does."""
    names, sizes = mesh.mesh_dim_names, mesh.shape
    if _strided(given) or any(g is not None and len(g) != len(sizes) for g in given):
        return None
    answers = []
    for i, (name, size) in enumerate(zip(names, sizes)):
        axis = SP.planning_mesh(((name, size),))
        one = tuple(None if g is None else (g[i],) for g in given)
        sharding, _ = SP._remembered(node, SP.chosen(node, one, axis), axis, memo)
        if sharding.replicated:
            return None
        answers.append(sharding)
    out = _joined([a.out for a in answers])
    inputs = tuple(_joined([a.inputs[j] for a in answers]) for j in range(len(answers[0].inputs)))
    if _strided((out,) + inputs):
        return None
    return Strategy(out, inputs)


def _joined(per_axis: list):
    """One axis's placements each (a 1-tuple, a tuple of them for a multi-output op, None),
    as one value over all axes."""
    first = per_axis[0]
    if first is None:
        return None
    if first and not isinstance(first[0], Placement):  # several outputs
        return tuple(_joined([p[k] for p in per_axis]) for k in range(len(first)))
    return tuple(p[0] for p in per_axis)


def _strided(values) -> bool:
    """Whether a strided split (``_StridedShard``) is among ``values`` (placements, nested)."""
    for v in values:
        if isinstance(v, tuple) and _strided(v) or isinstance(v, _StridedShard):
            return True
    return False


def _seeds(node: fx.Node, mesh, free: set[int], fixed: dict,
           parts: tuple[int, int] | None = None) -> list[M.Placements]:
    """A placeholder's candidate placements (see the module docstring); ``parts``: (dim, k)
    where its product is split into k equal parts along that dim (``fused``)."""
    base = node.meta[M.ANNOTATION]
    role = node.meta[M.ROLE]
    val = node.meta[M.VAL]
    if role.kind is M.InputKind.PARAM and role.name in fixed:
        return [fixed[role.name]]
    if role.kind is M.InputKind.PARAM:
        dims = range(val.dim())
    elif role.kind in (M.InputKind.INPUT, M.InputKind.TARGET) and val.dim() >= 1:
        dims = range(1)  # the batch: the axis used as data parallel
    else:
        return [base]
    per_axis = []
    for i, p in enumerate(base):
        if i not in free:
            per_axis.append([p])
            continue
        n = mesh.shape[i]
        options = [Replicate()]
        for d in dims:
            left = val.shape[d] // _split(base, d, mesh.shape)
            if left % n == 0 and left >= n:
                options.append(Shard(d))
        if parts is not None and val.shape[parts[0]] % (parts[1] * n) == 0 and \
                _split(base, parts[0], mesh.shape) == 1:
            options.append(_StridedShard(parts[0], split_factor=parts[1]))
        per_axis.append(options)
    return [tuple(c) for c in itertools.product(*per_axis)]


VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
MATMULS = frozenset({aten.addmm.default, aten.mm.default})


def fused(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
    """Parameter -> (dim, k) for the weights (and biases) of a matmul whose result, through
    views keeping its last dim, is split along that dim into k equal parts: their
    ``_StridedShard(dim, k)`` gives each rank its slice of every part, and the split is free."""
    out = {}
    for node in gm.graph.find_nodes(op="call_function", target=aten.split.Tensor):
        x, size = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else 0
        shape = x.meta[M.VAL].shape
        whole = shape[dim]
        k = whole // size if isinstance(size, int) else 0
        if dim % len(shape) != len(shape) - 1 or k < 2 or k * size != whole:
            continue
        while x.target in VIEWS and x.meta[M.VAL].shape[-1] == whole:
            x = x.args[0]
        if x.target not in MATMULS or x.meta[M.VAL].shape[-1] != whole:
            continue
        weight = x.args[-1]
        if weight.target is aten.t.default:
            weight = weight.args[0]
        for p in (weight, x.args[0] if x.target is aten.addmm.default else None):
            if p is not None and p.op == "placeholder" and \
                    p.meta[M.ROLE].kind is M.InputKind.PARAM:
                dims = [d for d, n in enumerate(p.meta[M.VAL].shape) if n == whole]
                if len(dims) == 1:
                    out[p] = (dims[0], k)
    return out


def _split(placements, dim: int, sizes) -> int:
    """How many parts the fixed axes already cut ``dim`` into."""
    out = 1
    for p, n in zip(placements, sizes):
        if isinstance(p, Shard) and p.dim == dim:
            out *= n
    return out
