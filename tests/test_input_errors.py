"""Bad settings and bad inputs are errors that say what, where and what to do, never a silently
different run and never a raw exception from deep inside.

Planning-time checks run in this process; the run-time checks that need a mesh (a state dict
checked against full shapes on tp=2 and pp=2, ranks passing different batches) share one
launch of two processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardfx
import shardfx.compiler.driver
from shardfx.errors import (CaptureError, InputError, LossError, MeshError, PassError,
                            PipelineError, ShardfxError, ShardingError)
from shardfx.schedule import Schedule

from test_errors import assert_explained


def mlp(hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 8))


X, Y = torch.randn(4, 8), torch.randn(4, 8)


def plan(model=None, **kwargs) -> shardfx.Plan:
    return shardfx.partition(model or mlp(), (X,), F.mse_loss, (Y,), **kwargs)


# --- settings partition would have ignored or misread ----------------------------------------


@pytest.mark.parametrize("kwargs, cause, where", [
    ({"mesh": {"pp": 2}, "microbatches": 2, "virtual_stages": 0}, "virtual_stages", "virtual"),
    ({"mesh": {"pp": 2}, "microbatches": 2, "virtual_stages": -1}, "virtual_stages", "virtual"),
    ({"virtual_stages": 0}, "virtual_stages", "virtual_stages"),
    ({"mesh": {"pp": 2}, "microbatches": 0}, "microbatches", "microbatches"),
    ({"mesh": {"pp": 2, "dp": 2}, "microbatches": -2}, ("microbatches", "-2"), "microbatches"),
])
def test_pipeline_settings_are_checked(kwargs, cause, where):
    with pytest.raises(PipelineError) as info:
        plan(**kwargs)
    assert_explained(info.value, cause=cause, where=where)


@pytest.mark.parametrize("mesh", [None, {"dp": 2}, {"dp": 2, "tp": 1}])
def test_sequence_parallel_without_a_tp_axis_is_refused(mesh):
    """megatron-sp splits the tokens over tp: with no tp axis it would do nothing."""
    with pytest.raises(InputError) as info:
        plan(mesh=mesh, shard="megatron-sp")
    assert_explained(info.value, cause=("megatron-sp", "no tp axis"), where='shard="megatron-sp"')
    assert 'mesh={"tp": 2}' in info.value.fix and '"megatron"' in info.value.fix


@pytest.mark.parametrize("kwargs, cause", [
    ({"mesh": {"dp": 2}, "zero": 1}, "zero=1"),
    ({"mesh": {"dp": 2}, "zero": 3}, "zero=3"),
    ({"optimizer_in_backward": True}, "optimizer_in_backward=True"),
])
def test_training_settings_on_an_inference_plan_are_refused(kwargs, cause):
    with pytest.raises(InputError) as info:
        shardfx.partition(mlp(), (X,), **kwargs)  # no loss_fn: an inference plan
    assert_explained(info.value, cause=(cause, "inference (no loss_fn)"), where="without loss_fn")
    assert "drop" in info.value.fix and "loss_fn" in info.value.fix


def test_inference_plan_takes_zero_auto_and_zero_0():
    for zero in ("auto", 0):
        assert shardfx.partition(mlp(), (X,), mesh={"dp": 2}, zero=zero).options.zero == 0


def test_an_expert_parallel_axis_on_a_model_without_experts_is_refused():
    with pytest.raises(MeshError) as info:
        plan(mesh={"ep": 2})
    assert_explained(info.value, cause=("ep axis", "no mixture-of-experts layer"),
                     where="mesh['ep']")
    assert "shardfx.experts" in info.value.fix
    plan(mesh={"ep": 1})  # a one-device axis changes nothing


@pytest.mark.parametrize("mesh", [None, {"pp": 2}])
def test_unknown_schedule_name_lists_the_valid_ones(mesh):
    with pytest.raises(PipelineError) as info:
        plan(mesh=mesh, microbatches=2 if mesh else 1, schedule="1F1B-interleaved")
    assert_explained(info.value, cause="unknown schedule '1F1B-interleaved'", where="schedule")
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"):
        assert name in info.value.fix


def test_schedule_text_is_still_read_as_a_schedule():
    text = "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1"
    assert str(plan(mesh={"pp": 2}, microbatches=2, schedule=text).schedule) == \
        str(Schedule.parse(text))


@pytest.mark.parametrize("budget, cause", [
    (True, "bool"), (-1, "positive"), (0, "positive"), (float("nan"), "positive"),
    ("1.2.3GB", "'1.2.3GB'"), ("8 parsecs", "'8 parsecs'"), ([1 << 30], "list"),
])
def test_bad_memory_budget(budget, cause):
    with pytest.raises(InputError) as info:
        plan(memory_budget=budget)
    assert_explained(info.value, cause=cause, where="memory_budget")


@pytest.mark.parametrize("budget, nbytes", [(1.5e9, 1_500_000_000), ("1.5GB", 1_500_000_000),
                                            ("2GiB", 2 << 30), (1 << 30, 1 << 30)])
def test_memory_budget_as_float_or_text(budget, nbytes):
    assert plan(memory_budget=budget).options.memory_budget == nbytes


# --- the optimizer factory ------------------------------------------------------------------


def _returns_nothing(params):
    torch.optim.SGD(params, lr=0.1)  # no return: the parameters would never change


def _raises(params):
    raise ValueError("no learning rate configured")


def _other_tensors(params):
    return torch.optim.SGD(mlp().parameters(), lr=0.1)


@pytest.mark.parametrize("factory, cause", [
    (_returns_nothing, "returned None"),
    (torch.optim.SGD(mlp().parameters(), lr=0.1), ("SGD", "optimizer instance")),
    (_raises, ("raised ValueError", "no learning rate")),
    (_other_tensors, "none of the parameters"),
])
def test_bad_optimizer_factory(factory, cause):
    with pytest.raises(InputError) as info:
        plan().runner(factory)
    assert_explained(info.value, cause=cause, where="optimizer")
    assert "lambda params:" in info.value.fix


# --- a step's inputs and a state dict -------------------------------------------------------


def test_batch_that_does_not_split_names_what_was_passed():
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(InputError) as info:
        shardfx.partition(mlp(), (x,), F.mse_loss, (y,), mesh={"pp": 2, "dp": 2}, microbatches=2)
    assert_explained(info.value, cause=("args[0]", "batch size 6",
                                        "microbatches=2 x dp=2 = 4 slices"),
                     where="microbatches=2, mesh dp=2")


@pytest.mark.parametrize("args, targets, cause, where", [
    ((X,), (), "targets missing", "runner.step, targets"),
    ((X,), Y, ("targets must be a tuple", "Tensor[4, 8]"), "runner.step, targets"),
    (X, (Y,), ("args must be a tuple", "Tensor[4, 8]"), "runner.step, args"),
    ((X, X), (Y,), ("(Tensor, Tensor)", "(Tensor,)"), "runner.step, args"),
])
def test_step_inputs_structured_otherwise_say_so_in_words(args, targets, cause, where):
    with pytest.raises(InputError) as info:
        plan().runner().step(args, targets)
    assert_explained(info.value, cause=cause, where=where)
    assert "TreeSpec" not in str(info.value)


def test_partition_without_targets_says_they_are_missing():
    with pytest.raises(LossError) as info:
        shardfx.partition(mlp(), (X,), F.mse_loss)
    assert_explained(info.value, cause=("example_targets missing", "TypeError"),
                     where="example_targets")


def test_step_inputs_on_another_device():
    with pytest.raises(InputError) as info:
        plan().runner().step((X.to("meta"),), (Y,))
    assert_explained(info.value, cause=("args[0]", "meta", "cpu"), where="args[0]")


@pytest.mark.parametrize("value, cause", [(1.0, ("0.weight", "float", "not a tensor")),
                                          (torch.zeros(17, 8), ("[17, 8]", "[16, 8]"))])
def test_load_state_dict_checks_every_entry_before_loading(value, cause):
    model = mlp()
    runner = plan(model).runner()
    before = {k: v.clone() for k, v in runner.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()} | {"0.weight": value}
    with pytest.raises(InputError) as info:
        runner.load_state_dict(state)
    assert_explained(info.value, cause=cause, where="0.weight")
    assert all(torch.equal(before[k], v) for k, v in runner.state_dict().items())  # untouched


# --- the user's line --------------------------------------------------------------------------


class ReadsAValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = x.abs().max().item()  # a Python number read from the data
        return self.lin(x) / scale


def test_item_in_forward_names_the_line():
    with pytest.raises(CaptureError) as info:
        shardfx.partition(ReadsAValue(), (X,), F.mse_loss, (Y,))
    assert_explained(info.value, cause=("ReadsAValue", "depends on the data"),
                     where=f"{__file__}:")
    assert "scale = x.abs().max().item()" in info.value.where
    assert ".item()" in info.value.fix


class Hinted(torch.nn.Module):
    def __init__(self, axis: str):
        super().__init__()
        self.axis = axis
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        h = shardfx.shard_hint(h, {self.axis: Shard(1)})
        return self.down(h)


@pytest.mark.parametrize("axis, mesh, cause", [
    ("dp", {"tp": 2}, "which the mesh lacks"),
    ("pp", {"pp": 2, "tp": 2}, "tp only"),
])
def test_hint_on_an_axis_tensors_are_not_sharded_over_names_the_line(axis, mesh, cause):
    with pytest.raises(ShardingError) as info:
        shardfx.partition(Hinted(axis), (X,), F.mse_loss, (Y,), mesh=mesh,
                          microbatches=2 if "pp" in mesh else 1)
    assert_explained(info.value, cause=(f"'{axis}'", cause), where=f"{__file__}:")
    assert "h = shardfx.shard_hint(" in info.value.where
    assert "tp" in info.value.fix


class OddHinted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 15), torch.nn.Linear(15, 8)

    def forward(self, x):
        h = shardfx.shard_hint(torch.relu(self.up(x)), {"tp": Shard(1)})
        return self.down(h)


def test_hint_on_a_dimension_the_axis_does_not_divide_names_the_line():
    with pytest.raises(ShardingError) as info:
        shardfx.partition(OddHinted(), (X,), F.mse_loss, (Y,), mesh={"tp": 2},
                          shard="megatron")
    assert_explained(info.value, cause=("S(1)", "15"), where=f"{__file__}:")
    assert "h = shardfx.shard_hint(" in info.value.where


def test_placements_written_as_a_string_ask_for_a_list():
    with pytest.raises(ShardingError) as info:
        plan(mesh={"tp": 2}, shard={"0.weight": "S(0)"})
    assert_explained(info.value, cause=("'S(0)'", "list of placements"), where="0.weight")


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = (torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                         torch.nn.Linear(8, 8))

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def test_one_row_microbatch_under_batchnorm_says_so():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(PipelineError) as info:
        shardfx.partition(Normed(), (x,), F.mse_loss, (y,), mesh={"pp": 2, "dp": 2},
                          microbatches=2)
    assert_explained(info.value, cause=("one row", "4 rows in microbatches=2 x dp=2", "BatchNorm"),
                     where="Normed.norm (BatchNorm1d)")
    assert "traceable" not in info.value.fix and "eval" in info.value.fix
    with pytest.raises(InputError) as info:  # one device: the example batch itself
        shardfx.partition(Normed(), (x[:1],), F.mse_loss, (y[:1],))
    assert_explained(info.value, cause=("batch has one row", "BatchNorm"), where="Normed.norm")


# --- shardfx's own failures -------------------------------------------------------------------


@pytest.fixture
def failing_pass(monkeypatch):
    """estimate_cost (after rng_stream and assign_phase) fails as a shardfx bug would."""
    def estimate_cost(gm, options):
        raise RuntimeError("boom")

    monkeypatch.setattr(shardfx.compiler.driver, "estimate_cost", estimate_cost)


def test_failed_plan_dumps_what_exists(failing_pass, monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFX_DUMP", str(tmp_path))
    with pytest.raises(PassError) as info:
        plan()
    assert_explained(info.value, cause="RuntimeError: boom", where="pass estimate_cost")
    assert str(tmp_path) in info.value.fix
    names = sorted(p.name for p in tmp_path.iterdir())  # NN-pass.txt for every pass that ran
    ran = [n.split("-", 1)[1] for n in names if n[:2].isdigit()]
    assert names[0] == "00-capture.txt" and names[-1] == "error.txt", names
    assert "assign_phase.txt" in ran and "estimate_cost.txt" not in ran, names
    last = (tmp_path / names[-2]).read_text()  # headed by what its pass changed
    assert last.startswith("# after ") and "\ngraph train Sequential" in last
    assert "RuntimeError: boom" in (tmp_path / "error.txt").read_text()


def test_failed_plan_says_how_to_get_the_dump(failing_pass, monkeypatch):
    monkeypatch.delenv("SHARDFX_DUMP", raising=False)
    with pytest.raises(PassError) as info:
        plan()
    assert "set SHARDFX_DUMP=dir" in info.value.fix


def test_codegen_failure_dumps_the_ir_too(monkeypatch, tmp_path):
    def broken_codegen(gm):
        raise PassError("codegen broke", where="codegen", fix="report it")

    monkeypatch.setattr(shardfx.compiler.driver, "generate", broken_codegen)
    monkeypatch.setenv("SHARDFX_DUMP", str(tmp_path))
    with pytest.raises(PassError):
        plan()
    assert {"00-capture.txt", "ir-at-failure.txt", "error.txt"} <= \
        {p.name for p in tmp_path.iterdir()}


# --- on two processes ---------------------------------------------------------------------------


def _error(fn) -> str | None:
    try:
        fn()
    except ShardfxError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _runtime_checks() -> dict[str, str | None]:
    """On each of 2 ranks: state dicts checked against full shapes (tp=2, pp=2), the batch
    every rank passes compared (dp=2, pp=2), and the ranks' plans (dp=2). Every check raises on
    both ranks alike."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    other = (x + rank,), (y,)  # rank 1's batch differs
    out = {}

    def load(runner, rows):
        state = runner.state_dict()
        state["0.weight"] = torch.zeros(rows, 8)
        runner.load_state_dict(state)

    tp = shardfx.partition(mlp(), (x,), F.mse_loss, (y,), mesh={"tp": 2},
                           shard={"0.weight": [Shard(0)], "0.bias": [Shard(0)],
                                  "2.weight": [Shard(1)]}).runner()
    out["tp load 17 rows"] = _error(lambda: load(tp, 17))  # would keep 16 rows per shard pair
    out["tp load 8 rows"] = _error(lambda: load(tp, 8))  # one shard's rows: still the wrong size
    out["tp load right"] = _error(lambda: load(tp, 16))
    out["tp loaded"] = str(float(tp.state_dict()["0.weight"].abs().sum()))

    once = shardfx.partition(mlp(), (x,), F.mse_loss, (y,), mesh={"dp": 2}, debug=False)
    dp = once.runner(lambda ps: torch.optim.SGD(ps, lr=0.1))
    out["dp first step differs"] = _error(lambda: dp.step(*other))
    dp = once.runner(lambda ps: torch.optim.SGD(ps, lr=0.1))
    dp.step((x,), (y,))
    out["dp later step unchecked"] = _error(lambda: dp.step(*other))
    every = shardfx.partition(mlp(), (x,), F.mse_loss, (y,), mesh={"dp": 2}, debug=True).runner()
    every.step((x,), (y,))
    out["dp debug later step"] = _error(lambda: every.step(*other))

    apart = shardfx.partition(mlp(), (x,), F.mse_loss, (y,), mesh={"dp": 2}, zero=rank)
    out["ranks planned apart"] = _error(lambda: apart.runner())

    pp_plan = shardfx.partition(mlp(), (x,), F.mse_loss, (y,), mesh={"pp": 2}, microbatches=2)
    out["pp optimizer None"] = _error(lambda: pp_plan.runner(lambda ps: None))
    pp = pp_plan.runner()
    out["pp load 17 rows"] = _error(lambda: load(pp, 17))
    out["pp step differs"] = _error(lambda: pp.step(*other))
    return out


def test_runtime_checks_on_two_processes():
    for rank, out in enumerate(shardfx.launch(_runtime_checks, nprocs=2, timeout=60)):
        for key in ("tp load 17 rows", "pp load 17 rows"):
            assert "0.weight has shape [17, 8] in the state dict, [16, 8] in the model" in \
                out[key], (rank, key, out[key])
        assert "[8, 8] in the state dict, [16, 8]" in out["tp load 8 rows"], out
        assert out["tp load right"] is None and out["tp loaded"] == "0.0", out
        for key in ("dp first step differs", "dp debug later step", "pp step differs"):
            msg = out[key]
            assert msg and "different global batches" in msg and "args[0] on rank 1" in msg \
                and "where: runner.step, args[0]" in msg, (rank, key, msg)
        assert out["dp later step unchecked"] is None, out  # cheap: the first step only
        apart = out["ranks planned apart"]  # rank 1 planned with ZeRO-1, rank 0 without
        assert apart and "the ranks planned different programs: rank 1" in apart and \
            "zero=0" in apart and "zero=1" in apart, (rank, apart)
        assert "returned None" in out["pp optimizer None"], out
