"""Checkpoints verified end to end (``runtime.checkpoint_files``, ``runtime.checkpoint_digest``):
every file carries its save's id and is checked against the checksum recorded when it was
written, and every field of ``shardfx.json`` is checked, so a damaged or mixed-up checkpoint is
an ``InputError`` naming the file or field before any tensor is used, not a load that silently
gives wrong values. Real saves, damaged on disk the ways checkpoints get damaged."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from shardfx import launch
from shardfx.errors import InputError
from shardfx.runtime import checkpoint
from shardfx.runtime.checkpoint import Box, check, full_state_dict, load, save
from shardfx.runtime.checkpoint_digest import read_trailer

W, E = (256, 64), (64, 32)  # W's boxes are mostly tensor bytes: a flip in one's middle is data


def whole(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def saved_on(r: int, step: int) -> dict[str, torch.Tensor]:
    """Rank ``r``'s state at ``step`` on dp=2 x tp=2: W in dp x tp boxes, E's tp columns (one
    writer for the two dp ranks holding each), the step whole."""
    dp, tp = divmod(r, 2)
    return {"model/w": Box.of(whole(W, step)[dp * 128:dp * 128 + 128, tp * 32:tp * 32 + 32], W,
                              (dp * 128, tp * 32)),
            "model/e": Box.of(whole(E, step + 1)[:, tp * 16:tp * 16 + 16], E, (0, tp * 16)),
            "optim/w/step": torch.tensor(float(step))}


def save_steps(root: str):
    """On 4 ranks: the checkpoints of step 2 and step 4, as shardfx run names them; then a copy
    of step 4 with 16 bytes flipped in the middle of W's box in ``__1_0.distcp``, loaded on dp=4
    (ZeRO-3's rows): this rank's InputError, (cause, where)."""
    r = dist.get_rank()
    for step in (2, 4):
        save(f"{root}/step-{step:06d}", saved_on(r, step),
             {"step": step, "seed": 0, "data_position": step})
    flipped = Path(root) / "flipped"
    if r == 0:
        shutil.copytree(Path(root) / "step-000004", flipped)
        at, length = payload_of(flipped, "model/w", "__1_0.distcp")
        flip(flipped / "__1_0.distcp", at + length // 2)
    dist.barrier()
    state = {"model/w": Box.of(torch.zeros(64, 64), W, (64 * r, 0)), "model/e": torch.zeros(E),
             "optim/w/step": torch.tensor(0.0)}
    try:
        load(flipped, state)
    except InputError as e:
        return e.cause, e.where
    return None


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> tuple[Path, list]:
    """The two saves (one launch of 4 ranks for the module) and the dp=4 ranks' refusals."""
    root = tmp_path_factory.mktemp("saves")
    return root, launch(save_steps, str(root), nprocs=4, timeout=60)


@pytest.fixture
def ck(saves, tmp_path) -> Path:
    """A copy of the step-4 checkpoint, to damage; step 2's beside it."""
    for step in (2, 4):
        shutil.copytree(saves[0] / f"step-{step:06d}", tmp_path / f"step-{step:06d}")
    return tmp_path / "step-000004"


def record(path: Path) -> dict:
    return json.loads((path / "shardfx.json").read_text())


def one_process() -> dict[str, torch.Tensor]:
    return {"model/w": Box.of(torch.zeros(W), W, (0, 0)), "model/e": torch.zeros(E),
            "optim/w/step": torch.tensor(0.0)}


def payload_of(path: Path, key: str, name: str) -> tuple[int, int]:
    """(offset, length) of ``key``'s box stored in the data file ``name``."""
    return next((info.offset, info.length) for index, info in
                FileSystemReader(path).read_metadata().storage_data.items()
                if index.fqn == key and info.relative_path == name)


def flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def refused(path: Path, says: str, where: str) -> InputError:
    """The InputError ``check`` and a one-process ``load`` give, both matching ``says``, its
    ``where`` naming ``where``."""
    with pytest.raises(InputError, match=says) as err:
        check(path)
    assert where in err.value.where, err.value
    with pytest.raises(InputError, match=says):
        load(path, one_process())
    return err.value


# ---- what a save records ------------------------------------------------------------------------


def test_every_file_carries_the_save_id_and_its_checksum_is_recorded(saves):
    root, _ = saves
    two, four = record(root / "step-000002"), record(root / "step-000004")
    assert two["save"] != four["save"]  # one id per save, the same on every rank
    path = root / "step-000004"
    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                     "__3_0.distcp", "shardfx.json"]  # no file beside DCP's and ours
    assert sorted(four["files"]) == names[:-1]
    assert FileSystemReader(path).read_metadata().storage_meta.save_id == four["save"]
    for name in names[1:-1]:
        mark = read_trailer(path / name)
        assert mark == {"save": four["save"], **four["files"][name]}
        assert (path / name).stat().st_size > mark["bytes"]  # DCP's bytes, then the trailer
    assert check(path) == {"step": 4, "seed": 0, "data_position": 4}


# ---- damaged data files -------------------------------------------------------------------------


def test_bytes_flipped_in_a_tensor_are_refused_on_every_rank_naming_the_file(saves, ck,
                                                                            monkeypatch):
    at, length = payload_of(ck, "model/w", "__1_0.distcp")
    flip(ck / "__1_0.distcp", at + length // 2)
    says = r"__1_0.distcp of the checkpoint .* is damaged: its \d+ bytes no longer match " \
           r"the checksum recorded when it was saved"
    err = refused(ck, says, "__1_0.distcp")
    assert "copy the checkpoint again" in err.fix
    with pytest.raises(InputError, match=says):
        full_state_dict(ck)
    # dp=4 loads it (``save_steps``): every rank refuses it alike, though one rank checks it
    got = saves[1]
    assert all(isinstance(g, tuple) and g == got[0] for g in got), got
    assert "__1_0.distcp" in got[0][0] and got[0][1].endswith("__1_0.distcp")
    # what it was before: the flip is in W's values, and a load without the check takes it
    monkeypatch.setattr(checkpoint, "verify_contents", lambda *args: None)
    state = one_process()
    load(ck, state)
    assert not torch.equal(state["model/w"].local()[:128, 32:], whole(W, 4)[:128, 32:])


def test_a_data_file_of_another_save_of_the_same_size_is_refused(ck):
    other = ck.parent / "step-000002" / "__1_0.distcp"
    assert other.stat().st_size == (ck / "__1_0.distcp").stat().st_size
    shutil.copy(other, ck / "__1_0.distcp")
    err = refused(ck, r"__1_0.distcp is from another save: it carries save id "
                      rf"{record(other.parent)['save']}, and this checkpoint's shardfx.json "
                      rf"records {record(ck)['save']}", "__1_0.distcp")
    assert "copy a checkpoint directory whole" in err.fix


def test_a_shardfx_json_of_another_save_is_refused(ck):
    shutil.copy(ck.parent / "step-000002" / "shardfx.json", ck / "shardfx.json")
    assert check(ck.parent / "step-000002")["step"] == 2  # itself, whole
    refused(ck, r"shardfx.json is from another save: it records save \w+, and \.metadata and "
                r"the data files carry save \w+", "shardfx.json")


def test_a_metadata_of_another_save_is_refused(ck):
    shutil.copy(ck.parent / "step-000002" / ".metadata", ck / ".metadata")
    refused(ck, r"\.metadata is from another save", ".metadata")


@pytest.mark.parametrize("how, says", [
    ("trailer", r"__0_0.distcp of the checkpoint .* is damaged: its end is not the trailer"),
    ("appended", r"__0_0.distcp of the checkpoint .* is damaged: its end is not the trailer"),
    ("index", r"\.metadata of the checkpoint .* is damaged: it does not match the checksum")])
def test_damage_outside_the_tensors_is_refused(ck, how, says):
    data = ck / "__0_0.distcp"
    if how == "trailer":
        flip(data, data.stat().st_size - 40, 4)
    elif how == "appended":
        data.write_bytes(data.read_bytes() + b"more")
    else:
        index = pickle.loads((ck / ".metadata").read_bytes())
        index.planner_data = {"changed": True}
        (ck / ".metadata").write_bytes(pickle.dumps(index))
    refused(ck, says, data.name if how != "index" else ".metadata")


def test_a_file_dcp_cannot_read_is_one_input_error_naming_it(ck, monkeypatch):
    """Zip headers damaged where the checksum does not look (patched out here): DCP's
    CheckpointException, a BaseException, becomes one InputError naming the file."""
    at, _ = payload_of(ck, "model/w", "__0_0.distcp")
    flip(ck / "__0_0.distcp", at, 30)  # the zip's first local header
    monkeypatch.setattr(checkpoint, "verify_contents", lambda *args: None)
    with pytest.raises(InputError, match=r"__0_0.distcp of the checkpoint .* is damaged: DCP "
                                         r"cannot read it \(\w+") as err:
        load(ck, one_process())
    assert err.value.where.endswith("__0_0.distcp")


# ---- shardfx.json's fields ----------------------------------------------------------------------


@pytest.fixture
def small(tmp_path) -> Path:
    return save(tmp_path / "ck", {"model/a": torch.ones(2, 3)},
                {"step": 3, "seed": 7, "data_position": 3})


@pytest.mark.parametrize("field, value, says", [
    ("step", "abc", r"'meta\.step' is \"abc\"; it must be a whole number >= 0"),
    ("step", -5, r"'meta\.step' is -5; it must be a whole number >= 0"),
    ("step", 2.5, r"'meta\.step' is 2\.5"),
    ("seed", "abc", r"'meta\.seed' is \"abc\"; it must be a whole number"),
    ("data_position", -1, r"'meta\.data_position' is -1"),
    ("optimizer", {"class": 3}, r"'meta\.optimizer' is"),
    ("format", "1", r"'format' is \"1\"; it must be a whole number"),
    ("format", None, r"has no 'format'"),
    ("tensors", None, r"has no 'tensors'; it must be an object of key"),
    ("tensors", {"model/a": {"shape": [2, -3], "dtype": "float32"}}, r"'tensors' is"),
    ("meta", None, r"has no 'meta'; it must be a JSON object"),
    ("meta", [1, 2], r"'meta' is \[1, 2\]; it must be a JSON object"),
    ("files", None, r"has no 'files'"),
    ("save", 12, r"'save' is 12"),
    ("world_size", 0, r"'world_size' is 0; it must be a whole number >= 1"),
    ("shardfx", None, r"has no 'shardfx'")])
def test_each_malformed_field_of_shardfx_json_is_named(small, field, value, says):
    fields = record(small)
    where = fields["meta"] if field in ("step", "seed", "data_position", "optimizer") else fields
    if value is None:
        del where[field]
    else:
        where[field] = value
    (small / "shardfx.json").write_text(json.dumps(fields))
    name = f"meta.{field}" if where is not fields else field
    with pytest.raises(InputError, match=says) as err:
        check(small)
    assert err.value.where.endswith(f"shardfx.json, field {name}")
    assert "put back the shardfx.json this save wrote" in err.value.fix


def test_shardfx_json_that_is_not_an_object_and_an_older_format_are_named(small):
    (small / "shardfx.json").write_text("[1, 2]")
    with pytest.raises(InputError, match=r"shardfx.json holds \[1, 2\]; it must be a JSON object"):
        check(small)
    (small / "shardfx.json").write_text(json.dumps({"format": 1, "shardfx": "0.0.9"}))
    with pytest.raises(InputError, match=r"checkpoint format 1 \(written by shardfx 0\.0\.9\) "
                                         r"cannot be read by this shardfx .*, which reads "
                                         r"formats 2 and 3") as err:
        check(small)
    assert err.value.fix.startswith("load it with a shardfx that reads format 1")


@pytest.mark.parametrize("edit, field", [
    (lambda r: r["meta"].update(step=r["meta"]["step"] + 1), "step"),  # well formed, wrong
    (lambda r: r["meta"].update(data_position=0), "data_position"),
    (lambda r: r["files"]["__0_0.distcp"].update(digest="0" * 32), "a data file's checksum"),
    (lambda r: r["tensors"]["model/a"].update(dtype="bfloat16"), "a tensor's dtype"),
    (lambda r: r.update(world_size=2), "world_size")])
def test_a_field_edited_since_the_save_is_refused_naming_shardfx_json(small, edit, field):
    """Every field of shardfx.json is covered by its own checksum: a well-formed value that
    is not the save's (a step of 4 made 5 resumes at the wrong step) is refused, naming
    shardfx.json, not the file an edited checksum describes."""
    fields = record(small)
    edit(fields)
    (small / "shardfx.json").write_text(json.dumps(fields))
    with pytest.raises(InputError, match=r"shardfx.json of the checkpoint .* is damaged: its "
                                         r"fields no longer match the checksum") as err:
        check(small)
    assert err.value.where.endswith("shardfx.json"), field


def test_shardfx_json_laid_out_anew_still_loads(small):
    """The checksum covers the fields, not the bytes: indentation and key order are free."""
    fields = record(small)
    (small / "shardfx.json").write_text(json.dumps(dict(reversed(fields.items()))))
    assert check(small) == {"step": 3, "seed": 7, "data_position": 3}


def test_format_2_without_a_checksum_of_its_own_loads_with_a_warning(small, caplog):
    fields = record(small)
    del fields["digest"]
    (small / "shardfx.json").write_text(json.dumps({**fields, "format": 2}))
    with caplog.at_level(logging.WARNING, logger="shardfx.checkpoint"):
        assert check(small) == {"step": 3, "seed": 7, "data_position": 3}
    assert "its fields (the step, the seed, the data position) cannot be verified" in caplog.text


def test_shardfx_run_refuses_a_damaged_checkpoint_before_any_process_plans(ck):
    """``shardfx run --resume``: the refusal comes from the checks before the ranks start."""
    from shardfx.run.train import RunConfig, preflight

    shutil.copy(ck.parent / "step-000002" / "__3_0.distcp", ck / "__3_0.distcp")
    spec = str(Path(__file__).parents[1] / "examples" / "nanogpt.py") + ":workload"
    with pytest.raises(InputError, match=r"__3_0.distcp is from another save"):
        preflight(RunConfig.of(spec, "", steps=6, resume=str(ck.parent)))  # the highest step
