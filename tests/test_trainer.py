"""``shardfx run`` as a trainer: the TOML config and its flags, the checks made before any
process starts, the learning-rate schedule, the token file, the metrics, and a run killed
between checkpoints that resumes with the losses of one never stopped."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import shardfx
from shardfx.run.config import RunConfig, load_toml
from shardfx.run.data import TokenFile
from shardfx.errors import InputError
from shardfx.run.train import lr_factor

REPO = Path(__file__).parents[1]
SPEC = str(REPO / "examples" / "nanogpt.py") + ":workload"
CONFIG = REPO / "examples" / "shakespeare.toml"


def test_the_toml_file_and_flags_over_it(tmp_path):
    config = load_toml(str(CONFIG))
    assert (config.mesh, config.steps, config.accumulate, config.decay) == ("dp=2,tp=2", 300, 2,
                                                                           "cosine")
    assert config.lr == 3e-3 and config.clip_grad_norm == 1.0 and config.every == 50
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml())  # the resolved config, as printed and saved, reads back
    assert load_toml(str(again)) == config
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nstep = 3\n")
    with pytest.raises(InputError, match="unknown key 'step' in \\[training\\] \\(did you mean 'steps'"):
        load_toml(str(bad))
    bad.write_text("[training]\nsteps = 'many'\n")
    with pytest.raises(InputError, match="steps is 'many', not an int"):
        load_toml(str(bad))
    bad.write_text("[trainin]\nsteps = 3\n")
    with pytest.raises(InputError, match="unknown section \\[trainin\\]"):
        load_toml(str(bad))
    bad.write_text("[training]\ninit_from = 'hf'\n")  # a key of another section: said so
    with pytest.raises(InputError, match=r"in \[training\] \(did you mean \[checkpoint\] "
                                         r"init_from\?(.|\n)*fix: +move it under \[checkpoint\]"):
        load_toml(str(bad))


def test_command_line_flags_override_the_file(monkeypatch):
    from shardfx.run import cli

    seen = []
    monkeypatch.setattr("shardfx.run.train.run", seen.append)
    assert cli.main(["run", "--config", str(CONFIG), "--steps", "7", "--mesh", "dp=2",
                     "--warmup", "2"]) == 0  # the file's 30 warmup steps: more than 7
    (config,) = seen
    assert (config.steps, config.mesh, config.accumulate) == (7, "dp=2", 2)
    assert config.spec == "examples/nanogpt.py:shakespeare"


def test_shard_is_a_flag_and_a_key_and_reaches_partition(monkeypatch, tmp_path):
    """``shard="auto"`` is the default; a run can leave it (``--shard``, ``[parallel] shard``)."""
    from shardfx.run import cli
    from shardfx.run import train

    seen = []
    monkeypatch.setattr("shardfx.run.train.run", seen.append)
    toml = tmp_path / "r.toml"
    toml.write_text(f'[run]\nspec = "{SPEC}"\n[parallel]\nshard = "replicate"\n')
    assert cli.main(["run", "--config", str(toml)]) == 0
    assert cli.main(["run", "--config", str(toml), "--shard", "megatron"]) == 0
    assert [c.shard for c in seen] == ["replicate", "megatron"]
    planned = []
    monkeypatch.setattr(shardfx, "partition", lambda *a, **k: planned.append(k) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train.train(seen[1])
    assert planned[0]["shard"] == "megatron"


def test_recompute_and_allow_nonfinite_are_keys_and_reach_the_runner(monkeypatch, tmp_path):
    """``[parallel] recompute`` goes to partition; ``[checkpoint] allow_nonfinite`` to the
    loads of --init-from and --resume."""
    from shardfx.run import cli
    from shardfx.run import train

    seen = []
    monkeypatch.setattr("shardfx.run.train.run", seen.append)
    toml = tmp_path / "r.toml"
    toml.write_text(f'[run]\nspec = "{SPEC}"\n[parallel]\nrecompute = "full"\n'
                    '[checkpoint]\nallow_nonfinite = true\n')
    assert cli.main(["run", "--config", str(toml)]) == 0
    assert (seen[0].parallel.recompute, seen[0].checkpoint.allow_nonfinite) == ("full", True)
    assert cli.main(["run", "--config", str(toml), "--recompute", "selective"]) == 0
    assert seen[1].parallel.recompute == "selective"
    planned = []
    monkeypatch.setattr(shardfx, "partition", lambda *a, **k: planned.append(k) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train.train(seen[1])
    assert planned[0]["recompute"] == "selective"
    assert cli.main(["run", "--config", str(toml), "--recompute", "most"]) == 2  # argparse's


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "dp=2", "--schedule", "gpipe"], "--schedule given, but the mesh dp=2 has no pp"),
    (["--virtual-stages", "2"], "--virtual-stages given, but the mesh 1 device has no pp"),
    (["--mesh", "tp=2", "--zero", "2"], "--zero 2 shards the training state over dp"),
    (["--mesh", "dp=3"], "batch has 8 rows, which dp=3 cannot divide"),
    (["--mesh", "dp=2,pp=2", "--microbatches", "3"], "dp=2 x 3 microbatches cannot divide"),
    (["--every", "5"], "every is 5, with no save directory"),
    (["--warmup", "10", "--steps", "5"], "warmup is 10 steps of a 5-step run"),
    (["--tokens", "nowhere.bin"], "no token file 'nowhere.bin'"),
    (["--mesh", "cp=3"], "sequences have 64 tokens, which cp=3 cannot split"),
    (["--mesh", "dp=2", "--shard", "megatron-sp"], "--shard megatron-sp splits the sequence"),
    (["--beta1", "1.5"], "beta1 is 1.5"),
    (["--eps", "0"], "eps is 0.0"),
    (["--mesh", "dp=2,pp=2", "--zero", "3"], "--zero 3 inside a pipeline is not supported"),
    (["--tensorboard", "tb"], None),
    (["--gpu", "tpu9"], "no peak FLOP/s preset for the GPU 'tpu9'"),
    (["--init-from", "nowhere"], "nowhere is not a directory"),
    (["--init-from", "a", "--resume", "b"], "--init-from and --resume both given"),
    # every path the run writes, before it trains for hours and then cannot write it
    (["--export-hf", str(REPO / "examples")], "examples exists and is not a Hugging Face"),
    (["--export-hf", "out", "--jsonl", "out/m.jsonl"], "--jsonl out/m.jsonl is inside "
                                                       "--export-hf out"),
    (["--save", str(REPO / "README.md")], "README.md is a file, not a directory"),
    (["--jsonl", str(REPO / "examples")], "examples is a directory, not a file"),
    (["--trace", str(REPO / "README.md" / "t.json")], "README.md is a file, so"),
])
def test_what_can_be_checked_is_checked_before_any_process_starts(flags, message, capsys,
                                                                    monkeypatch):
    from shardfx.run import cli

    if message is None:  # tensorboard: an error only where the package is missing
        import importlib.util

        if importlib.util.find_spec("tensorboard") is not None:
            pytest.skip("tensorboard is installed")
        message = "needs the tensorboard package"
    monkeypatch.setattr(shardfx, "launch", lambda *a, **k: pytest.fail("spawned"))
    monkeypatch.setattr("shardfx.run.train.train", lambda *a: pytest.fail("trained"))
    assert cli.main(["run", SPEC, *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and "fix:" in err and "Traceback" not in err, err


def test_the_learning_rate_schedule():
    config = RunConfig.of(SPEC, steps=11, lr=1.0, warmup=2, decay="cosine", final_lr=0.1)
    lrs = [lr_factor(config, s) for s in range(11)]
    assert lrs[:3] == [1 / 3, 2 / 3, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    config = RunConfig.of(SPEC, steps=6, warmup=0, decay="linear", final_lr=0.0)
    assert [lr_factor(config, s) for s in range(6)] == pytest.approx([1, .8, .6, .4, .2, 0])


def test_a_token_file_is_read_in_windows_each_once_per_epoch(tmp_path):
    ids = np.arange(1001, dtype=np.uint16) % 97
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids)
    for name in ("t.bin", "t.npy"):
        f = TokenFile(str(tmp_path / name), rows=4, length=10, seed=3, dtype=torch.int64)
        assert f.windows == 100
        seen = []
        for i in range(25):  # one epoch: 25 batches of 4 windows
            (x,), (y,) = f.batch(i)
            assert x.shape == (4, 10) and x.dtype == torch.int64
            assert torch.equal(y[:, :-1], x[:, 1:])  # the targets: the next tokens
            seen += [int(r[0]) for r in x]
        assert sorted(seen) == sorted(int(ids[w * 10]) for w in range(100))
        assert torch.equal(f.batch(7)[0][0], TokenFile(str(tmp_path / name), 4, 10, 3,
                                                       torch.int64).batch(7)[0][0])


def _cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardfx", "run", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)


def _steps(jsonl: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return {r["step"]: r for r in lines if "step" in r and "event" not in r}


def test_a_run_killed_between_checkpoints_resumes_with_the_same_losses(tmp_path):
    """The Shakespeare config on dp=2, a checkpoint every 2 steps: killed (-9) after step 5,
    resumed from step 4, its losses, learning rates and gradient norms are an uninterrupted
    run's, bit for bit; the metrics file says it resumed and plots."""
    subprocess.run([sys.executable, "examples/prepare_text.py"], cwd=REPO, check=True,
                   capture_output=True)  # the config's token file (deterministic)
    common = ["--config", str(CONFIG), "--mesh", "dp=2", "--steps", "7", "--warmup", "2",
              "--every", "2", "--keep", "2"]
    whole = _cli([*common, "--save", str(tmp_path / "a"), "--jsonl", str(tmp_path / "a.jsonl")])
    out = whole.communicate(timeout=600)[0]
    assert whole.returncode == 0, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-000006", "step-000007"]

    log = tmp_path / "b.jsonl"
    killed = _cli([*common, "--save", str(tmp_path / "b"), "--jsonl", str(log)])
    for line in killed.stdout:
        if line.startswith("step 5/7"):
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = _cli([*common, "--save", str(tmp_path / "b"), "--jsonl", str(log),
                    "--resume", str(tmp_path / "b")])
    out = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, out[-3000:]
    assert re.search(r"resumed from \S+step-000004 at step 4 \(data position: batch 8\)", out)
    a, b = _steps(tmp_path / "a.jsonl"), _steps(log)
    assert sorted(a) == sorted(b) == list(range(1, 8))
    for key in ("loss", "lr", "grad_norm"):
        assert [a[s][key] for s in a] == [b[s][key] for s in a], key
    events = [json.loads(line).get("event") for line in log.read_text().splitlines()]
    assert events.count("resume") == 1 and events.count("start") == 2
    page = tmp_path / "loss.html"
    subprocess.run([sys.executable, "examples/plot_metrics.py", str(tmp_path / "a.jsonl"),
                    str(log), "--out", str(page)], cwd=REPO, check=True, capture_output=True)
    assert page.read_text().count("<polyline") >= 2


def test_a_mistake_in_the_config_is_said_before_torch_is_imported(tmp_path):
    """A wrong key or value in the TOML costs no torch import (seconds of CPU) to report."""
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[run]\nspec = "{SPEC}"\n[optimizer]\nbeta1 = 1.5\n')
    code = ("import sys; from shardfx.run import cli; "
            f"code = cli.main(['run', '--config', {str(bad)!r}]); "
            "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.stdout.split() == ["1", "False"], (done.stdout, done.stderr)
    assert "beta1 is 1.5" in done.stderr and "where: --beta1" in done.stderr


def test_a_factory_whose_data_file_is_missing_says_so_once(capsys, monkeypatch, tmp_path):
    """The likeliest first mistake: the Shakespeare config run before prepare_text.py."""
    from shardfx.run import cli

    monkeypatch.setattr(shardfx, "launch", lambda *a, **k: pytest.fail("spawned"))
    script = tmp_path / "needs_data.py"
    script.write_text("def make():\n"
                      "    raise FileNotFoundError('data/meta.json is missing: run "
                      "python examples/prepare_text.py first')\n")
    assert cli.main(["run", f"{script}:make"]) == 1
    err = capsys.readouterr().err
    assert "FileNotFoundError: data/meta.json is missing: run python examples/prepare_text.py" \
        in err and f"{script}:2 in make" in err and "Traceback" not in err, err


def test_inspect_refuses_a_schedule_without_a_pp_axis(capsys):
    from shardfx.run import cli

    assert cli.main(["inspect", SPEC, "--mesh", "dp=2", "--schedule", "gpipe"]) == 1
    assert "--schedule given, but the mesh dp=2 has no pp axis" in capsys.readouterr().err
