"""kernels.triton: one Triton kernel per fused group (``passes.fusion``), readable source.

A group works on rows: its iteration shape ``S`` is a tensor shape, each Triton program
handles one row (every dimension of ``S`` but the last) and holds the row's ``S[-1]`` columns
in one block. A value of the group has a *width*, its last dimension: *full* (``S[-1]``, a
vector in the kernel), a *row value* (1: one scalar per row, what a reduction over the last
dimension gives and what broadcasts back over the columns), or *narrow* (fewer columns: a
slice of the row, as RoPE's ``rotate_half`` takes, held in the first columns of a vector).
Slices, ``cat`` and ``slice_backward`` over the last dimension move columns within the block
(``tl.gather``), so a row never leaves the program that holds it. Inputs are read through their
strides as the runtime hands them over (a broadcast dimension has stride 0, a transposed
operand its own strides), so the kernel makes no assumption about layouts; outputs are
written contiguous. Every value is computed in fp32 (bool and integer values in their own
dtype) and rounded to its dtype where the eager op would round it: where it is stored, and at
a cast inside the group.

The source is generated once per distinct group (ops, dtypes and shape), written under
``SHARDFX_TRITON_CACHE`` (default ``~/.cache/shardfx/triton``, since ``triton.jit`` reads a
kernel's source from its file) and imported from there. On CPU the kernels run through
Triton's interpreter (``TRITON_INTERPRET=1``, which ``import shardfx`` sets on a machine
without CUDA if triton is not imported yet): correct and slow, how the tests run them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardfx.kernels import choose_triton_mode
from shardfx.kernels.triton_ops import HELPERS, compute_dtype, expression, tl_dtype
from shardfx.ir.text import DTYPE_ABBR
from shardfx.errors import InputError

choose_triton_mode()  # before this module's kernels import triton


class _Width:
    """A kernel value with a ``width``: its last dimension, ``S[-1]`` (full), 1 (a row value)
    or fewer columns (narrow)."""

    @property
    def row(self) -> bool:
        return self.width == 1


@dataclass(frozen=True)
class KernelInput(_Width):
    name: str  # x0, x1, ...
    source: str  # the program value it reads, for comments
    dtype: torch.dtype
    shape: tuple[int, ...]  # as it arrives: broadcast to S[:-1] + [width] at run time
    width: int  # ``_Width``


@dataclass(frozen=True)
class KernelOp(_Width):
    name: str  # v0, v1, ...
    source: str  # the program op it replaces (``mul_7``), for comments
    target: Any  # the ATen overload
    args: tuple  # Refs and literals
    kwargs: dict
    dtype: torch.dtype
    width: int  # ``_Width``


@dataclass(frozen=True)
class Group:
    """What one kernel computes: ``ops`` in order over ``inputs``; ``outputs`` leave it."""

    name: str
    shape: tuple[int, ...]  # S: the iteration shape
    inputs: tuple[KernelInput, ...]
    ops: tuple[KernelOp, ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]  # (op name, the shape it leaves with)
    unfused_bytes: int = 0  # what the ops it replaces read and write, each on its own

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        return self.shape[-1]

    def op(self, name: str) -> KernelOp:
        return next(o for o in self.ops if o.name == name)

    @property
    def fused_bytes(self) -> int:
        """Bytes the kernel reads and writes: each input once, each output once."""
        read = sum(_numel(i.shape) * i.dtype.itemsize for i in self.inputs)
        return read + sum(_numel(shape) * self.op(name).dtype.itemsize
                          for name, shape in self.outputs)


def _numel(shape) -> int:
    return math.prod(shape)


# --- source -----------------------------------------------------------------------------------

def source(g: Group) -> str:
    """The kernel's Triton source: arguments commented, bytes moved counted."""
    dims = len(g.shape) - 1
    lines = ["import triton", "import triton.language as tl", "", HELPERS.strip("\n"), "", "",
             "@triton.jit", f"def {g.name}("]
    for i in g.inputs:
        kind = "row value" if i.row else "full" if i.width == g.cols else \
            f"narrow: {i.width} columns"
        lines.append(f"    {i.name}_ptr,  # in: {i.source} {_type(i.dtype, i.shape)} ({kind})")
        lines.append(f"    {', '.join(f'{i.name}_s{d}' for d in range(len(g.shape)))},"
                     f"  # its strides over {[*g.shape[:-1], i.width]} (0: broadcast)")
    for k, (name, shape) in enumerate(g.outputs):
        op = g.op(name)
        lines.append(f"    out{k}_ptr,  # out: {op.source} {_type(op.dtype, shape)}, contiguous")
    lines += [f"    n_cols,  # {g.cols}: the last dimension",
              f"    BLOCK: tl.constexpr,  # {_block(g.cols)}: a row, padded to a power of two",
              "):",
              f"    # one program per row of {list(g.shape)}: {g.rows} programs",
              f"    # bytes moved: {g.fused_bytes} (the {len(g.ops)} ops unfused: "
              f"{g.unfused_bytes})",
              "    row = tl.program_id(0)",
              "    cols = tl.arange(0, BLOCK)",
              "    mask = cols < n_cols"]
    # the row's coordinates in every dimension but the last
    rest = "row"
    for d in reversed(range(dims)):
        if d == 0:
            lines.append(f"    r0 = {rest}")
        else:
            lines.append(f"    r{d} = {rest} % {g.shape[d]}")
            lines.append(f"    q{d} = {rest} // {g.shape[d]}")
            rest = f"q{d}"
    for i in g.inputs:
        offset = " + ".join([f"r{d} * {i.name}_s{d}" for d in range(dims)] or ["0"])
        cast = f".to({compute_dtype(i.dtype)})"
        if i.row:
            lines.append(f"    {i.name} = tl.load({i.name}_ptr + {offset}){cast}")
        else:
            other = "0" if not i.dtype.is_floating_point else "0.0"
            lines.append(f"    {i.name} = tl.load({i.name}_ptr + {offset} + cols * "
                         f"{i.name}_s{dims}, mask={_mask(i.width, g)}, other={other}){cast}")
    for op in g.ops:
        expr = expression(op, g)
        lines.append(f"    {op.name} = {expr}  # {op.source}: {_target(op.target)}")
    for k, (name, _) in enumerate(g.outputs):
        op = g.op(name)
        value = f"{name}.to({tl_dtype(op.dtype)})"
        if op.row:
            lines.append(f"    tl.store(out{k}_ptr + row, {value})")
        elif op.width == g.cols:
            lines.append(f"    tl.store(out{k}_ptr + row * n_cols + cols, {value}, mask=mask)")
        else:
            lines.append(f"    tl.store(out{k}_ptr + row * {op.width} + cols, {value}, "
                         f"mask={_mask(op.width, g)})")
    return "\n".join(lines) + "\n"


def _mask(width: int, g: Group) -> str:
    return "mask" if width == g.cols else f"cols < {width}"


def _type(dtype: torch.dtype, shape) -> str:
    return f"{DTYPE_ABBR.get(dtype, str(dtype))}[{', '.join(map(str, shape))}]"


def _target(target) -> str:
    return str(target).removeprefix("aten.")


def _block(cols: int) -> int:
    return 1 << max(0, (cols - 1).bit_length())


# --- running ----------------------------------------------------------------------------------

_LOADED: dict[str, Any] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDFX_TRITON_CACHE",
                               Path.home() / ".cache" / "shardfx" / "triton"))


def compile_source(name: str, text: str):
    """The ``triton.jit`` function ``name`` from ``text``, loaded once per distinct source."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if digest in _LOADED:
        return _LOADED[digest]
    path = cache_dir() / f"{name}_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(f"shardfx_triton_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED[digest] = getattr(module, name)
    return _LOADED[digest]


@dataclass(eq=False)
class FusedKernel:
    """The program's call to one fused group: ``kernel(*inputs) -> tuple of outputs``."""

    group: Group
    _fn: Any = field(default=None, repr=False)

    @property
    def __name__(self) -> str:  # how the program's code names it
        return self.group.name

    @property
    def source(self) -> str:
        return source(self.group)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = self.group
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)),
                      torch.device("cpu"))
        if self._fn is None:
            if device.type == "cpu":
                _check_interpreter()
            self._fn = compile_source(g.name, self.source)
        args: list = []
        for x, i in zip(inputs, g.inputs):  # with its strides over S (0 where it broadcasts)
            args += [x, *x.expand(*g.shape[:-1], i.width).stride()]
        outs = []
        for name, shape in g.outputs:
            op = g.op(name)
            outs.append(torch.empty((*g.shape[:-1], op.width), dtype=op.dtype, device=device))
        args += outs
        if g.rows:
            self._fn[(g.rows,)](*args, g.cols, BLOCK=_block(g.cols))
        return tuple(o.view(shape) for o, (_, shape) in zip(outs, g.outputs))


def _check_interpreter() -> None:
    """On CPU a kernel runs only in Triton's interpreter, chosen before triton was imported."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.sum, InterpretedFunction):
        raise InputError(
            "Triton kernels on CPU need Triton's interpreter, and triton was imported without "
            "it", where="partition(..., kernels='triton') on a CPU",
            fix="set TRITON_INTERPRET=1 in the environment before starting Python (or import "
                "shardfx before anything imports triton), or plan with kernels='aten'")
