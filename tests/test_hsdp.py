"""HSDP (a ``dp_replicate`` axis beside dp): ZeRO shards within each dp group, the groups are
replicas whose gradients' rows are all-reduced across them. The program's collectives, the
cost and memory models, print(plan), bad meshes, training equal to one device and
checkpoints that move between HSDP and plain ZeRO, on real processes (gloo)."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.auto import zero_stage
from shardfx.codegen.redistribute import Purpose
from shardfx.cost.device_model import DeviceModel, Link
from shardfx.errors import InputError, PipelineError
from shardfx.mesh import MeshSpec
from shardfx.request.options import Options

from models import lm_loss, tiny, token_batches
from test_zero import _check, _train

HSDP = {"dp_replicate": 2, "dp": 2}
c10d = torch.ops._c10d_functional


def plan_of(zero: int, mesh=HSDP, name: str = "llama") -> shardfx.Plan:
    (x,), (y,) = token_batches(1, 4)[0]
    return shardfx.partition(tiny(name), (x,), lm_loss, (y,), mesh=mesh, zero=zero,
                             shard="replicate")


def _gradient_traffic(plan: shardfx.Plan) -> dict[tuple[str, str], int]:
    """(axis, kind) -> bytes of the collectives that reduce gradients."""
    out: dict[tuple[str, str], int] = {}
    for c in plan.collectives:
        if c.purpose in (Purpose.ZERO, Purpose.BUCKET) and c.kind != "all_gather":
            out[c.axis, c.kind] = out.get((c.axis, c.kind), 0) + c.nbytes
    return out


@pytest.mark.parametrize("zero", [2, 3])
def test_the_replicas_all_reduce_only_each_ranks_rows(zero):
    """Under ZeRO-2/3 no whole gradient crosses the replicas: each bucket's reduce-scatter over
    dp is followed by an all-reduce of its rows over dp_replicate, 1/dp of its bytes, issued
    once the next bucket's reduce-scatter is (the last's before the output)."""
    plan = plan_of(zero)
    traffic = _gradient_traffic(plan)
    assert set(traffic) == {("dp", "reduce_scatter"), ("dp_replicate", "all_reduce")}, traffic
    assert traffic["dp_replicate", "all_reduce"] * 2 == traffic["dp", "reduce_scatter"]
    graph = plan.program.module.graph
    groups = {n.args[2].name for n in graph.find_nodes(op="call_function",
                                                       target=c10d.all_reduce.default)
              if n.args[1] == "sum" and n.meta["val"].numel() > 1}
    assert groups == {"group_dp_replicate"}, groups  # no gradient all-reduced whole over dp
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    replicas = sorted(n for n in order if n.endswith("_replicas_all_reduce"))
    assert replicas and all(order[f"{r.removesuffix('_replicas_all_reduce')}_reduce_scatter"]
                            < order[r] for r in replicas)


def test_without_zero_the_whole_gradients_are_summed_over_both_axes():
    traffic = _gradient_traffic(plan_of(0))
    assert traffic["dp", "all_reduce"] == traffic["dp_replicate", "all_reduce"] > 0


def test_the_memory_model_shards_over_dp_only():
    """Each rank of a dp=2 group keeps what it keeps on plain dp=2: the replicas hold the same
    rows, they divide nothing."""
    for zero in (1, 3):
        assert list(plan_of(zero).state_rows().values()) == \
            list(plan_of(zero, {"dp": 2}).state_rows().values())
    assert "HSDP: 2 replicas of the dp=2 group" in str(plan_of(3))


def test_the_stage_is_priced_with_the_replicas_all_reduce():
    """Per parameter byte: plain dp and ZeRO-1 all-reduce the whole gradient over the replicas
    too, ZeRO-2/3 only the rows (1/dp): 2 x (r-1)/r passes of a ring over r = 2 ranks."""
    links = DeviceModel("links", {"float32": 1e12}, 1e12,
                        {"intra": Link(1e8, 1e-5), "inter": Link(1e8, 1e-5)})
    def per_byte(mesh):
        options = Options(mesh=MeshSpec.parse(mesh), zero="auto")
        return {s.k: s.per_byte for s in zero_stage.stages(options, links)}
    plain, hsdp = per_byte({"dp": 4}), per_byte({"dp_replicate": 2, "dp": 4})
    ring = 2 * (2 - 1) / 2 / 1e8
    for k, share in ((0, 1), (1, 1), (2, 1 / 4), (3, 1 / 4)):
        assert hsdp[k] - plain[k] == pytest.approx(ring * share), k


def test_zero_auto_folds_the_replicas_into_dp_only_where_the_budget_needs_it():
    """Which axis shards: the replicas are kept where a stage within dp fits the budget, and
    folded into dp (the same ranks, ZeRO over all four) where none does; a budget neither
    meets names both lowest peaks."""
    def plan(**kw):
        (x,), (y,) = token_batches(1, 4)[0]
        return shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh=HSDP, zero="auto",
                                 shard="replicate", **kw)
    folded_peak = max(plan_of(3, {"dp": 4}).memory_estimate().values())
    hsdp_peak = max(plan_of(3).memory_estimate().values())
    assert folded_peak < hsdp_peak
    kept = plan(memory_budget=hsdp_peak)
    assert str(kept.mesh) == "dp_replicate=2,dp=2" and kept.options.folded_from is None
    folded = plan(memory_budget=folded_peak)
    assert str(folded.mesh) == "dp=4" and folded.options.zero == 3
    assert max(folded.memory_estimate().values()) <= folded_peak
    assert "HSDP folded" in str(folded)
    with pytest.raises(shardfx.MemoryBudgetError) as e:
        plan(memory_budget=folded_peak // 2)
    assert "with the replicas folded into dp (mesh dp=4) its lowest peak is" in str(e.value)


@pytest.mark.parametrize("mesh, zero, error, says", [
    ({"dp_replicate": 2, "pp": 2}, 0, PipelineError, "fold the replicas into dp"),
    ({"dp_replicate": 2, "tp": 2}, 2, InputError, "HSDP is {'dp_replicate': R, 'dp': D}"),
])
def test_a_mesh_hsdp_cannot_run_is_a_named_error(mesh, zero, error, says):
    (x,), (y,) = token_batches(1, 4)[0]
    with pytest.raises(error) as e:
        shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh=mesh, zero=zero,
                          microbatches=2 if "pp" in mesh else 1)
    assert says in str(e.value)


def test_hsdp_trains_like_one_device():
    """ZeRO-2 and ZeRO-3 within dp=2, replicated over 2 (GPT-2's tied embedding: its gradient
    is whole before the reduction, and takes its rows with no collective). Mixtral too with
    ``pytest -m slow``."""
    _check(shardfx.launch(_train, [("llama", HSDP, 2), ("gpt2", HSDP, 3)], nprocs=4,
                          timeout=120, deadline=900))


@pytest.mark.slow
def test_hsdp_trains_mixtral_like_one_device():
    """Mixtral's experts (replicated) with ZeRO-3 within dp=2, every rank's tokens routed."""
    _check(shardfx.launch(_train, [("mixtral", HSDP, 3)], nprocs=4, timeout=300,
                          deadline=900))


# --- checkpoints between HSDP and plain ZeRO ---------------------------------------------------

STEPS = 5  # 3 before the save, 2 after


def _runner(mesh: dict, zero: int):
    data = token_batches(STEPS, 8)
    plan = shardfx.partition(tiny("llama"), *data[0][:1], lm_loss, data[0][1], mesh=mesh,
                             shard="replicate", zero=zero)
    return plan.runner(lambda p: torch.optim.AdamW(p, lr=1e-3)), data


def _save_then_resume(path: str, moves: list[tuple[tuple, list[tuple]]]) -> list:
    """For each (saved_on, resumed_on): train 3 steps on ``saved_on`` and save; then on each
    mesh of ``resumed_on`` load it: whether the state there is the saved one exactly, and the
    next 2 losses against the saving run's."""
    out = []
    for n, (saved_on, resumed_on) in enumerate(moves):
        runner, data = _runner(*saved_on)
        for args, targets in data[:3]:
            runner.step(args, targets)
        runner.save(f"{path}{n}")
        saved = {k: v.detach().cpu().clone() for k, v in runner.state_dict().items()}
        losses = [runner.step(a, t).item() for a, t in data[3:]]
        for mesh, zero in resumed_on:
            runner, data = _runner(mesh, zero)
            runner.load(f"{path}{n}")
            state = {k: v.detach().cpu().clone() for k, v in runner.state_dict().items()}
            exact = state.keys() == saved.keys() and all(torch.equal(state[k], saved[k])
                                                        for k in saved)
            after = [runner.step(a, t).item() for a, t in data[3:]]
            out.append((saved_on, mesh, zero, exact, after, losses))
    return out


def test_checkpoints_move_between_hsdp_and_plain_zero(tmp_path):
    """Saved on HSDP (ZeRO-3), resumed on dp=4 ZeRO-3 and on HSDP ZeRO-2; saved on dp=4 ZeRO-2,
    resumed on HSDP ZeRO-3 and on 4 plain replicas: the values saved come back exactly, and
    the optimizer's moments and step with them (the next losses are the saving run's)."""
    moves = [((HSDP, 3), [({"dp": 4}, 3), (HSDP, 2)]),
             (({"dp": 4}, 2), [(HSDP, 3), ({"dp_replicate": 4}, 0)])]
    for saved_on, mesh, zero, exact, after, losses in shardfx.launch(
            _save_then_resume, str(tmp_path / "ck"), moves, nprocs=4, timeout=120,
            deadline=600)[0]:
        assert exact, (saved_on, mesh, zero)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(after, losses)), \
            (saved_on, mesh, zero, after, losses)
