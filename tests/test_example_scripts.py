"""The example scripts beside the trainer: examples/prepare_text.py and examples/plot_metrics.py.

prepare_text turns a small text in tmp_path into train.bin and val.bin that read back with
np.memmap as uint16 and decode to the text again; the shipped Shakespeare prepares with its
defaults. plot_metrics draws two JSON-lines files as one polyline each, named in the legend,
skipping the lines that carry no loss, and adds an lr chart when the files log "lr". Both
scripts, run as programs, say a missing file or an unusable one in one line and exit 2.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    """examples/ is not a package: load the script ``name``.py as a module."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare_text = load("prepare_text")
plot_metrics = load("plot_metrics")


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


# --- prepare_text -------------------------------------------------------------------------

TEXT = "First Citizen:\r\nBefore we proceed, hear me speak.\n\nAll:\nSpeak, speak. Café!\n"


def test_prepare_text_round_trips(tmp_path, capsys):
    src = tmp_path / "tiny.txt"
    src.write_bytes(TEXT.encode("utf-8"))  # bytes: keep the "\r\n" as written
    out = tmp_path / "tokens"

    assert prepare_text.main([str(src), "--out", str(out), "--val-fraction", "0.25"]) == 0

    meta = json.loads((out / "meta.json").read_text())
    chars = meta["chars"]
    assert chars == "".join(sorted(set(TEXT))) and meta["vocab_size"] == len(chars)
    ids = prepare_text.encode(TEXT, chars)
    assert ids.dtype == np.uint16 and prepare_text.decode(ids, chars) == TEXT

    train = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(out / "val.bin", dtype=np.uint16, mode="r")
    assert len(train) + len(val) == len(TEXT)
    assert len(val) == round(0.25 * len(TEXT)) == meta["val_tokens"]
    assert len(train) == meta["train_tokens"]
    assert np.array_equal(np.concatenate([train, val]), ids)
    assert prepare_text.decode(val, chars) == TEXT[len(train):]

    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == [
        f"wrote {out / name}" for name in ("train.bin", "val.bin", "meta.json")]


def test_prepare_text_is_deterministic(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text(TEXT * 3, encoding="utf-8")
    for out in ("a", "b"):
        assert prepare_text.main([str(src), "--out", str(tmp_path / out)]) == 0
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_encode_names_characters_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"not in the vocabulary: 'xz'"):
        prepare_text.encode("abzx", "ab")


def test_shipped_shakespeare_prepares(tmp_path):
    text = (EXAMPLES / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    assert 250_000 < len(text) < 350_000 and text.startswith("First Citizen:")

    assert prepare_text.main(["--out", str(tmp_path)]) == 0  # the default TEXT

    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["vocab_size"] == len(set(text)) == 62
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)


def test_prepare_text_missing_file_exits_2(tmp_path):
    r = run_script("prepare_text", tmp_path / "nope.txt", "--out", tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "nope.txt" in r.stderr


# --- plot_metrics -------------------------------------------------------------------------

def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def polylines(svg: str) -> list[int]:
    """The number of points of each polyline in ``svg``."""
    return [len(p.split()) for p in re.findall(r'<polyline points="([^"]*)"', svg)]


def test_plot_metrics_one_line_per_file(tmp_path, capsys):
    a = write_jsonl(tmp_path / "run_a.jsonl", [
        {"event": "start", "world_size": 2},  # no step: skipped
        {"step": 0, "loss": 4.2, "grad_norm": 1.5, "mfu": 0.3},
        {"step": 10, "grad_norm": 0.9},  # no loss: skipped
        {"step": 20, "loss": 3.1, "tokens_per_s": 1e4},
        {"step": 30, "loss": 2.5},
        '{"step": 40, "lo',  # the half-written line of a run still going: skipped
    ])
    b = write_jsonl(tmp_path / "run_b.jsonl", [{"step": s, "loss": 5.0 - s / 10} for s in range(5)])
    out = tmp_path / "plot.html"

    assert plot_metrics.main([str(a), str(b), "--out", str(out)]) == 0

    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert page.count("<svg") == 1  # no "lr" logged: no lr chart
    assert polylines(page) == [3, 5]  # run_a's three lines with a loss, run_b's five
    legend = re.search(r'<ul class="legend">(.*?)</ul>', page, re.S).group(1)
    assert str(a) in legend and str(b) in legend
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")


def test_plot_metrics_adds_an_lr_chart(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl",
                    [{"step": s, "loss": 3.0, "lr": 1e-3 * s} for s in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"step": s, "loss": 2.0} for s in range(4)])  # no lr
    page = plot_metrics.render([a, b])
    loss_svg, lr_svg = page.split("<svg")[1:]
    assert polylines(loss_svg) == [4, 4] and polylines(lr_svg) == [4]
    assert ">lr</text>" in lr_svg


def test_plot_metrics_key_picks_the_value(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"step": 1, "loss": 3.0}, {"step": 2, "grad_norm": 0.5}])
    page = plot_metrics.render([a], key="grad_norm")
    assert polylines(page) == [2]  # the single point is drawn as a zero-length segment
    assert "last grad_norm 0.5" in page


@pytest.mark.parametrize("case", ["missing", "no usable lines"])
def test_plot_metrics_unusable_file_exits_2(tmp_path, case):
    path = tmp_path / "m.jsonl"
    if case == "no usable lines":
        write_jsonl(path, [{"event": "start"}, {"step": 1, "lr": 0.1}, ""])
    r = run_script("plot_metrics", path, "--out", tmp_path / "plot.html")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and str(path) in r.stderr
    assert not (tmp_path / "plot.html").exists()
