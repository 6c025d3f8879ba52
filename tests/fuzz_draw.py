"""Drawing a ``ModelSpec`` (``fuzz_models``) from any source of choices.

``generate(pick)`` builds a spec op by op, keeping every shape valid: ``random_spec(seed)`` for
numbered models (benchmarks, reproducible by number), ``model_specs()`` for hypothesis, which
shrinks a failing spec towards fewer and simpler ops. Every spec also carries random tp
placements for the "tp2-globs" mesh.

About one op in seven (``SPECIAL``) is a custom autograd.Function, a checkpointed region, dropout
or noise, so that most models have one, in any combination: a random op inside a checkpointed
region (eager replays shardfx's stream through the recompute too), a reentrant checkpoint
before any parameter (whose region eager, and so shardfx, trains nothing in).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch

from fuzz_models import (ACTIVATIONS, DIMS, DROPOUTS, FUNCTIONS, LINEAR_NAMES, NOISE_SCALES,
                         NOISES, NORMS, PLACEMENTS, SCALES, SEQS, ModelSpec, Op, body_of, build,
                         shape_after)

SPECIAL = 0.15  # per op: a Function, a checkpoint, dropout or noise instead of the ops above


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
    shape, drawn, trained = (seq, dim), [], False
    for _ in range(pick.integer(*blocks)):
        block = []
        for _ in range(pick.integer(*ops)):
            op = _random_op(pick, shape, trained)
            shape = shape_after(op, shape)
            trained = trained or _trains(op)
            block.append(op)
        drawn.append(tuple(block))
    if not any(_count_linears(b) for b in drawn):  # something to train
        drawn[-1] += (_random_linear(pick, pick.choice(DIMS)),)
    spec = ModelSpec(seq, dim, seed, tuple(drawn))
    return dataclasses.replace(spec, shard=_random_shard(pick, spec))


def _count_linears(ops: Sequence[Op]) -> int:
    return sum((op[0] == "linear") + _count_linears(body_of(op)) for op in ops)


def _trains(op: Op) -> bool:
    """Whether ``op`` has parameters (so what comes after it has a gradient)."""
    return op[0] == "linear" or op[0] == "norm" and op[2] or any(map(_trains, body_of(op)))


def random_spec(seed: int) -> ModelSpec:
    """Model number ``seed``: the same spec on every machine and Python version."""
    return generate(RandomPicker(seed))


def model_specs():
    """A hypothesis strategy of specs."""
    from hypothesis import strategies as st

    return st.composite(lambda draw: generate(DrawPicker(draw)))()


def _random_op(pick, shape: tuple[int, ...], trained: bool) -> Op:
    """An op taking ``shape``; ``trained``: whether the ops before it have parameters."""
    if pick.chance(SPECIAL):
        return _random_special(pick, shape, trained)
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
        return ("res", random_body(pick, shape))
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


def _random_special(pick, shape: tuple[int, ...], trained: bool, checkpoint: bool = True,
                    random: bool = True) -> Op:
    """A custom autograd.Function, dropout, noise, or (``checkpoint``) a checkpointed body;
    ``random``: whether dropout and noise may be drawn. A reentrant checkpoint is likelier
    after a parameter (``trained``), where its input needs a gradient: before one, eager's
    ``CheckpointFunction`` trains nothing inside (PyTorch warns), and shardfx the same."""
    kinds = ["fn"] + ["dropout", "noise"] * random + ["checkpoint"] * checkpoint
    kind = pick.choice(kinds)
    if kind == "fn":
        return ("fn", pick.choice(FUNCTIONS))
    if kind == "dropout":
        return ("dropout", pick.choice(DROPOUTS))
    if kind == "noise":
        return ("noise", pick.choice(NOISE_SCALES), pick.choice(NOISES))
    reentrant = pick.chance(0.7 if trained else 0.2)  # reentrant: torch's own autograd.Function
    return ("ckpt" if reentrant else "ckptnr", random_body(pick, shape, random=random))


def random_body(pick, shape: tuple[int, ...], random: bool = True) -> tuple[Op, ...]:
    """1-3 units that keep ``shape``: pointwise ops, norms, a Linear back to the same width, an
    MLP (up, activation, down), a Linear over the other axis (transpose, Linear, transpose), or
    (``SPECIAL``) a Function, dropout or noise (``random``: dropout and noise allowed)."""
    body: list[Op] = []
    for _ in range(pick.integer(1, 3)):
        if pick.chance(SPECIAL):
            body.append(_random_special(pick, shape, False, checkpoint=False, random=random))
            continue
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
