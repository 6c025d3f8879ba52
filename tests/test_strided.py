"""A strided split over tp (``_StridedShard``): GPT-2's fused q, k, v projection split the way
Megatron splits separate ones, by name and by the solver, with Megatron's communication. (It
trains like one device wherever GPT-2 is planned on tp: test_spmd, test_zero, test_auto_shard,
test_sequence_parallel, test_resume's checkpoints.)"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import _StridedShard

import shardfx
from shardfx.ir import cp_layout
from shardfx.ir import strided
from shardfx.auto.candidates import fused
from shardfx.errors import ShardingError
from shardfx.ir import meta as M
from shardfx.auto.shard import AUTO
from shardfx.runtime.saving import Held, offsets, parts

from models import lm_loss, tiny, token_batches
from test_auto_shard import FAST_LINKS

CALL = cp_layout.call


@pytest.mark.parametrize("n,k", [(2, 3), (4, 3), (2, 2)])
def test_each_rank_holds_its_slice_of_every_part(n, k):
    """Rank r's part of a dim of k parts: the r-th slice of each; gathered in rank order and
    unshuffled, the whole again; shuffled, an even split gives each rank its part."""
    m = 2
    whole = torch.arange(5 * k * n * m, dtype=torch.float32).reshape(5, k * n * m)
    mine = [strided.take(CALL, whole, tuple(whole.shape), 1, r, n, k) for r in range(n)]
    for r, t in enumerate(mine):
        expected = torch.cat([whole[:, j * n * m + r * m: j * n * m + (r + 1) * m]
                              for j in range(k)], 1)
        assert torch.equal(t, expected)
    gathered = torch.cat([t.T for t in mine], 0)  # the gather's dim at the front
    assert torch.equal(strided.unshuffle(CALL, gathered, tuple(gathered.shape), n, k).T, whole)
    ranked = strided.shuffle(CALL, whole.T.contiguous(), (k * n * m, 5), n, k)
    assert all(torch.equal(piece.T, t) for piece, t in zip(ranked.chunk(n, 0), mine))


def test_a_checkpoint_box_per_part():
    """A strided shard is one rectangle of the whole tensor per part: its box has a piece
    each; ZeRO's rows over dp (here rows 3..8 of a tp shard of 3 parts of 4) cut through
    them."""
    placements = (_StridedShard(0, split_factor=3),)
    axes, coord = (("tp", 2),), {"tp": 1}
    local = torch.arange(12.0)
    at, split = offsets((12,), placements, axes, coord), parts((12,), placements, axes, coord)
    assert at == (4,) and (split.k, split.m, split.stride, split.base) == (3, 4, 8, 4)
    box = Held(local, at, parts=split).box(local, (24,))
    assert [(o, v.tolist()) for o, v in box.pieces] == [
        ((4,), [0., 1., 2., 3.]), ((12,), [4., 5., 6., 7.]), ((20,), [8., 9., 10., 11.])]
    rows = Held(local[3:8], (4 + 3,), parts=split).box(local[3:8], (24,))
    assert [(o, v.tolist()) for o, v in rows.pieces] == [((7,), [3.]), ((12,), [4., 5., 6., 7.])]


def _collectives(plan) -> list:
    return [c for c in plan.collectives if c.axis == "tp" and not c.reason.startswith("tp ")]


def _plan(shard, **kw):
    (x,), (y,) = token_batches(1, 2)[0]
    return shardfx.partition(tiny("gpt2"), (x,), lm_loss, (y,), mesh={"tp": 2}, shard=shard,
                             **kw)


def test_megatron_splits_gpt2s_fused_qkv_by_heads():
    """``c_attn`` (q, k and v side by side) takes each rank's heads of all three: per layer 2
    all-reduces of the activations forward and 2 backward, nothing else, as with separate
    q, k and v projections."""
    plan = _plan("megatron")
    params = plan.ir.graph.find_nodes(op="placeholder")
    placed = {n.meta[M.ROLE].name: n.meta[M.ANNOTATION] for n in params
              if "c_attn" in n.meta[M.ROLE].name}
    assert placed and all(p == (_StridedShard(1 if name.endswith("weight") else 0,
                                              split_factor=3),) for name, p in placed.items())
    kinds = sorted((c.kind, c.phase) for c in _collectives(plan))
    layers = tiny("gpt2").config.n_layer
    assert kinds == sorted([("all_reduce", "fwd"), ("all_reduce", "bwd")] * 2 * layers)


def test_the_solver_finds_the_split_from_the_ops():
    """No names: the matmul whose result is split into 3 equal parts is seeded with the
    strided split, and the plan the solver picks splits ``c_attn`` so, gathering neither q, k
    nor v."""
    plan = _plan("auto", device_model=FAST_LINKS)
    report = plan.ir.meta[AUTO]
    split = {fqn: p for fqn, p in report.params.items() if "c_attn" in fqn}
    assert split and all(type(p[0]) is _StridedShard and p[0].split_factor == 3
                         for p in split.values())
    assert not [c for c in _collectives(plan) if re.match(r"split", c.reason)]
    found = {n.meta[M.ROLE].name: v for n, v in fused(_plan("replicate").ir).items()}
    assert found and set(found) == {f"transformer.h.{i}.attn.c_attn.{leaf}"
                                    for i in range(2) for leaf in ("weight", "bias")}


def test_a_strided_split_that_does_not_divide_is_named():
    """9 outputs are 3 parts of 3: not divisible over tp=2."""
    with pytest.raises(ShardingError, match=r"not divisible in 3 parts, each by mesh axis tp=2"):
        shardfx.partition(torch.nn.Linear(4, 9), (torch.randn(2, 4),), torch.nn.functional.mse_loss,
                          (torch.randn(2, 9),), mesh={"tp": 2},
                          shard={"bias": (_StridedShard(0, split_factor=3),),
                                 "weight": (Replicate(),)})


def test_the_ir_text_writes_and_reads_a_strided_split():
    """``S(1,3)``: dim 1 in 3 parts, each split over the axis; read back, propagation gives
    the same placements."""
    from shardfx.ir.parse import text_to_ir
    from shardfx.ir.text import ir_to_text

    text = ir_to_text(_plan("megatron").ir, people=False)
    assert re.search(r"transformer_h_0_attn_c_attn_weight: f32\[\d+, \d+\] = param .*# S\(1,3\)",
                     text), text[:2000]
    assert ir_to_text(text_to_ir(text), people=False) == text
