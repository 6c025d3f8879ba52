"""Checkpoints (``shardfx.runtime.checkpoint``): a round trip in one process, resharding from 4
ranks to 2 and to 1, kill -9 at any moment of a save, and the errors for checkpoints that
cannot be loaded (damaged and mixed-up files: tests/test_checkpoint_verify.py). Real files and
real processes throughout."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from shardfx import launch
from shardfx.errors import CheckpointError, InputError
from shardfx.runtime.checkpoint import PAUSE_ENV, Box, check, full_state_dict, load, save
from shardfx.runtime.checkpoint_digest import Digest
from shardfx.runtime.checkpoint_files import seal


def whole(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.local() if isinstance(v, Box) else v for k, v in state.items()}


# ---- one process ------------------------------------------------------------------------------


def test_round_trip_in_one_process_and_full_state_dict_loads_into_the_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    state = {"model/weight": Box.of(model.weight.detach(), (6, 4), (0, 0)),
             "model/bias": Box.of(model.bias.detach(), (6,), (0,)),
             "optim/weight/step": torch.tensor(7.0)}
    assert save(tmp_path / "ck", state, {"step": 7}) == tmp_path / "ck"
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging or .old left
    assert check(tmp_path / "ck") == {"step": 7}

    weight, bias, step = torch.zeros(6, 4), torch.zeros(6), torch.tensor(0.0)
    into = {"model/weight": Box.of(weight, (6, 4), (0, 0)), "model/bias": bias,
            "optim/weight/step": step}
    assert load(tmp_path / "ck", into) == {"step": 7}
    assert torch.equal(weight, model.weight) and torch.equal(bias, model.bias)  # in place
    assert step.item() == 7.0

    fresh = torch.nn.Linear(4, 6)
    fresh.load_state_dict(full_state_dict(tmp_path / "ck"))
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert full_state_dict(tmp_path / "ck", prefix="optim/") == {"weight/step": 7.0}


def test_box_shares_storage_and_rejects_a_box_outside_its_tensor():
    local = torch.zeros(2, 3)
    box = Box.of(local, (4, 3), (2, 0))
    box.local().fill_(1.0)
    assert local.sum().item() == 6.0 and type(box + 1) is torch.Tensor
    assert repr(box) == "Box([2, 3] at [2, 0] of [4, 3], float32)"
    with pytest.raises(InputError, match=r"box of shape \[2, 3\] at offsets \[3, 0\] does not fit"):
        Box.of(local, (4, 3), (3, 0))


# ---- resharding: 4 ranks (dp=2 x tp=2) save, 2 ranks and 1 process load --------------------

W, E, R = ((10, 6), 1), ((4, 6), 2), ((3, 4), 3)  # (global shape, seed)


def save_on_4(path: str) -> list[str]:
    """W in dp x tp boxes; E in tp columns, the same box on both dp ranks (one writer); R in
    padded chunks of 1 row over 4 ranks, rank 3's empty; the step a plain tensor on all."""
    r = dist.get_rank()
    dp, tp = divmod(r, 2)
    state = {"model/w": Box.of(whole(*W)[dp * 5:dp * 5 + 5, tp * 3:tp * 3 + 3], (10, 6),
                               (dp * 5, tp * 3)),
             "model/e": Box.of(whole(*E)[:, tp * 3:tp * 3 + 3], (4, 6), (0, tp * 3)),
             "model/r": Box.of(whole(*R)[r:r + 1], (3, 4), (min(r, 3), 0)),
             "optim/w/step": torch.tensor(11.0)}
    save(path, state, {"step": 11})
    return sorted(os.listdir(path))


def load_on_2(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """W as rows 7 + 3, E as columns 2 + 4, R whole on rank 0 and empty on rank 1."""
    r = dist.get_rank()
    w0, w1 = (0, 7) if r == 0 else (7, 10)
    e0, e1 = (0, 2) if r == 0 else (2, 6)
    state = {"model/w": Box.of(torch.zeros(w1 - w0, 6), (10, 6), (w0, 0)),
             "model/e": Box.of(torch.zeros(4, e1 - e0), (4, 6), (0, e0)),
             "model/r": Box.of(torch.zeros(3 - 3 * r, 4), (3, 4), (3 * r, 0)),
             "optim/w/step": torch.tensor(0.0)}
    return load(path, state), plain(state)


def test_save_on_4_ranks_loads_on_2_ranks_and_in_one_process(tmp_path):
    path = str(tmp_path / "ck")
    files = launch(save_on_4, path, nprocs=4, timeout=30)
    assert files[0] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                        "__3_0.distcp", "shardfx.json"]
    chunks = {k: sorted(tuple(c.offsets) for c in md.chunks) for k, md in
              FileSystemReader(path).read_metadata().state_dict_metadata.items()}
    assert chunks == {"model/w": [(0, 0), (0, 3), (5, 0), (5, 3)],
                      "model/e": [(0, 0), (0, 3)],  # each box once, though two ranks hold it
                      "model/r": [(0, 0), (1, 0), (2, 0)],  # rank 3's empty box: none
                      "optim/w/step": [()]}

    (meta0, got0), (meta1, got1) = launch(load_on_2, path, nprocs=2, timeout=30)
    assert meta0 == meta1 == {"step": 11}
    assert torch.equal(got0["model/w"], whole(*W)[:7]) and torch.equal(got1["model/w"],
                                                                        whole(*W)[7:])
    assert torch.equal(got0["model/e"], whole(*E)[:, :2])
    assert torch.equal(got1["model/e"], whole(*E)[:, 2:])
    assert torch.equal(got0["model/r"], whole(*R)) and got1["model/r"].numel() == 0
    assert got0["optim/w/step"].item() == got1["optim/w/step"].item() == 11.0

    full = full_state_dict(path)
    assert sorted(full) == ["e", "r", "w"]
    assert all(torch.equal(full[k], whole(*s)) for k, s in (("w", W), ("e", E), ("r", R)))


# ---- kill -9 during a save ----------------------------------------------------------------------


def big(name: str) -> dict[str, torch.Tensor]:
    """8 MB of model and a step: checkpoint "A" or "B", every value different between them."""
    seed = {"A": 10, "B": 20, "C": 30}[name]
    state = {f"model/w{i}": Box.of(whole((512, 1024), seed + i), (512, 1024), (0, 0))
             for i in range(4)}
    return {**state, "optim/w0/step": torch.tensor(float(seed))}


def save_b(path: str, pause: str | None, ready) -> None:
    """In a child process: save "B" over "A", stopping at ``pause`` (see checkpoint._pause)."""
    if pause:
        os.environ[PAUSE_ENV] = pause
    state = big("B")
    ready.set()
    save(path, state, {"name": "B"})


def which(path) -> str:
    """Which checkpoint, "A" or "B", ``path`` loads, through ``load`` and ``full_state_dict``;
    fails on a mix."""
    name = check(path)["name"]
    into = {k: Box.of(torch.zeros_like(v), v.global_shape, v.offsets) if isinstance(v, Box)
            else torch.zeros_like(v) for k, v in big("A").items()}
    assert load(path, into) == {"name": name}
    expected = big(name)
    assert all(torch.equal(into[k], expected[k]) for k in expected), f"{path} mixes A and B"
    full = full_state_dict(path)
    assert all(torch.equal(full[k.removeprefix("model/")], v) for k, v in expected.items()
               if k.startswith("model/"))
    return name


def wait_stopped(proc, seconds: float = 30.0) -> None:
    """Until ``proc`` is stopped (SIGSTOP, state "T" in /proc)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.is_alive():
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.005)
    raise AssertionError(f"the save did not stop at its pause point (exit code {proc.exitcode})")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_save_killed_at_any_moment_leaves_the_old_or_the_new_checkpoint(tmp_path, caplog):
    ctx = multiprocessing.get_context("forkserver")  # a clean child; torch imported once
    ctx.set_forkserver_preload(["shardfx"])
    save(tmp_path / "probe", big("B"))  # warm: the first save in a process is slower
    start = time.monotonic()
    save(tmp_path / "probe", big("B"))
    t_save = time.monotonic() - start
    rng = random.Random(0)
    trials = [("before-metadata", None), ("between-renames", None), ("before-cleanup", None)]
    trials += [(None, t_save * f * rng.uniform(1, 1.2)) for f in (0, 0.2, 0.4, 0.6, 0.8, 1.0)]
    seen = []
    for i, (pause, delay) in enumerate(trials):
        path = tmp_path / f"trial{i}" / "ck"
        save(path, big("A"), {"name": "A"})
        ready = ctx.Event()
        proc = ctx.Process(target=save_b, args=(str(path), pause, ready))
        proc.start()
        assert ready.wait(30)
        if pause:
            wait_stopped(proc)
        else:
            time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):  # too late: the save is done
            os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        left = sorted(p.name.split("-")[0] for p in path.parent.iterdir())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardfx.checkpoint"):
            seen.append(which(path))
        if pause == "before-metadata":  # A in place; B's data files, no .metadata: refused
            assert seen[-1] == "A" and left == ["ck", "ck.partial"]
            partial = next(path.parent.glob("ck.partial-*"))
            with pytest.raises(InputError, match=r"incomplete: \.metadata and shardfx.json "
                                                 r"missing; it was cut during a save"):
                check(partial)
        if pause == "between-renames":  # A as ck.old, read with a warning
            assert seen[-1] == "A" and left == ["ck.old", "ck.partial"]
            assert "a save was killed between its two renames" in caplog.text
        if pause == "before-cleanup":  # B in place, A as ck.old not yet deleted
            assert seen[-1] == "B" and left == ["ck", "ck.old"]
        save(path, big("C"), {"name": "C"})  # a fresh save puts C in place, deletes the rest
        assert os.listdir(path.parent) == ["ck"] and check(path) == {"name": "C"}
    assert seen[:3] == ["A", "A", "B"]


# ---- checkpoints that cannot be loaded ----------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    state = {"model/a": Box.of(whole((2, 3), 0), (2, 3), (0, 0)), "model/b": whole((4,), 1),
             "optim/a/step": torch.tensor(1.0)}
    return save(tmp_path / "ck", state, {"step": 1})


def cut(path, how: str) -> None:
    if how == "truncated":  # into the tensors' bytes, not only the trailer
        data = path / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:-300])
    else:
        (path / how).unlink()


@pytest.mark.parametrize("how, says", [
    (".metadata", r"incomplete: \.metadata missing"),
    ("shardfx.json", r"incomplete: shardfx.json missing"),
    ("__0_0.distcp", r"incomplete: __0_0.distcp is missing"),
    ("truncated", r"incomplete: __0_0.distcp holds \d+ bytes, shardfx.json says \d+")])
def test_an_incomplete_checkpoint_is_refused(small, how, says):
    cut(small, how)
    with pytest.raises(InputError, match=says) as err:
        check(small)
    assert "cut during a save" in str(err.value) and "resume from an earlier checkpoint" in str(
        err.value) and err.value.where == str(small)
    with pytest.raises(InputError, match=says):
        load(small, {})


def test_what_is_not_a_checkpoint_is_refused_and_not_overwritten(tmp_path):
    with pytest.raises(InputError, match="there is no checkpoint at"):
        check(tmp_path / "nothing")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(InputError, match="is not a shardfx checkpoint"):
        check(tmp_path / "notes")
    with pytest.raises(InputError, match="exists and is not a shardfx checkpoint: a save will "
                                         "not replace it"):
        save(tmp_path / "notes", {"model/a": torch.zeros(2)})
    assert os.listdir(tmp_path / "notes") == ["todo.txt"]


def test_keys_missing_unexpected_and_misshaped_are_named_in_one_error(small):
    state = {"model/a": torch.zeros(3, 3), "model/c": torch.zeros(1),
             "optim/a/step": torch.tensor(0.0)}
    with pytest.raises(InputError) as err:
        load(small, state)
    msg = str(err.value)
    assert "missing from the checkpoint (1): model/c" in msg
    assert "in the checkpoint, not expected (1): model/b" in msg
    assert "shaped differently (1): model/a: checkpoint [2, 3], model [3, 3]" in msg
    assert "load a checkpoint of the same model configuration" in msg
    assert state["model/a"].sum() == 0  # nothing read


def test_strict_optim_false_loads_the_model_without_the_optimizer(small):
    a, b = torch.zeros(2, 3), torch.zeros(4)
    with pytest.raises(InputError, match=r"not expected \(1\): optim/a/step"):
        load(small, {"model/a": a, "model/b": b})
    assert load(small, {"model/a": a, "model/b": b, "optim/x/step": torch.tensor(0.0)},
                strict_optim=False) == {"step": 1}
    assert torch.equal(a, whole((2, 3), 0)) and torch.equal(b, whole((4,), 1))


def test_a_format_from_the_future_and_another_torch_are_named(small, caplog):
    record = json.loads((small / "shardfx.json").read_text())
    (small / "shardfx.json").write_text(json.dumps(seal({**record, "torch": "2.0.1"})))
    with caplog.at_level(logging.WARNING, logger="shardfx.checkpoint"):
        assert check(small) == {"step": 1}  # this torch still reads it: a warning only
    assert f"written by torch 2.0.1; this is torch {torch.__version__}" in caplog.text
    garbled = b"a pickle of another torch's classes"
    (small / ".metadata").write_bytes(garbled)
    with pytest.raises(InputError, match=r"\.metadata of the checkpoint .* is damaged: it does "
                                         r"not match the checksum .* and \.metadata cannot be "
                                         r"read"):
        check(small)  # not what the save wrote: damaged, whichever torch reads it
    digest = Digest()
    digest.update(garbled)
    files = {**record["files"], ".metadata": {"bytes": len(garbled), "digest": digest.hexdigest()}}
    (small / "shardfx.json").write_text(json.dumps(seal({**record, "torch": "2.0.1",
                                                         "files": files})))
    with pytest.raises(InputError, match=r"written by torch 2.0.1 and this torch .* cannot read "
                                         r"it: \.metadata cannot be read"):
        check(small)  # what the save wrote, which this torch cannot unpickle
    (small / "shardfx.json").write_text(json.dumps({**record, "format": 99}))
    with pytest.raises(InputError, match=r"checkpoint format 99 .* which reads formats 2 and 3",
                       ) as err:
        check(small)
    assert err.value.fix == "upgrade shardfx"


def test_meta_must_be_json_and_values_tensors(tmp_path):
    with pytest.raises(InputError, match="meta cannot be written as JSON"):
        save(tmp_path / "ck", {"model/a": torch.zeros(1)}, {"when": object()})
    with pytest.raises(InputError, match=r"state\['lr'\] is a float, not a tensor or a Box"):
        save(tmp_path / "ck", {"lr": 0.1})
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())


def test_a_leftover_partial_is_ignored_and_removed_by_the_next_save(small):
    stale = small.with_name("ck.partial-deadbeef")
    shutil.copytree(small, stale)
    cut(stale, ".metadata")
    assert check(small) == {"step": 1}
    save(small, {"model/a": torch.ones(1)}, {"step": 2})
    assert os.listdir(small.parent) == ["ck"] and check(small) == {"step": 2}


def _save_with_a_full_disk_on_rank_1(root: str) -> str:
    """Save step 1 whole, then step 2 with rank 1's data file failing as a full disk does."""
    from shardfx.runtime import checkpoint

    r = dist.get_rank()
    state = {"model/w": Box.of(whole((4, 3), 0)[2 * r:2 * r + 2], (4, 3), (2 * r, 0))}
    save(f"{root}/ck", state, {"step": 1})
    if r == 1:
        def full(self, path, mode):
            raise OSError(28, "No space left on device", str(path))

        checkpoint._DigestedFiles.create_stream = contextlib.contextmanager(full)
    try:
        save(f"{root}/ck", {"model/w": Box.of(state["model/w"].local() + 1, (4, 3), (2 * r, 0))},
             {"step": 2})
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_save_that_fails_on_one_rank_is_named_on_every_rank(tmp_path):
    """Not DCP's "CheckpointException ranks:dict_keys([1])": the rank, its cause and file, on
    every rank; the previous checkpoint is as it was and the failed save's files are gone."""
    said = launch(_save_with_a_full_disk_on_rank_1, str(tmp_path), nprocs=2, timeout=60)
    assert said[0] == said[1], said
    assert "could not be written (rank 1: OSError: [Errno 28] No space left on device" in said[0]
    assert "__1_0.distcp" in said[0] and "make room" in said[0]
    assert check(tmp_path / "ck") == {"step": 1}
    assert torch.equal(full_state_dict(tmp_path / "ck")["w"], whole((4, 3), 0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
