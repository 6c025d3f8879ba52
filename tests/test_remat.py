"""Rematerialization under ``memory_budget`` (``passes.remat``): at 60% of the unconstrained
peak, the plan recomputes activations in the backward, its measured peak is under the budget,
and training equals eager (``shardfx.testing.compare_training``): on one device, tp=2,
pp=2 under 1F1B, and pp=2 asked for GPipe, where the plan runs 1F1B with fewer microbatches
in flight instead (``shardfx.budget``); dropout masks recompute exactly; an impossible budget is a named error."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.measure import measured_peak
from shardfx.passes.stage_cut import block_of
from shardfx.testing import adamw, compare_training

from models import lm_loss, tiny, token_batches

# Activations dominate at 8 layers and 32 rows: a budget of 60% is met by recomputing them.
LAYERS, ROWS, SHARE = 8, 32, 0.6


def budget_for(share: float = SHARE, **kw) -> int:
    """``share`` of the unconstrained plan's predicted peak on its fullest device."""
    batches = token_batches(1, batch=ROWS)
    plan = shardfx.partition(tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1], **kw)
    return int(share * max(plan.memory_estimate().values()))


def trained_under_budget(share: float = SHARE, **kw) -> tuple[int, int, int, str]:
    """On this rank: (budget, predicted, measured) and the plan's text, after checking two
    steps against eager with remat on."""
    budget = budget_for(share, **kw)
    batches = token_batches(3, batch=ROWS)
    compare_training(tiny("llama", LAYERS), batches[:2], lm_loss, memory_budget=budget, **kw)
    plan = shardfx.partition(tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1],
                             memory_budget=budget, **kw)
    runner = plan.runner(adamw)
    runner.step(*batches[0])
    (x,), (y,) = batches[1]
    peak = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return budget, plan.memory_estimate()[rank], peak.total - x.nbytes - y.nbytes, str(plan)


def check(budget: int, predicted: int, measured: int, text: str) -> None:
    assert measured <= budget, (budget, measured)
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    assert "Rematerialization under memory_budget" in text and "ops recomputed" in text


def test_one_device_under_budget_and_equal_to_eager():
    check(*trained_under_budget())


@pytest.mark.parametrize("kw", [dict(mesh={"tp": 2}),
                                dict(mesh={"pp": 2}, microbatches=4, schedule="1f1b"),
                                dict(mesh={"pp": 2}, microbatches=4, schedule="gpipe",
                                     share=0.35)],
                         ids=["tp2", "pp2-1f1b", "pp2-gpipe-35%"])
def test_under_budget_on_a_mesh(kw):
    for row in shardfx.launch(_trained, kw, nprocs=2):
        check(*row)


def _trained(kw: dict):
    return trained_under_budget(**kw)


def test_a_pipeline_chooses_what_to_save_and_how_many_microbatches_in_flight():
    """GPipe keeps all 4 microbatches in flight; under 35% of its peak, 1F1B capped at 2
    recomputes less and its step is shorter, so the plan runs that (shardfx.budget)."""
    kw = dict(mesh={"pp": 2}, microbatches=4, schedule="gpipe")
    budget = budget_for(share=0.35, **kw)
    batches = token_batches(1, batch=ROWS)
    plan = shardfx.partition(tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1],
                             memory_budget=budget, **kw)
    assert max(plan.memory_estimate().values()) <= budget
    tried = {c.name: c for c in plan.budget_candidates}
    assert list(tried) == ["gpipe", "1f1b, at most 2 in flight", "1f1b, at most 1 in flight"]
    gpipe, capped, serial = tried.values()
    assert gpipe.fits and capped.fits and serial.skipped  # one at a time: slower, unfitted
    assert plan.schedule is capped.schedule and capped.step < gpipe.step
    assert capped.recompute_flops < gpipe.recompute_flops
    assert "-> 1f1b, at most 2 in flight" in str(plan)


def test_recomputed_ops_are_in_the_backward_and_the_dump(tmp_path):
    batches = token_batches(1, batch=ROWS)
    plan = shardfx.partition(tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1],
                             memory_budget=budget_for())
    assert plan.remat is not None and plan.remat.recomputed
    assert sum(plan.remat.saved_after.values()) < sum(plan.remat.saved_before.values())
    copies = [n for n in plan.ir.graph.nodes if "shardfx.remat" in n.meta]
    assert copies and all(str(n.meta["shardfx.phase"]) == "bwd" for n in copies)
    out = plan.dump(tmp_path)
    assert (out / f"{len(plan.history) - 1:02d}-remat.txt").exists()
    # the blocks share one choice: every layer recomputes the same number of ops
    per_layer = [sum(block_of(n) == f"model.layers.{i}" for n in copies) for i in range(LAYERS)]
    assert len(set(per_layer)) == 1 and per_layer[0] > 0, per_layer


def test_a_budget_that_fits_recomputes_nothing():
    batches = token_batches(1, batch=ROWS)
    plan = shardfx.partition(tiny("llama", 2), *batches[0][:1], lm_loss, batches[0][1],
                             memory_budget="1GiB")
    assert plan.remat is None and "fits without recomputing" in str(plan)


def test_dropout_recomputes_the_same_masks():
    """GPT-2 with its dropouts on: the same seed, with and without remat, trains the same."""
    import transformers as T

    from models import HIDDEN, SEQ, VOCAB

    def build():
        torch.manual_seed(0)
        return T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=6, n_embd=HIDDEN, n_head=4, n_positions=2 * SEQ, vocab_size=VOCAB,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)).train()

    batches = token_batches(2, batch=ROWS)
    x, y = batches[0]
    full = shardfx.partition(build(), x, lm_loss, y)
    budget = int(SHARE * full.memory_estimate()[0])
    runs = []
    for kw in ({}, {"memory_budget": budget}):
        plan = shardfx.partition(build(), x, lm_loss, y, **kw)
        torch.manual_seed(1)  # the runners draw the same dropout seed
        runner = plan.runner(adamw)
        losses = torch.stack([runner.step(a, t) for a, t in batches])
        runs.append((plan, losses, runner.state_dict()))
    (_, want, state), (plan, got, state2) = runs
    # the masks themselves are recomputed in the backward (a hash of fixed inputs: passes.rng)
    assert any(n.startswith("native_dropout") and n.endswith("_mask") for n in plan.remat.recomputed)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for name in state:
        torch.testing.assert_close(state2[name], state[name], rtol=1e-6, atol=1e-7)


def test_impossible_budget_names_the_smallest_and_what_dominates():
    batches = token_batches(1, batch=ROWS)
    with pytest.raises(shardfx.MemoryBudgetError) as info:
        shardfx.partition(tiny("llama", 2), *batches[0][:1], lm_loss, batches[0][1],
                          memory_budget="100KiB")
    text = str(info.value)
    assert "no plan fits memory_budget=102400" in text and "a budget of at least" in text
    assert "optimizer" in text and "parameters" in text
