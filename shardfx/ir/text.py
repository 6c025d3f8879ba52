"""The text form of the IR: one node per line, with its type and our annotations.

    graph train GPT2LMHeadModel
      transformer_wte_weight: f32[64, 32] = param transformer.wte.weight (= lm_head.weight)
      args_0: i64[2, 8] = input args[0]
      tangent_loss: f32[] = tangent loss
      embedding: f32[2, 8, 32] = aten.embedding.default(transformer_wte_weight, args_0)  # fwd
      ...
      output loss loss = mean
      output grad transformer.wte.weight = add_3

Types are ``dtype[shape]`` (``f32[2, 8]``), a tuple of them for multi-output ops, ``-`` for a
value that is not a tensor. A small constant input shows its value
(``tensor_constant0: i64[2] = constant _tensor_constant0 [0, 1]``). Operands are node names or
Python literals. ``# fwd``/``# bwd`` is the node's PHASE; ``@1`` its pipeline STAGE; then, on a
graph planned for a mesh (``graph train M mesh dp=2,tp=2``), its placements, one per mesh axis
(``S(0)R``: Shard(0) on dp, Replicate on tp; ``P`` a partial sum). ``shardfx.ir.parse.text_to_ir``
reads this form back, so tests can be written in it.

After ``|`` come what the parser ignores, for a person reading a dump: the op's estimated cost
(``1.02 MFLOP 8.0 KiB``, once ``estimate_cost`` ran) and where it comes from, the module's path
in the model and the source line (``model.layers.3.mlp.down_proj modeling_llama.py:155``)::

      mm_9: f32[16, 32] = aten.mm.default(view_27, t_9)  # fwd | 32.77 KFLOP 2.0 KiB | model.layers.0.mlp.down_proj modeling_llama.py:155
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.fx as fx

from shardfx.errors import user_frame
from shardfx.ir import meta as M
from shardfx.ir.units import flops, nbytes

DTYPE_ABBR = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64",
}


def type_str(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{DTYPE_ABBR.get(val.dtype, str(val.dtype))}[{', '.join(map(str, val.shape))}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(type_str(v) for v in val) + ")"
    return "-"


def arg_str(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(arg_str(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a)  # torch.float32
    if isinstance(a, torch.device):
        return f"torch.device({str(a)!r})"
    if isinstance(a, (torch.memory_format, torch.layout)):
        return f"torch.{str(a).removeprefix('torch.')}"
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return f"float({str(a)!r})"
    return repr(a)


def target_str(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    name = getattr(target, "__qualname__", None) or target.__name__  # an op object: its name
    return f"{target.__module__}.{name}".replace("_operator.", "operator.")


def node_line(node: fx.Node, people: bool = True) -> str:
    ty = type_str(node.meta.get(M.VAL))
    if node.op == "placeholder":
        role = node.meta.get(M.ROLE)
        rhs = f"{role.kind} {role.name}" if role else "input ?"
        if role and role.aliases:
            rhs += " (= " + ", ".join(role.aliases) + ")"
        if role and role.kind is M.InputKind.CONSTANT:
            rhs += constant_str(node.meta.get(M.CONSTANT))
    elif node.op == "get_attr":
        rhs = f"constant {node.target}"
    else:
        operands = [arg_str(a) for a in node.args]
        operands += [f"{k}={arg_str(v)}" for k, v in node.kwargs.items()]
        rhs = f"{target_str(node.target)}({', '.join(operands)})"
    notes = [node_notes(node)]
    if people:  # after |: what parse ignores
        notes += [cost_str(node.meta.get(M.COST)), origin(node)]
    while notes and not notes[-1]:
        notes.pop()
    return f"{node.name}: {ty} = {rhs}" + (f"  # {' | '.join(notes)}" if notes else "")


def cost_str(cost: M.NodeCost | None) -> str:
    """``1.02 MFLOP 8.0 KiB``: an op's estimated FLOPs and the bytes it makes (each left out
    when 0; ``-`` for a view, which has neither); '' before ``estimate_cost`` ran."""
    if cost is None:
        return ""
    if not (cost.flops or cost.out_bytes):
        return "-"
    work = flops(cost.flops)
    parts = [f"{work}FLOP" if work[-1].isalpha() else f"{work} FLOP"] if cost.flops else []
    return " ".join(parts + ([nbytes(cost.out_bytes)] if cost.out_bytes else []))


def origin(node: fx.Node) -> str:
    """Where an op comes from: the path in the model of the module that ran it (torch.export's
    ``nn_module_stack``; a backward op: the module whose forward it differentiates; the model's
    class name for its own ops, ``(loss)`` the loss function's) and the source line,
    ``file:line`` in the user's code or the library the model is from (the innermost frame of
    ``stack_trace`` outside torch and shardfx).
    '' when neither is known (an op shardfx made, a graph parsed from text)."""
    module = module_of(node)
    frame = user_frame(node.meta.get("stack_trace")) if node.op == "call_function" else None
    line = f"{os.path.basename(frame[0])}:{frame[1]}" if frame else ""
    return f"{module} {line}".strip()


def module_of(node: fx.Node) -> str:
    """The path in the model of the module that ran ``node`` (``origin`` without the line)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    return _module(next(reversed(stack.values()))) if stack else ""


def block_pattern(path: str) -> str:
    """A module path with each block index as ``*``: "model.layers.*.mlp" for every layer's."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


INLINE_CONSTANT = 16  # constants of at most this many elements are printed with their values


def constant_str(const: M.Constant | None) -> str:
    """`` [0, 1]``: a small constant's value, as a literal ``parse`` reads back; '' otherwise."""
    if const is None or const.value.numel() > INLINE_CONSTANT:
        return ""
    value = const.value
    if (value.is_floating_point() or value.is_complex()) and not value.isfinite().all():
        return ""  # nan and inf are not literals
    return f" {value.tolist()!r}"


def node_notes(node: fx.Node) -> str:
    """Our annotations on a node, compact; later passes add theirs here (placements, stage)."""
    notes = [str(node.meta[M.PHASE])] if M.PHASE in node.meta else []
    if M.STAGE in node.meta:
        notes.append(f"@{node.meta[M.STAGE]}")
    for key in (M.ANNOTATION, M.SHARDING):
        if key in node.meta:
            value = node.meta[key]
            notes.append(str(value) if key == M.SHARDING else M.placements_str(value))
    if M.ZERO in node.meta:  # a program's input that is ZeRO's rows of a parameter
        z = node.meta[M.ZERO]
        notes.append(f"ZeRO(rows {z.per_rank} of {z.rows} per rank of dp={z.dp})")
    return " ".join(notes)


def _module(entry: tuple[str, str]) -> str:
    """An ``nn_module_stack`` entry, ``(path, qualified class)``, as ``origin`` names it: the
    path, or for the model itself its class name, ``(loss)`` for the loss function."""
    path, cls = entry
    if path:
        return path
    return "(loss)" if cls.endswith("._LossOf") else cls.rsplit(".", 1)[-1]


def ir_to_text(gm: fx.GraphModule, mark: fx.Node | None = None, people: bool = True) -> str:
    """The whole graph as text; ``mark`` puts ``>>`` in front of one node's line.
    ``people=False`` leaves out each op's cost and origin (the part after ``|``, which
    ``parse`` ignores): the text ``parse`` reads back to the same text."""
    info = gm.meta.get(M.GRAPH)
    header = f"graph {info.mode} {info.model}" if info else "graph"
    if info and info.mesh:
        header += " mesh " + ",".join(f"{a}={n}" for a, n in info.mesh)
    lines = [header]
    for node in gm.graph.nodes:
        if node.op == "output":
            roles = node.meta.get(M.OUTPUTS) or ()
            for value, role in zip(node.args[0], roles):
                lines.append(f"  output {role.kind} {role.name} = {arg_str(value)}")
            continue
        prefix = ">> " if node is mark else "  "
        lines.append(prefix + node_line(node, people))
    return "\n".join(lines) + "\n"
