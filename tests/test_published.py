"""bench/published.py: the published rows as read, translated into shardfx's arguments, and
priced (one row shrunk to plan in seconds on the meta device)."""

from __future__ import annotations

import dataclasses

import pytest

import shardfx

from bench.published import build, read_rows, price, summary, translate, weak_pairs
from shardfx.estimate.step_time import predict_step

ROWS = {row.id: row for row in read_rows()}


def test_every_row_reads_and_its_gpus_are_its_mesh():
    assert len(ROWS) == 15
    for row in ROWS.values():
        config = translate(row)
        assert row.dp * row.pp * row.cp * row.tp == row.gpus
        assert config.device_model in ("h100", "a100")
        size = 1
        for n in config.mesh.values():
            size *= n
        assert size == row.gpus, row.id
    assert weak_pairs(list(ROWS.values())) == [("llama31-70b-64", "llama31-70b-2048")]


def test_a_nemo_row_with_interleaving_cp_and_its_techniques():
    row = ROWS["llama31-70b-64"]
    assert (row.layers, row.hidden, row.ffn, row.kv_heads, row.vocab) == \
        (80, 8192, 28672, 8, 128256)
    assert row.measured_tokens() == pytest.approx(1121, rel=1e-3)  # the row's own figure
    config = translate(row)
    assert config.mesh == {"dp": 2, "pp": 4, "cp": 2, "tp": 4}
    assert config.kwargs == {"microbatches": 64, "precision": "bf16", "fused_loss": False,
                             "shard": "megatron-sp", "zero": 1, "recompute": "none",
                             "schedule": "interleaved-1f1b", "virtual_stages": 5}
    assert config.techniques == ("low-precision-weights", "vendor-attention", "vocab-parallel",
                                 "tp-overlap", "fused-elementwise", "grad-reduce-once",
                                 "param-gather-overlap", "optimizer-over-dp-cp")
    assert translate(ROWS["llama31-405b-512"]).unpriced == ("deferred embedding wgrad",)


def test_a_megatron_row_filled_from_its_scripts_and_measured_in_eq3():
    row = ROWS["sc21-145.6b"]
    assert (row.mbs, row.vp) == (2, 2)  # examples/sc21/run_table_1.sh
    config = translate(row)
    assert config.kwargs["microbatches"] == 2304 // (2 * 24)
    assert config.kwargs["recompute"] == "full" and config.kwargs["zero"] == 0
    assert config.kwargs["shard"] == "megatron" and config.device_model == "a100"
    # 148 TFLOP/s per GPU by Eq. 3 over 1536 GPUs
    step = row.eq3_flops() / (148e12 * 1536)
    assert row.measured_tokens() == pytest.approx(2304 * 2048 / (step * 1536))
    assert translate(ROWS["sc21-18.4b"]).techniques == \
        ("low-precision-weights", "vocab-parallel", "unfused-attention", "fused-elementwise",
         "grad-reduce-once")
    # Megatron's p2p scatter/gather where the messages are whole on each tp rank (no sp)
    assert "p2p-scatter-gather" in translate(ROWS["sc21-1t"]).techniques
    assert "p2p-scatter-gather" not in translate(ROWS["kort-175b-sel"]).techniques


def test_a_shrunk_row_plans_and_prices_both_ways():
    """kort-22b-sel's configuration (tp=8, sequence parallel, selective recompute, fp16 on
    the a100 model) on a 1-layer, 256-wide GPT: planned, priced as is and with its system's
    techniques: the LM head split by vocabulary, which only makes it faster, and Megatron's
    attention of 2022, unfused, which only makes it slower."""
    row = dataclasses.replace(ROWS["kort-22b-sel"], layers=1, hidden=256, ffn=1024, heads=8,
                              kv_heads=8, vocab=1024, seq=128)
    result = price(row)
    assert not result.refused, result.refused
    assert result.as_is.model == "a100"
    assert result.with_.assumed == ("low-precision-weights", "vocab-parallel",
                                    "unfused-attention", "fused-elementwise")
    plan = shardfx.partition(*build(row), mesh=result.config.mesh, device_model="a100",
                             **result.config.kwargs)
    faster = predict_step(plan, assume=("low-precision-weights", "vocab-parallel"))
    slower = predict_step(plan, assume=("unfused-attention",))
    assert faster.total < result.as_is.total < slower.total and result.memory > 0
    # with the weights in fp16 and the vocabulary split over tp=8: less to hold
    assert 0 < result.memory_with < result.memory
    text, figures = summary([result])
    assert figures["rows"] == 1 and "median" in text


def test_a_row_of_another_rows_recipe_takes_its_techniques():
    """llama31-70b-2048 is llama31-70b-64's recipe on 2048 GPUs ("same as"): tp's
    userbuffers overlap is on in both."""
    row = ROWS["llama31-70b-2048"]
    assert row.source == ROWS["llama31-70b-64"].source
    assert translate(row).techniques == translate(ROWS["llama31-70b-64"]).techniques
    assert "weak scaling of llama31-70b-64" in row.notes


def test_a_pipeline_reduces_cp_with_dp_once_a_step():
    """Megatron reduces a pipeline's gradients over dp x cp once a step; shardfx's program
    reduces them over cp in every microbatch's W part. grad-reduce-once prices Megatron's."""
    row = dataclasses.replace(ROWS["llama31-70b-64"], layers=2, hidden=256, ffn=512, heads=4,
                              kv_heads=2, vocab=512, seq=64, gbs=16, tp=1, pp=2, vp=1, dp=2,
                              gpus=8, sp=False)
    config = translate(row)
    assert "grad-reduce-once" in config.techniques
    model, args, loss, targets = build(row)
    plan = shardfx.partition(model, args, loss, targets, mesh=config.mesh,
                             device_model="h100", **config.kwargs)
    as_is, once = plan.predicted_step, predict_step(plan, assume=("grad-reduce-once",))
    assert once.communication < as_is.communication and once.total < as_is.total
