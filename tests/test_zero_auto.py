"""``zero="auto"`` (the default): the ZeRO stage is the plan's choice, the cheapest by the device
model that fits the memory. Plain dp where everything fits; under a budget plain dp cannot meet,
the stage that meets it; chosen with the placements by the solver on a mesh with tp; and the
chosen plans train like one device on real processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.auto import ilp
from shardfx.auto import zero_stage
from shardfx.run.config import RunConfig, zero_stage as zero_flag
from shardfx.cost.device_model import DeviceModel, Link
from shardfx.errors import InputError, MemoryBudgetError
from shardfx.ir import meta as M
from shardfx.estimate.memory import DeviceMemory
from shardfx.mesh import MeshSpec
from shardfx.auto.shard import AUTO
from shardfx.request.options import Options
from shardfx.auto.remat_search import advice
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches

_SLOW = {"float64": 1e9, "float32": 1e9, "bfloat16": 1e9, "float16": 1e9}
LINKS = DeviceModel("links", _SLOW, 1e12, {"intra": Link(1e8, 1e-5), "inter": Link(1e8, 1e-5)})


def _plan(mesh, **kw):
    (x,), (y,) = token_batches(1, 4)[0]
    return shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh=mesh, fused_loss=False,
                             **kw)


def _peaks(mesh, stages=(0, 1, 2, 3)) -> dict[int, int]:
    return {k: max(_plan(mesh, zero=k, shard="replicate").memory_estimate().values())
            for k in stages}


def test_each_stage_is_priced_by_what_it_moves_over_dp():
    """Per parameter byte over dp=4: stage 0's all-reduce and stage 2's reduce-scatter +
    all-gather move the same bytes, stages 1 and 3 half as much again; each collective pays
    its latency a bucket. Without a budget the cheapest is plain dp."""
    options = Options(mesh=MeshSpec.parse({"dp": 4}), zero="auto")
    stages = {s.k: s for s in zero_stage.stages(options, LINKS)}
    assert set(stages) == {0, 1, 2, 3}
    one = 2 * 3 / 4 / 1e8  # an all-reduce's bytes on the ring, per byte
    assert stages[0].per_byte == pytest.approx(one)
    assert stages[2].per_byte == pytest.approx(one)
    assert stages[1].per_byte == pytest.approx(1.5 * one)
    assert stages[3].per_byte == pytest.approx(1.5 * one)
    assert stages[0].state == 4 and stages[1].state == 2.5 and stages[3].state == 1.0
    assert zero_stage.choose(1e6, 1e3, 0, None, list(stages.values())).k == 0
    # 1 MB of parameters under AdamW: 4 MB plain, 2.5 MB under ZeRO-1, 1.75 MB under ZeRO-2
    assert zero_stage.choose(1e6, 1e3, 0, 3e6, list(stages.values())).k == 2
    assert zero_stage.choose(1e6, 1e3, 0, 1.2e6, list(stages.values())).k == 3
    assert zero_stage.allowed("auto", MeshSpec.parse({"dp": 2, "pp": 2})) == (0, 1, 2)
    assert zero_stage.allowed("auto", MeshSpec.parse({"tp": 2})) == (0,)


def test_plain_dp_where_everything_fits():
    plan = _plan({"dp": 2})
    assert plan.options.zero == 0 and plan.zero_chosen
    assert 'ZeRO: none (zero="auto")' in str(plan)


def test_inference_keeps_no_training_state_to_shard():
    (x,), _ = token_batches(1, 4)[0]
    plan = shardfx.partition(tiny("llama"), (x,), mesh={"dp": 2}, memory_budget="300KiB")
    assert plan.options.zero == 0


def test_a_budget_plain_dp_cannot_meet_takes_the_cheapest_stage_that_does():
    """Stage 2 moves what plain dp moves: chosen before stage 1 or 3 where it fits; where only
    stage 3 fits, stage 3; the plan as planned with that stage by hand."""
    peaks = _peaks({"dp": 2})
    assert peaks[0] > peaks[2] > peaks[3]  # tiny Llama: each stage holds less
    budget = (peaks[0] + peaks[2]) // 2
    plan = _plan({"dp": 2}, memory_budget=budget, shard="replicate")
    assert plan.options.zero == 2 and plan.remat is None
    assert max(plan.memory_estimate().values()) == peaks[2] <= budget
    assert "ZeRO-2 chosen" in str(plan)
    only_three = (peaks[2] + peaks[3]) // 2
    plan = _plan({"dp": 2}, memory_budget=only_three, shard="replicate")
    assert plan.options.zero == 3 and max(plan.memory_estimate().values()) == peaks[3]


SLOW_TP = (1e12, 1e6)  # dp's link and tp's, bytes per second


def _budget_over_dp_by_tp() -> int:
    """Under what plain replication holds on dp=2 x tp=2 (tiny Llama): 55% of its peak."""
    return int(0.55 * _peaks({"dp": 2, "tp": 2}, (0,))[0])


def test_the_solver_chooses_the_stage_with_the_placements(monkeypatch):
    """dp=2 x tp=2 under a budget replication cannot meet: the integer program weighs ZeRO over
    dp against splitting weights over tp by what each moves, then the memory model checks the
    stage. With tp on a slow link it keeps more weights whole, and takes ZeRO, than with tp on
    a fast one (where splits over tp may fit it alone); every plan fits its budget.
    (ZeRO-2 moves what plain dp moves: where it saves memory, it is free.) The search over memory's price stops early where it can: once its answer is proved
    within ``ilp.GAP``, proved no cheaper than a stage solved before, or where no price can
    prove more (bisecting the price tried every one in two of these searches)."""
    searches = _counting_searches(monkeypatch)
    free = _plan({"dp": 2, "tp": 2}, device_model=LINKS)
    assert free.ir.meta[AUTO].zero == 0 and free.ir.meta[AUTO].zero_chosen
    budget = _budget_over_dp_by_tp()
    whole = {}
    for name, links in (("slow tp", SLOW_TP), ("fast tp", (1e6, 1e12))):
        plan = _plan({"dp": 2, "tp": 2}, device_model=_by_links(*links), memory_budget=budget)
        report = plan.ir.meta[AUTO]
        if name == "slow tp":  # splitting over tp costs more than ZeRO's free memory
            assert report.zero > 0 and plan.options.zero > 0, name
        assert max(plan.memory_estimate().values()) <= budget, name
        whole[name] = sum(M.placements_str(p) == "RR" for p in report.params.values())
    assert whole["slow tp"] > whole["fast tp"], whole
    full = ilp.ROUNDS + 2  # the cheapest, the least memory, then each price
    assert all(runs < full for runs, _, _ in searches), searches  # none tries every price
    assert any(2 < runs < full and found for runs, found, above in searches), searches
    assert any(2 < runs < full and not found and above < np.inf
               for runs, found, above in searches), searches


def _counting_searches(monkeypatch) -> list[tuple[int, bool, float]]:
    """(HiGHS runs, whether it found a plan, the seconds to beat) of each ``ilp.solve`` under
    a budget from now on."""
    searches, runs = [], [0]
    run, solve = ilp._Program.run, ilp.solve

    def counted_run(self, objective):
        runs[0] += 1
        return run(self, objective)

    def counted_solve(problem, budget=None, *args, above=np.inf, **kw):
        runs[0] = 0
        solution = solve(problem, budget, *args, above=above, **kw)
        if budget is not None:
            searches.append((runs[0], solution is not None, above))
        return solution

    monkeypatch.setattr(ilp._Program, "run", counted_run)
    monkeypatch.setattr(ilp, "solve", counted_solve)
    return searches


def test_a_stage_given_is_kept():
    plan = _plan({"dp": 2}, zero=1)
    assert plan.options.zero == 1 and not plan.zero_chosen
    assert "zero=\"auto\"" not in str(plan)


def test_the_flag_and_the_config_take_auto():
    assert zero_flag("auto") == "auto" and zero_flag("2") == 2
    assert RunConfig.of("m:f", "dp=2", zero="auto").parallel.zero == "auto"
    assert RunConfig().parallel.zero == "auto"
    with pytest.raises(InputError, match="zero"):
        RunConfig.of("m:f", "dp=2", zero="two")


def _train(cases):
    out = []
    for mesh, budget, *model in cases:
        kw = {"device_model": _by_links(*model[0])} if model else {}
        report = compare_training(tiny("llama"), token_batches(3, 4), lm_loss, mesh=mesh,
                                  memory_budget=budget, fused_loss=False, **kw)
        out.append((mesh, report.max(), report.plan.options.zero))
    return out


def _by_links(dp_link: float, tp_link: float) -> DeviceModel:
    """Links by the byte, no latency: dp=2 x tp=2 on two "nodes" of 2, tp inside one."""
    return DeviceModel(f"dp {dp_link:g} B/s, tp {tp_link:g} B/s", _SLOW, 1e12,
                       {"intra": Link(tp_link, 0.0), "inter": Link(dp_link, 0.0)},
                       devices_per_node=2)


def test_the_chosen_stage_trains_like_one_device():
    peaks = _peaks({"dp": 2})
    rows = shardfx.launch(_train, [({"dp": 2}, None), ({"dp": 2}, (peaks[0] + peaks[2]) // 2),
                                   ({"dp": 2}, (peaks[2] + peaks[3]) // 2)],
                          nprocs=2, timeout=180, deadline=600)
    (_, e0, z0), (_, e2, z2), (_, e3, z3) = rows[0]
    assert (z0, z2, z3) == (0, 2, 3)
    assert max(e0, e2, e3) < 1e-5, (e0, e2, e3)


def test_the_solvers_stage_and_placements_train_like_one_device():
    """dp=2 x tp=2 under a budget: a ZeRO stage and weights split over tp, as the solver chose
    them, on 4 real processes."""
    rows = shardfx.launch(_train, [({"dp": 2, "tp": 2}, _budget_over_dp_by_tp(), SLOW_TP)],
                          nprocs=4, timeout=180, deadline=600)
    ((_, error, zero),) = rows[0]
    assert zero > 0 and error < 1e-5, (zero, error)


def test_the_budget_advice_names_the_stage_the_plan_has():
    """Where the training state dominates a peak no budget-fitting can lower, the advice says
    to shard it over dp, unless the plan already does: then it names the stage (and that
    ``zero="auto"`` chose it) and what is left to try."""
    state = DeviceMemory(parameters=100, gradients=100, optimizer=200, transient=10)
    assert "zero=1|2|3" in advice(state)
    given = advice(state, 3, 2)
    assert "already split over dp=2 by ZeRO-3" in given and "zero=1|2|3" not in given
    assert "zero=\"auto\"" not in given and "zero=\"auto\"" in advice(state, 2, 4, chosen=True)
    assert "a higher stage (zero=2|3)" in advice(state, 1, 2)
    assert advice(DeviceMemory(parameters=1, transient=10), 3, 2).startswith("activations")


def test_a_budget_no_stage_meets_names_the_stage_in_its_fix():
    """The advice reaches the error ``partition`` raises: an MLP whose weights dominate, under
    a budget far below what ZeRO-2 over dp=2 holds."""
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    with pytest.raises(MemoryBudgetError) as e:
        shardfx.partition(mlp, (torch.randn(2, 256),), F.mse_loss, (torch.randn(2, 4),),
                          mesh={"dp": 2}, memory_budget=50_000, zero=2)
    assert "already split over dp=2 by ZeRO-2: a higher stage (zero=3)" in e.value.fix
    assert "zero=1|2|3" not in e.value.fix
