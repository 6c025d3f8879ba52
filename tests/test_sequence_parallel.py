"""Megatron sequence parallelism (``shard="megatron-sp"``): the norms, dropout and residual adds
on each tp rank's part of the sequence, equal to one device, moving what tensor parallelism's
all-reduces move, holding 1/t of the norms' activations."""

from __future__ import annotations

import operator
import re
from collections import Counter

import pytest
import torch

import shardfx
from shardfx.ir import meta as M
from shardfx.ir.text import module_of
from shardfx.testing import compare_inference, compare_training

from models import SEQ, lm_loss, tiny, token_batches

pytest.importorskip("transformers")


def _train_and_infer(cases: list[tuple[str, dict, dict, int]]) -> list[tuple]:
    out = []
    for name, mesh, kw, batch in cases:
        data = token_batches(3, batch)
        report = compare_training(tiny(name), data, lm_loss, mesh=mesh, shard="megatron-sp", **kw)
        worst = compare_inference(tiny(name), data[0][0], mesh=mesh, shard="megatron-sp", **kw)
        source = report.plan.program.source if report.plan.program is not None else ""
        out.append((f"{name} {mesh} {kw}", report.max(), worst, hash(source)))
    return out


def _check(results: list[list[tuple]]) -> None:
    for rows in results:
        for label, train, infer, _ in rows:
            assert train < 1e-5 and infer < 1e-5, (label, train, infer)
    assert len({tuple(h for *_, h in rows) for rows in results}) == 1  # one program for all


def test_two_ranks_train_like_one_device():
    _check(shardfx.launch(_train_and_infer, [
        ("llama", {"tp": 2}, {}, 4),
        ("llama", {"tp": 2}, {}, 1),  # a batch of one: tokens flattened as they are
        ("gpt2", {"tp": 2}, {"fused_loss": True}, 4),
    ], nprocs=2, timeout=120, deadline=600))


def test_four_ranks_train_like_one_device():
    """tp=4, and sequence parallelism inside dp x tp and inside a pipeline's stages (each
    microbatch's tokens split over its stage's tp ranks)."""
    _check(shardfx.launch(_train_and_infer, [
        ("llama", {"tp": 4}, {}, 4),
        ("gpt2", {"tp": 4}, {}, 4),
        ("llama", {"dp": 2, "tp": 2}, {}, 4),
        ("gpt2", {"pp": 2, "tp": 2}, {"microbatches": 2}, 4),
    ], nprocs=4, timeout=120, deadline=900))


# --- what it moves and what it holds, counted in the generated program ---------------------

def _plan(shard: str, tp: int, layers: int = 2, name: str = "llama", batch: int = 4):
    (x,), (y,) = token_batches(1, batch)[0]
    return shardfx.partition(tiny(name, layers), (x,), lm_loss, (y,), mesh={"tp": tp},
                             shard=shard, fused_loss=False)


def _moved(plan, tp: int) -> float:
    """Bytes each rank sends for the activations' collectives (ring algorithms): an all-reduce
    of n bytes 2(t-1)/t n, a reduce-scatter of n (t-1)/t n, an all-gather of n (t-1) n.
    Gradient buckets (no one op's) are left out."""
    share = {"all_reduce": 2 * (tp - 1) / tp, "reduce_scatter": (tp - 1) / tp,
             "all_gather": tp - 1}
    return sum(share[c.kind] * c.nbytes for c in plan.collectives if c.module)


@pytest.mark.parametrize("tp,batch", [(2, 4), (4, 4), (2, 1)])
def test_a_layer_moves_what_tensor_parallelism_all_reduces(tp, batch):
    """Per layer (a 2-layer plan less a 1-layer one), forward and backward: Megatron's two
    all-reduces become a reduce-scatter onto the sequence and an all-gather from it, the same
    bytes (one gather for q, k and v, with a batch of one too). The norms' weight gradients
    are summed over tp on top (2 x hidden per layer, as in Megatron-SP): they are in the
    gradient bucket, not counted here."""
    per_layer = {shard: _moved(_plan(shard, tp, 2, batch=batch), tp)
                 - _moved(_plan(shard, tp, 1, batch=batch), tp)
                 for shard in ("megatron", "megatron-sp")}
    assert per_layer["megatron"] > 0
    assert per_layer["megatron-sp"] == per_layer["megatron"], per_layer
    # each of tp's all-reduces is a reduce-scatter and an all-gather, in the same phase (with
    # 2 kv heads on tp=4 both gather k and v: the same in both)
    kinds = {shard: Counter((c.phase, c.kind) for c in _plan(shard, tp, 1, batch=batch).collectives
                            if c.module.startswith("model.layers.0"))
             for shard in ("megatron", "megatron-sp")}
    want = Counter({k: n for k, n in kinds["megatron"].items() if k[1] != "all_reduce"})
    for phase in ("fwd", "bwd"):
        reduces = kinds["megatron"][phase, "all_reduce"]
        assert reduces == 2, kinds
        want[phase, "reduce_scatter"] += reduces
        want[phase, "all_gather"] += reduces
    assert kinds["megatron-sp"] == want, kinds


def _norm_activations(plan) -> int:
    """Bytes of the values the norms' forward ops make that the backward reads, on one rank
    (an output of a tuple-valued op, such as layer norm's mean and rstd, counts as its op's)."""
    def made_in(n):  # the program keeps the IR's names
        ir = nodes.get(n.name)
        return ir.args[0] if ir is not None and ir.target is operator.getitem else ir

    nodes = {n.name: n for n in plan.ir.graph.nodes}
    total = 0
    for n in plan.program.module.graph.nodes:
        op = made_in(n)
        if op is None or not isinstance(n.meta.get(M.VAL), torch.Tensor):
            continue
        if op.meta.get(M.PHASE) is M.Phase.FORWARD and re.search(r"norm|ln_", module_of(op)) \
                and any(u.meta.get(M.PHASE) is M.Phase.BACKWARD for u in n.users):
            total += n.meta[M.VAL].numel() * n.meta[M.VAL].element_size()
    return total


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_norms_hold_a_tp_share_of_their_activations(name):
    """What the norms save for the backward is split over the sequence: 1/t of tensor
    parallelism's (which replicates the norms on every rank). The peak measured on each rank
    against the memory model: tests/test_memory.py."""
    tp, sp = (_norm_activations(_plan(shard, 2, name=name)) for shard in ("megatron", "megatron-sp"))
    assert tp > 0 and sp * 2 <= tp, (tp, sp)


def test_print_shows_the_collectives_per_layer():
    text = str(_plan("megatron-sp", 2))
    assert "Communication by module, per block" in text
    assert "model.layers.*.self_attn.q_proj" in text and "reduce_scatter" in text


# --- bad input -----------------------------------------------------------------------------

def test_a_sequence_tp_does_not_divide_is_refused():
    (x,), (y,) = token_batches(1, 4)[0]
    x, y = x[:, :SEQ - 1], y[:, :SEQ - 1]
    with pytest.raises(shardfx.MeshError) as e:
        shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh={"tp": 2}, shard="megatron-sp")
    assert "sequence length 7, not divisible by tp=2" in str(e.value)
    assert 'shard="megatron"' in str(e.value)
