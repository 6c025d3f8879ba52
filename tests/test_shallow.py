"""A memory budget on a deep model: each candidate judged on shallow copies of it
(``shardfx.compiler.shallow``) predicts what the whole program's estimate says, the plan chosen is the
one judging on the whole program chooses, a prediction that falls short is corrected on the
whole program, and the plan trains as eager does."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import shardfx
from shardfx.compiler import shallow
from shardfx.compiler.budget import evaluate
from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.ir.text import ir_to_text
from shardfx.partitioner.capture import capture
from shardfx.auto import remat
from shardfx.auto import remat_search
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches

LAYERS, ROWS = shallow.DEEP, 16


def plan_of(budget=None, model=None):
    (x,), (y,) = token_batches(1, ROWS)[0]
    return shardfx.partition(model or tiny("llama", LAYERS), (x,), lm_loss, (y,),
                             memory_budget=budget)


def test_a_capture_cut_to_fewer_blocks_is_the_capture_of_the_shallower_model():
    (x,), (y,) = token_batches(1)[0]
    deep = capture(tiny("llama", 6), (x,), lm_loss, (y,))
    assert deep.depth == 6
    assert ir_to_text(deep.at_depth(6)) == ir_to_text(deep.gm)
    for blocks in (2, 3):  # the traced pair alone, and one block stamped
        shallower = capture(tiny("llama", blocks), (x,), lm_loss, (y,))
        assert ir_to_text(deep.at_depth(blocks)) == ir_to_text(shallower.gm)
    with pytest.raises(ValueError, match="cannot cut it to 1"):
        deep.at_depth(1)


def test_shallow_copies_predict_the_whole_programs_peak():
    plan = plan_of()
    problem = remat.Problem(plan.ir, remat_search.device_group, remat_search.held_once)
    judge = shallow._Shallow.of(plan, problem)
    assert judge is not None and judge.depths == (2, 4)
    fewest = problem.kept_bytes(problem.smallest()[0])["device"]
    every = problem.kept_bytes(problem.must & problem.can_keep)["device"]
    candidates = [None, problem.smallest()] + [
        problem.solve({"device": int(fewest + share * (every - fewest))})
        for share in (0.25, 0.5, 0.75)]
    for solution in candidates:
        predicted = judge.judge(solution)["device"]
        if solution is None:
            whole = evaluate(plan)["device"]
        else:
            whole = remat_search.trial_memory(plan.ir, problem, solution,
                                              lambda: evaluate(plan))["device"]
        assert (predicted.total, predicted.when.split(",")[0]) == \
            (whole.total, whole.when.split(",")[0])


def test_shallow_copies_predict_a_zero3_plan_within_a_bucket():
    """ZeRO-3 on dp=2 (a meta Llama, planned only): the reduce-scatter buckets fall a little
    differently across blocks at each depth, so the line may be off by part of a bucket."""
    import torch
    import transformers as T

    config = T.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=512, intermediate_size=1408,
                           num_attention_heads=8, num_key_value_heads=8, vocab_size=1000)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    ids = torch.randint(0, 1000, (8, 128), device="meta")
    plan = shardfx.partition(model, (ids,), lm_loss, (ids,), mesh={"dp": 2}, zero=3)
    problem = remat.Problem(plan.ir, remat_search.device_group, remat_search.held_once)
    judge = shallow._Shallow.of(plan, problem)
    assert judge is not None  # 12.6 MB of gradients a block: two buckets in 5
    for solution in (None, problem.smallest()):
        predicted = judge.judge(solution)["device"].total
        whole = (evaluate(plan) if solution is None else
                 remat_search.trial_memory(plan.ir, problem, solution,
                                           lambda: evaluate(plan)))["device"]
        assert abs(predicted - whole.total) <= BUCKET_BYTES, (predicted, whole)


@pytest.mark.slow  # bench/plan_budget compares the two at 4, 16 and 80 layers
def test_the_plan_and_the_stated_minimum_are_the_whole_programs(monkeypatch):
    top = plan_of().memory_estimate()[0]
    chosen = {}
    for name, deep in (("shallow", shallow.DEEP), ("whole", 10 ** 9)):
        monkeypatch.setattr(shallow, "DEEP", deep)
        with pytest.raises(shardfx.MemoryBudgetError) as info:
            plan_of(1)
        least = info.value.least.total
        plan = plan_of((least + top) // 2)
        chosen[name] = least, plan.remat.recomputed, plan.memory_estimate()[0]
    assert chosen["shallow"] == chosen["whole"]
    least, recomputed, peak = chosen["shallow"]
    assert recomputed and peak <= (least + top) // 2


def test_a_prediction_that_falls_short_is_corrected_on_the_whole_program(monkeypatch, caplog):
    """Shallow copies that understate every peak by 3%: the choice they make is over the
    budget on the whole program, and the search runs again against less."""
    top = plan_of().memory_estimate()[0]
    real = shallow._extend

    def short(*args):
        m = real(*args)
        return dataclasses.replace(m, transient=m.transient - m.total * 3 // 100)

    monkeypatch.setattr(shallow, "_extend", short)
    budget = int(top * 0.8)
    with caplog.at_level(logging.INFO, logger="shardfx.compiler.budget"):
        plan = plan_of(budget)
    assert plan.memory_estimate()[0] <= budget
    verified = [r.message for r in caplog.records if "predicted" in r.message]
    assert len(verified) >= 2, verified  # one over the budget, then one corrected


def test_a_deep_model_under_a_budget_trains_as_eager_does(caplog):
    top = plan_of().memory_estimate()[0]
    with caplog.at_level(logging.INFO, logger="shardfx.compiler.budget"):
        report = compare_training(tiny("llama", LAYERS), token_batches(2, ROWS), lm_loss,
                                  memory_budget=int(top * 0.8))
    assert report.plan.remat is not None
    assert any("shallow copies predicted" in r.message for r in caplog.records)
