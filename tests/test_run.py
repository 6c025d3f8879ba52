"""``shardfx run`` (``shardfx.train``): a model factory trained from the command line on a
mesh, a line per step, equal to one device; checkpoints that resume with the same losses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfx.errors import InputError
from shardfx.train import RunConfig, run

REPO = Path(__file__).parents[1]
SPEC = str(REPO / "examples" / "nanogpt.py") + ":workload"


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_device() -> list[float]:
    return run(RunConfig(SPEC, "", steps=6))


def test_dp_tp_trains_like_one_device(one_device):
    assert close(run(RunConfig(SPEC, "dp=2,tp=2", steps=4)), one_device[:4])


def test_the_command_line_prints_a_line_per_step_and_a_pipeline_matches(one_device):
    done = subprocess.run(
        [sys.executable, "-m", "shardfx", "run", SPEC, "--mesh", "pp=2", "--microbatches", "4",
         "--schedule", "zero-bubble", "--steps", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"^step +(\d+)/3 +loss (\S+) .* tokens/s", done.stdout, re.M)
    assert [int(s) for s, _ in lines] == [1, 2, 3], done.stdout
    assert close([float(v) for _, v in lines], [round(x, 6) for x in one_device[:3]])
    assert "shardfx run:" in done.stdout and "median step" in done.stdout


def test_save_then_resume_continues_with_the_same_losses(one_device, tmp_path):
    first = run(RunConfig(SPEC, "dp=2", steps=4, save=str(tmp_path / "ck")))
    rest = run(RunConfig(SPEC, "dp=2", steps=6, resume=str(tmp_path / "ck")))
    assert close(first + rest, one_device)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == \
        ["meta.json", "model.pt", "optimizer-rank0.pt", "optimizer-rank1.pt"]
    with pytest.raises(InputError, match="saved on mesh dp=2, this run is on tp=2"):
        run(RunConfig(SPEC, "tp=2", steps=6, resume=str(tmp_path / "ck")))


def test_version_and_inspect_prints_the_schedule(capsys):
    from shardfx.cli import main

    assert main(["--version"]) == 0
    assert re.fullmatch(r"shardfx \S+\n", capsys.readouterr().out)
    assert main(["inspect", SPEC, "--mesh", "pp=2", "--microbatches", "4",
                 "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "Schedule (2 ranks, 4 microbatches)" in out and "0F0" in out
