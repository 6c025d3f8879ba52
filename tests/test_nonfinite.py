"""A checkpoint holding NaN or Inf is refused where a run would start from it: ``runner.load``
(the parameters and the optimizer's state) and ``runner.load_hf`` (every tensor, as cast into
the model), one ``InputError`` on every rank naming the tensors, unless ``allow_nonfinite=True``
asks for them on purpose."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import shardfx
from shardfx.errors import InputError

from models import lm_loss, tiny, token_batches

W = "model.layers.1.mlp.down_proj.weight"


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def runner_of(mesh: dict | None = None, zero: int = 0):
    (x,), (y,) = token_batches(1, 8)[0]
    plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), mesh=mesh or {"dp": 1},
                             zero=zero)
    return plan.runner(adamw)


def diverged(path: Path, poison) -> None:
    """A runner trained one step, ``poison(model, optimizer)`` applied, saved at ``path``."""
    runner = runner_of()
    runner.step(*token_batches(1, 8)[0])
    with torch.no_grad():
        poison(runner.plan.model, runner.optimizer)
    runner.save(path)


def nan_row(model, optimizer) -> None:
    dict(model.named_parameters())[W][3, 5] = math.nan


def inf_state(model, optimizer) -> None:
    p = dict(model.named_parameters())["model.norm.weight"]
    optimizer.state[p]["exp_avg_sq"][0] = math.inf


def test_nan_weights_are_refused_by_runner_load_naming_the_tensor(tmp_path):
    diverged(tmp_path / "ck", nan_row)
    runner = runner_of()
    with pytest.raises(InputError, match=rf"the checkpoint .*ck holds values that are not "
                                         rf"finite in 1 tensors: {W} \(NaN\); training from "
                                         rf"them would give a NaN loss") as e:
        runner.load(tmp_path / "ck")
    assert "allow_nonfinite=True" in e.value.fix and "earlier step" in e.value.fix
    assert runner.step_count == 0
    runner.load(tmp_path / "ck", allow_nonfinite=True)  # on purpose: loaded as saved
    assert math.isnan(runner.state_dict()[W][3, 5]) and runner.step_count == 1


def test_inf_in_the_optimizer_state_is_named(tmp_path):
    diverged(tmp_path / "ck", inf_state)
    with pytest.raises(InputError, match=r"in 1 tensors: optim/model.norm.weight/exp_avg_sq "
                                         r"\(Inf\)"):
        runner_of().load(tmp_path / "ck")


def _load_on_two(path: str) -> str:
    runner = runner_of({"dp": 2}, zero=3)
    try:
        runner.load(path)
    except InputError as e:
        return e.cause
    return "loaded"


@pytest.mark.multiprocess
def test_every_rank_refuses_nan_only_one_rank_holds(tmp_path):
    """ZeRO-3 over dp=2: the NaN is in rank 0's rows of the tensor alone; both ranks raise the
    same error (rank 1 alone going on would wait for rank 0 in its first step)."""
    diverged(tmp_path / "ck", nan_row)
    said = shardfx.launch(_load_on_two, str(tmp_path / "ck"), nprocs=2, timeout=60)
    assert said[0] == said[1] and f"{W} (NaN)" in said[0], said


def test_load_hf_names_nan_and_inf_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny("llama")
    model.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.embed_tokens.weight"][2, 2] = -math.inf
    tensors[W][0, 0] = math.nan
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    runner = runner_of()
    with pytest.raises(InputError, match=rf"in 2 tensors: model.embed_tokens.weight \(Inf\), "
                                         rf"{W} \(NaN\)") as e:
        runner.load_hf(tmp_path / "hf")
    assert e.value.where == f"runner.load_hf({str(tmp_path / 'hf')!r})"
    runner.load_hf(tmp_path / "hf", allow_nonfinite=True)
    assert math.isnan(runner.state_dict()[W][0, 0])


def test_a_cast_that_overflows_is_named(tmp_path):
    """A float32 checkpoint with a value past float16's range, into a float16 model: Inf once
    cast, which the file itself does not hold."""
    model = tiny("llama")
    with torch.no_grad():
        dict(model.named_parameters())[W][1, 1] = 1e6
    model.save_pretrained(tmp_path / "hf")
    (x,), (y,) = token_batches(1, 8)[0]
    runner = shardfx.partition(tiny("llama").half(), (x,), lm_loss, (y,)).runner()
    with pytest.raises(InputError, match=rf"in 1 tensors: {W} \(Inf\)"):
        runner.load_hf(tmp_path / "hf")
