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
    ste  clampste                      custom autograd.Functions whose backward is not their
                                       forward's derivative: round(4x)/4 with the identity as
                                       backward; clamp(-1, 1) with half the gradient everywhere
    ckpt[OPS]  ckptnr[OPS]             OPS under torch.utils.checkpoint, use_reentrant=True /
                                       False
    dropout(P)                         nn.Dropout(P), in training
    noise(C[,KIND])                    x + C * noise: randn_like (KIND normal, the default),
                                       uniform_(-1, 1) (uniform) or exponential_ (exp)

The last four are what capture used to change in silence (a Function's backward, a reentrant
checkpoint's gradients) and random ops, which shardfx draws from its own stream on every mesh
and ``compare_training`` replays in eager.

Specs are drawn by ``fuzz_draw`` and checked through the meshes by ``fuzz_check``;
``bench/fuzz.py`` runs many and reduces failures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils.checkpoint

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
FUNCTIONS = ("ste", "clampste")  # custom autograd.Functions (RoundSTE, HalfGradClamp)
DROPOUTS = (0.1, 0.25, 0.5)
NOISES = ("normal", "uniform", "exp")
NOISE_SCALES = (0.1, 0.5)
NESTED = ("res", "ckpt", "ckptnr")  # the ops with a body, written NAME[OPS]


# --- the description -------------------------------------------------------------------------

Op = tuple  # ("linear", name, out, bias) | ("act", kind) | ("norm", kind, affine) | ("softmax",)
#             | ("scale", c) | ("transpose",) | ("split", a) | ("merge",) | ("res", ops)
#             | ("fn", kind) | ("ckpt", ops) | ("ckptnr", ops) | ("dropout", p)
#             | ("noise", c, kind)


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
    return sum(1 + _count(body_of(op)) for op in ops)


def body_of(op: Op) -> tuple[Op, ...]:
    """The ops nested in ``op`` (a residual's or a checkpoint's body); () for the others."""
    return op[1] if op[0] in NESTED else ()


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
    if kind in ("scale", "split", "dropout"):
        return f"{kind}({op[1]:g})"
    if kind == "noise":
        return f"noise({op[1]:g}{'' if op[2] == 'normal' else ',' + op[2]})"
    if kind == "fn":
        return op[1]
    if kind in NESTED:
        return f"{kind}[{format_ops(op[1])}]"
    return kind


_TOKEN = re.compile(r"(\w+)\[|\]|(\w+)(?:\(([^)]*)\))?")


def parse_ops(text: str) -> tuple[Op, ...]:
    tokens = [m for m in _TOKEN.finditer(text)]
    ops, rest = _parse_tokens(tokens, 0)
    if rest != len(tokens):
        raise ValueError(f"unbalanced ']' in {text!r}")
    return ops


def _parse_tokens(tokens: list[re.Match], i: int) -> tuple[tuple[Op, ...], int]:
    ops: list[Op] = []
    while i < len(tokens) and tokens[i][0] != "]":
        opening, word, args = tokens[i][1], tokens[i][2], tokens[i][3]
        if opening in NESTED:
            body, i = _parse_tokens(tokens, i + 1)
            if i == len(tokens):
                raise ValueError(f"{opening}[ without ]")
            ops.append((opening, body))
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
        elif word in FUNCTIONS:
            ops.append(("fn", word))
        elif word == "dropout":
            ops.append(("dropout", float(args)))
        elif word == "noise":
            c, *kind = args.split(",")
            if kind and kind[0] not in NOISES[1:]:
                raise ValueError(f"unknown noise {kind[0]!r} in {tokens[i][0]!r}")
            ops.append(("noise", float(c), kind[0] if kind else "normal"))
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


class Checkpointed(nn.Module):
    """``body`` under activation checkpointing, reentrant (``CheckpointFunction``) or not."""

    def __init__(self, body: Ops, reentrant: bool):
        super().__init__()
        self.body = body
        self.reentrant = reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.reentrant)


class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: ``round(4x) / 4`` forward, the identity backward (the
    forward's own derivative is 0 everywhere: traced without it, what comes before gets no
    gradient)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class HalfGradClamp(torch.autograd.Function):
    """``clamp(-1, 1)`` forward; backward half the gradient, everywhere (the forward's
    derivative is 1 inside the range and 0 outside: a different gradient, continuous forward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class CustomFunction(nn.Module):
    """``RoundSTE`` or ``HalfGradClamp`` applied to the input."""

    def __init__(self, kind: str):
        super().__init__()
        self.function = {"ste": RoundSTE, "clampste": HalfGradClamp}[kind]

    def forward(self, x):
        return self.function.apply(x)


class Noise(nn.Module):
    """``x + c * noise`` in training, the noise drawn by ``randn_like``, ``uniform_(-1, 1)`` or
    ``exponential_``."""

    def __init__(self, c: float, kind: str):
        super().__init__()
        self.c, self.kind = c, kind

    def forward(self, x):
        if not self.training:
            return x
        if self.kind == "normal":
            noise = torch.randn_like(x)
        elif self.kind == "uniform":
            noise = torch.empty_like(x).uniform_(-1, 1)
        else:
            noise = torch.empty_like(x).exponential_()
        return x + self.c * noise


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
    if kind in ("ckpt", "ckptnr"):
        return Checkpointed(_build_ops(op[1], shape)[0], reentrant=kind == "ckpt")
    if kind == "fn":
        return CustomFunction(op[1])
    if kind == "dropout":
        return nn.Dropout(op[1])
    if kind == "noise":
        return Noise(op[1], op[2])
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
    if kind in ("ckpt", "ckptnr"):
        for o in op[1]:
            shape = shape_after(o, shape)
    return shape


def batches(spec: ModelSpec, steps: int) -> list[tuple[tuple, tuple]]:
    """``steps`` different (inputs, targets) batches, drawn from ``spec.seed``."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    target = out_shape(spec)
    return [((torch.randn(BATCH, spec.seq, spec.dim, generator=g),),
             (torch.randn(BATCH, *target, generator=g),)) for _ in range(steps)]


