"""The ATen ops a fused kernel computes, each as a Triton expression (``kernels.triton``).

One entry per op: a function from the op's arguments (kernel value names, or Python literals)
to an expression over a row. Pointwise ops map element by element; reductions over the last
dimension (``sum``, ``mean``, ``amax``) and the row ops (softmax, log-softmax and their
backward) use the helpers of ``HELPERS``, which mask the padding columns out. The column ops
(``slice``, ``cat`` and ``slice_backward`` over the last dimension: RoPE's ``rotate_half`` and
its gradient) move columns within the row with ``_shift``. ``fusible``
says whether a node's arguments are ones the table covers (a ``pow`` by 2, not by a tensor).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch

aten = torch.ops.aten

HELPERS = '''
@triton.jit
def _row_sum(x, mask):
    return tl.sum(tl.where(mask, x, 0.0), axis=0)


@triton.jit
def _row_max(x, mask):
    return tl.max(tl.where(mask, x, float("-inf")), axis=0)


@triton.jit
def _softmax(x, mask):
    e = tl.exp(x - _row_max(x, mask))
    return e / _row_sum(e, mask)


@triton.jit
def _log_softmax(x, mask):
    shifted = x - _row_max(x, mask)
    return shifted - tl.log(_row_sum(tl.exp(shifted), mask))


@triton.jit
def _shift(x, by, BLOCK: tl.constexpr):
    # column c of the result is column c + by of x (clamped to the block: callers mask)
    at = tl.minimum(tl.maximum(tl.arange(0, BLOCK) + by, 0), BLOCK - 1)
    return tl.gather(x, at, 0)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
'''


def _lit(x: Any) -> str:
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, float):
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        return repr(x)
    return str(x)


def _arg(x: Any) -> str:
    return x.name if isinstance(x, Ref) else _lit(x)


def _alpha(kwargs: dict) -> str:
    alpha = kwargs.get("alpha", 1)
    return "" if alpha == 1 else f" * {_lit(alpha)}"


def _pow(x: str, e: Any) -> str:
    return {2: f"({x} * {x})", 3: f"({x} * {x} * {x})", 1: x, 0.5: f"tl.sqrt({x})",
            -0.5: f"tl.math.rsqrt({x})", -1: f"(1.0 / {x})"}[e]


_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327

# op -> (args, kwargs) -> expression
POINTWISE: dict[Any, Callable[..., str]] = {
    aten.add.Tensor: lambda a, b, **k: f"({a} + {b}{_alpha(k)})",
    aten.sub.Tensor: lambda a, b, **k: f"({a} - {b}{_alpha(k)})",
    aten.mul.Tensor: lambda a, b: f"({a} * {b})",
    aten.mul.Scalar: lambda a, b: f"({a} * {b})",
    aten.div.Tensor: lambda a, b: f"({a} / {b})",
    aten.div.Scalar: lambda a, b: f"({a} / {b})",
    aten.neg.default: lambda a: f"(-{a})",
    aten.reciprocal.default: lambda a: f"(1.0 / {a})",
    aten.relu.default: lambda a: f"tl.maximum({a}, 0.0)",
    aten.silu.default: lambda a: f"({a} * tl.sigmoid({a}))",
    aten.silu_backward.default: lambda g, x: (
        f"({g} * tl.sigmoid({x}) * (1.0 + {x} * (1.0 - tl.sigmoid({x}))))"),
    aten.sigmoid_backward.default: lambda g, y: f"({g} * {y} * (1.0 - {y}))",
    aten.tanh_backward.default: lambda g, y: f"({g} * (1.0 - {y} * {y}))",
    aten.gelu.default: lambda a, **k: f"(0.5 * {a} * (1.0 + tl.math.erf({a} * {_SQRT1_2})))",
    aten.gelu_backward.default: lambda g, x, **k: (
        f"({g} * (0.5 * (1.0 + tl.math.erf({x} * {_SQRT1_2})) + {x} * {_INV_SQRT_2PI} * "
        f"tl.exp(-0.5 * {x} * {x})))"),
    aten.threshold_backward.default: lambda g, x, t: f"tl.where({x} <= {t}, 0.0, {g})",
    aten.pow.Tensor_Scalar: _pow,
    aten.where.self: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.maximum.default: lambda a, b: f"tl.maximum({a}, {b})",
    aten.minimum.default: lambda a, b: f"tl.minimum({a}, {b})",
    aten.clone.default: lambda a, **k: a,
    aten.alias.default: lambda a: a,
}

_CALLS = {aten.exp.default: "tl.exp", aten.log.default: "tl.log", aten.sqrt.default: "tl.sqrt",
          aten.rsqrt.default: "tl.math.rsqrt", aten.abs.default: "tl.abs",
          aten.sigmoid.default: "tl.sigmoid", aten.tanh.default: "_tanh",
          aten.erf.default: "tl.math.erf"}
POINTWISE.update({op: (lambda a, fn=fn: f"{fn}({a})") for op, fn in _CALLS.items()})

for _op, _sign in {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "eq": "==", "ne": "!="}.items():
    for _overload in ("Tensor", "Scalar"):  # a comparison with a tensor or a number
        POINTWISE[getattr(getattr(aten, _op), _overload)] = \
            lambda a, b, sign=_sign: f"({a} {sign} {b})"

# reductions over the last dimension, keepdim: op -> (x, ...) -> expression
REDUCTIONS: dict[Any, Callable[..., str]] = {
    aten.sum.dim_IntList: lambda x, *_, **k: f"_row_sum({x}, mask)",
    aten.mean.dim: lambda x, *_, **k: f"(_row_sum({x}, mask) / n_cols)",
    aten.amax.default: lambda x, *_: f"_row_max({x}, mask)",
}

# whole-row ops over the last dimension: the result is full
ROW_OPS: dict[Any, Callable[..., str]] = {
    aten._softmax.default: lambda x, dim, half: f"_softmax({x}, mask)",
    aten._softmax_backward_data.default: lambda g, y, dim, dtype: (
        f"({y} * ({g} - _row_sum({g} * {y}, mask)))"),
    aten._log_softmax.default: lambda x, dim, half: f"_log_softmax({x}, mask)",
    aten._log_softmax_backward_data.default: lambda g, y, dim, dtype: (
        f"({g} - tl.exp({y}) * _row_sum({g}, mask))"),
}


# column ops over the last dimension: op -> (op, group) -> expression (``_columns``)
COLUMN_OPS = frozenset({aten.slice.Tensor, aten.cat.default, aten.slice_backward.default})


def columns(node) -> tuple | None:
    """A column op's columns over its operands' last dimension, or None if it is not one
    ``_shift`` can do (another dimension, a step, a single column): ``slice`` ->
    ``(start, end)``; ``cat`` -> each part's width; ``slice_backward`` -> ``(start, end,
    width)``."""
    t, a = node.target, node.args
    if t not in COLUMN_OPS:
        return None
    if t is aten.cat.default:
        parts = a[0]
        dim = a[1] if len(a) > 1 else node.kwargs.get("dim", 0)
        widths = tuple(p.meta["val"].shape[-1] if p.meta["val"].dim() else 0 for p in parts)
        ok = _is_last(dim, node.meta["val"].dim()) and min(widths, default=0) > 1
        return widths if ok else None
    if t is aten.slice.Tensor:
        x, dim, start, end, step = (*a, *(0, None, None, 1)[len(a) - 1:])
        width = x.meta["val"].shape[-1] if x.meta["val"].dim() else 0
    else:
        _, sizes, dim, start, end, step = a
        width = sizes[-1] if sizes else 0
    start, end, _ = slice(start, end).indices(width)
    if step != 1 or not _is_last(dim, node.meta["val"].dim()) or end - start < 2 or \
            node.kwargs:
        return None
    return (start, end) if t is aten.slice.Tensor else (start, end, width)


def _is_last(dim: int, rank: int) -> bool:
    return rank > 0 and dim in (-1, rank - 1)


def _columns(op, args: list[str]) -> str:
    spec = op.args[-1]  # the ``columns`` spec the fusion pass put in place of the arguments
    if op.target is aten.slice.Tensor:
        start, _ = spec
        return args[0] if start == 0 else f"_shift({args[0]}, {start}, BLOCK)"
    if op.target is aten.slice_backward.default:
        start, end, _ = spec
        moved = args[0] if start == 0 else f"_shift({args[0]}, {-start}, BLOCK)"
        inside = f"cols < {end}" if start == 0 else f"(cols >= {start}) & (cols < {end})"
        return f"tl.where({inside}, {moved}, 0.0)"
    parts, expr, at = args[:-1], "", 0  # cat: each part where its columns are
    for k, (part, width) in enumerate(zip(parts, spec)):
        moved = part if at == 0 else f"_shift({part}, {-at}, BLOCK)"
        at += width
        expr += moved if k == len(parts) - 1 else f"tl.where(cols < {at}, {moved}, "
    return expr + ")" * (len(parts) - 1)


def fusible(node) -> bool:
    """Whether the table computes ``node`` (its op, and arguments it covers)."""
    t = node.target
    if t is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype", "layout", "device"} and \
            node.meta["val"].device == node.args[0].meta["val"].device
    if t is aten.pow.Tensor_Scalar:
        return node.args[1] in (2, 3, 1, 0.5, -0.5, -1)
    if t in (aten.gelu.default, aten.gelu_backward.default):
        return node.kwargs.get("approximate", "none") == "none"
    if t in (aten.clone.default,):
        return set(node.kwargs) <= {"memory_format"}
    if t in REDUCTIONS or t in ROW_OPS:
        return _last_dim(node)
    if t in COLUMN_OPS:
        return columns(node) is not None
    if t in (aten.add.Tensor, aten.sub.Tensor):
        return set(node.kwargs) <= {"alpha"}
    return t in POINTWISE and not node.kwargs


def _last_dim(node) -> bool:
    """A reduction or row op over the last dimension (a reduction keeping it, as 1)."""
    last = (-1, node.args[0].meta["val"].dim() - 1)
    t = node.target
    if t in (aten._softmax.default, aten._log_softmax.default):
        _, dim, half_to_float = node.args
        return dim in last and not half_to_float
    if t in ROW_OPS:  # the backward ones: (grad, output, dim, input_dtype)
        return node.args[2] in last
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dims is not None and len(dims) == 1 and dims[0] in last and keep


def expression(op, group) -> str:
    """``op`` (a ``KernelOp``) as a Triton expression over the kernel's names."""
    args = [_arg(a) for a in op.args]
    kwargs = {k: v for k, v in op.kwargs.items()}
    if op.target is aten._to_copy.default:  # rounded to its dtype, computed on in fp32
        return f"{args[0]}.to({tl_dtype(op.dtype)}).to({compute_dtype(op.dtype)})"
    if op.target in REDUCTIONS:
        return REDUCTIONS[op.target](*args)
    if op.target in ROW_OPS:
        return ROW_OPS[op.target](*args)
    if op.target in COLUMN_OPS:
        return _columns(op, args)
    if op.target is aten.pow.Tensor_Scalar:
        return _pow(args[0], op.args[1])
    if op.target is operator.getitem:
        raise ValueError("getitem is not fused")
    return POINTWISE[op.target](*args, **kwargs)


@dataclass(frozen=True)
class Ref:
    """A value of the group, by its kernel name (``x0`` an input, ``v3`` an op's result)."""

    name: str


_TL = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
       torch.bool: "tl.int1", torch.int8: "tl.int8", torch.uint8: "tl.uint8"}


def tl_dtype(dtype: torch.dtype) -> str:
    return _TL[dtype]


def compute_dtype(dtype: torch.dtype) -> str:
    """What a value is computed in: fp32 for floats (fp64 stays), else its own dtype."""
    return "tl.float64" if dtype == torch.float64 else \
        "tl.float32" if dtype.is_floating_point else _TL[dtype]
