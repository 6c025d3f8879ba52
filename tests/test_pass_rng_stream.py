"""rng_stream (with random_draws) on hand-written IR text.

In a training graph the pass replaces each random op on shardfx's stream (here a dropout and a
``rand_like``) by ATen ops computing its value from a new RNG input ``rng: i64[3]`` =
``[seed, step, slice]``, the op's number in program order and each element's position. The
tests check the text after the pass (the RNG input, the random ops gone, their readers reading
the replacements), and run the graph: the same seed and step draw the same values, another step
or seed other ones, the dropout is ``x * mask / (1 - p)`` with its backward reading the same
mask, and the values are the ones ``random_draws.on_stream_eagerly`` makes the original graph
draw. Graphs the pass must leave alone (inference, dropout off, a random op off the stream) are
printed unchanged.
"""

from __future__ import annotations

import re

import pytest
import torch

from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.passes.random_draws import on_stream_eagerly
from shardfx.passes.rng import rng_stream, rng_value
from shardfx.request.options import Options

BEFORE = """\
graph train Drop
  x: f32[4, 8] = input args[0]
  tangent_loss: f32[] = tangent loss
  native_dropout: (f32[4, 8], b8[4, 8]) = aten.native_dropout.default(x, 0.5, True)
  dropped: f32[4, 8] = operator.getitem(native_dropout, 0)
  kept: b8[4, 8] = operator.getitem(native_dropout, 1)
  noise: f32[4, 8] = aten.rand_like.default(dropped, pin_memory=False)
  add: f32[4, 8] = aten.add.Tensor(dropped, noise)
  loss: f32[] = aten.sum.default(add)
  expand: f32[4, 8] = aten.expand.default(tangent_loss, [4, 8])
  grad_x: f32[4, 8] = aten.native_dropout_backward.default(expand, kept, 2.0)
  output loss loss = loss
  output output out[0] = dropped
  output output out[1] = noise
  output output out[2] = grad_x
"""


@pytest.fixture(scope="module")
def rewritten():
    gm = rng_stream(text_to_ir(BEFORE), Options())
    verify(gm)
    return gm


def test_text_shows_the_random_ops_replaced(rewritten):
    text = ir_to_text(rewritten)
    lines = text.splitlines()
    assert lines[:4] == ["graph train Drop", "  x: f32[4, 8] = input args[0]",
                         "  tangent_loss: f32[] = tangent loss",
                         "  rng: i64[3] = rng rng"]  # the new input, after the others
    assert "native_dropout.default" not in text and "rand_like" not in text
    # each op reads seed, step and slice from the RNG input
    assert sum(" = aten.select.int(rng, 0, " in line for line in lines) == 6
    # its own key: op 0 and op 1 mix (op + 1) * 0x9E3779B9 (mod 2**32) into the seed
    assert re.search(r" = aten\.bitwise_xor\.Scalar\(\w+, 2654435769\)$", text, re.M)
    assert re.search(r" = aten\.bitwise_xor\.Scalar\(\w+, 1013904242\)$", text, re.M)
    # each element's position: arange(numel) + slice * numel
    assert len(re.findall(r" = aten\.arange\.default\(32, dtype=torch\.int64, "
                          r"device=torch\.device\('cpu'\)\)$", text, re.M)) == 2
    assert re.search(r"^  native_dropout_index: i64\[32\] = aten\.add\.Tensor\(\w+, \w+\)$",
                     text, re.M)
    # dropout keeps an element where its hash >= round(p * 2**32), then scales by 1/(1-p)
    assert re.search(r"^  (\w+): b8\[32\] = aten\.ge\.Scalar\(\w+, 2147483648\)\n"
                     r"  native_dropout_mask: b8\[4, 8\] = aten\.view\.default\(\1, \[4, 8\]\)\n"
                     r"  (\w+): f32\[4, 8\] = aten\.mul\.Tensor\(x, native_dropout_mask\)\n"
                     r"  native_dropout_out: f32\[4, 8\] = aten\.mul\.Tensor\(\2, 2\.0\)$",
                     text, re.M)
    # rand_like: the top 24 bits of the hash, times 2**-24
    assert re.search(r"^  noise_value: f32\[4, 8\] = aten\.view\.default\(\w+, \[4, 8\]\)$",
                     text, re.M)
    # the readers read the replacements; the backward reads the same mask
    assert "  add: f32[4, 8] = aten.add.Tensor(native_dropout_out, noise_value)" in lines
    assert "  grad_x: f32[4, 8] = aten.native_dropout_backward.default(expand, " \
           "native_dropout_mask, 2.0)" in lines
    assert lines[-3:] == ["  output output out[0] = native_dropout_out",
                          "  output output out[1] = noise_value",
                          "  output output out[2] = grad_x"]
    assert ir_to_text(text_to_ir(text)) == text  # what the pass made is IR the parser reads
    assert str(rewritten.meta[M.RANDOM]) == ("Random: native_dropout x1, rand_like x1 on "
                                             "shardfx's stream (the same draws on any mesh)")


def _run(gm, x, rng=None):
    """Loss, dropped, noise, grad_x; ``rng`` the RNG input (None: the graph takes none)."""
    return gm(x, torch.ones(()), *(() if rng is None else (rng,)))


def test_same_draw_for_the_same_seed_and_step_another_for_another(rewritten):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) + 3  # no zeros
    loss, dropped, noise, grad = _run(rewritten, x, rng_value(7, 3))
    again = _run(rewritten, x, rng_value(7, 3))
    assert all(torch.equal(a, b) for a, b in zip((loss, dropped, noise, grad), again))

    mask = grad != 0  # native_dropout_backward: tangent * mask * 2
    assert set(grad.unique().tolist()) == {0.0, 2.0}
    assert 8 <= int(mask.sum()) <= 24  # about half of 32 kept
    assert torch.equal(dropped, x * mask * 2.0)  # the backward's mask is the forward's
    assert noise.min() >= 0 and noise.max() < 1 and noise.unique().numel() == 32
    assert torch.equal(loss, (dropped + noise).sum())

    for seed, step in ((7, 4), (8, 3)):
        _, _, other_noise, other_grad = _run(rewritten, x, rng_value(seed, step))
        assert not torch.equal(other_grad != 0, mask), (seed, step)
        assert not torch.equal(other_noise, noise), (seed, step)


@pytest.mark.parametrize("step", [0, 5])
def test_values_are_what_eager_draws_on_the_stream(rewritten, step):
    """The original graph, run eagerly with its random ops drawn on shardfx's stream
    (``on_stream_eagerly``, numbered as they run), computes exactly what the rewritten one
    computes from the RNG input."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    before = text_to_ir(BEFORE)
    with on_stream_eagerly(11, step):
        want = _run(before, x)
    got = _run(rewritten, x, rng_value(11, step))
    for name, g, w in zip(("loss", "dropped", "noise", "grad_x"), got, want):
        assert torch.equal(g, w), name


def test_a_slice_draws_its_rows_of_the_whole_batch(rewritten):
    """A pipeline runs the batch slice by slice on a graph traced on one slice; the RNG
    input's slice number offsets each element's position, so slice 1 of a (4, 8) graph draws
    what rows 4..7 of the (8, 8) graph draw in one go."""
    whole = rng_stream(text_to_ir(BEFORE.replace("4, 8", "8, 8")), Options())
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    _, dropped, noise, grad = _run(whole, x, rng_value(5, 2, 0))
    for piece, rows in ((0, slice(0, 4)), (1, slice(4, 8))):
        _, part_dropped, part_noise, part_grad = _run(rewritten, x[rows], rng_value(5, 2, piece))
        assert torch.equal(part_dropped, dropped[rows]) and torch.equal(part_noise, noise[rows])
        assert torch.equal(part_grad, grad[rows])


TRAIN_DROPOUT = """\
graph train Drop
  x: f32[4, 8] = input args[0]
  tangent_loss: f32[] = tangent loss
  native_dropout: (f32[4, 8], b8[4, 8]) = aten.native_dropout.default(x, {p}, {train})
  dropped: f32[4, 8] = operator.getitem(native_dropout, 0)
  loss: f32[] = aten.sum.default(dropped)
  output loss loss = loss
"""
INFER_DROPOUT = """\
graph infer Drop
  x: f32[4, 8] = input args[0]
  native_dropout: (f32[4, 8], b8[4, 8]) = aten.native_dropout.default(x, 0.5, True)
  dropped: f32[4, 8] = operator.getitem(native_dropout, 0)
  output output out[0] = dropped
"""


@pytest.mark.parametrize("text", [
    TRAIN_DROPOUT.format(p=0.5, train=False),  # dropout off (eval)
    TRAIN_DROPOUT.format(p=0.0, train=True),  # p = 0: nothing drawn
    INFER_DROPOUT,  # not a training graph
], ids=["train=False", "p=0", "infer"])
def test_graphs_without_a_draw_on_the_stream_are_unchanged(text):
    gm = rng_stream(text_to_ir(text), Options())
    assert ir_to_text(gm) == text
    assert M.RANDOM not in gm.meta


def test_a_dropout_that_draws_is_replaced():
    """The counterpart of the test above: p = 0.5 in training is rewritten."""
    gm = rng_stream(text_to_ir(TRAIN_DROPOUT.format(p=0.5, train=True)), Options())
    assert "native_dropout.default" not in ir_to_text(gm)
    assert "  loss: f32[] = aten.sum.default(native_dropout_out)" in ir_to_text(gm)


def test_random_op_off_the_stream_stays_and_is_reported():
    text = """\
graph train Perm
  x: f32[4, 8] = input args[0]
  tangent_loss: f32[] = tangent loss
  randperm: i64[4] = aten.randperm.default(4, device=torch.device('cpu'), pin_memory=False)
  index: f32[4, 8] = aten.index.Tensor(x, [randperm])
  loss: f32[] = aten.sum.default(index)
  output loss loss = loss
"""
    gm = rng_stream(text_to_ir(text), Options())
    assert ir_to_text(gm) == text  # no RNG input: nothing was drawn on the stream
    report = gm.meta[M.RANDOM]
    assert report.on == () and report.off == (("randperm", 1),)
    assert "OFF the stream" in str(report) and "randperm at randperm" in str(report)
