"""``shardfx run`` (``shardfx.run.train``): a model factory trained from the command line on a
mesh, a line per step, equal to one device; checkpoints that resume with the same losses."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfx.errors import InputError
from shardfx.runtime.checkpoint import PAUSE_ENV, check
from shardfx.run.checkpoints import resolve
from shardfx.run.train import RunConfig, run

REPO = Path(__file__).parents[1]
SPEC = str(REPO / "examples" / "nanogpt.py") + ":workload"


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_device() -> list[float]:
    return run(RunConfig.of(SPEC, "", steps=6))


def test_dp_tp_trains_like_one_device(one_device):
    assert close(run(RunConfig.of(SPEC, "dp=2,tp=2", steps=4)), one_device[:4])


def test_the_command_line_prints_a_line_per_step_and_a_pipeline_matches(one_device):
    done = subprocess.run(
        [sys.executable, "-m", "shardfx", "run", SPEC, "--mesh", "pp=2", "--microbatches", "4",
         "--schedule", "zero-bubble", "--steps", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"^step +(\d+)/3 +loss (\S+) .* tokens/s", done.stdout, re.M)
    assert [int(s) for s, _ in lines] == [1, 2, 3], done.stdout
    assert close([float(v) for _, v in lines], [round(x, 6) for x in one_device[:3]])
    assert "shardfx run:" in done.stdout and "median" in done.stdout  # the table at the end


def test_save_then_resume_continues_with_the_same_losses(one_device, tmp_path):
    whole = run(RunConfig.of(SPEC, "dp=2", steps=6))
    first = run(RunConfig.of(SPEC, "dp=2", steps=4, save=str(tmp_path / "ck")))
    rest = run(RunConfig.of(SPEC, "dp=2", steps=6, resume=str(tmp_path / "ck")))
    assert first + rest == whole and close(whole, one_device)  # the same bits as not stopping
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-000004"]
    names = sorted(p.name for p in (tmp_path / "ck" / "step-000004").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "shardfx.json"], names
    # another mesh: each rank takes its shards of the model and the optimizer state
    assert close(run(RunConfig.of(SPEC, "tp=2", steps=6, resume=str(tmp_path / "ck"))), whole[4:])


def test_a_run_killed_while_saving_resumes_from_a_whole_checkpoint(tmp_path):
    """kill -9 of a 2-rank run inside its save, at the points between which the checkpoint on
    disk changes and at random moments: resuming gives the losses of a run never stopped."""
    whole = run(RunConfig.of(SPEC, "dp=2", steps=12))
    ck = tmp_path / "ck"
    assert run(RunConfig.of(SPEC, "dp=2", steps=2, save=str(ck))) == whole[:2]
    rng = random.Random(0)
    trials = [("before-metadata", None), ("between-renames", None),
              (None, rng.uniform(0, 1.0)), (None, rng.uniform(0, 1.0))]
    for pause, delay in trials:
        at = check(resolve(str(ck)))["data_position"]
        env = {**os.environ, PAUSE_ENV: pause or ""}
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardfx", "run", SPEC, "--mesh", "dp=2", "--steps",
             str(at + 2), "--resume", str(ck), "--save", str(ck)], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)
        for line in proc.stdout:  # the last step is done: the save comes next
            if re.match(rf"step +{at + 2}/{at + 2} ", line):
                break
        if pause:
            _wait_stopped(proc.pid)
        else:
            time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        now = check(resolve(str(ck)))["data_position"]  # the old checkpoint or the new, whole
        assert now in (at, at + 2), (pause, delay, now)
        if pause:  # stopped before the new one was in place
            assert now == at, pause
        assert run(RunConfig.of(SPEC, "dp=2", steps=now + 2, resume=str(ck))) == whole[now:now + 2]


def _wait_stopped(group: int, timeout: float = 120) -> None:
    """Until a process of ``group`` has stopped itself (the checkpoint's test hook)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if fields[0] == "T" and int(fields[2]) == group:
                    return
        time.sleep(0.05)
    raise AssertionError("the save never reached its pause")


def test_an_incomplete_checkpoint_is_refused_before_planning(tmp_path):
    run(RunConfig.of(SPEC, "", steps=2, save=str(tmp_path / "ck")))
    (tmp_path / "ck" / "step-000002" / ".metadata").unlink()
    with pytest.raises(InputError, match="incomplete"):
        run(RunConfig.of(SPEC, "dp=2", steps=4, resume=str(tmp_path / "ck")))


TINY = """
import torch
def tiny():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return {"model": model, "args": (x,), "loss_fn": torch.nn.functional.mse_loss, "targets": (x,)}
"""


def test_an_export_refused_after_training_is_written_beside_it_and_named(tmp_path, monkeypatch):
    """The export directory changes during the run (a file appears in it after the last
    step): the model goes to DIR.step-N beside it, with the trained weights (the last
    checkpoint's), and the error names both; resumed from that checkpoint with --export-hf,
    the run trains nothing and exports the same tensors."""
    import torch
    from safetensors.torch import load_file

    from shardfx.run import train
    from shardfx.runtime.checkpoint import full_state_dict

    (tmp_path / "tiny.py").write_text(TINY)
    spec = f"{tmp_path / 'tiny.py'}:tiny"
    out, ck = tmp_path / "hf", tmp_path / "ck"
    loop = train._loop

    def spoiled(*args):
        losses = loop(*args)
        out.mkdir()
        (out / "notes.txt").write_text("written while the run trained")
        return losses

    monkeypatch.setattr(train, "_loop", spoiled)
    with pytest.raises(InputError) as info:
        run(RunConfig.of(spec, "", steps=2, save=str(ck), export_hf=str(out)))
    moved, last = tmp_path / "hf.step-000002", ck / "step-000002"
    message = str(info.value)
    assert f"{out} exists and is not a Hugging Face checkpoint" in message, message
    assert f"written as a Hugging Face checkpoint to {moved} instead" in message, message
    assert f"in the checkpoint {last}" in message and "fix:" in message, message
    exported, trained = load_file(moved / "model.safetensors"), full_state_dict(last)
    assert exported and all(torch.equal(v, trained[k]) for k, v in exported.items())

    monkeypatch.setattr(train, "_loop", loop)
    again = tmp_path / "again"
    assert run(RunConfig.of(spec, "", steps=2, resume=str(ck), export_hf=str(again))) == []
    assert load_file(again / "model.safetensors").keys() == exported.keys()
    assert all(torch.equal(v, exported[k]) for k, v in
               load_file(again / "model.safetensors").items())


def test_version_and_inspect_prints_the_schedule(capsys):
    from shardfx.run.cli import main

    assert main(["--version"]) == 0
    assert re.fullmatch(r"shardfx \S+\n", capsys.readouterr().out)
    assert main(["inspect", SPEC, "--mesh", "pp=2", "--microbatches", "4",
                 "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "Schedule (2 ranks, 4 microbatches)" in out and "0F0" in out
