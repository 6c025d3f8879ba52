"""``text_to_ir``: the IR's text form (``shardfx.ir.text``) read back into a GraphModule.

    gm = text_to_ir('''
    graph train Tiny
      w: f32[4, 4] = param w
      args_0: f32[2, 4] = input args[0]
      tangent_loss: f32[] = tangent loss
      mm: f32[2, 4] = aten.mm.default(args_0, w)  # fwd
      loss: f32[] = aten.sum.default(mm)  # fwd
      output loss loss = loss
    ''')

Each line is read once, top to bottom. The header gives ``GRAPH``. A placeholder line gives
``ROLE`` and a FakeTensor of the declared type (one ``FakeTensorMode`` for the graph). An op
line is parsed with ``ast``: the target is ``ns.op.overload`` from ``torch.ops`` or
``operator.getitem``, operands are nodes above or Python literals; the op runs on the operands'
fake values, which recomputes ``meta["val"]``, and must give the declared type. ``# fwd`` /
``# bwd`` give ``PHASE``. ``output KIND NAME = VALUE`` lines give the output node's values and
``OUTPUTS``.

Unreadable text raises ``ParseError``; a declared type the op does not compute raises
``VerifyError``; both name the line and show it in context. The result passes ``verify``, and
``ir_to_text(text_to_ir(t)) == t`` for text ``ir_to_text`` printed. A constant input is read
with its value (``= constant NAME [0, 1]``, as ``ir_to_text`` prints small ones); one printed
without (too large to print) is refused.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from shardfx.errors import ParseError, ShardfxError, VerifyError
from shardfx.ir import cp_layout, meta as M
from shardfx.ir.text import DTYPE_ABBR, target_str, type_str
from shardfx.ir.verify import verify
from shardfx.mesh import MeshSpec
from shardfx.passes.shard_propagate import shard_propagate  # above passes: see docs/architecture.md
from shardfx.request.options import Options


_DTYPES = {abbr: dtype for dtype, abbr in DTYPE_ABBR.items()}
_HEADER = re.compile(r"graph\s+(?P<mode>\w+)\s+(?P<model>\S+)(?:\s+mesh\s+(?P<mesh>\S+))?")
_PLACEMENT = re.compile(r"[SC]\((-?\d+)(?:,(\d+))?\)|R|P(?:\((\w+)\))?")
_OUTPUT = re.compile(r"output\s+(?P<kind>\w+)\s+(?P<name>\S+)\s*=\s*(?P<value>.+)")
_NODE = re.compile(r"(?P<name>\w+):\s*(?P<type>[^=]+?)\s*=\s*(?P<rhs>.+?)"
                   r"(?:\s+#\s*(?P<notes>.*))?")  # name: type = rhs  # notes
_CONSTANT = re.compile(r"constant\s+(?P<name>\S+)(?:\s+(?P<value>.+))?")
_INPUT = re.compile(r"(?P<kind>\w+)\s+(?P<name>[^\s(]+)(?:\s+\(=\s*(?P<aliases>[^)]*)\))?")
_TENSOR = re.compile(r"(?P<dtype>[\w.]+)\[(?P<shape>[\d,\s]*)\]")
_LEAF = {M.InputKind.INPUT: re.compile(r"args\[(\d+)\]"),
         M.InputKind.TARGET: re.compile(r"targets\[(\d+)\]")}
_INPUT_WORDS = {k.value for k in M.InputKind}
_CALLS = {"float": float, "torch.device": torch.device}  # literals arg_str prints as calls
_TORCH_ENUMS = (torch.dtype, torch.memory_format, torch.layout)  # torch.float32, torch.strided


def text_to_ir(text: str, device: str | torch.device = "cpu") -> fx.GraphModule:
    """Parse ``text`` into the IR. Placeholders' fake values live on ``device`` (the text form
    does not say where tensors are)."""
    return _Reader(text.splitlines(), torch.device(device)).read()


class _Reader:
    def __init__(self, lines: list[str], device: torch.device):
        self.lines, self.device = lines, device
        self.lineno = 0
        self.graph = fx.Graph()
        self.nodes: dict[str, fx.Node] = {}
        self.fake_mode = FakeTensorMode()
        self.info: M.GraphInfo | None = None
        self.outputs: list[tuple[Any, M.OutputRole]] = []
        self.declared: dict[fx.Node, tuple[int, str]] = {}  # op -> (line, placements it declares)

    def read(self) -> fx.GraphModule:
        for self.lineno, raw in enumerate(self.lines, 1):
            line = raw.strip().removeprefix(">>").strip()  # ir_to_text(mark=...) marks a line
            if not line or line.startswith("#"):
                continue
            if self.info is None:
                self._header(line)
            elif m := _OUTPUT.fullmatch(line):
                self._output(m)
            elif m := _NODE.fullmatch(line):
                self._node(m)
            else:
                raise self._error("expected 'NAME: TYPE = ...' or 'output KIND NAME = VALUE'")
        if self.info is None:
            raise ParseError("the text has no 'graph MODE MODEL' header", where="line 1")
        self._number_targets()
        out = self.graph.output(tuple(v for v, _ in self.outputs))
        out.meta[M.OUTPUTS] = tuple(r for _, r in self.outputs)
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        gm.meta[M.GRAPH] = self.info
        verify(gm)
        if self.declared:
            self._check_placements(gm)
        return gm

    def _check_placements(self, gm: fx.GraphModule) -> None:
        """Ops' placements are not read but derived, by the propagation pass, then compared
        with what the text declares (as types are)."""
        shard_propagate(gm, Options(mesh=MeshSpec(self.info.mesh)))
        for node, (self.lineno, declared) in self.declared.items():
            got = str(node.meta[M.SHARDING])
            if got.replace(" ", "") != declared.replace(" ", ""):
                raise self._error(f"{node.name} is declared {declared} but propagation gives "
                                  f"{got}", cls=VerifyError)

    def _placements(self, text: str) -> M.Placements:
        """``S(0)R`` -> (Shard(0), Replicate()), one per mesh axis."""
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        found = [(m.group(0), m) for m in _PLACEMENT.finditer(text)]
        if "".join(t for t, _ in found) != text or len(found) != len(self.info.mesh):
            raise self._error(f"cannot read placements {text!r} for mesh "
                              f"{MeshSpec(self.info.mesh)}",
                              fix="one of S(dim), S(dim,parts), C(dim), R, P per mesh axis, "
                              "e.g. S(0)R")
        out = tuple((_StridedShard(int(m[1]), split_factor=int(m[2])) if m[2] else
                     Shard(int(m[1]))) if t[0] in "SC" else Replicate() if t == "R"
                    else Partial(m[3] or "sum") for t, m in found)
        return tuple(cp_layout.as_chunks(p) if t.startswith("C") else p
                     for (t, _), p in zip(found, out))

    # --- one method per kind of line ------------------------------------------------------

    def _header(self, line: str) -> None:
        m = _HEADER.fullmatch(line)
        if m is None:
            raise self._error("the first line must be 'graph MODE MODEL'")
        mesh = MeshSpec.parse(m["mesh"]).axes if m["mesh"] else ()
        self.info = M.GraphInfo(self._enum(M.Mode, m["mode"]), m["model"], mesh)

    def _output(self, m: re.Match) -> None:
        kind = self._enum(M.OutputKind, m["kind"])
        leaf = re.fullmatch(r"out\[(\d+)\]", m["name"])
        index = int(leaf[1]) if leaf and kind is M.OutputKind.OUTPUT else None
        value = self._value(self._expr(m["value"]))
        self.outputs.append((value, M.OutputRole(kind, m["name"], index)))

    def _node(self, m: re.Match) -> None:
        name = m["name"]
        if name in self.nodes:
            raise self._error(f"{name!r} is defined twice")
        first = m["rhs"].split(maxsplit=1)[0]
        node = self._placeholder(m) if first in _INPUT_WORDS else self._call(m)
        if node.name != name:
            raise self._error(f"torch.fx cannot name a node {name!r} (it would be {node.name!r})",
                              fix="rename it: no Python builtins or keywords")
        self.nodes[name] = node
        notes = (m["notes"] or "").split("|")[0].strip()  # text.node_notes's part: phase,
        # stage, placements; cost and origin after "|" are for people
        word = notes.split(" ", 1)[0]
        if word in {p.value for p in M.Phase}:
            node.meta[M.PHASE] = M.Phase(word)
            notes = notes[len(word):].strip()
        if m_stage := re.match(r"@(\d+)\s*", notes):
            node.meta[M.STAGE] = int(m_stage[1])
            notes = notes[m_stage.end():]
        if notes and not self.info.mesh:
            raise self._error(f"placements {notes!r} on a graph without a mesh",
                              fix="name the mesh in the header: graph MODE MODEL mesh dp=2")
        if notes and node.op == "placeholder":
            node.meta[M.ANNOTATION] = self._placements(notes)
        elif notes:
            self.declared[node] = (self.lineno, notes)

    def _placeholder(self, m: re.Match) -> fx.Node:
        if m["rhs"].split(maxsplit=1)[0] == M.InputKind.CONSTANT.value:
            return self._constant(m)
        rhs = _INPUT.fullmatch(m["rhs"])
        if rhs is None:
            raise self._error(f"cannot read input {m['rhs']!r}",
                              fix="write 'KIND NAME' or 'KIND NAME (= ALIAS, ...)'")
        kind = M.InputKind(rhs["kind"])
        index = None
        if kind in _LEAF:
            if not (leaf := _LEAF[kind].fullmatch(rhs["name"])):
                raise self._error(f"a {kind} is named args[i] or targets[i], not {rhs['name']!r}")
            index = int(leaf[1])
        aliases = tuple(a.strip() for a in rhs["aliases"].split(",")) if rhs["aliases"] else ()
        dtype, shape = self._tensor_type(m["type"])
        node = self.graph.placeholder(m["name"])
        node.meta[M.ROLE] = M.InputRole(kind, rhs["name"], index, aliases)
        with self.fake_mode:
            node.meta[M.VAL] = torch.empty(shape, dtype=dtype, device=self.device)
        return node

    def _constant(self, m: re.Match) -> fx.Node:
        """``constant NAME VALUE``: a CONSTANT input, its value a Python literal."""
        c = _CONSTANT.fullmatch(m["rhs"])
        if c is None or c["value"] is None:
            raise self._error("constants cannot be rebuilt from text without their values (too "
                              "large to print)", fix="capture the model (shardfx.partition), "
                              "which records them, or make the value an input of the model")
        dtype, shape = self._tensor_type(m["type"])
        try:
            value = torch.tensor(ast.literal_eval(c["value"]), dtype=dtype).reshape(shape)
        except (ValueError, SyntaxError, TypeError, RuntimeError) as e:
            raise self._error(f"cannot read the value of constant {c['name']}: {e}",
                              fix=f"write a list literal of {m['type']}, e.g. [0, 1]") from None
        node = self.graph.placeholder(m["name"])
        node.meta[M.ROLE] = M.InputRole(M.InputKind.CONSTANT, c["name"])
        node.meta[M.CONSTANT] = M.Constant(value)
        with self.fake_mode:
            node.meta[M.VAL] = torch.empty(shape, dtype=dtype, device=self.device)
        return node

    def _call(self, m: re.Match) -> fx.Node:
        call = self._expr(m["rhs"])
        if not isinstance(call, ast.Call):
            raise self._error(f"expected an op call like aten.mm.default(a, b), got {m['rhs']!r}")
        target = self._target(call.func)
        args = tuple(self._value(a) for a in call.args)
        kwargs = {k.arg: self._value(k.value) for k in call.keywords}
        node = self.graph.create_node("call_function", target, args, kwargs, name=m["name"])
        fake_args, fake_kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta[M.VAL],
                                                      (args, kwargs))
        try:
            with self.fake_mode:
                node.meta[M.VAL] = target(*fake_args, **fake_kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise self._error(f"{m['name']}: {target_str(target)} fails on its operands: "
                              f"{type(e).__name__}: {first}", cls=VerifyError) from e
        got = type_str(node.meta[M.VAL])
        if got.replace(" ", "") != m["type"].replace(" ", ""):
            raise self._error(f"{m['name']} is declared {m['type']} but {target_str(target)} "
                              f"gives {got}", cls=VerifyError,
                              fix="correct the declared type, or the op and its operands")
        return node

    # --- pieces of a line -----------------------------------------------------------------

    def _expr(self, src: str) -> ast.expr:
        try:
            return ast.parse(src, mode="eval").body
        except SyntaxError as e:
            raise self._error(f"cannot parse {src!r}: {e.msg}") from None

    def _target(self, func: ast.expr) -> Any:
        dotted = _dotted(func)
        parts = dotted.split(".")
        target: Any = None
        if len(parts) == 2 and parts[0] == "operator":
            target = getattr(operator, parts[1], None)
        elif len(parts) == 3:
            packet = getattr(getattr(torch.ops, parts[0], None), parts[1], None)
            target = getattr(packet, parts[2], None)
            target = target if isinstance(target, torch._ops.OpOverload) else None
        if not callable(target):
            raise self._error(f"unknown op {dotted or ast.unparse(func)!r}",
                              fix="write ops as NAMESPACE.OP.OVERLOAD (aten.mm.default) or "
                              "operator.getitem")
        return target

    def _value(self, e: ast.expr) -> Any:
        """An operand: a node above, or a literal as ``text.arg_str`` prints it."""
        if isinstance(e, ast.Name):
            if e.id not in self.nodes:
                raise self._error(f"unknown name {e.id!r}: no node of that name above this line")
            return self.nodes[e.id]
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub) \
                and isinstance(e.operand, ast.Constant):
            return -e.operand.value
        if isinstance(e, (ast.List, ast.Tuple)):
            items = [self._value(x) for x in e.elts]
            return items if isinstance(e, ast.List) else tuple(items)
        if isinstance(e, ast.Call) and _dotted(e.func) in _CALLS and not e.keywords \
                and all(isinstance(a, ast.Constant) for a in e.args):
            return _CALLS[_dotted(e.func)](*(a.value for a in e.args))
        dotted = _dotted(e)
        if dotted.startswith("torch."):
            value = getattr(torch, dotted.removeprefix("torch."), None)
            if isinstance(value, _TORCH_ENUMS):
                return value
        raise self._error(f"cannot read operand {ast.unparse(e)!r}", fix="operands are node "
                          "names or literals: numbers, lists, None, torch.float32, "
                          "torch.device('cpu'), torch.contiguous_format, float('inf')")

    def _tensor_type(self, s: str) -> tuple[torch.dtype, list[int]]:
        m = _TENSOR.fullmatch(s.strip())
        dtype = _DTYPES.get(m["dtype"]) if m else None
        if m and dtype is None and m["dtype"].startswith("torch."):  # type_str's fallback
            dtype = getattr(torch, m["dtype"].removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise self._error(f"an input's type must be a tensor type like f32[2, 4], not {s!r}",
                              fix="dtypes: " + ", ".join(_DTYPES))
        return dtype, [int(d) for d in m["shape"].replace(",", " ").split()]

    def _number_targets(self) -> None:
        """Leaves are numbered over (args, targets) flattened: targets[j] is leaf n_args + j."""
        placeholders = self.graph.find_nodes(op="placeholder")
        n_args = sum(p.meta[M.ROLE].kind is M.InputKind.INPUT for p in placeholders)
        for p in placeholders:
            if (role := p.meta[M.ROLE]).kind is M.InputKind.TARGET:
                p.meta[M.ROLE] = dataclasses.replace(role, index=n_args + role.index)

    def _enum(self, cls: type[enum.Enum], word: str) -> Any:
        try:
            return cls(word)
        except ValueError:
            raise self._error(f"unknown {cls.__name__} {word!r}",
                              fix="one of " + ", ".join(k.value for k in cls)) from None

    def _error(self, cause: str, fix: str | None = None, cls: type = ParseError) -> ShardfxError:
        """``cause`` at the current line, with the lines around it, that line marked ``>>``."""
        lo, hi = max(1, self.lineno - 3), min(len(self.lines), self.lineno + 1)
        context = "\n".join(f"    {'>>' if i == self.lineno else '  '} {i:4d} | "
                            f"{self.lines[i - 1]}" for i in range(lo, hi + 1))
        return cls(f"line {self.lineno}: {cause}", where=f"line {self.lineno}\n{context}",
                   fix=fix)


def _dotted(e: ast.expr) -> str:
    """``aten.mm.default`` for the ast of that dotted name; '' for anything else."""
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Attribute):
        base = _dotted(e.value)
        return f"{base}.{e.attr}" if base else ""
    return ""
