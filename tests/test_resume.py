"""``runner.save`` / ``runner.load``: a checkpoint written on one mesh resumes on another (the
shards of the model and of the optimizer's state re-cut), gives plain PyTorch the model's
``state_dict``, and refuses what does not fit, by name."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import shardfx
from shardfx.errors import InputError
from shardfx.runtime.checkpoint import full_state_dict

from models import lm_loss, tiny, token_batches

STEPS = 5  # 3 before the save, 2 after


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def runner_on(name: str, mesh: dict, zero: int = 0, optimizer=adamw, **kw):
    data = token_batches(STEPS, 8)
    shard = "megatron" if "tp" in mesh else "auto"
    plan = shardfx.partition(tiny(name), *data[0][:1], lm_loss, data[0][1], mesh=mesh,
                             shard=shard, zero=zero, **kw)
    return plan.runner(optimizer), data


def _save(path: str, name: str, mesh: dict, zero: int) -> tuple[list[float], dict]:
    """Train 3 steps, save, train 2 more: the losses after the save and the state at it."""
    runner, data = runner_on(name, mesh, zero)
    for args, targets in data[:3]:
        runner.step(args, targets)
    runner.save(path, note="three steps")
    state = {k: v.detach().cpu().clone() for k, v in runner.state_dict().items()}  # a snapshot
    return [runner.step(a, t).item() for a, t in data[3:]], state


def _resume(path: str, cases: list) -> list:
    out = []
    for name, mesh, zero, kw in cases:
        runner, data = runner_on(name, mesh, zero, **kw)
        meta = runner.load(path)
        state = {k: v.detach().cpu().clone() for k, v in runner.state_dict().items()}  # a snapshot
        out.append((mesh, zero, meta["note"], runner.step_count, state,
                    [runner.step(a, t).item() for a, t in data[3:]]))
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_checkpoint_resumes_on_another_mesh(name, tmp_path):
    """GPT-2's fused q, k, v (``c_attn``) is a strided split over tp: each rank holds a slice
    of each of the three, a box each in the checkpoint; saved under ZeRO-3, the bias's rows
    over dp cut through those boxes."""
    path = str(tmp_path / "ck")
    zero = 3 if name == "gpt2" else 0
    losses, saved = shardfx.launch(_save, path, name, {"dp": 2, "tp": 2}, zero, nprocs=4)[0]
    cases = [(name, {"tp": 4}, 0, {}), (name, {"dp": 4}, 3, {}),
             (name, {"dp": 2, "pp": 2}, 2, {"microbatches": 2}),
             (name, {"pp": 2, "tp": 2}, 0, {"microbatches": 2})]
    for mesh, zero, note, step, state, after in shardfx.launch(_resume, path, cases, nprocs=4)[0]:
        assert note == "three steps" and step == 3
        # the saved values exactly, re-cut for this mesh
        assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k])
                                                    for k in saved), (mesh, zero)
        # the optimizer's moments and step count came along: the next updates are the same
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(after, losses)), \
            (mesh, zero, after, losses)
    model = tiny(name)  # plain PyTorch: the model's own state_dict, tied weights included
    model.load_state_dict(full_state_dict(path))
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)


def test_a_pipeline_checkpoint_resumes_on_another_mesh(tmp_path):
    """Saved by pipeline ranks, each holding its stages' tensors (and, under ZeRO-2, its rows
    of their optimizer state): every rank's keys are in the checkpoint, and it resumes on dp=4
    (ZeRO-3) and on the same pipeline."""
    path = str(tmp_path / "ck")
    losses, saved = shardfx.launch(_save_pipeline, path, nprocs=4)[0]
    cases = [("llama", {"dp": 4}, 3, {}), ("llama", {"dp": 2, "pp": 2}, 2, {"microbatches": 2})]
    for mesh, zero, _, step, state, after in shardfx.launch(_resume, path, cases, nprocs=4)[0]:
        assert step == 3 and all(torch.equal(state[k], saved[k]) for k in saved), (mesh, zero)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(after, losses)), (mesh, after)


def _save_pipeline(path: str):
    runner, data = runner_on("llama", {"dp": 2, "pp": 2}, 2, microbatches=2)
    for args, targets in data[:3]:
        runner.step(args, targets)
    runner.save(path, note="three steps")
    state = {k: v.detach().cpu().clone() for k, v in runner.state_dict().items()}
    return [runner.step(a, t).item() for a, t in data[3:]], state


def test_on_one_device_the_next_losses_are_the_same_bits(tmp_path):
    losses, _ = _save(str(tmp_path / "ck"), "llama", {}, 0)
    (*_, after), = _resume(str(tmp_path / "ck"), [("llama", {}, 0, {})])
    assert after == losses


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(tmp_path):
    _save(str(tmp_path / "ck"), "llama", {}, 0)
    runner, _ = runner_on("gpt2", {})
    with pytest.raises(InputError, match="missing from the checkpoint") as e:
        runner.load(str(tmp_path / "ck"))
    assert "transformer.wte.weight" in str(e.value) and "model.embed_tokens" in str(e.value)


def test_another_optimizer_is_refused_and_another_lr_is_kept_with_a_warning(tmp_path, caplog):
    _save(str(tmp_path / "ck"), "llama", {}, 0)
    runner, _ = runner_on("llama", {}, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(InputError, match="AdamW's; this runner's optimizer is SGD"):
        runner.load(str(tmp_path / "ck"))
    runner, _ = runner_on("llama", {}, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3 / 3))
    with caplog.at_level(logging.WARNING, logger="shardfx.checkpoint"):
        runner.load(str(tmp_path / "ck"))
    # said as a person reads it: 4 significant digits
    assert "lr 0.001 -> 0.0003333 " in caplog.text and "keeping this run's" in caplog.text
    assert runner.optimizer.param_groups[0]["lr"] == 1e-3 / 3


def test_a_damaged_checkpoint_is_refused_by_runner_load_naming_the_file_or_field(tmp_path):
    """16 bytes flipped in the largest tensor of the one data file, or a step that is not a
    whole number: an InputError that names them, and the runner still at step 0."""
    path = tmp_path / "ck"
    _save(str(path), "llama", {}, 0)
    record = (path / "shardfx.json").read_text()
    runner, _ = runner_on("llama", {})
    data = path / "__0_0.distcp"
    at = max(FileSystemReader(path).read_metadata().storage_data.values(),
             key=lambda info: info.length)
    damaged, middle = bytearray(data.read_bytes()), at.offset + at.length // 2
    damaged[middle:middle + 16] = bytes(16)
    data.write_bytes(bytes(damaged))
    with pytest.raises(InputError, match=r"__0_0.distcp of the checkpoint .* is damaged: its "
                                         r"\d+ bytes no longer match the checksum") as e:
        runner.load(str(path))
    assert e.value.where == str(data) and runner.step_count == 0
    (path / "shardfx.json").write_text(record.replace('"step": 3', '"step": "three"'))
    with pytest.raises(InputError, match=r"'meta\.step' is \"three\"") as e:
        runner.load(str(path))
    assert e.value.where.endswith("shardfx.json, field meta.step")
