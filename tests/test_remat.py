"""Rematerialization under ``memory_budget`` (``auto.remat``): at 60% of the unconstrained
peak, the plan recomputes activations in the backward, its measured peak is under the budget,
and training equals eager (``shardfx.testing.compare_training``): on one device, tp=2,
pp=2 under 1F1B, and pp=2 asked for GPipe, where the plan runs 1F1B with fewer microbatches
in flight instead (``shardfx.compiler.budget``); dropout masks recompute exactly; an impossible budget is a named error."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.ir import meta as M
from shardfx.runtime.measure import measured_peak
from shardfx.auto.remat import redistributed
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


def trained_under_budget(share: float = SHARE, **kw) -> tuple[int, int, int, shardfx.Plan]:
    """On this rank: (budget, predicted, measured) and the plan, after checking two steps
    against eager with remat on."""
    budget = budget_for(share, **kw)
    batches = token_batches(3, batch=ROWS)
    report = compare_training(tiny("llama", LAYERS), batches[:2], lm_loss,
                              memory_budget=budget, **kw)
    plan, runner = report.plan, report.runner  # its optimizer's state exists by now
    (x,), (y,) = batches[2]
    peak = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return budget, plan.memory_estimate()[rank], peak.total - x.nbytes - y.nbytes, plan


def check(budget: int, predicted: int, measured: int, text: str) -> None:
    assert measured <= budget, (budget, measured)
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    assert "Rematerialization under memory_budget" in text and "ops recomputed" in text


def test_one_device_under_budget_and_equal_to_eager():
    *row, plan = trained_under_budget()
    check(*row, str(plan))
    # what is recomputed, by module, a block's index as *
    assert "recomputed, by module: model.layers.*." in " ".join(str(plan).split())


@pytest.mark.parametrize("kw", [dict(mesh={"tp": 2}, shard="megatron"),
                                # 33%: the residual adds are recomputed from the all-reduced
                                # row-parallel outputs, the all-reduce run again
                                dict(mesh={"tp": 2}, shard="megatron", share=0.33,
                                     fused_loss=False),
                                dict(mesh={"pp": 2}, microbatches=4, schedule="1f1b"),
                                # 35% of the fused plan's peak, where the schedules below
                                # were chosen between
                                dict(mesh={"pp": 2}, microbatches=4, schedule="gpipe",
                                     share=0.35, fused_loss=True)],
                         ids=["tp2", "tp2-33%", "pp2-1f1b", "pp2-gpipe-35%"])
def test_under_budget_on_a_mesh(kw):
    for budget, predicted, measured, text, tried, through in shardfx.launch(_trained, kw,
                                                                            nprocs=2):
        check(budget, predicted, measured, text)
        if kw["mesh"] == {"pp": 2}:
            chose_in_pipeline(kw["schedule"], tried, text)
        if kw.get("share") == 0.33:  # one residual add a block, after the attention
            assert len(through) == LAYERS and all(a.startswith("add") for a in through), through


def _trained(kw: dict):
    *row, plan = trained_under_budget(**kw)
    tried = [(c.name, c.fits, c.skipped, c.step, c.recompute_flops, c.schedule is plan.schedule)
             for c in plan.budget_candidates]
    through = [n.meta[M.REMAT] for n in plan.ir.graph.nodes if M.REMAT in n.meta and
               redistributed(n)]  # recomputed from a value a collective brings
    return *row, str(plan), tried, through


def chose_in_pipeline(schedule: str, tried: list, text: str) -> None:
    """What shardfx.compiler.budget tried. 1F1B at 60% fits recomputing; one microbatch in flight is
    slower even recomputing nothing, so it is not fitted. GPipe keeps all 4 microbatches in
    flight; at 35% of its peak, 1F1B capped at 2 recomputes less and its step is shorter, so
    the plan runs that."""
    names = [t[0] for t in tried]
    if schedule == "1f1b":
        assert names == ["1f1b", "1f1b, at most 1 in flight"], names
        (_, fits, _, _, _, chosen), (_, _, skipped, *_) = tried
        assert fits and chosen and skipped
        return
    assert names == ["gpipe", "1f1b, at most 2 in flight", "1f1b, at most 1 in flight"], names
    gpipe, capped, serial = tried
    assert gpipe[1] and capped[1] and serial[2]  # fits, fits, skipped
    assert capped[5] and capped[3] < gpipe[3] and capped[4] < gpipe[4]  # chosen, faster, less
    assert "-> 1f1b, at most 2 in flight" in text


def test_recomputed_ops_are_in_the_backward_and_the_dump(tmp_path):
    batches = token_batches(1, batch=ROWS)
    plan = shardfx.partition(tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1],
                             memory_budget=budget_for())
    assert plan.remat is not None and plan.remat.recomputed
    assert sum(plan.remat.saved_after.values()) < sum(plan.remat.saved_before.values())
    copies = [n for n in plan.ir.graph.nodes if "shardfx.remat" in n.meta]
    assert copies and all(str(n.meta["shardfx.phase"]) == "bwd" for n in copies)
    out = plan.dump(tmp_path)
    names = [r.name for r in plan.history]
    assert (out / f"{names.index('remat'):02d}-remat.txt").exists()
    assert "chunked_loss" in names[names.index("remat"):]  # the program passes ran again
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


def test_a_pipeline_no_budget_fits_is_searched_at_one_microbatch_in_flight(monkeypatch):
    """Where the schedule asked for does not fit, 1F1B with one microbatch in flight is fitted
    next, and where that does not fit either the search ends there: fewer in flight holds no
    more at any moment. The lowest peak it states is met (pp=4: two searches, not four)."""
    from shardfx.compiler import budget
    from shardfx.schedule import peak_in_flight

    fitted = []
    fit_schedule = budget._fit_schedule
    monkeypatch.setattr(budget, "_fit_schedule", lambda plan, limit: (
        fitted.append(plan.schedule), fit_schedule(plan, limit))[1])
    batches = token_batches(1, batch=ROWS)
    kw = dict(mesh={"pp": 4}, microbatches=8, schedule="1f1b")
    with pytest.raises(shardfx.MemoryBudgetError) as info:
        shardfx.partition(tiny("llama", 4), *batches[0][:1], lm_loss, batches[0][1],
                          memory_budget=1, **kw)
    assert "with 1f1b, at most 1 in flight" in str(info.value)
    assert len(fitted) == 2 and max(peak_in_flight(fitted[1]).values()) == 1, fitted
    plan = shardfx.partition(tiny("llama", 4), *batches[0][:1], lm_loss, batches[0][1],
                             memory_budget=info.value.least.total, **kw)
    assert max(plan.memory_estimate().values()) <= info.value.least.total


def test_zero_bubble_under_a_budget_recomputes():
    """Under a split backward the values W parts read stay kept; the views of them W reads
    come back for free from their kept bases. (Before, those views could be neither kept nor
    recomputed, no choice existed and nothing was recomputed: every budget under the plan's
    own peak was refused.)"""
    (x,), (y,) = token_batches(1, 16)[0]
    kw = dict(mesh={"pp": 2}, microbatches=2, schedule="zero-bubble")
    peak = max(shardfx.partition(tiny("llama", 4), (x,), lm_loss, (y,), **kw)
               .memory_estimate().values())
    plan = shardfx.partition(tiny("llama", 4), (x,), lm_loss, (y,), memory_budget=int(0.95 * peak),
                             **kw)
    assert plan.remat is not None and plan.remat.recomputed
    assert max(plan.memory_estimate().values()) <= 0.95 * peak
