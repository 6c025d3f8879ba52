"""Random small models, described as plain data: the description and the model it builds.

A ``ModelSpec`` is the whole description of a model: input shape, weight seed, a list of blocks
(each a list of ops), and the parameter placements used by the "tp2-globs" mesh. It prints as one
line that parses back, so a failure is reproduced from the test output alone::

    x(4,24) seed 7: transpose linear(4,bias) transpose | layernorm | res[up_proj(16) gelu
        down_proj(24)] ; shard layers.2.op0.body.op0.up_proj.weight=S0      (on one line)

The model (``build``) is ``layers``, an ``nn.ModuleList`` with one module per block (the cut
points of a pipeline), applied in order to a batch-first input ``(8, seq, dim)``; the loss is
the mean squared error against a random target of the output's shape. Ops, each on the last
dimension unless said otherwise::

    linear(N[,bias])  NAME(N[,bias])   a Linear to N features; NAME is a module name Megatron's
                                       plan knows (up_proj, down_proj, q_proj, o_proj, fc1, fc2)
    relu gelu silu tanh sigmoid        activations
    layernorm rmsnorm                  over the last dim; "(plain)": without affine weights
    softmax  scale(C)                  softmax over the last dim; x * C
    transpose                          swap the last two dims (a view: not contiguous)
    split(A)  merge                    (.., D) -> (.., A, D/A); (.., A, B) -> (.., A*B)
    res[OPS]                           x + OPS(x), OPS keeping the shape

Specs are drawn by ``fuzz_draw`` and checked through the meshes by ``fuzz_check``;
``bench/fuzz.py`` runs many and reduces failures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

BATCH = 8
SEQS = (4, 6, 8)
DIMS = (4, 8, 12, 16, 24)  # even, so every mesh axis of 2 divides every dim
ACTIVATIONS = ("relu", "gelu", "silu", "tanh", "sigmoid")
NORMS = ("layernorm", "rmsnorm")
# Megatron's plan shards q_proj/up_proj/fc1 by output and o_proj/down_proj/fc2 by input features;
# "linear" it leaves replicated.
LINEAR_NAMES = ("linear", "up_proj", "down_proj", "q_proj", "o_proj", "fc1", "fc2")
SCALES = (-1.5, 0.5, 2.0)
PLACEMENTS = ("R", "S0", "S1")


# --- the description -------------------------------------------------------------------------

Op = tuple  # ("linear", name, out, bias) | ("act", kind) | ("norm", kind, affine) | ("softmax",)
#             | ("scale", c) | ("transpose",) | ("split", a) | ("merge",) | ("res", ops)


@dataclass(frozen=True)
class ModelSpec:
    """A model as data; ``str`` is its one-line text form, ``ModelSpec.parse`` reads it back."""

    seq: int
    dim: int
    seed: int
    blocks: tuple[tuple[Op, ...], ...]
    shard: tuple[tuple[str, str], ...] = ()  # (parameter FQN, "R" | "S0" | "S1") for tp2-globs

    def __str__(self) -> str:
        text = f"x({self.seq},{self.dim}) seed {self.seed}: " + \
            " | ".join(format_ops(ops) for ops in self.blocks)
        if self.shard:
            text += " ; shard " + " ".join(f"{n}={p}" for n, p in self.shard)
        return text

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example: pasteable
        return f"ModelSpec.parse({str(self)!r})"

    @staticmethod
    def parse(text: str) -> "ModelSpec":
        m = re.fullmatch(r"\s*x\((\d+),(\d+)\) seed (\d+): (.*?)(?: ; shard (.*))?\s*", text)
        if not m:
            raise ValueError(f"not a model spec: {text!r}")
        blocks = tuple(parse_ops(b) for b in m[4].split("|"))
        shard = tuple(tuple(item.split("=")) for item in (m[5] or "").split())
        return ModelSpec(int(m[1]), int(m[2]), int(m[3]), blocks, shard)

    def size(self) -> int:
        """How big the description is (ops, nested ones and shard entries): what ``reduce``
        makes smaller."""
        return sum(_count(ops) for ops in self.blocks) + len(self.shard)


def _count(ops: Sequence[Op]) -> int:
    return sum(1 + (_count(op[1]) if op[0] == "res" else 0) for op in ops)


def format_ops(ops: Sequence[Op]) -> str:
    return " ".join(_format_op(op) for op in ops)


def _format_op(op: Op) -> str:
    kind = op[0]
    if kind == "linear":
        _, name, out, bias = op
        return f"{name}({out}{',bias' if bias else ''})"
    if kind == "act":
        return op[1]
    if kind == "norm":
        return op[1] + ("" if op[2] else "(plain)")
    if kind in ("scale", "split"):
        return f"{kind}({op[1]:g})"
    if kind == "res":
        return f"res[{format_ops(op[1])}]"
    return kind


_TOKEN = re.compile(r"res\[|\]|(\w+)(?:\(([^)]*)\))?")


def parse_ops(text: str) -> tuple[Op, ...]:
    tokens = [m for m in _TOKEN.finditer(text)]
    ops, rest = _parse_tokens(tokens, 0)
    if rest != len(tokens):
        raise ValueError(f"unbalanced ']' in {text!r}")
    return ops


def _parse_tokens(tokens: list[re.Match], i: int) -> tuple[tuple[Op, ...], int]:
    ops: list[Op] = []
    while i < len(tokens) and tokens[i][0] != "]":
        word, args = tokens[i][1], tokens[i][2]
        if tokens[i][0] == "res[":
            body, i = _parse_tokens(tokens, i + 1)
            if i == len(tokens):
                raise ValueError("res[ without ]")
            ops.append(("res", body))
        elif word in LINEAR_NAMES:
            out, *flags = args.split(",")
            ops.append(("linear", word, int(out), flags == ["bias"]))
        elif word in ACTIVATIONS:
            ops.append(("act", word))
        elif word in NORMS:
            ops.append(("norm", word, args != "plain"))
        elif word == "scale":
            ops.append(("scale", float(args)))
        elif word == "split":
            ops.append(("split", int(args)))
        elif word in ("softmax", "transpose", "merge"):
            ops.append((word,))
        else:
            raise ValueError(f"unknown op {tokens[i][0]!r}")
        i += 1
    return tuple(ops), i


# --- the model --------------------------------------------------------------------------------


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(-1, -2)


class Split(nn.Module):
    def __init__(self, a: int):
        super().__init__()
        self.a = a

    def forward(self, x):
        return x.reshape(*x.shape[:-1], self.a, x.shape[-1] // self.a)


class Merge(nn.Module):
    def forward(self, x):
        return x.flatten(-2)


class Scale(nn.Module):
    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


class Named(nn.Module):
    """A Linear under a module name of the spec's choosing (what Megatron's plan reads)."""

    def __init__(self, name: str, linear: nn.Linear):
        super().__init__()
        self.name = name
        self.add_module(name, linear)

    def forward(self, x):
        return getattr(self, self.name)(x)


class Ops(nn.Module):
    """Ops applied in order, registered as ``op0``, ``op1``, ... (no numbered module names
    inside a block: a pipeline cuts where the first numbered name, ``layers.N``, changes)."""

    def __init__(self, ops: list[nn.Module]):
        super().__init__()
        for i, op in enumerate(ops):
            self.add_module(f"op{i}", op)

    def forward(self, x):
        for op in self.children():
            x = op(x)
        return x


class Residual(nn.Module):
    def __init__(self, body: Ops):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class FuzzModel(nn.Module):
    def __init__(self, blocks: list[Ops]):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):  # (B, seq, dim) -> (B, *out_shape)
        for block in self.layers:
            x = block(x)
        return x


def build(spec: ModelSpec) -> FuzzModel:
    """The model ``spec`` describes, weights drawn from ``spec.seed``; ValueError when the ops
    do not fit the shapes they get."""
    torch.manual_seed(spec.seed)
    shape = (spec.seq, spec.dim)
    blocks = []
    for ops in spec.blocks:
        block, shape = _build_ops(ops, shape)
        blocks.append(block)
    model = FuzzModel(blocks)
    with torch.no_grad():  # norms start away from (1, 0): a misplaced weight shows in the numbers
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                for p in m.parameters():
                    p.add_(0.2 * torch.randn_like(p))
    return model


def out_shape(spec: ModelSpec) -> tuple[int, ...]:
    """The model's output shape without the batch dim (ValueError if the ops do not fit)."""
    shape = (spec.seq, spec.dim)
    for ops in spec.blocks:
        for op in ops:
            shape = shape_after(op, shape)
    return shape


def _build_ops(ops: Sequence[Op], shape: tuple[int, ...]) -> tuple[Ops, tuple[int, ...]]:
    modules = []
    for op in ops:
        modules.append(_build_op(op, shape))
        shape = shape_after(op, shape)
    return Ops(modules), shape


def _build_op(op: Op, shape: tuple[int, ...]) -> nn.Module:
    kind, d = op[0], shape[-1]
    if kind == "linear":
        return Named(op[1], nn.Linear(d, op[2], bias=op[3]))
    if kind == "act":
        return {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh,
                "sigmoid": nn.Sigmoid}[op[1]]()
    if kind == "norm":
        norm = nn.LayerNorm if op[1] == "layernorm" else nn.RMSNorm
        return norm(d, elementwise_affine=op[2])
    if kind == "softmax":
        return nn.Softmax(dim=-1)
    if kind == "scale":
        return Scale(op[1])
    if kind == "transpose":
        return Transpose()
    if kind == "split":
        return Split(op[1])
    if kind == "merge":
        return Merge()
    if kind == "res":
        return Residual(_build_ops(op[1], shape)[0])
    raise ValueError(f"unknown op {op!r}")


def shape_after(op: Op, shape: tuple[int, ...]) -> tuple[int, ...]:
    kind = op[0]
    if kind == "linear":
        return (*shape[:-1], op[2])
    if kind == "transpose":
        return (*shape[:-2], shape[-1], shape[-2])
    if kind == "split":
        if len(shape) > 2 or shape[-1] % op[1]:
            raise ValueError(f"split({op[1]}) does not fit shape {shape}")
        return (*shape[:-1], op[1], shape[-1] // op[1])
    if kind == "merge":
        if len(shape) < 3:
            raise ValueError(f"merge needs 3 dims, shape is {shape}")
        return (*shape[:-2], shape[-2] * shape[-1])
    if kind == "res":
        inner = shape
        for o in op[1]:
            inner = shape_after(o, inner)
        if inner != shape:
            raise ValueError(f"residual body maps {shape} to {inner}")
    return shape


def batches(spec: ModelSpec, steps: int) -> list[tuple[tuple, tuple]]:
    """``steps`` different (inputs, targets) batches, drawn from ``spec.seed``."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    target = out_shape(spec)
    return [((torch.randn(BATCH, spec.seq, spec.dim, generator=g),),
             (torch.randn(BATCH, *target, generator=g),)) for _ in range(steps)]


