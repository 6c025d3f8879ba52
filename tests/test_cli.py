"""``shardfx inspect MODULE:FACTORY``: prints the plan, dumps it, and fails in one paragraph.

A two-layer MLP with an MSE loss, written as a module into a temporary directory, is planned by
file path and by dotted name; the printed table names the model, its parameter count and its
forward/backward FLOPs. A bad MODULE:FACTORY exits 2 naming the cause and the fix without a
traceback, an error from shardfx exits 1, and ``python -m shardfx`` runs the same command.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardfx.run.cli import main

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn.functional as F


    class TinyMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 8)  # 40 parameters
            self.fc2 = torch.nn.Linear(8, 4)  # 36 parameters

        def forward(self, x):  # (2, 4) -> (2, 4)
            return self.fc2(torch.relu(self.fc1(x)))


    def factory():
        return {"model": TinyMLP(), "args": (torch.randn(2, 4),), "loss_fn": F.mse_loss,
                "targets": (torch.randn(2, 4),)}


    def as_tuple():
        return TinyMLP(), (torch.randn(2, 4),), F.mse_loss, (torch.randn(2, 4),)


    def not_scalar():
        return TinyMLP(), (torch.randn(2, 4),), lambda out, y: out - y, (torch.randn(2, 4),)


    def wrong():
        return 42


    def typo():
        return {"model": TinyMLP(), "arg": (torch.randn(2, 4),)}


    def bare_tensor():
        return TinyMLP(), torch.randn(2, 4)


    def needs(width):
        return factory()


    not_a_function = 3
''')

# 2x4 @ 4x8 and 2x8 @ 8x4 at 2 FLOPs per multiply-add; backward needs twice that, less the
# input gradient of the first layer.
FWD_FLOPS, BWD_FLOPS, PARAMS = "256", "384", "76"


@pytest.fixture
def factories(tmp_path: Path, monkeypatch):
    """The factory module's path; the CLI's additions to sys.path and sys.modules are undone."""
    path = tmp_path / "cli_factories.py"
    path.write_text(FACTORIES)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield path
    for name in [n for n in sys.modules if n.endswith("cli_factories")]:
        del sys.modules[name]


def row(out: str, label: str) -> list[str]:
    """The cells of the table row that starts with ``label``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells[0] == label:
            return cells
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_inspect_prints_the_training_plan(factories, capsys):
    assert main(["inspect", f"{factories}:factory"]) == 0
    out = capsys.readouterr().out
    assert "shardfx plan: TinyMLP (train, mesh 1 device)" in out
    assert row(out, "parameters")[1] == PARAMS
    assert [row(out, p)[1] for p in ("forward", "backward")] == [FWD_FLOPS, BWD_FLOPS]
    assert "mse_loss.default" in out


def test_inspect_by_dotted_name_tuple_factory_and_mesh(factories, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(factories.parent))
    monkeypatch.delitem(sys.modules, "cli_factories", raising=False)
    assert main(["inspect", "cli_factories:as_tuple", "--mesh", "dp=1,tp=1"]) == 0
    out = capsys.readouterr().out
    assert "shardfx plan: TinyMLP (train, mesh dp=1,tp=1)" in out
    assert [row(out, p)[1] for p in ("forward", "backward")] == [FWD_FLOPS, BWD_FLOPS]


def test_precision_and_budget(factories, capsys):
    assert main(["inspect", f"{factories}:factory", "--precision", "bf16",
                 "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "Precision: bf16: " in out and "memory_budget 1.0 GiB: fits" in out


def test_infer_ignores_the_loss(factories, capsys):
    assert main(["inspect", f"{factories}:factory", "--infer"]) == 0
    out = capsys.readouterr().out
    assert "shardfx plan: TinyMLP (infer, mesh 1 device)" in out
    assert row(out, "forward")[1] == FWD_FLOPS
    with pytest.raises(AssertionError, match="no row 'backward'"):
        row(out, "backward")
    assert "mse_loss" not in out


def test_dump_writes_the_ir_program_and_plan(factories, tmp_path, capsys):
    out_dir = tmp_path / "dump"
    assert main(["inspect", f"{factories}:factory", "--dump", str(out_dir)]) == 0
    assert str(out_dir) in capsys.readouterr().out
    for name in ("00-capture.txt", "program_train.py", "plan.txt", "plan.html"):
        assert (out_dir / name).is_file(), sorted(p.name for p in out_dir.iterdir())
    assert "TinyMLP" in (out_dir / "plan.txt").read_text()


@pytest.mark.parametrize("spec, cause, fix", [
    ("{path}", "does not name a factory", "write MODULE:FACTORY"),
    ("no_such_module_xyz.models:factory", "no module named 'no_such_module_xyz.models'",
     "give the path to the .py file instead"),
    ("{dir}/missing.py:factory", "no file", "give the path of a .py file"),
    ("{path}:fatory", "has no attribute 'fatory'", "name one of its functions (factory, as_tuple"),
    ("{path}:not_a_function", "is an int, not a callable", "name a function"),
    ("{path}:needs", "needs(width) has required parameters", "give its parameters defaults"),
    ("{path}:wrong", "returned an int, not a dict or a 2- to 4-tuple", 'return {"model"'),
    ("{path}:typo", "unknown keys 'arg'; missing keys 'args'", "use the keys model, args"),
    ("{path}:bare_tensor", "args is a Tensor, not a tuple", "wrap a single tensor in a tuple"),
])
def test_bad_spec_exits_2_naming_cause_and_fix(factories, capsys, spec, cause, fix):
    spec = spec.format(path=factories, dir=factories.parent)
    assert main(["inspect", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith("shardfx inspect: error: ")
    assert cause in err and fix in err and "Traceback" not in err, err


def test_bad_mesh_is_a_usage_error(factories, capsys):
    assert main(["inspect", f"{factories}:factory", "--mesh", "dp=two"]) == 2
    err = capsys.readouterr().err
    assert "cannot read mesh 'dp=two'" in err and "e.g. dp=2,tp=2" in err


def test_shardfx_error_exits_1_with_its_message(factories, capsys):
    assert main(["inspect", f"{factories}:not_scalar"]) == 1
    err = capsys.readouterr().err
    assert "loss_fn must return a scalar tensor" in err and "fix:" in err
    assert "Traceback" not in err


def test_python_dash_m_shardfx(factories):
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "shardfx", "inspect", f"{factories}:factory"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [row(done.stdout, p)[1] for p in ("forward", "backward")] == [FWD_FLOPS, BWD_FLOPS]
