"""``search.space``: every way to run a step on N devices that a model allows, each once, each a
valid request; the published configurations among them."""

from __future__ import annotations

import math

from shardfx.cluster.space import Candidate, Shape, candidates, factorizations

LLAMA_8B = Shape(layers=32, heads=32, kv_heads=8, seq=8192, batch=128)


def test_factorizations_are_every_ordered_product_once():
    got = list(factorizations(12, 3))
    assert len(got) == len(set(got)) == 18 and all(math.prod(f) == 12 for f in got)


def test_each_candidate_once_and_each_within_what_the_model_allows():
    seen = set()
    for c in candidates(64, LLAMA_8B):
        assert c not in seen
        seen.add(c)
        axes = dict(c.mesh)
        assert math.prod(axes.values()) == 64
        tp, cp, pp = c.axis("tp"), c.axis("cp"), c.axis("pp")
        assert 32 % tp == 0 and 8 % tp == 0 and tp <= 8
        assert 8192 % (2 * cp) == 0 and pp <= 32
        assert c.axis("dp_replicate") * c.axis("dp") * c.mbs * c.microbatches == 128
        assert pp == 1 or c.microbatches >= pp
        assert c.zero == 0 or c.axis("dp") > 1
        assert not (c.zero == 3 and pp > 1) and c.axis("ep") == 1  # no experts
        if c.schedule == "interleaved-1f1b":
            assert 32 % (pp * c.virtual_stages) == 0 and c.microbatches % pp == 0
    assert len(seen) > 1000


def test_fixed_axes_are_kept_and_published_configurations_are_in_the_space():
    fixed = list(candidates(64, LLAMA_8B, {"tp": 4, "pp": 4}))
    assert fixed and all(c.axis("tp") == 4 and c.axis("pp") == 4 for c in fixed)
    # NeMo's Llama-3.1-8B on 8 H100s: cp=2 x dp=4, mbs 1, distributed optimizer (ZeRO-1)
    nemo = Candidate((("dp", 4), ("cp", 2)), mbs=1, microbatches=32, zero=1)
    assert nemo in set(candidates(8, LLAMA_8B))
    assert nemo.options() == dict(mesh={"dp": 4, "cp": 2}, microbatches=32, zero=1,
                                  recompute="none", shard="megatron")
    assert str(nemo) == "dp=4 x cp=2, 32 microbatches of 1, zero=1, recompute=none"


def test_experts_allow_ep_and_a_dense_model_does_not():
    moe = Shape(layers=4, heads=4, kv_heads=2, experts=8, seq=64, batch=16)
    assert any(c.axis("ep") == 8 for c in candidates(8, moe))
    assert not any(c.axis("ep") > 1 for c in candidates(8, LLAMA_8B))
