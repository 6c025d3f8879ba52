"""Stamping: the graph of a model cut to two blocks, grown to all of them.

``capture`` traced the model with a repeated list cut after the pair it compares, blocks 0
and 1 here (the list's ``first`` and ``first + 1``; see ``repeats``; blocks before them are
glue). In that graph, in program order, each block is one contiguous *unit* of forward ops and
one of backward ops::

    glue before | F0 | F1 | glue after (head, loss) | its backward | B1 | B0 | glue's backward

(a unit is found from the module path torch records on each op; ops with none, such as the
adds that sum a residual's gradients, belong to the unit they sit in). Block 1 is the
template. ``stamp`` first proves that F1 and B1 are F0 and B0 op for op, values of the same
shapes, strides and dtypes, with every operand in one of these relations, the same wherever
it appears:

    own        the value at place q of F1 (or B1): block 0 reads F0 (B0) at q; in B1 reading
               F1, a saved activation
    param      block 1's parameter or buffer ``rel``; block 0 reads its own ``rel``
    shared     the same value outside every unit (rotary tables, the mask)
    carry      F1 (or B1) reading F0 at q, where block 0 reads glue: block i reads block i-1
    carry-back B1 reading the glue's backward, where B0 reads B1 at q: block i reads B(i+1)

and that the glue reads block 0 only before it (backward: after) and block 1 only from the
glue after the blocks. Then blocks 2 .. n-1 are copies of block 1, each operand mapped by its
relation; the glue after the blocks reads block n-1, and B1 reads B2. The result is the graph
the full trace gives (``rename_in_order`` names both the same way), which
``tests/test_stamp.py`` checks model by model.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.graph import _Namespace

from shardfx.ir import meta as M
from shardfx.ir.graph import placeholder_name
from shardfx.partitioner.repeats import Repeat


class NotStampable(Exception):
    """The traced blocks are not interchangeable; the message says where."""


class NotRepeatable(NotStampable):
    """No pair of blocks would do: the glue depends on how many there are, or the blocks
    differ in what they read."""


@dataclasses.dataclass(frozen=True)
class _Units:
    f0: list[fx.Node]
    f1: list[fx.Node]
    b0: list[fx.Node]
    b1: list[fx.Node]


def stamp(gm: fx.GraphModule, repeat: Repeat) -> None:
    """Grow ``gm`` (captured with ``repeat``'s list cut after its pair) to all of its blocks.
    Raises NotStampable, changing nothing, when block 1 is not block 0's twin."""
    graph = gm.graph
    units = _units(graph, repeat)
    where: dict[fx.Node, tuple[str, int]] = {}
    for name, unit in (("f0", units.f0), ("f1", units.f1), ("b0", units.b0), ("b1", units.b1)):
        where.update((n, (name, q)) for q, n in enumerate(unit))
    relation = _relate(units, where, repeat)
    outside = _outside_uses(graph, where)
    _check_outputs(graph, repeat, where)
    for node, (unit, q) in where.items():  # block 1's copies take it with the rest of its meta
        node.meta[M.BLOCK] = M.BlockPlace(repeat.path, unit[0], q)
    _stamp(graph, repeat, units, where, relation, outside)


# --- finding the units -------------------------------------------------------------------


def _backward(node: fx.Node) -> bool:
    return bool(node.meta.get("autograd_backward"))


def _block_of(node: fx.Node, repeat: Repeat) -> int | None:
    """0 or 1 for an op of block 0 or 1; -1 for another module's (glue); None: no module."""
    stack = node.meta.get("fwd_nn_module_stack" if _backward(node) else "nn_module_stack")
    if not stack:
        return None
    for i in (0, 1):
        prefix = repeat.instance(i)
        if any(p == prefix or p.startswith(prefix + ".") for p, _ in stack.values()):
            return i
    return -1


def _units(graph: fx.Graph, repeat: Repeat) -> _Units:
    ops = [n for n in graph.nodes if n.op == "call_function"]
    fwd = [n for n in ops if not _backward(n)]
    bwd = [n for n in ops if _backward(n)]
    f0, f1 = _split(fwd, [0, 1], repeat, "forward")
    b1, b0 = _split(bwd, [1, 0], repeat, "backward") if bwd else ([], [])
    if len(f0) != len(f1) or len(b0) != len(b1):
        raise NotStampable(f"{repeat.instance(0)} and {repeat.instance(1)} have "
                           f"{len(f0)}/{len(b0)} and {len(f1)}/{len(b1)} forward/backward ops")
    return _Units(f0, f1, b0, b1)


def _split(ops: list[fx.Node], order: list[int], repeat: Repeat, what: str
           ) -> tuple[list[fx.Node], list[fx.Node]]:
    """The two units of ``ops`` (forward or backward), in ``order`` of appearance."""
    owner = [_block_of(n, repeat) for n in ops]
    first = []
    for i in order:
        if i not in owner:
            raise NotStampable(f"no {what} op of {repeat.instance(i)} in the trace")
        first.append(owner.index(i))
    if first[0] > first[1]:
        raise NotStampable(f"the {what} ops of {repeat.instance(order[1])} come before "
                           f"{repeat.instance(order[0])}'s")
    end = next((k for k in range(first[1], len(ops)) if owner[k] == -1), len(ops))
    units = (ops[first[0]:first[1]], ops[first[1]:end])
    for i, unit in zip(order, units):
        stray = next((n for n in unit if _block_of(n, repeat) not in (i, None)), None)
        if stray is not None:
            raise NotStampable(f"{stray.name} runs amid {repeat.instance(i)}'s {what} ops "
                               "but belongs elsewhere")
    rest = [n for k, n in enumerate(ops) if not first[0] <= k < end and owner[k] in (0, 1)]
    if rest:
        raise NotStampable(f"{rest[0].name} of {repeat.instance(owner[ops.index(rest[0])])} "
                           f"runs apart from the rest of its {what} ops")
    return units


# --- relating block 1 to block 0 ---------------------------------------------------------

Relation = tuple[str, Any]  # ("shared", None) | ("param", rel) | ("carry", (unit, q)) | ...


def _relate(units: _Units, where: dict, repeat: Repeat) -> dict[fx.Node, Relation]:
    """The relation of every operand of F1 and B1 from outside its unit (see the module
    docstring), checked the same at every use."""
    relation: dict[fx.Node, Relation] = {}
    for one, zero, name in ((units.f1, units.f0, "f"), (units.b1, units.b0, "b")):
        for a, b in zip(one, zero):
            if a.target != b.target or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
                raise NotStampable(f"{a.name} ({a.target}) of {repeat.instance(1)} does not "
                                   f"match {b.name} ({b.target}) of {repeat.instance(0)}")
            if _layout(a.meta.get(M.VAL)) != _layout(b.meta.get(M.VAL)):  # a pair that maps
                raise NotStampable(  # shape A to B, then B to C: block 2 would get C
                    f"{a.name} of {repeat.instance(1)} is {_layout(a.meta.get(M.VAL))}, "
                    f"{b.name} of {repeat.instance(0)} {_layout(b.meta.get(M.VAL))}")
            _match(a.args, b.args, a, name, where, relation, repeat)
            _match(tuple(a.kwargs.values()), tuple(b.kwargs.values()), a, name, where,
                   relation, repeat)
    return relation


def _layout(val: Any) -> Any:
    """Shape, strides and dtype of a value (of each, for several)."""
    if isinstance(val, (tuple, list)):
        return tuple(_layout(v) for v in val)
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.stride(), val.dtype)
    return val


def _match(x: Any, y: Any, at: fx.Node, unit: str, where: dict, relation: dict,
           repeat: Repeat) -> None:
    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
        if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
            raise NotStampable(f"{at.name}: a value in one block, a constant in the other")
        found = _relation_of(x, y, unit, where, repeat)
        if found is None or relation.setdefault(x, found) != found:
            raise NotStampable(f"{at.name} of {repeat.instance(1)} reads {x.name} where "
                               f"{repeat.instance(0)} reads {y.name}: not the same wiring")
        return
    if isinstance(x, (tuple, list)) and type(x) is type(y) and len(x) == len(y):
        for a, b in zip(x, y):
            _match(a, b, at, unit, where, relation, repeat)
        return
    if type(x) is not type(y) or not (x == y or (x != x and y != y)):  # nan == nan here
        raise NotStampable(f"{at.name}: argument {x!r} in {repeat.instance(1)}, {y!r} in "
                           f"{repeat.instance(0)}")


def _relation_of(x: fx.Node, y: fx.Node, unit: str, where: dict, repeat: Repeat
                 ) -> Relation | None:
    """How block 1's operand ``x`` (in unit ``unit`` f or b) relates to block 0's ``y``."""
    wx, wy = where.get(x), where.get(y)
    if wx is not None and wx[0] in ("f1", "b1"):  # block 1's own value, at place q
        return ("own", None) if wy == (wx[0][0] + "0", wx[1]) else None
    if wx is not None and wx[0] == "f0":
        return ("carry", wx[1]) if wy is None else None
    if wx is not None:
        return None
    if unit == "b" and wy is not None and wy[0] == "b1":
        return ("carry-back", wy[1])
    if x is y:
        return ("shared", None)
    if x.op == "placeholder" and y.op == "placeholder":
        rx, ry = x.meta[M.ROLE].name, y.meta[M.ROLE].name
        one, zero = repeat.instance(1) + ".", repeat.instance(0) + "."
        if rx.startswith(one) and ry.startswith(zero) and rx[len(one):] == ry[len(zero):]:
            return ("param", rx[len(one):])
    return None


def _outside_uses(graph: fx.Graph, where: dict) -> list[tuple[fx.Node, fx.Node]]:
    """(user, value) for each glue op reading a block's value; a glue op after the blocks
    must read block 1 only, one before block 0's backward (or after it) block 0 only."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    f1_end = max(order[n] for n, (u, _) in where.items() if u == "f1")
    b1_start = min((order[n] for n, (u, _) in where.items() if u == "b1"), default=len(order))
    uses = []
    for node in graph.nodes:
        if node in where or node.op == "output":
            continue
        for value in node.all_input_nodes:
            if value not in where:
                continue
            one = where[value][0].endswith("1")
            between = f1_end < order[node] < b1_start
            if one != between:
                raise NotRepeatable(f"{node.name}, outside the blocks, reads {value.name} of "
                                   f"block {1 if one else 0}: the glue depends on how many "
                                   "blocks there are")
            if one:
                uses.append((node, value))
    return uses


# --- copying ----------------------------------------------------------------------------


def _stamp(graph: fx.Graph, repeat: Repeat, units: _Units, where: dict,
           relation: dict, outside: list[tuple[fx.Node, fx.Node]]) -> None:
    n = repeat.blocks
    params = _param_copies(graph, repeat, relation)
    copies: dict[int, dict[str, list[fx.Node]]] = {1: {"f1": units.f1, "b1": units.b1}}

    def mapper(j: int) -> Callable[[fx.Node], fx.Node]:
        def env(x: fx.Node) -> fx.Node:
            if x in where and where[x][0] in ("f1", "b1"):
                unit, q = where[x]
                return copies[j][unit][q]
            kind, what = relation.get(x, ("shared", None))
            if kind == "param":
                return params[j][what]
            if kind == "carry":
                return copies[j - 1]["f1"][what]
            if kind == "carry-back":
                return copies[j + 1]["b1"][what] if j + 1 < n else x
            return x
        return env

    seqs = {m.meta["seq_nr"] for m in units.f1 if "seq_nr" in m.meta}
    low, span = (min(seqs), max(seqs) - min(seqs) + 1) if seqs else (0, 0)
    start = max((m.meta.get("seq_nr", -1) for m in graph.nodes), default=-1) + 1

    def seq(j: int) -> Callable[[int], int]:
        """torch's ``seq_nr`` pairs a backward op with the forward op it differentiates
        (stage_cut reads it): each copy's forward ops get numbers of their own, and its
        backward ops are paired the same way (a number from outside the block is kept)."""
        return lambda s: start + (j - 2) * span + (s - low) if s in seqs else s

    stacks: dict = {}
    anchor = units.f1[-1]
    for j in range(2, n):
        copies[j] = {"f1": [], "b1": []}
        env = mapper(j)
        for node in units.f1:
            with graph.inserting_after(anchor):
                anchor = _copy(graph, node, env, repeat, j, seq(j), stacks)
            copies[j]["f1"].append(anchor)
    if units.b1:
        for j in range(n - 1, 1, -1):
            env = mapper(j)
            with graph.inserting_before(units.b1[0]):
                for node in units.b1:
                    copies[j]["b1"].append(_copy(graph, node, env, repeat, j, seq(j), stacks))
    last = copies[n - 1]
    for node in units.b1:  # B1 now reads B2 where it read the glue's backward
        for x in list(node.all_input_nodes):
            if relation.get(x, ("",))[0] == "carry-back":
                node.replace_input_with(x, copies[2]["b1"][relation[x][1]])
    for user, value in outside:  # the glue after the blocks reads the last one
        unit, q = where[value]
        user.replace_input_with(value, last[unit][q])
    _extend_outputs(graph, repeat, copies, where)


def _copy(graph: fx.Graph, node: fx.Node, env: Callable, repeat: Repeat, j: int,
          seq: Callable[[int], int], stacks: dict) -> fx.Node:
    new = graph.node_copy(node, env)
    if "seq_nr" in node.meta:
        new.meta["seq_nr"] = seq(node.meta["seq_nr"])
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        if stack := node.meta.get(key):
            new.meta[key] = _renamed_stack(stack, repeat, j, stacks)
    return new


def _renamed_stack(stack: dict, repeat: Repeat, j: int, stacks: dict) -> dict:
    """``stack`` with block 1's module paths made block j's; one dict per distinct stack and
    block, shared by the block's ops (a block has a few dozen modules and hundreds of ops)."""
    key = (tuple(stack.items()), j)
    if key not in stacks:
        stacks[key] = {k: (_renamed(path, repeat, j), cls) for k, (path, cls) in stack.items()}
    return stacks[key]


def _renamed(name: str, repeat: Repeat, j: int) -> str:
    one = repeat.instance(1)
    if name == one or name.startswith(one + "."):
        return repeat.instance(j) + name[len(one):]
    return name


def _param_copies(graph: fx.Graph, repeat: Repeat, relation: dict) -> dict[int, dict[str, fx.Node]]:
    """For blocks 2 .. n-1, a placeholder per parameter and buffer of block 1's, named for its
    block, where the full trace has it: after block j-1's last input of the same kind."""
    one = repeat.instance(1) + "."
    template = [p for p in graph.find_nodes(op="placeholder")
                if p.meta[M.ROLE].name.startswith(one)]
    used = {what for kind, what in relation.values() if kind == "param"}
    missing = used - {p.meta[M.ROLE].name[len(one):] for p in template}
    if missing:
        raise NotStampable(f"block 1 reads {sorted(missing)[0]}, not an input of its own")
    last = {p.meta[M.ROLE].kind: p for p in template}
    out: dict[int, dict[str, fx.Node]] = {}
    for j in range(2, repeat.blocks):
        out[j], placed = {}, {}
        for p in template:
            kind, rel = p.meta[M.ROLE].kind, p.meta[M.ROLE].name[len(one):]
            role = dataclasses.replace(p.meta[M.ROLE], name=f"{repeat.instance(j)}.{rel}",
                                       aliases=())
            name = placeholder_name(role)
            with graph.inserting_after(placed.get(kind, last[kind])):
                new = graph.create_node("placeholder", name, name=name)
            new.meta.update(p.meta)
            new.meta[M.ROLE] = role
            out[j][rel] = placed[kind] = new
        last = placed
    return out


def _check_outputs(graph: fx.Graph, repeat: Repeat, where: dict) -> None:
    """Block 1's outputs (its gradients, its buffer updates) are computed inside it."""
    out = graph.output_node()
    one = repeat.instance(1) + "."
    for value, role in zip(out.args[0], out.meta[M.OUTPUTS]):
        if role.name.startswith(one) and where.get(value, ("",))[0] not in ("f1", "b1"):
            raise NotStampable(f"output {role.name} is not computed inside its block")


def _extend_outputs(graph: fx.Graph, repeat: Repeat, copies: dict, where: dict) -> None:
    """Each gradient (or buffer update) output of block 1 gets one per copy, in parameter
    order: after block j-1's."""
    out = graph.output_node()
    values, roles = list(out.args[0]), list(out.meta[M.OUTPUTS])
    one = repeat.instance(1) + "."
    mine = [k for k, r in enumerate(roles) if r.name.startswith(one)]
    at = (mine[-1] + 1) if mine else len(values)
    new_values, new_roles = [], []
    for j in range(2, repeat.blocks):
        for k in mine:
            unit, q = where[values[k]]
            new_values.append(copies[j][unit][q])
            new_roles.append(dataclasses.replace(roles[k], name=repeat.instance(j) + "."
                                                 + roles[k].name[len(one):]))
    out.args = (tuple(values[:at] + new_values + values[at:]),)
    out.meta[M.OUTPUTS] = tuple(roles[:at] + new_roles + roles[at:])


def rename_in_order(graph: fx.Graph) -> None:
    """Name every op by its kind and its rank among the ops of that kind, in program order
    (``mm``, ``mm_1``, ...), inputs keeping theirs: a graph's names then follow from its ops
    alone, so the stamped graph and the full trace read the same."""
    names = _Namespace()
    for node in graph.nodes:
        keep = node.op in ("placeholder", "output")
        node.name = names.create_name(node.name if keep else _kind(node.name), node)
    graph._graph_namespace = names


def _kind(name: str) -> str:
    return re.sub(r"(_\d+)+$", "", name) or name
