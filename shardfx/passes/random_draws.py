"""shardfx's random stream: every random value a pure function of where it is.

A value drawn by random op number ``op`` (in program order) at the element of linear index
``i`` of the one-device tensor is a function of ``(seed, step, op, i)`` -- a counter-based
generator, as Philox is -- so the same model draws the same values on one device and on any
mesh (``passes.rng`` rewrites the program's random ops into these formulas). The functions
here take ``f(target, *args, **kwargs)``, which applies an ATen op: ``call`` computes it
eagerly, the pass's emitter builds it into the graph. The same code both ways, so tests and
``shardfx.testing`` compute in eager exactly what the program computes (``on_stream``).

The hash: murmur3's 32-bit finalizer (``fmix32``: xor-shift, multiply, full avalanche), keyed
per op and step, two rounds with a key word in each. Philox4x32-10 needs the high half of
32x32-bit products, which overflow int64 (C++ signed overflow: undefined) or take several
times the ops in exact 16-bit limbs; every product here is exact in int64 (``_mul32``), so the
values are the same on every backend and machine. Two keyed rounds of a bijective mixer are
plenty for Bernoulli masks and float draws; the two key words come from four more rounds over
(seed, step, op, lane). A lane is a second independent stream of the same op (the normal
distribution takes two uniforms per element).

What each op draws, from ``h`` in [0, 2**32) per element:
- dropout with drop probability p, and ``bernoulli(q)``: kept where ``h >= round((1-q) 2**32)``
  (so CPU eager's dropout, ``bernoulli_(1 - p)``, draws dropout's mask);
- ``rand``/``rand_like``/``uniform(a, b)``: ``u = (h >> 8) 2**-24`` in [0, 1), exact in fp32;
  ``a + (b - a) u``;
- ``exponential(lambd)``: ``-log1p(-u) / lambd``;
- ``randn``/``randn_like``/``normal(mean, std)``: Box-Muller over two lanes.
Floats are computed in fp32 and cast to the op's dtype, so an fp64 or bf16 run draws the same
values as fp32 to that dtype's rounding.
"""

from __future__ import annotations

import math
import traceback
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / phi: spreads small op numbers over the key space
LANE = 0x85EBCA77  # mixes a lane number into the key (lane 0: the op's first stream)

# The random ops on the stream, by overload packet: what each draws (see the docstring).
ON_STREAM = {aten.native_dropout, aten.bernoulli, aten.bernoulli_, aten.rand, aten.rand_like,
             aten.uniform, aten.uniform_, aten.exponential, aten.exponential_, aten.randn,
             aten.randn_like, aten.normal_functional, aten.normal_}
_SELF_SHAPED = {aten.bernoulli, aten.bernoulli_, aten.rand_like, aten.uniform, aten.uniform_,
                aten.exponential, aten.exponential_, aten.randn_like, aten.normal_functional,
                aten.normal_}


def is_random(target: Any) -> bool:
    """Whether an op draws from a random generator (ATen's ``nondeterministic_seeded`` tag)."""
    return isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


def draws(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of a random op draws anything (dropout with p in (0, 1), in training);
    one that does not takes no op number."""
    arg = _Args(target, args, kwargs)
    if target.overloadpacket is aten.native_dropout:
        return bool(arg.get("train", False)) and 0 < float(arg.get("p", 0)) < 1
    if "dropout_p" in arg.names:  # attention kernels: random only with dropout
        return float(arg.get("dropout_p", 0.0)) > 0
    return True


def on_stream(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.overloadpacket in ON_STREAM and \
        target not in (aten.bernoulli.Tensor, aten.bernoulli_.Tensor)  # per-element p: not yet


def shape_of(target, args: tuple, value) -> tuple[int, ...]:
    """The shape a random op draws over: its first argument's (a tensor, or a size list)."""
    first = args[0]
    return tuple(first) if isinstance(first, (list, tuple)) else tuple(value(first).shape)


def sample(f: Callable, target, args: tuple, kwargs: dict, rng, op: int, shape: tuple[int, ...],
           dtype: torch.dtype, device=None):
    """The value of random op ``target(*args, **kwargs)`` number ``op`` on the stream, over a
    tensor of ``shape``, as ``dtype``. ``args`` hold what ``f`` takes (graph nodes or tensors).
    Dropout: the (output, mask) pair ``native_dropout`` returns."""
    packet = target.overloadpacket
    arg = _Args(target, args, kwargs)
    if packet is aten.native_dropout:
        p = float(arg.get("p", 1))
        mask = keep_mask(f, rng, shape, p, op, device)
        return f(aten.mul.Tensor, f(aten.mul.Tensor, args[0], mask), 1.0 / (1.0 - p)), mask
    if packet in (aten.bernoulli, aten.bernoulli_):
        q = float(arg.get("p", 0.5)) if target in (aten.bernoulli.p, aten.bernoulli_.float) \
            else None
        if q is None:  # bernoulli(probabilities): kept where u >= 1 - q, per element
            u = uniform(f, rng, shape, op, device=device)
            keep = f(aten.ge.Tensor, u, f(aten.rsub.Scalar, _fp32(f, args[0]), 1.0))
        else:
            keep = keep_mask(f, rng, shape, 1.0 - q, op, device)
        return _as(f, keep, dtype)
    if packet in (aten.randn, aten.randn_like, aten.normal_functional, aten.normal_):
        mean, std = float(arg.get("mean", 0.0)), float(arg.get("std", 1.0))
        u1 = uniform(f, rng, shape, op, 0, device)
        u2 = uniform(f, rng, shape, op, 1, device)
        radius = f(aten.sqrt.default, f(aten.mul.Tensor, f(aten.log1p.default,
                                                           f(aten.neg.default, u1)), -2.0))
        z = f(aten.mul.Tensor, radius, f(aten.cos.default, f(aten.mul.Tensor, u2, 2 * math.pi)))
        return _as(f, f(aten.add.Tensor, f(aten.mul.Tensor, z, std), mean), dtype)
    u = uniform(f, rng, shape, op, 0, device)
    if packet in (aten.exponential, aten.exponential_):
        lambd = float(arg.get("lambd", 1.0))
        e = f(aten.div.Tensor, f(aten.neg.default, f(aten.log1p.default, f(aten.neg.default, u))),
              lambd)
        return _as(f, e, dtype)
    if packet in (aten.uniform, aten.uniform_):
        low, high = float(arg.get("from", 0.0)), float(arg.get("to", 1.0))
        return _as(f, f(aten.add.Tensor, f(aten.mul.Tensor, u, high - low), low), dtype)
    return _as(f, u, dtype)  # rand, rand_like


class _Args:
    """A call's arguments by schema name, positional or keyword."""

    def __init__(self, target, args: tuple, kwargs: dict):
        self.names = [a.name for a in target._schema.arguments]
        self.values = {**dict(zip(self.names, args)), **kwargs}

    def get(self, name: str, default):
        value = self.values.get(name)
        return default if value is None else value


def _fp32(f, x):
    return f(aten._to_copy.default, x, dtype=torch.float32)


def _as(f, x, dtype: torch.dtype):
    return x if dtype == torch.float32 else f(aten._to_copy.default, x, dtype=dtype)


def keep_mask(f, rng, shape: tuple[int, ...], p: float, op: int, device=None):
    """The bool mask of dropout number ``op`` (True: kept) over a tensor of ``shape``, given
    ``rng`` = ``[seed, step, slice]`` (int64): kept where ``h >= round(p 2**32)``."""
    threshold = round(p * 2**32)  # uniform(h) >= p, in integers
    return f(aten.view.default, f(aten.ge.Scalar, bits(f, rng, shape, op, 0, device), threshold),
             list(shape))


def uniform(f, rng, shape: tuple[int, ...], op: int, lane: int = 0, device=None):
    """fp32 in [0, 1) over ``shape``: the top 24 bits of each element's hash, exactly."""
    h = f(aten.bitwise_right_shift.Tensor_Scalar, bits(f, rng, shape, op, lane, device), 8)
    u = f(aten.mul.Tensor, f(aten._to_copy.default, h, dtype=torch.float32), 2.0**-24)
    return f(aten.view.default, u, list(shape))


def bits(f, rng, shape: tuple[int, ...], op: int, lane: int = 0, device=None):
    """int64 in [0, 2**32), one per element of a tensor of ``shape`` (flat): the hash of (seed,
    step, op, lane, the element's global index ``local + slice * numel``)."""
    n = math.prod(shape)
    seed, step, piece = (f(aten.select.int, rng, 0, i) for i in range(3))
    salt = ((op + 1) * GOLDEN + lane * LANE) & M32
    seed_lo = f(aten.bitwise_and.Scalar, seed, M32)
    seed_hi = f(aten.bitwise_and.Scalar, f(aten.bitwise_right_shift.Tensor_Scalar, seed, 32), M32)
    a = fmix32(f, f(aten.bitwise_xor.Scalar, seed_hi, salt))
    a = fmix32(f, f(aten.bitwise_xor.Tensor, seed_lo, a))
    k0 = fmix32(f, f(aten.bitwise_xor.Tensor, a, f(aten.bitwise_and.Scalar, step, M32)))
    k1 = fmix32(f, f(aten.bitwise_xor.Scalar, k0, GOLDEN))
    index = f(aten.arange.default, n, dtype=torch.int64, device=device)
    index = f(aten.add.Tensor, index, f(aten.mul.Tensor, piece, n))  # the global position
    h = fmix32(f, f(aten.bitwise_xor.Tensor, f(aten.bitwise_and.Scalar, index, M32), k0))
    high = f(aten.bitwise_right_shift.Tensor_Scalar, index, 32)  # nonzero past 2**32 elements
    return fmix32(f, f(aten.bitwise_xor.Tensor, f(aten.bitwise_xor.Tensor, h, high), k1))


def call(target, *args, **kwargs):
    """The ``f`` that computes eagerly."""
    return target(*args, **kwargs)


def fmix32(f, h):
    """murmur3's finalizer on values in [0, 2**32) held in int64."""
    h = f(aten.bitwise_xor.Tensor, h, f(aten.bitwise_right_shift.Tensor_Scalar, h, 16))
    h = _mul32(f, h, 0x85EBCA6B)
    h = f(aten.bitwise_xor.Tensor, h, f(aten.bitwise_right_shift.Tensor_Scalar, h, 13))
    h = _mul32(f, h, 0xC2B2AE35)
    return f(aten.bitwise_xor.Tensor, h, f(aten.bitwise_right_shift.Tensor_Scalar, h, 16))


def _mul32(f, x, c: int):
    """``x * c mod 2**32`` for ``x`` in [0, 2**32), exact in int64: no product passes 2**48."""
    lo = f(aten.mul.Tensor, x, c & 0xFFFF)
    hi = f(aten.bitwise_and.Scalar, f(aten.mul.Tensor, x, c >> 16), 0xFFFF)
    return f(aten.bitwise_and.Scalar, f(aten.add.Tensor, lo, f(aten.mul.Tensor, hi, 1 << 16)), M32)


class on_stream_eagerly(TorchDispatchMode):
    """Within: eager PyTorch draws every random op on shardfx's stream, numbered in the order
    they run, as step ``step`` of a program with ``seed`` (slice ``piece``) draws them. So an
    eager run of a model with dropout or other random ops computes what its shardfx program
    computes, and the two can be compared (``shardfx.testing``). A random op off the stream
    raises: its values could not match.

    Activation checkpointing runs a region's forward again in the backward, after restoring
    torch's generator to its state before the region (``preserve_rng_state``), so that it
    draws the same values. The op numbers follow the same rule: each draw also advances the
    CPU generator by one value, and an op number is given per generator state, so a replay
    from a restored state gets the numbers (and the values) of the first run.

    Checkpointing with ``preserve_rng_state=False`` restores nothing: its backward draws values
    the forward never drew (new op numbers), and eager's gradient is then that of another mask
    than the forward's. Once the caller sets ``backward`` (the forward done), each such fresh
    draw of a checkpoint's recomputation is listed in ``fresh`` with the user's line that made
    it."""

    def __init__(self, seed: int, step: int, piece: int = 0):
        super().__init__()
        self.rng = torch.tensor([seed, step, piece], dtype=torch.int64)
        self.numbers: dict[bytes, int] = {}  # the generator's state at a draw -> its op number
        self.backward = False  # set by the caller once the forward has run
        self.fresh: list[str] = []  # draws in the backward no forward draw replays

    def _number(self, func) -> int:
        state = torch.get_rng_state().numpy().tobytes()
        if self.backward and state not in self.numbers and _recomputing():
            self.fresh.append(f"{func} ({_user_line()})")
        op = self.numbers.setdefault(state, len(self.numbers))
        torch.empty(1).uniform_()  # the next draw sees another state (the mode is off here)
        return op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_random(func) or not draws(func, args, kwargs):
            return func(*args, **kwargs)
        if not on_stream(func):
            raise NotImplementedError(f"{func} is not on shardfx's random stream")
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):
            dtype, device = first.dtype, first.device
        else:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = kwargs.get("device") or torch.device("cpu")
        if kwargs.get("dtype") is not None:
            dtype = kwargs["dtype"]
        shape = shape_of(func, args, lambda t: t)
        value = sample(call, func, args, kwargs, self.rng.to(device), self._number(func), shape,
                       dtype, device)
        if func._schema.is_mutable:  # uniform_, exponential_, bernoulli_, normal_: in place
            return first.copy_(value)
        return value


def _user_line() -> str:
    """``file:line`` of the innermost frame outside torch and shardfx: the model's code that
    called the op (the recomputed forward, when a checkpoint's backward runs it)."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and "/shardfx/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "unknown line"


def _recomputing() -> bool:
    """Whether torch.utils.checkpoint is running a region again (reentrant or not)."""
    return any(f.filename.endswith("torch/utils/checkpoint.py") for f in traceback.extract_stack())
