"""Context parallelism: the ``cp`` mesh axis splits every activation's sequence, attention runs
as a ring (``codegen.ring_attention``), and training equals one device's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.ir import cp_layout
from shardfx.codegen.ring_attention import RingAttention, RingAttentionBackward, _blocks
from shardfx.report.html import plan_html
from shardfx.testing import compare_inference, compare_training

from models import SEQ, VOCAB, lm_loss, tiny, token_batches

pytest.importorskip("transformers")


class _Encoder(torch.nn.Module):
    """Every token attends to every other (no causal mask), or, with ``window``, to the ones
    within ``window`` positions: a mask the ring cannot split."""

    def __init__(self, window: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.window = window

    def forward(self, ids):
        b, t = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = None
        if self.window is not None:
            pos = torch.arange(t, device=ids.device)
            mask = (pos[:, None] - pos[None, :]).abs() <= self.window
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(self.out(y.transpose(1, 2).reshape(b, t, 32)))


def _build(name: str) -> torch.nn.Module:
    return _Encoder() if name == "encoder" else tiny(name)


def _graphs(plan) -> list[torch.fx.Graph]:
    """The program's graph, or each part's of a pipeline's stage program."""
    module = plan.program.module if plan.program is not None else plan.stage_program
    return [m.graph for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def _train_and_infer(cases: list[tuple]) -> list[tuple]:
    """(model, mesh, batch[, partition's keywords]) each."""
    out = []
    for name, mesh, batch, *kw in cases:
        data = token_batches(3, batch)
        kw = dict(mesh=mesh, **(kw[0] if kw else {}))
        report = compare_training(_build(name), data, lm_loss, **kw)
        worst = compare_inference(_build(name), data[0][0], **kw)
        graphs = _graphs(report.plan)
        ring = sum(isinstance(n.target, (RingAttention, RingAttentionBackward))
                   for g in graphs for n in g.nodes)
        out.append((f"{name} {mesh} batch {batch}", report.max(), worst, ring,
                    hash("".join(str(g) for g in graphs))))
    return out


def _check(results: list[list[tuple]]) -> None:
    for rows in results:
        for label, train, infer, ring, _ in rows:
            assert train < 1e-5 and infer < 1e-5, (label, train, infer)
            assert ring >= 2, (label, ring)  # each layer's attention, forward and backward
    assert len({tuple(h for *_, h in rows) for rows in results}) == 1  # one program for all


def test_two_ranks_train_like_one_device():
    """Causal (Llama's and GPT-2's masks, traced dense, found causal) and full attention."""
    _check(shardfx.launch(_train_and_infer, [
        ("llama", {"cp": 2}, 2),  # two sequences: flattened tokens, each one's chunks
        ("gpt2", {"cp": 2}, 1),
        ("encoder", {"cp": 2}, 1),
    ], nprocs=2, timeout=120, deadline=600))


def test_four_ranks_train_like_one_device():
    _check(shardfx.launch(_train_and_infer, [
        ("llama", {"cp": 4}, 1),
        ("gpt2", {"cp": 4}, 1),
        ("llama", {"dp": 2, "cp": 2}, 4),
        ("llama", {"cp": 2, "tp": 2}, 1, dict(shard="megatron")),
        ("llama", {"cp": 2, "tp": 2}, 1, dict(shard="megatron-sp")),
        ("llama", {"pp": 2, "cp": 2}, 2, dict(microbatches=2)),
    ], nprocs=4, timeout=120, deadline=900))


def test_only_gradients_and_the_loss_cross_cp():
    """The ring's blocks pass inside its ops; the program's cp collectives are the gradients'
    and the loss's sums: no activation is gathered over cp."""
    (x,), (y,) = token_batches(1, 1)[0]
    plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh={"cp": 2},
                             fused_loss=False)
    kinds = {c.kind for c in plan.collectives if c.axis == "cp"}
    assert kinds == {"all_reduce"}, plan.collectives
    activations = [c for c in plan.collectives if c.module and c.kind != "all_reduce"]
    assert not activations, activations
    assert "each sequence split over cp=2" in str(plan)
    assert "each sequence split over cp=2" in plan_html(plan)


def test_megatron_sp_splits_each_cp_part_over_tp():
    """With cp and megatron-sp the sequence is split over cp, then each rank's part over tp:
    the row-parallel outputs are reduce-scattered, gathered before the column-parallel ones,
    and the predicted peak is below megatron's (the norms keep a tp-th of the tokens)."""
    (x,), (y,) = token_batches(1, 1)[0]
    plans = {shard: shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh={"cp": 2, "tp": 2},
                                      shard=shard, fused_loss=False)
             for shard in ("megatron", "megatron-sp")}
    kinds = {s: {(c.kind, c.axis) for c in p.collectives} for s, p in plans.items()}
    assert ("reduce_scatter", "tp") in kinds["megatron-sp"] - kinds["megatron"]
    assert "then over tp=2 between the parallel matmuls" in str(plans["megatron-sp"])
    peak = {s: max(p.memory_estimate().values()) for s, p in plans.items()}
    assert peak["megatron-sp"] < peak["megatron"]


def test_the_ring_counts_its_messages_and_blocks():
    """What the predicted step (``step_time``) and the device FLOPs take from the ring ops:
    cp - 1 key/value blocks sent forward; backward those, and their fp32 gradients cp times
    (the last time home); causal attention computes (cp + 1) / 2 blocks on every rank (its own
    and half of each other), full attention cp."""
    q = k = v = torch.empty(1, 4, 16, 8)  # a rank's (B, H, T / cp, D)
    block = 2 * k.numel() * 4
    causal, full = RingAttention(True, None, 4), RingAttention(False, None, 4)
    assert causal.sends(q, k, v) == [block] * 3
    assert RingAttentionBackward(True, None, 4).sends(q, q, k, v) == [block] * 3 + [block] * 4
    assert causal.flops(q, k, v) == 4 * 4 * 16 * 16 * 8 * 2.5
    assert full.flops(q, k, v) == 4 * 4 * 16 * 16 * 8 * 4


def test_each_rank_holds_a_front_and_a_back_chunk():
    """cp=4 cuts a sequence of 16 into 8 chunks of 2, rank r holding chunks r and 7 - r; a
    gather in rank order puts them back in order, and a reduce-scatter's input is ordered so
    that each rank receives its own two; tokens of several sequences flattened, each's."""
    seq = torch.arange(16 * 3).view(16, 3)
    parts = [cp_layout.take(cp_layout.call, seq, (16, 3), 0, r, 4) for r in range(4)]
    assert parts[0][:, 0].tolist() == [0, 3, 42, 45] and parts[3][:, 0].tolist() == [18, 21, 24, 27]
    whole = cp_layout.unshuffle(cp_layout.call, torch.cat(parts), (16, 3), 4)
    assert torch.equal(whole, seq)
    scattered = cp_layout.shuffle(cp_layout.call, seq, (16, 3), 4).chunk(4)
    assert all(torch.equal(a, b) for a, b in zip(scattered, parts))
    # two sequences of 8 flattened into 16 tokens (sf=2), cp=2: each sequence cut alike
    parts = [cp_layout.take(cp_layout.call, seq, (16, 3), 0, r, 2, sf=2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 3, 18, 21, 24, 27, 42, 45]
    whole = cp_layout.unshuffle(cp_layout.call, torch.cat(parts), (16, 3), 2, sf=2)
    assert torch.equal(whole, seq)
    scattered = cp_layout.shuffle(cp_layout.call, seq, (16, 3), 2, sf=2).chunk(2)
    assert all(torch.equal(a, b) for a, b in zip(scattered, parts))


def test_causal_attention_is_the_same_work_on_every_rank():
    """Each rank's own block (causal, counted whole as the flash kernel's FLOPs are) and half
    of every other: (cp + 1) / 2 blocks on each of the cp ranks, not 1 .. cp."""
    work = {"own": 1.0, "front": 0.5, "back": 0.5, "all": 1.0}
    for cp in (2, 4):
        per_rank = {sum(work[part] for _, part in _blocks(r, cp, True)) for r in range(cp)}
        assert per_rank == {(cp + 1) / 2}
        assert {sum(work[p] for _, p in _blocks(r, cp, False)) for r in range(cp)} == {cp}


def test_dtensor_dispatch_is_offered_no_sequence_strategy():
    """The sequence strategy of the CPU attention op is for shardfx's plans alone (their ring
    computes it): a user's DTensors on a mesh with a cp axis (PyTorch's context_parallel on
    CPU among them) would attend within each rank's own tokens."""
    from torch.distributed.device_mesh import DeviceMesh

    from shardfx.passes.shard_propagate import planning_mesh
    from shardfx.rules import attention

    theirs = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("cp",), _init_backend=False,
                        _rank=0)
    assert attention._has_cp(planning_mesh((("cp", 2),))) and not attention._has_cp(theirs)


# --- bad input -----------------------------------------------------------------------------

def _partition(model, batch: int = 1, seq: int = SEQ, **kw):
    (x,), (y,) = token_batches(1, batch)[0]
    return shardfx.partition(model, (x[:, :seq],), lm_loss, (y[:, :seq],), **kw)


def test_a_mask_the_ring_cannot_split_is_refused():
    with pytest.raises(shardfx.ShardingError) as e:
        _partition(_Encoder(window=2), mesh={"cp": 2})
    assert "dense mask, a (8, 8) pattern that is neither causal, full nor a sliding window" \
        in str(e.value) and "drop the cp axis" in str(e.value)


def test_a_sliding_window_is_named_with_its_width_and_a_fix_for_it():
    """Mistral's sliding window: not "pass no attention_mask" (the user passed none)."""
    import transformers as T

    torch.manual_seed(0)
    model = T.MistralForCausalLM(T.MistralConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, sliding_window=4))
    with pytest.raises(shardfx.ShardingError) as e:
        _partition(model, mesh={"cp": 2})
    assert "a sliding window: each query attends to its own key and the 3 before it" in \
        str(e.value) and "sliding_window=None" in e.value.fix, e.value


def test_a_mask_from_the_inputs_is_named_as_such():
    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = tiny("llama")

        def forward(self, ids, keep):
            return self.model(ids, attention_mask=keep)

    (x,), (y,) = token_batches(1, 2)[0]
    with pytest.raises(shardfx.ShardingError) as e:
        shardfx.partition(Padded(), (x, torch.ones_like(x)), lm_loss, (y,), mesh={"cp": 2})
    assert "computed from the model's inputs" in str(e.value)
    assert "without attention_mask" in e.value.fix


def _bert_cp2() -> float:
    from models import hf

    return compare_training(hf("bert"), token_batches(2), lm_loss, mesh={"cp": 2}).max()


def test_bert_on_cp2_is_full_attention_and_equals_one_device():
    """BERT's traced mask lets every token attend to every other (no sequence padded): full
    attention, which the ring runs, not a dense mask it refuses."""
    (x,), (y,) = token_batches(1)[0]
    from models import hf
    from shardfx.passes import causal_mask

    plan = shardfx.partition(hf("bert"), (x,), lm_loss, (y,), mesh={"cp": 2})
    flash = [n for n in plan.ir.graph.nodes if n.target in (causal_mask.FLASH,
                                                            causal_mask.FLASH_BACKWARD)]
    assert flash and all("attn_mask" not in n.kwargs for n in flash)
    assert max(shardfx.launch(_bert_cp2, nprocs=2, timeout=120)) < 1e-5


@pytest.mark.parametrize("name", ["llama", "gpt2", "nanogpt"])
def test_a_long_mask_is_checked_a_few_rows_at_a_time(monkeypatch, name):
    """A mask over ``BLOCK`` elements is computed and compared with the causal one a block of
    query rows at a time (here 2 rows of 8): the same answers as whole. Each block's copy of
    the same mask is checked once."""
    from shardfx.passes import causal_mask

    monkeypatch.setattr(causal_mask, "BLOCK", 16)
    checked = []
    monkeypatch.setattr(causal_mask, "_classify",
                        lambda m, check=causal_mask._classify: checked.append(m) or check(m))
    plan = _partition(tiny(name), mesh={"cp": 2})
    assert len(checked) <= 1, checked
    flash = [n for n in plan.ir.graph.nodes if n.target in (causal_mask.FLASH,
                                                            causal_mask.FLASH_BACKWARD)]
    assert flash and all("attn_mask" not in n.kwargs for n in flash)
    with pytest.raises(shardfx.ShardingError):
        _partition(_Encoder(window=2), mesh={"cp": 2})


@pytest.mark.parametrize("kw,words", [
    (dict(seq=SEQ - 4, mesh={"cp": 4}), "sequence length 4, not divisible by 2*cp=8"),
    (dict(seq=SEQ - 4, mesh={"cp": 2, "tp": 4}, shard="megatron-sp"),
     "sequence length 4, not divisible by cp*tp=8"),
])
def test_bad_requests_are_refused(kw, words):
    with pytest.raises(shardfx.ShardfxError) as e:
        _partition(tiny("llama"), **kw)
    assert words in str(e.value)
