"""Random models through one device, dp=2, tp=2 (Megatron's plan and random placements) and
pp=2, each trained 3 AdamW steps and compared with eager PyTorch by
``shardfx.testing.compare_training``.

The models (``tests/fuzz_models.py``) are drawn by ``tests/fuzz_draw.py`` from Linear (with and
without bias, under names Megatron's plan shards), activations, residual blocks, LayerNorm /
RMSNorm, softmax, transposes (and Linears over the other axis), reshapes, custom
autograd.Functions, checkpointed regions (reentrant or not), dropout and noise (random ops on
shardfx's stream, which the comparison replays in eager). A failure prints the model's one-line
description, which ``ModelSpec.parse`` reads back::

    .venv/bin/python -m bench.fuzz --repro "x(4,24) seed 0: transpose ..." --meshes pp2

- one device: hypothesis draws the models (derandomized: the same ones on every run);
- the meshes: a launch of 2 processes costs seconds, so each mesh checks numbered models
  (``random_spec(n)``, the same on every machine) and the issue's own examples in one launch.
The ``slow`` tests check many more models, through every mesh; ``bench/fuzz.py`` does the same
with a table of counts, and reduces a failure to the smallest model that fails the same way
(the command is printed with each failure).
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

import shardfx.partitioner.capture
import shardfx.testing
from fuzz_check import MESHES, check, run
from fuzz_draw import model_specs, random_spec
from fuzz_models import ModelSpec, batches, build, out_shape

# Models of issue 9: a LayerNorm over a transposed activation between Linears over the other
# axis (a program assuming contiguous strides failed on it), and a pipeline whose stage 0 ends
# in a LayerNorm of a softmax (its backward part's only output is a multi-output op).
TRANSPOSED_NORM = ModelSpec.parse(
    "x(4,24) seed 0: transpose linear(4,bias) transpose | layernorm | "
    "transpose linear(4,bias) transpose")
STAGE_ENDS_IN_NORM = ModelSpec.parse(
    "x(4,16) seed 0: scale(-1.5) softmax layernorm | relu linear(20,bias) linear(12,bias)")

# Found by this fuzzer: under tp, LayerNorm's saved mean and rstd reached its backward as a
# strided slice (a replicated value cut along the sequence dim), which the CPU kernel reads as
# dense memory: wrong weight and input gradients, no error.
NORM_THEN_SHARDED_TRANSPOSE = ModelSpec.parse("x(4,4) seed 0: layernorm transpose fc2(4)")

# Also found by it: a 2-element bias whose true gradient is zero (it shifts a softmax's input
# along the axis it normalizes) is rounding noise at the model's scale in both fp32 runs; the
# comparison must not call that a mismatch (shardfx.testing.GRAD_NOISE).
ZERO_GRADIENT_BIAS = ModelSpec.parse(
    "x(8,8) seed 244: transpose res[rmsnorm q_proj(8) silu o_proj(8) fc1(8,bias)] split(2) "
    "q_proj(4) | fc1(24,bias) linear(16) res[transpose down_proj(2,bias) transpose] softmax ; "
    "shard layers.0.op1.body.op1.q_proj.weight=S1 layers.1.op0.fc1.weight=S0 "
    "layers.1.op0.fc1.bias=S0 layers.1.op1.linear.weight=R")

# What capture used to change in silence and the random ops shardfx draws from its own stream,
# every kind in one model: Functions whose backward is not their forward's derivative, Megatron's
# MLP inside a reentrant and a non-reentrant checkpoint, dropout and the three kinds of noise.
SPECIAL_OPS = ModelSpec.parse(
    "x(4,8) seed 0: fc1(8,bias) ste res[clampste linear(8)] | ckpt[up_proj(16) gelu "
    "down_proj(8)] ckptnr[layernorm q_proj(8) o_proj(8)] | dropout(0.25) noise(0.5) "
    "noise(0.1,uniform) noise(0.5,exp) fc2(4) ; shard layers.1.op0.body.op0.up_proj.weight=S0 "
    "layers.1.op1.body.op2.o_proj.weight=S1")

QUICK = [TRANSPOSED_NORM, STAGE_ENDS_IN_NORM, NORM_THEN_SHARDED_TRANSPOSE, ZERO_GRADIENT_BIAS,
         SPECIAL_OPS, *map(random_spec, range(5))]
SLOW_MODELS = 30  # per mesh


@settings(max_examples=40, derandomize=True, deadline=None, database=None)
@given(spec=model_specs())
def test_specs_print_parse_and_build(spec):
    """The text form reads back; the model's output has the shape the description says."""
    assert ModelSpec.parse(str(spec)) == spec
    (x,), (y,) = batches(spec, 1)[0]
    out = build(spec)(x)
    assert out.shape[1:] == y.shape[1:] == out_shape(spec)


def test_special_ops_print_and_parse():
    text = str(SPECIAL_OPS)
    assert ModelSpec.parse(text) == SPECIAL_OPS
    for op in ("ste", "clampste", "ckpt[", "ckptnr[", "dropout(0.25)", "noise(0.5)",
               "noise(0.1,uniform)", "noise(0.5,exp)"):
        assert op in text


# Shrinking a spec costs a training run per try, minutes in all: a failure prints the spec and
# the command that reduces it (bench/fuzz.py --reduce) instead.
QUICKLY = settings(max_examples=8, derandomize=True, deadline=None, database=None,
                   phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=[HealthCheck.too_slow])


@QUICKLY
@given(spec=model_specs())
@example(spec=TRANSPOSED_NORM)
def test_random_models_on_one_device(spec):
    result = check(spec, "one")
    assert result.ok, explain([result])


@pytest.mark.parametrize("mesh", ["dp2", "tp2", "tp2-globs", "pp2"])
def test_random_models_on_two_devices(mesh):
    failed = [r for r in run(QUICK, mesh) if not r.ok]
    assert not failed, explain(failed)


# The fuzzer would have caught each fix undone: a model that passes, and fails once the fix is
# taken away. Capture without the carrier op (each autograd.Function's forward differentiated,
# a reentrant checkpoint traced as a forward under no_grad); random values read from another
# slice of the stream than eager replays (what a mesh drawing at the wrong global index does).
def _carrier_off(monkeypatch):
    monkeypatch.setattr(shardfx.partitioner.capture, "routed_through_carrier",
                        contextlib.nullcontext)


def _another_slice(monkeypatch):
    replay = shardfx.testing.on_stream_eagerly
    monkeypatch.setattr(shardfx.testing, "on_stream_eagerly",
                        lambda seed, step, piece=0: replay(seed, step, piece + 1))


UNDONE = {
    "ste": ("x(4,8) seed 0: linear(8) ste | linear(4)", _carrier_off),
    "clampste": ("x(4,8) seed 0: linear(8) clampste | linear(4)", _carrier_off),
    "ckpt": ("x(4,8) seed 0: linear(8) ckpt[linear(8) relu] | linear(4)", _carrier_off),
    "dropout": ("x(4,8) seed 0: linear(8) dropout(0.25) | linear(4)", _another_slice),
    "noise": ("x(4,8) seed 0: linear(8) noise(0.5) | linear(4)", _another_slice),
    "noise-uniform": ("x(4,8) seed 0: linear(8) noise(0.5,uniform) | linear(4)", _another_slice),
    "noise-exp": ("x(4,8) seed 0: linear(8) noise(0.5,exp) | linear(4)", _another_slice),
}


@pytest.mark.parametrize("op", UNDONE)
def test_the_fuzzer_catches_the_fix_undone(op, monkeypatch):
    spec, undo = ModelSpec.parse(UNDONE[op][0]), UNDONE[op][1]
    assert check(spec, "one").ok, explain([check(spec, "one")])
    undo(monkeypatch)
    result = check(spec, "one")
    assert not result.ok and result.kind != "invalid", result


# Two combinations where eager PyTorch is subtle, each once a false difference.
def test_random_op_inside_a_checkpoint():
    """Checkpointing recomputes the dropout in the backward after restoring torch's generator:
    eager's replay of shardfx's stream numbers the recompute's draws as the forward's."""
    result = check(ModelSpec.parse("x(4,4) seed 0: ckptnr[dropout(0.25) linear(4)]"), "one")
    assert result.ok, result
    result = check(ModelSpec.parse("x(4,4) seed 0: linear(4) ckpt[dropout(0.25) linear(4)]"),
                   "one")
    assert result.ok, result


def test_reentrant_checkpoint_of_an_input_without_gradient():
    """Eager's reentrant checkpoint gives the parameters inside no gradient when no input
    requires one (PyTorch warns); the trace computes the same, and trains the rest."""
    result = check(ModelSpec.parse("x(4,4) seed 0: ckpt[linear(4)] linear(4)"), "one")
    assert result.ok, result


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "one"])
def test_many_random_models(mesh):
    """``SLOW_MODELS`` numbered models per mesh, four-process meshes included (minutes each)."""
    failed = [r for r in run([random_spec(n) for n in range(SLOW_MODELS)], mesh) if not r.ok]
    assert not failed, f"{len(failed)} of {SLOW_MODELS} failed:\n" + explain(failed)


@pytest.mark.slow
@settings(QUICKLY, max_examples=100)
@given(spec=model_specs())
def test_many_random_models_on_one_device(spec):
    result = check(spec, "one")
    assert result.ok, explain([result])


def explain(failed) -> str:
    """Each failure, and the command that reduces it to the smallest model failing the same way."""
    return "\n".join(f"{r}\n  reduce: .venv/bin/python -m bench.fuzz --repro '{r.spec}' "
                     f"--meshes {r.mesh} --reduce" for r in failed)
