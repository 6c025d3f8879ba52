"""Random small models, described as plain data, checked through every mesh against one device.

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

``generate(pick)`` draws a spec from any source of choices: ``random_spec(seed)`` for numbered
models (benchmarks, reproducible by number), ``model_specs()`` for hypothesis, which shrinks a
failing spec towards fewer and simpler ops. ``check(spec, mesh)`` trains a model eagerly and
through shardfx (``shardfx.testing.compare_training``) and classifies the outcome; ``run``
checks many specs on one mesh with one ``shardfx.launch`` for all of them (a launch costs
seconds), launching again after a failure. ``bench/fuzz.py`` runs many and reduces failures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

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
            shape = _shape_after(op, shape)
    return shape


def _build_ops(ops: Sequence[Op], shape: tuple[int, ...]) -> tuple[Ops, tuple[int, ...]]:
    modules = []
    for op in ops:
        modules.append(_build_op(op, shape))
        shape = _shape_after(op, shape)
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


def _shape_after(op: Op, shape: tuple[int, ...]) -> tuple[int, ...]:
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
            inner = _shape_after(o, inner)
        if inner != shape:
            raise ValueError(f"residual body maps {shape} to {inner}")
    return shape


def batches(spec: ModelSpec, steps: int) -> list[tuple[tuple, tuple]]:
    """``steps`` different (inputs, targets) batches, drawn from ``spec.seed``."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    target = out_shape(spec)
    return [((torch.randn(BATCH, spec.seq, spec.dim, generator=g),),
             (torch.randn(BATCH, *target, generator=g),)) for _ in range(steps)]


# --- drawing a spec ---------------------------------------------------------------------------


class RandomPicker:
    """Choices from ``random.Random(seed)``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def choice(self, options: Sequence):
        return self.rng.choice(list(options))

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p


class DrawPicker:
    """Choices drawn by hypothesis; each shrinks towards the first option, the lower bound and
    False, so a failing spec shrinks towards fewer and simpler ops."""

    def __init__(self, draw):
        self.draw = draw

    def choice(self, options: Sequence):
        from hypothesis import strategies as st

        return self.draw(st.sampled_from(list(options)))

    def integer(self, lo: int, hi: int) -> int:
        from hypothesis import strategies as st

        return self.draw(st.integers(lo, hi))

    def chance(self, p: float) -> bool:
        from hypothesis import strategies as st

        return self.draw(st.integers(0, 99)) >= round(100 * (1 - p))


def generate(pick, blocks: tuple[int, int] = (2, 3), ops: tuple[int, int] = (1, 4)) -> ModelSpec:
    """A random spec: ``blocks`` blocks (at least 2: a pipeline of 2 stages needs a cut) of
    ``ops`` ops each, and placements for some of its parameters."""
    seq, dim = pick.choice(SEQS), pick.choice(DIMS)
    seed = pick.integer(0, 999)
    shape, drawn = (seq, dim), []
    for _ in range(pick.integer(*blocks)):
        block = []
        for _ in range(pick.integer(*ops)):
            op = _random_op(pick, shape)
            shape = _shape_after(op, shape)
            block.append(op)
        drawn.append(tuple(block))
    if not any(_count_linears(b) for b in drawn):  # something to train
        drawn[-1] += (_random_linear(pick, pick.choice(DIMS)),)
    spec = ModelSpec(seq, dim, seed, tuple(drawn))
    return dataclasses.replace(spec, shard=_random_shard(pick, spec))


def _count_linears(ops: Sequence[Op]) -> int:
    return sum(_count_linears(op[1]) if op[0] == "res" else op[0] == "linear" for op in ops)


def random_spec(seed: int) -> ModelSpec:
    """Model number ``seed``: the same spec on every machine and Python version."""
    return generate(RandomPicker(seed))


def model_specs():
    """A hypothesis strategy of specs."""
    from hypothesis import strategies as st

    return st.composite(lambda draw: generate(DrawPicker(draw)))()


def _random_op(pick, shape: tuple[int, ...]) -> Op:
    d = shape[-1]
    splits = [a for a in (2, 4, 6) if d % a == 0 and (d // a) % 2 == 0 and d // a >= 2]
    kinds = ["act", "linear", "norm", "scale", "softmax", "transpose", "res", "linear",
             "transpose"]
    kinds += ["split"] * bool(len(shape) == 2 and splits) + ["merge"] * (len(shape) == 3)
    kind = pick.choice(kinds)
    if kind == "linear":
        return _random_linear(pick, pick.choice((d, *DIMS)))
    if kind == "split":
        return ("split", pick.choice(splits))
    if kind == "res":
        return ("res", _random_body(pick, shape))
    return _random_simple(pick, kind)


def _random_simple(pick, kind: str) -> Op:
    if kind == "act":
        return ("act", pick.choice(ACTIVATIONS))
    if kind == "norm":
        return ("norm", pick.choice(NORMS), not pick.chance(0.25))
    if kind == "scale":
        return ("scale", pick.choice(SCALES))
    return (kind,)


def _random_linear(pick, out: int, names: Sequence[str] = LINEAR_NAMES) -> Op:
    return ("linear", pick.choice(names), out, pick.chance(0.5))


def _random_body(pick, shape: tuple[int, ...]) -> tuple[Op, ...]:
    """1-3 units that keep ``shape``: pointwise ops, norms, a Linear back to the same width, an
    MLP (up, activation, down), or a Linear over the other axis (transpose, Linear, transpose)."""
    body: list[Op] = []
    for _ in range(pick.integer(1, 3)):
        unit = pick.choice(["act", "linear", "norm", "mlp", "scale", "softmax", "other-axis"])
        if unit == "linear":
            body.append(_random_linear(pick, shape[-1]))
        elif unit == "mlp":
            up, down = pick.choice([("up_proj", "down_proj"), ("fc1", "fc2"),
                                    ("linear", "linear"), ("q_proj", "o_proj")])
            body += [_random_linear(pick, pick.choice(DIMS), [up]),
                     ("act", pick.choice(ACTIVATIONS)), _random_linear(pick, shape[-1], [down])]
        elif unit == "other-axis":
            body += [("transpose",), _random_linear(pick, shape[-2]), ("transpose",)]
        else:
            body.append(_random_simple(pick, unit))
    return tuple(body)


def _random_shard(pick, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """A placement on the tp axis for some parameters (every dim is even: all divide by 2)."""
    with torch.device("meta"):
        params = list(build(spec).named_parameters())
    out = []
    for name, p in params:
        if pick.chance(0.5):
            out.append((name, pick.choice(PLACEMENTS[:1 + p.dim()])))
    return tuple(out)


# --- meshes and checking one model ------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """A mesh to check models on: ``partition`` keyword arguments and the processes it needs."""

    mesh: dict
    shard: str = "auto"  # "globs": the spec's own placements
    microbatches: int = 1

    @property
    def nprocs(self) -> int:
        n = 1
        for size in self.mesh.values():
            n *= size
        return n

    def partition_kwargs(self, spec: ModelSpec) -> dict[str, Any]:
        shard: Any = self.shard
        if shard == "globs":
            shard = _globs(spec, list(self.mesh))
        return dict(mesh=self.mesh, shard=shard, microbatches=self.microbatches)


MESHES = {
    "one": Mesh({}),
    "dp2": Mesh({"dp": 2}),
    "tp2": Mesh({"tp": 2}, "megatron"),
    "tp2-globs": Mesh({"tp": 2}, "globs"),
    "pp2": Mesh({"pp": 2}, microbatches=2),
    # four processes: slower, benchmarks only
    "dp2-tp2": Mesh({"dp": 2, "tp": 2}, "megatron"),
    "pp2-tp2": Mesh({"pp": 2, "tp": 2}, "megatron", microbatches=2),
    "dp2-pp2": Mesh({"dp": 2, "pp": 2}, microbatches=2),
}


def _globs(spec: ModelSpec, axes: list[str]) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for name, p in spec.shard:
        placement = Replicate() if p == "R" else Shard(int(p[1:]))
        out[name] = [placement if a == "tp" else Replicate() for a in axes]
    return out


@dataclass(frozen=True)
class Result:
    """How one model fared on one mesh.

    kind: "pass" | "mismatch" (numbers differ from eager) | "plan" (``partition`` raised) |
    "run" (a training step raised) | "hang" (no answer in time) | "crash" (a rank died) |
    "invalid" (the spec itself does not build or train eagerly: a generator bug).
    """

    spec: str
    mesh: str
    kind: str
    error: str = ""  # exception type ("AssertionError", "RuntimeError", ...)
    message: str = ""  # first lines of the message
    where: str = ""  # the innermost frames, "file:line func" (shardfx's own, when it has any)
    worst: float = 0.0  # passes: the largest error over its bound (see ``_worst``)
    rank: int = 0

    @property
    def ok(self) -> bool:
        return self.kind == "pass"

    def key(self) -> str:
        """What makes two failures the same bug: kind, exception type and the message's start
        without numbers and node names."""
        head = re.sub(r"\d+|'[^']*'|\[[^\]]*\]", "#", self.message.splitlines()[0] if
                      self.message else "")[:60]
        return f"{self.kind} {self.error} {head}".strip()

    def __str__(self) -> str:
        if self.ok:
            return f"{self.mesh}: pass ({self.worst:.1e})  {self.spec}"
        lines = [f"{self.mesh}: {self.kind} {self.error}  {self.spec}",
                 *self.message.splitlines(), *[f"at {self.where}"] * bool(self.where)]
        return "\n    ".join(lines)


def check(spec: ModelSpec, mesh: str, steps: int = 3) -> Result:
    """Train ``spec``'s model for ``steps`` AdamW steps eagerly and through shardfx on ``mesh``
    (this process must be one of the mesh's ranks) and say how it went."""
    from shardfx.testing import adamw, compare_training

    try:  # the model must train eagerly
        model, data = build(spec), batches(spec, steps)
        F.mse_loss(model(*data[0][0]), *data[0][1]).backward()
        adamw(list(model.parameters()))
        model.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        return _failure(spec, mesh, "invalid", e)
    try:
        report = compare_training(model, data, F.mse_loss, **MESHES[mesh].partition_kwargs(spec))
    except Exception as e:  # noqa: BLE001 - every way of failing is a result here
        return _failure(spec, mesh, _stage_of(e), e)
    return Result(str(spec), mesh, "pass", worst=_worst(report), rank=_rank())


def _worst(report) -> float:
    """The largest error over its bound (below 1: within it) of a ``compare_training``
    report."""
    checks = getattr(report, "checks", None)
    if checks is None:  # a report without per-tensor bounds: its own summary
        return report.max()
    return max((c.shardfx / c.bound for c in checks), default=0.0)


def _stage_of(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, AssertionError) and frames and frames[-1].filename.endswith(
            os.path.join("shardfx", "testing.py")):
        return "mismatch"
    planning = any(f.name == "partition" and f.filename.endswith(os.path.join("shardfx", "api.py"))
                   for f in frames)
    return "plan" if planning else "run"


def _failure(spec: ModelSpec, mesh: str, kind: str, e: BaseException) -> Result:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if os.sep + "shardfx" + os.sep in f.filename] or frames
    where = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
    message = "\n".join(str(e).splitlines()[:12])[:2000]
    return Result(str(spec), mesh, kind, type(e).__name__, message, where, rank=_rank())


def _short(path: str) -> str:
    parts = Path(path).parts
    for root in ("shardfx", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return Path(path).name


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# --- checking many models on one mesh ---------------------------------------------------------


def run(specs: Sequence[ModelSpec], mesh: str, steps: int = 3, *, model_s: float = 120.0,
        stop: Callable[[Result], bool] | None = None,
        log: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """``check`` each spec on ``mesh``, in order; returns their results.

    One device runs here. A mesh of N devices runs every spec in one ``shardfx.launch`` of N
    ranks; after a model fails the ranks stop (a failed step can leave messages in flight that
    a later model would receive) and the rest run in a new launch. A model that takes longer
    than ``model_s`` seconds is a "hang". With ``stop``, the first result it accepts ends the
    run. ``log`` sees each result as it comes.
    """
    results: list[Result] = []
    todo = list(specs)
    while todo:
        if MESHES[mesh].nprocs == 1:
            got = [check(todo[0], mesh, steps)]
        else:
            got = _launch(todo, mesh, steps, model_s)
        for result in got:
            log(result)
        results += got
        todo = todo[len(got):]
        if stop and any(stop(r) for r in got):
            break
    return results


def _launch(specs: list[ModelSpec], mesh: str, steps: int, model_s: float) -> list[Result]:
    """Results of the specs one launch got through: up to and including the first failure."""
    import shardfx

    n = MESHES[mesh].nprocs
    with tempfile.TemporaryDirectory(prefix="shardfx-fuzz-") as out:
        error = None
        try:
            shardfx.launch(_rank_main, [str(s) for s in specs], mesh, steps, out, model_s,
                           nprocs=n, timeout=model_s, deadline=30 + model_s * len(specs))
        except shardfx.LaunchError as e:
            error = e
        records = [_read(Path(out, f"rank{r}.jsonl")) for r in range(n)]
    results = []
    for i, spec in enumerate(specs):
        mine = [rec[i] for rec in records if i in rec]
        if not mine:
            cause = str(error).splitlines()[0] if error else "no rank answered"
            results.append(Result(str(spec), mesh, "crash", "LaunchError", cause))
            break
        result = _primary(mine)
        if result.ok and len(mine) < n:  # a rank passed, another never answered
            cause = str(error).splitlines()[0] if error else "a rank did not answer"
            result = Result(str(spec), mesh, "crash", "LaunchError", cause)
        results.append(result)
        if not result.ok:
            break
    return results


def _read(path: Path) -> dict[int, Result]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row.pop("index"): Result(**row) for row in rows}


# Errors a rank gets because another rank failed first.
_SECONDARY = re.compile(r"Connection (reset|closed)|timed? ?out|Broken pipe|peer", re.I)


def _primary(results: list[Result]) -> Result:
    """The result that explains the ranks' outcomes: a failure rather than a pass, a rank's own
    failure rather than the one it met waiting for that rank."""
    failed = [r for r in results if not r.ok]
    own = [r for r in failed if r.kind != "hang" and not _SECONDARY.search(r.message)]
    return (own or failed or results)[0]


def _rank_main(specs: list[str], mesh: str, steps: int, out: str, model_s: float) -> None:
    """On every rank: check each spec, writing each result as it comes. A rank whose model
    fails raises, so the launcher stops the others at once (instead of them waiting out a
    collective's timeout); one running a model past ``model_s`` writes a hang and exits."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # tiny models: the ranks share the machine's cores
    path = Path(out, f"rank{dist.get_rank()}.jsonl")
    for i, text in enumerate(specs):
        spec = ModelSpec.parse(text)
        watchdog = threading.Timer(model_s, _hung, (path, i, spec, mesh, model_s))
        watchdog.daemon = True
        watchdog.start()
        result = check(spec, mesh, steps)
        watchdog.cancel()
        _write(path, i, result)
        if not result.ok:
            raise _Failed(f"model {i} failed on rank {dist.get_rank()}: {result.kind}")
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, result.ok)  # in step: no rank starts the next model early


class _Failed(Exception):
    """Ends a rank after a failed model (the result is in its file)."""


def _write(path: Path, index: int, result: Result) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"index": index, **dataclasses.asdict(result)}) + "\n")


def _hung(path: Path, index: int, spec: ModelSpec, mesh: str, model_s: float) -> None:
    _write(path, index, Result(str(spec), mesh, "hang", message=f"no result after {model_s:g} s",
                               rank=_rank()))
    os._exit(3)
