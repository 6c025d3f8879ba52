"""Context parallelism: the ``cp`` mesh axis splits every activation's sequence, attention runs
as a ring (``codegen.ring_attention``) over the band of keys its mask allows (causal, full, a
sliding window, chunks), and training equals one device's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.ir import cp_layout
from shardfx.codegen.ring_attention import RingAttention, RingAttentionBackward
from shardfx.ir.band import Band
from shardfx.kernels.attention import BAND_MASK, band_of
from shardfx.report.html import plan_html
from shardfx.testing import compare_inference, compare_training

from models import SEQ, VOCAB, banded, lm_loss, long_batches, tiny, token_batches

pytest.importorskip("transformers")


class _Encoder(torch.nn.Module):
    """Every token attends to every other (no causal mask), or, with ``window``, to the ones
    within ``window`` positions either side (a band of keys that is not causal), or with
    ``every_other`` to those an even distance away (not a band: a mask the ring cannot run)."""

    def __init__(self, window: int | None = None, every_other: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.window, self.every_other = window, every_other

    def forward(self, ids):
        b, t = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = None
        pos = torch.arange(t, device=ids.device)
        if self.window is not None:
            mask = (pos[:, None] - pos[None, :]).abs() <= self.window
        if self.every_other:
            mask = (pos[:, None] - pos[None, :]) % 2 == 0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(self.out(y.transpose(1, 2).reshape(b, t, 32)))


def _build(name: str) -> torch.nn.Module:
    """``encoder``, ``encoder-window`` (2 positions either side), a tiny model, or a banded
    one (``mistral-window``: ``models.banded("mistral")``)."""
    if name.startswith("encoder"):
        return _Encoder(window=2 if name == "encoder-window" else None)
    if name.endswith(("-window", "-chunks")):
        return banded(name.split("-")[0])
    return tiny(name)


def _graphs(plan) -> list[torch.fx.Graph]:
    """The program's graph, or each part's of a pipeline's stage program."""
    module = plan.program.module if plan.program is not None else plan.stage_program
    return [m.graph for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def _train_and_infer(cases: list[tuple]) -> list[tuple]:
    """(model, mesh, batch[, partition's keywords]) each; a banded model's sequences are
    ``LONG_SEQ`` long."""
    out = []
    for name, mesh, batch, *kw in cases:
        long = name.endswith(("-window", "-chunks"))
        data = long_batches(3, batch) if long else token_batches(3, batch)
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
            # each layer's attention, forward and backward; Gemma 2's soft-capped scores are
            # not the flash op's: matmuls, the keys gathered over cp
            assert ring >= 2 or label.startswith("gemma2") and ring == 0, (label, ring)
    assert len({tuple(h for *_, h in rows) for rows in results}) == 1  # one program for all


def test_two_ranks_train_like_one_device():
    """Causal (Llama's and GPT-2's masks, traced dense, found causal) and full attention; bands
    that cross the ranks' chunks: Gemma 3's sliding window of 3 keys beside a global layer
    (Gemma 2's too, soft-capped: not a ring), and a window either side of each query."""
    _check(shardfx.launch(_train_and_infer, [
        ("llama", {"cp": 2}, 2),  # two sequences: flattened tokens, each one's chunks
        ("gpt2", {"cp": 2}, 1),
        ("encoder", {"cp": 2}, 1),
        ("encoder-window", {"cp": 2}, 1),
        ("gemma3-window", {"cp": 2}, 1),
        ("gemma2-window", {"cp": 2}, 1),
    ], nprocs=2, timeout=120, deadline=900))


def test_four_ranks_train_like_one_device():
    """cp=4 cuts 16 positions into 8 chunks of 2: Mistral's window of 3 keys reaches the
    neighbours only (a step skipped); on dp=2 x cp=2, Llama 4's chunks of 3 positions cross the
    chunks of 4 unaligned, beside a causal NoPE layer."""
    _check(shardfx.launch(_train_and_infer, [
        ("gpt2", {"cp": 4}, 1),
        ("mistral-window", {"cp": 4}, 1),
        ("llama4-chunks", {"dp": 2, "cp": 2}, 2),
        ("llama", {"dp": 2, "cp": 2}, 4),
        ("llama", {"cp": 2, "tp": 2}, 1, dict(shard="megatron-sp")),
        ("llama", {"pp": 2, "cp": 2}, 2, dict(microbatches=2)),
    ], nprocs=4, timeout=120, deadline=1200))


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
    """What the predicted step (``step_time``) and the device FLOPs take from the ring ops,
    the busiest rank's: causal attention at cp=4 sends a whole block at each of the 3 steps
    (some rank needs both of another's chunks), backward those and the fp32 gradients of the
    rows received, sent back; it computes 3 of the 4 quarters of its own block and half of
    each other; full attention every block whole. A window of 4 keys sends 3 rows to each
    neighbour only, and computes about 4 keys per query. (The work is the same on every rank:
    tests/test_ring_blocks.py.)"""
    q = k = v = torch.empty(1, 4, 16, 8)  # a rank's (B, H, T / cp, D)
    block = 2 * k.numel() * 4
    causal, full = RingAttention(Band(after=0), None, 4), RingAttention(Band(), None, 4)
    assert causal.sends(q, k, v) == [block] * 3
    assert RingAttentionBackward(Band(after=0), None, 4).sends(q, q, k, v) == [block] * 6
    assert causal.flops(q, k, v) == 4 * 4 * 16 * 16 * 8 * (0.75 + 3 * 0.5)
    assert full.flops(q, k, v) == 4 * 4 * 16 * 16 * 8 * 4
    window = RingAttention(Band(before=3, after=0), None, 4)
    assert window.sends(q, k, v) == [3 * block // 16] * 2
    assert window.flops(q, k, v) < causal.flops(q, k, v) / 3


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
        _partition(_Encoder(every_other=True), mesh={"cp": 2})
    assert "dense mask, a (8, 8) pattern that is not a band of keys" in str(e.value) \
        and "drop the cp axis" in str(e.value)


def test_a_sliding_window_rings_only_to_the_neighbours():
    """Mistral's sliding window of 3 keys at cp=4 (chunks of 2 positions): the IR makes the
    mask by ``band_mask`` (the program never does), the ring ops carry the window, and each
    sends 2 rows to each neighbour and nothing further (2 messages; causal attention: 3 whole
    blocks); no activation is gathered over cp. In bf16 the masks' casts go with them."""
    (x,), (y,) = long_batches(1)[0]
    plan = shardfx.partition(banded("mistral"), (x,), lm_loss, (y,), mesh={"cp": 4},
                             fused_loss=False)
    made = [n for n in plan.ir.graph.nodes if n.target is BAND_MASK]
    assert made and {n.kwargs["before"] for n in made} == {2}
    program = plan.program.module.graph
    assert not [n for n in program.nodes if n.target is BAND_MASK]
    bf16 = shardfx.partition(banded("mistral"), (x,), lm_loss, (y,), mesh={"cp": 2},
                             precision="bf16").program.module.graph
    assert not [n for n in bf16.nodes if n.target is BAND_MASK]
    assert [n for n in bf16.nodes if isinstance(n.target, RingAttention)]
    rings = [n for n in program.nodes if isinstance(n.target, RingAttention)]
    assert rings and {n.target.band for n in rings} == {Band(before=2, after=0)}
    q = rings[0].args[0].meta["val"]
    row = 2 * q.numel() // q.shape[2] * 4  # a row of keys and values, fp32
    assert rings[0].target.sends(q, q, q) == [2 * row] * 2
    assert {c.kind for c in plan.collectives if c.axis == "cp"} == {"all_reduce"}


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


@pytest.mark.parametrize("name", ["llama", "gpt2", "nanogpt", "mistral-window"])
def test_a_long_mask_is_checked_a_few_rows_at_a_time(monkeypatch, name):
    """A mask over ``BLOCK`` elements is computed and its rows read a block of query rows at a
    time (here 2 rows of 8): the same answers as whole (causal; Mistral's window of 3 keys).
    Each block's copy of the same mask is checked once."""
    from shardfx.passes import causal_mask

    monkeypatch.setattr(causal_mask, "BLOCK", 16)
    checked = []
    monkeypatch.setattr(causal_mask, "_classify",
                        lambda m, check=causal_mask._classify: checked.append(m) or check(m))
    plan = _partition(_build(name), mesh={"cp": 2})
    assert len(checked) <= 1, checked
    flash = [n for n in plan.ir.graph.nodes if n.target in (causal_mask.FLASH,
                                                            causal_mask.FLASH_BACKWARD)]
    masks = {str(band_of(n.kwargs["attn_mask"])) if "attn_mask" in n.kwargs else None
             for n in flash}
    assert flash and masks == ({"a sliding window of 3 keys (its own and the 2 before it)"}
                               if name == "mistral-window" else {None}), masks
    with pytest.raises(shardfx.ShardingError):
        _partition(_Encoder(every_other=True), mesh={"cp": 2})


class _Cached(_Encoder):
    """Keys and values appended to a cache of none yet, an empty 1-D tensor (Hugging Face's
    legacy caches; T5's and BART's decoders train with one unless told not to)."""

    def forward(self, ids):
        b, t = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        k, v = (torch.cat([x.new_zeros(0), x], dim=-2) for x in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.out(y.transpose(1, 2).reshape(b, t, 32)))


def test_a_cache_of_no_keys_yet_is_planned():
    """DTensor's rule for the concatenation asks the empty operand to be split on a dim it has
    not; shardfx takes another placement (was: KeyError in shard_propagate)."""
    plan = _partition(_Cached(), mesh={"cp": 2})
    assert [n for n in plan.program.module.graph.nodes if isinstance(n.target, RingAttention)]


@pytest.mark.parametrize("kw,words", [
    (dict(seq=SEQ - 4, mesh={"cp": 4}), "sequence length 4, not divisible by 2*cp=8"),
    (dict(seq=SEQ - 4, mesh={"cp": 2, "tp": 4}, shard="megatron-sp"),
     "sequence length 4, not divisible by cp*tp=8"),
])
def test_bad_requests_are_refused(kw, words):
    with pytest.raises(shardfx.ShardfxError) as e:
        _partition(tiny("llama"), **kw)
    assert words in str(e.value)
