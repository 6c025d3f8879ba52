"""Pipeline parallelism on real processes: stages, microbatches and schedules vs one device."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.errors import InputError
from shardfx.schedule import peak_in_flight
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches


def build(name: str, layers: int = 2):
    return tiny(name, layers)


def batches(n: int, batch: int = 4):
    return token_batches(n, batch)


def train(cases):
    """On every rank: 3 AdamW steps through the pipeline, compared with one device."""
    return [compare_training(build(name, 4 if "interleaved" in schedule else 2), batches(3),
                             lm_loss, mesh={"pp": 2}, microbatches=m, schedule=schedule).max()
            for name, schedule, m in cases]


def test_schedules_on_two_stages():
    results = shardfx.launch(train, [
        ("llama", "gpipe", 4),
        ("llama", "1f1b", 4),
        ("llama", "zero-bubble", 4),
        ("gpt2", "1f1b", 2),  # the tied embedding lives in stage 0 and stage 1
        ("mixtral", "zero-bubble", 2),  # experts routed token by token, W deferred
        ("nanogpt", "gpipe", 4),
        ("nanogpt", "1f1b", 4),
        ("nanogpt", "zero-bubble", 4),
        ("nanogpt", "interleaved-1f1b", 4),  # 4 layers: 2 ranks x 2 virtual stages
    ], nprocs=2, timeout=120, deadline=600)
    for rank_errors in results:
        assert max(rank_errors) < 1e-5, rank_errors


def test_microbatches_must_divide_the_batch():
    (x,), (y,) = batches(1, batch=6)[0]
    with pytest.raises(InputError) as info:
        shardfx.partition(build("llama"), (x,), lm_loss, (y,), mesh={"pp": 2}, microbatches=4)
    assert "args[0]" in info.value.cause and "6" in info.value.cause


def build_deep():
    return tiny("llama", layers=4)


def train_interleaved_and_trace(path: str):
    """Interleaved 1F1B: 2 ranks x 2 virtual stages of a 4-layer Llama; then the timeline."""
    report = compare_training(build_deep(), batches(3), lm_loss, mesh={"pp": 2},
                              microbatches=4, schedule="interleaved-1f1b")
    (x,), (y,) = batches(1)[0]
    plan = shardfx.partition(build_deep(), (x,), lm_loss, (y,), mesh={"pp": 2},
                             microbatches=4, schedule="interleaved-1f1b")
    runner = plan.runner()
    runner.step((x,), (y,))
    runner.trace(path)
    spans = runner.timeline()
    return report.max(), [[a for a, _, _ in rank] for rank in spans], runner.bubble(), held()


def held():
    """Each schedule's saved activations, as the runner frees them, against the static count:
    1F1B holds 2 microbatches at most on rank 0 where GPipe holds all 4."""
    import torch.distributed as dist
    from shardfx.schedule import in_flight

    (x,), (y,) = batches(1)[0]
    out = {}
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        plan = shardfx.partition(build("llama"), (x,), lm_loss, (y,), mesh={"pp": 2},
                                 microbatches=4, schedule=schedule)
        runner = plan.runner()
        runner.step((x,), (y,))
        rank = dist.get_rank()
        out[schedule] = (runner.held(), in_flight(plan.schedule)[rank])
    return out


def test_interleaved_virtual_stages_and_the_trace(tmp_path):
    import json

    path = str(tmp_path / "trace.json")
    (err, actions, bubble, held), (*_, held1) = shardfx.launch(train_interleaved_and_trace, path, nprocs=2,
                                               timeout=120, deadline=600)
    assert err < 1e-5
    assert {a[0] for a in actions[0]} == {"0", "2"} and {a[0] for a in actions[1]} == {"1", "3"}
    events = json.load(open(path))["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert sum(e["ph"] == "X" for e in events) == sum(map(len, actions))
    assert bubble >= 0
    for schedule in held:
        for measured, expected in (held[schedule], held1[schedule]):
            assert measured == expected, schedule
    assert max(held["gpipe"][0]) == 4 and max(held["1f1b"][0]) == 2


def train_dp_pp():
    report = compare_training(build("llama"), batches(3, batch=8), lm_loss,
                              mesh={"dp": 2, "pp": 2}, microbatches=2, schedule="1f1b")
    # a summed loss: slices' losses and replicas' gradients add up instead of averaging
    summed = compare_training(TwoStages(), rows(3), sum_loss, mesh={"dp": 2, "pp": 2},
                              microbatches=2)
    return max(report.max(), summed.max()), forward_after_training(
        "llama", {"dp": 2, "pp": 2}, batch=8, microbatches=2)


def test_data_parallel_pipelines():
    """dp=2 x pp=2: two replicas of a 2-stage pipeline, gradients averaged across them; then
    inference, each replica its rows, joined on every rank."""
    for err, forward_err in shardfx.launch(train_dp_pp, nprocs=4, timeout=120, deadline=600):
        assert err < 1e-5 and forward_err < 1e-5


def forward_after_training(name: str, mesh: dict, batch: int = 4, layers: int = 2,
                           **kwargs) -> float:
    """Two AdamW steps through a pipeline plan, then ``runner.forward`` on a third batch
    against the eager model holding ``runner.state_dict()``: relative error of the logits."""
    import copy

    import torch
    from shardfx.testing import rel_error

    data = batches(3, batch)
    (x,), (y,) = data[0]
    model = tiny(name, layers)
    plan = shardfx.partition(copy.deepcopy(model), (x,), lm_loss, (y,), mesh=mesh, **kwargs)
    runner = plan.runner(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    for args, targets in data[:2]:
        runner.step(args, targets)
    got = runner.forward(data[2][0])
    state = runner.state_dict()
    model.load_state_dict(state)
    with torch.no_grad():
        want = model(*data[2][0], use_cache=False)
    # a fresh runner resumes from the checkpoint: the same weights, the same outputs
    resumed = shardfx.partition(tiny(name, layers), (x,), lm_loss, (y,), mesh=mesh,
                                **kwargs).runner()
    resumed.load_state_dict(state)
    again = resumed.forward(data[2][0])
    assert all(torch.equal(a, state[k]) for k, a in resumed.state_dict().items())
    return max(rel_error(got["logits"], want.logits), rel_error(again["logits"], want.logits))


def infer():
    """An inference plan cut into 2 stages, and the forward of trained 1F1B and interleaved
    training plans (GPT-2's tied embedding read by the first and the last stage)."""
    from shardfx.testing import compare_inference

    (x,), _ = batches(1)[0]
    return [compare_inference(build("llama"), (x,), mesh={"pp": 2}, microbatches=2),
            forward_after_training("gpt2", {"pp": 2}, microbatches=2),
            forward_after_training("llama", {"pp": 2}, layers=4, microbatches=2,
                                   schedule="interleaved-1f1b")]


class TwoStages(torch.nn.Module):
    """Linear, ReLU | Linear, with an optional BatchNorm: a cut by a pipe_split marker."""

    def __init__(self, norm: bool = False, running_stats: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8, track_running_stats=running_stats) if norm \
            else torch.nn.Identity()

    def forward(self, x):
        return self.b(shardfx.pipe_split(torch.relu(self.norm(self.a(x)))))


def rows(n: int, batch: int = 8) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(batch, 8, generator=g),), (torch.randn(batch, 8, generator=g),))
            for _ in range(n)]


def sum_loss(out, target):
    return torch.nn.functional.mse_loss(out, target, reduction="sum")


def test_microbatching_that_would_change_the_result_is_refused():
    """BatchNorm's batch statistics, and a loss that is neither a mean nor a sum over rows (a
    mean over non-ignored tokens, with different numbers ignored per row)."""
    from shardfx.errors import LossError, PipelineError

    (x,), (y,) = rows(1)[0]
    with pytest.raises(PipelineError) as info:
        shardfx.partition(TwoStages(norm=True), (x,), torch.nn.functional.mse_loss, (y,),
                          mesh={"pp": 2}, microbatches=2)
    assert "norm" in info.value.cause and "statistics over the batch" in info.value.cause
    with pytest.raises(PipelineError):  # without running statistics: another ATen overload
        shardfx.partition(TwoStages(norm=True, running_stats=False), (x,),
                          torch.nn.functional.mse_loss, (y,), mesh={"pp": 2}, microbatches=2)
    shardfx.partition(TwoStages(norm=True), (x,), torch.nn.functional.mse_loss, (y,),
                      mesh={"pp": 2}, microbatches=1)  # one slice: the batch's own statistics

    def token_loss(out, labels):  # 2 tokens of 4 classes per row, a mean over those counted
        return torch.nn.functional.cross_entropy(out.reshape(-1, 4), labels.reshape(-1))

    labels = torch.randint(0, 4, (8, 2), generator=torch.Generator().manual_seed(0))
    labels[0, 0] = -100  # row 0 counts 1 token, row 1 counts 2: per-row means weigh them apart
    with pytest.raises(LossError) as info:
        shardfx.partition(TwoStages(), (x,), token_loss, (labels,), mesh={"pp": 2},
                          microbatches=2)
    assert "neither the mean" in info.value.cause and "nan" not in info.value.cause
    labels[0, 0] = 1  # every token counted: a mean over rows
    plan = shardfx.partition(TwoStages(), (x,), token_loss, (labels,), mesh={"pp": 2},
                             microbatches=2)
    assert plan.options.loss_reduction == "mean"
    plan = shardfx.partition(TwoStages(), (x,), sum_loss, (y,), mesh={"pp": 2}, microbatches=2)
    assert plan.options.loss_reduction == "sum"


def test_dump_of_a_pipeline_plan(tmp_path):
    """Each stage's F, B and W code, and the schedule, as a grid and as lists that parse back."""
    from shardfx.schedule import Schedule

    (x,), (y,) = rows(1)[0]
    plan = shardfx.partition(TwoStages(), (x,), sum_loss, (y,), mesh={"pp": 2}, microbatches=2,
                             schedule="zero-bubble")
    out = plan.dump(tmp_path)
    for part in ("stage0_F", "stage0_B", "stage0_W", "stage1_F", "stage1_B", "stage1_W"):
        assert "def forward" in (out / f"{part}.py").read_text(), part
    grid, lists = (out / "schedule.txt").read_text().split("\n\n")
    assert Schedule.parse(grid) == Schedule.parse(lists) == plan.schedule
    assert not list(out.glob("*_replicas.py"))  # no dp: nothing to sum over replicas


def test_dump_of_a_pipeline_with_dp_shows_each_stage_s_sum_over_replicas(tmp_path):
    """With dp, each stage's reduction: a bucket's issue part starting its all-reduce, then
    the finish part waiting for it."""
    (x,), (y,) = rows(1)[0]
    plan = shardfx.partition(TwoStages(), (x,), sum_loss, (y,), mesh={"pp": 2, "dp": 2},
                             microbatches=2)
    out = plan.dump(tmp_path)
    for stage in (0, 1):
        text = (out / f"stage{stage}_replicas.py").read_text()
        issue, finish = text.split("# finish")
        assert "# bucket0 issue: " in issue and "all_reduce" in issue and "wait" not in issue
        assert "wait_tensor" in finish


class WithMean(torch.nn.Module):
    """Two linear stages; returns the output and its mean (not batch-first)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.b(shardfx.pipe_split(self.a(x)))
        return y, y.mean()


def infer_not_batch_first():
    plan = shardfx.partition(WithMean(), (torch.randn(4, 8),), mesh={"pp": 2}, microbatches=2)
    with pytest.raises(shardfx.ShardfxError) as info:
        plan.runner().forward((torch.randn(4, 8),))
    return str(info.value)


def test_inference_through_pipelines():
    for errors in shardfx.launch(infer, nprocs=2, timeout=120, deadline=600):
        assert max(errors) < 1e-5, errors
    message = shardfx.launch(infer_not_batch_first, nprocs=2, timeout=60)[0]
    assert "out[1]" in message and "not batch-first" in message


def test_own_schedule_that_deadlocks_is_rejected_before_launch():
    """Rank 0 waits for stage 1's backward of microbatch 0 before sending it microbatch 0's
    forward: a deadlock the static check finds at partition time, naming rank and action."""
    from shardfx.schedule import ScheduleError

    own = "rank 0: 0F0 0B0\nrank 1: 1F0 1B0"
    (x,), (y,) = batches(1)[0]
    plan = shardfx.partition(build("llama"), (x,), lm_loss, (y,), mesh={"pp": 2}, schedule=own)
    assert str(plan.schedule.actions[0][1]) == "0B0"
    bad = "rank 0: 0B0 0F0\nrank 1: 1F0 1B0"
    with pytest.raises(ScheduleError) as info:
        shardfx.partition(build("llama"), (x,), lm_loss, (y,), mesh={"pp": 2}, schedule=bad)
    assert "rank 0" in str(info.value) and "0B0" in str(info.value)


def train_pp_tp():
    report = compare_training(tiny("gpt2"), token_batches(3), lm_loss, mesh={"pp": 2, "tp": 2},
                              microbatches=2, schedule="1f1b", shard="megatron")
    return report.max(), forward_after_training("gpt2", {"pp": 2, "tp": 2}, microbatches=2,
                                                shard="megatron")


def test_tensor_parallel_stages_with_tied_weights():
    """pp=2 x tp=2 GPT-2: each stage's program is tensor parallel, and the tied embedding's
    shards travel between the first and the last stage; inference runs on the trained shards."""
    for err, forward_err in shardfx.launch(train_pp_tp, nprocs=4, timeout=120, deadline=600):
        assert err < 1e-5 and forward_err < 1e-5


def test_memory_budget_bounds_the_schedule():
    """A budget 1F1B fits as it is: GPipe, which keeps all 4 microbatches in flight where 1F1B
    keeps 2, would meet it by recomputing activations (``auto.remat``), but 1F1B's order
    meets it recomputing nothing with the same bubble, so the plan runs that
    (``shardfx.compiler.budget``); a budget below the weights alone is a MemoryBudgetError."""
    (x,), (y,) = batches(1)[0]

    def plan(**kw):
        return shardfx.partition(build("llama"), (x,), lm_loss, (y,), mesh={"pp": 2},
                                 microbatches=4, **kw)

    need = {s: plan(schedule=s).memory_breakdown() for s in ("gpipe", "1f1b")}
    assert need["gpipe"][0].saved > need["1f1b"][0].saved  # 4 vs 2 in flight
    budget = max(m.total for m in need["1f1b"].values())
    assert plan(schedule="1f1b", memory_budget=budget).remat is None
    gpipe = plan(schedule="gpipe", memory_budget=budget)
    assert max(gpipe.memory_estimate().values()) <= budget
    asked, capped = gpipe.budget_candidates[:2]
    assert asked.name == "gpipe" and asked.fits and asked.choice is not None  # by recomputing
    assert capped.choice is None and gpipe.remat is None and gpipe.schedule is capped.schedule
    assert peak_in_flight(gpipe.schedule) == {0: 2, 1: 1}  # 1F1B's
    need = shardfx.partition(build("llama"), (x,), lm_loss, (y,), mesh={"dp": 2, "pp": 2},
                             microbatches=2).memory_estimate()
    assert set(need) == {0, 1, 2, 3} and need[0] == need[2] and need[1] == need[3]  # dp x pp
    with pytest.raises(shardfx.MemoryBudgetError, match="budget"):
        shardfx.partition(build("llama"), (x,), lm_loss, (y,), memory_budget="1KiB")


