"""``shardfx.search``: the candidates for N devices, priced from shallow plans composed, the
fastest planned in full; its first choice trains equal to one device; a device count no mesh
fits and a budget no candidate meets are named errors."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.errors import InputError, MemoryBudgetError, SearchError
from shardfx.cluster.blocks import Blocks
from shardfx.cluster.compose import price
from shardfx.cluster.space import Candidate
from shardfx.api import request
from shardfx.cost.device_model import PRESETS
from shardfx.mesh import MeshSpec
from shardfx.run.choose import choose_mesh
from shardfx.run.config import RunConfig, check_fields
from shardfx.testing import compare_training

from models import SEQ, lm_loss, tiny, token_batches

LAYERS, ROWS = 4, 8


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", LAYERS)


@pytest.fixture(scope="module")
def found(llama):
    (args, targets), = token_batches(1, ROWS)
    return shardfx.search(llama, args, lm_loss, targets, devices=4, max_mbs=1, finalists=2)


def test_candidates_are_ranked_and_the_first_is_planned(found):
    steps = [r.predicted_step for r in found]
    assert steps == sorted(steps) and len(found) > 10
    assert found.best.planned is not None and found.best.agreement is not None
    assert {r.candidate.axis("dp") * r.candidate.axis("dp_replicate") * r.candidate.axis("pp")
            * r.candidate.axis("tp") * r.candidate.axis("cp") for r in found} == {4}
    text = str(found)
    assert text.count("\n| ") >= 11 and f"first: {found.best.candidate}" in text
    best = found.best
    assert best.tokens_per_s == pytest.approx(ROWS * SEQ / (best.predicted_step * 4))
    assert 0 < best.mfu < 1 and best.memory > 0


def test_the_composed_price_is_the_plan_where_the_pass_is_the_whole(llama):
    """tp alone: the step is one pass of the tp mesh and the optimizer, nothing composed
    around it: the price is the plan's predicted step. A pipeline's is the line at a stage's
    blocks and the schedule's bubble: within 10%."""
    (args, targets), = token_batches(1, ROWS)
    _, options = request(llama, args, lm_loss, None, shard="megatron")
    blocks = Blocks(llama, args, lm_loss, targets, options)
    for c, close in ((Candidate((("tp", 4),), ROWS, 1), 1e-9),
                     (Candidate((("pp", 2), ("tp", 2)), 2, 4, 0, "none", "1f1b"), 0.1)):
        line = blocks.line(c.axis("tp"), c.axis("cp"), c.axis("ep"), c.mbs, c.recompute)
        got = price(c, line, options.device_model).step
        want = shardfx.partition(llama, args, lm_loss, targets, **c.options()).predicted_step
        assert got == pytest.approx(want.total, rel=close), c


def test_fixed_axes_are_kept(llama):
    (args, targets), = token_batches(1, ROWS)
    found = shardfx.search(llama, args, lm_loss, targets, devices=4, mesh={"tp": 2},
                           max_mbs=1, recompute=("none",), finalists=1)
    assert {r.candidate.axis("tp") for r in found} == {2}


@pytest.mark.multiprocess
def test_the_first_choice_trains_equal_to_one_device(found, llama):
    shardfx.launch(_train, found.best.candidate.options(), nprocs=4, timeout=300, deadline=900)


def _train(options: dict) -> None:
    report = compare_training(tiny("llama", LAYERS), token_batches(2, ROWS), lm_loss, **options)
    assert report.plan.mesh.size == 4


def test_a_device_count_no_mesh_fits_is_named(llama):
    (args, targets), = token_batches(1, 2)
    with pytest.raises(SearchError) as e:
        shardfx.search(llama, args, lm_loss, targets, devices=7)
    assert "no mesh of 7 devices" in str(e.value) and "use 4 or 8 devices" in str(e.value)


def test_a_budget_no_candidate_meets_is_named(llama):
    (args, targets), = token_batches(1, ROWS)
    with pytest.raises(MemoryBudgetError) as e:
        shardfx.search(llama, args, lm_loss, targets, devices=2, memory_budget="1KB", max_mbs=1,
                       recompute=("none",))
    assert "the least memory is" in str(e.value) and "more devices" in str(e.value)


@pytest.mark.parametrize("kw, says", [({"devices": 0}, "devices must be a positive int"),
                                      ({"devices": 4, "mesh": {"tq": 2}}, "unknown mesh axis"),
                                      ({"devices": 4, "mesh": {"tp": 3}}, "does not divide")])
def test_bad_requests_are_named(llama, kw, says):
    (args, targets), = token_batches(1, ROWS)
    with pytest.raises(InputError, match=says):
        shardfx.search(llama, args, lm_loss, targets, **kw)


def test_a_run_with_mesh_auto_takes_the_search_s_first_choice():
    config = RunConfig.of("examples/nanogpt.py:workload", mesh="auto", devices=2, steps=1)
    check_fields(config)
    choose_mesh(config)
    assert MeshSpec.parse(config.mesh).size == 2 and config.devices is None
    check_fields(config)  # a mesh as a user would give it


@pytest.mark.parametrize("kw, says", [({"mesh": "auto"}, 'mesh = "auto" without devices'),
                                      ({"mesh": "dp=2", "devices": 2}, "devices = 2 with")])
def test_mesh_auto_and_devices_go_together(kw, says):
    with pytest.raises(InputError, match=says):
        check_fields(RunConfig.of("examples/nanogpt.py:workload", **kw))


def test_mfu_is_palm_s_model_flops_over_the_peak_of_the_compute_dtype(llama):
    (args, targets), = token_batches(1, ROWS)
    found = shardfx.search(llama, args, lm_loss, targets, devices=2, device_model="h100",
                           precision="bf16", max_mbs=1, recompute=("none",), finalists=1)
    config, best = llama.config, found.best
    params = sum(p.numel() for p in llama.parameters()) - config.vocab_size * config.hidden_size
    per_token = 6 * params + 12 * LAYERS * config.hidden_size * SEQ
    peak = PRESETS["h100"].peak(torch.bfloat16)
    assert best.mfu == pytest.approx(best.tokens_per_s * per_token / peak)
