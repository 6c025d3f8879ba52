"""Every code block of README.md runs as written: the README stands alone for a user who has
only the repository.

Each ```python block is written to a file in a fresh temporary directory and run there by this
Python (``python block.py``), with the repository root on ``PYTHONPATH`` so that
``from examples.nanogpt import ...`` works; files a block writes (``plan.dump("out/")``,
``trace.json``) land in the temporary directory. A file, not stdin: ``shardfx.launch`` pickles
the function it runs by reference to ``__main__``, and its ranks find that function by
importing the script again, which ``python -`` does not give them.

Each command line of a ```sh block runs as a subprocess too: ``shardfx ...`` through the
``shardfx`` script installed beside this Python (else ``python -m shardfx``), in a temporary
directory holding a link to the repository's ``examples/``, so that relative paths resolve as
from the repository root and ``--dump out`` writes there. tests/test_cli.py covers the command
on a factory of its own; the README's lines (``examples/nanogpt.py:workload``) are run only
here. ``make`` lines are skipped: they build the virtual environment and run the suite this
file belongs to (``make test``) or the demo, which is the set-up CI itself runs.

One test per block (python) or line (sh), named by the heading above it. Blocks are small
(tiny models, at most 4 processes); the largest is the 80-layer Llama planned on the meta device.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TIMEOUT_S = 300  # per block; each takes 10 to 30 s on two cores
KNOWN = {"python", "sh", "text", ""}  # "", "text": plain text (the layout, an excerpt): not run
FENCE = re.compile(r"^```(\S*)\s*$")
HEADING = re.compile(r"^#{1,6}\s+(.*\S)\s*$")


def fenced_blocks() -> list[tuple[str, str, str]]:
    """(heading above it, language, text) of every fenced block of README.md, in order."""
    blocks, heading, lang, lines = [], "README", None, []
    for line in README.read_text().splitlines():
        fence = FENCE.match(line)
        if lang is None:
            if fence:
                lang, lines = fence[1], []
            elif HEADING.match(line):
                heading = HEADING.match(line)[1]
        elif fence and not fence[1]:
            blocks.append((heading, lang, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    assert lang is None, f"README.md: the {lang} block under {heading!r} is not closed"
    return blocks


def named(items: list[tuple[str, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """Each item with its heading as id, numbered where a heading has several."""
    seen: dict[str, int] = {}
    out = []
    for heading, *rest in items:
        seen[heading] = seen.get(heading, 0) + 1
        out.append((heading if seen[heading] == 1 else f"{heading} ({seen[heading]})",
                    tuple(rest)))
    return out


def python_blocks():
    return [pytest.param(text, id=name) for name, (text,) in
            named([(h, t) for h, lang, t in fenced_blocks() if lang == "python"])]


def sh_lines():
    """Each command of the sh blocks, with its comment stripped, and its block's number: the
    lines of one block run one after another in one directory (``--save`` then ``--resume``)."""
    params = []
    lines = [(h, line, str(i)) for i, (h, lang, t) in enumerate(fenced_blocks()) if lang == "sh"
             for line in t.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    for name, (line, block) in named(lines):
        argv = shlex.split(line, comments=True)
        marks = [pytest.mark.skip(reason="make builds .venv and runs the demo or this suite: "
                                         "the set-up CI itself runs")] if argv[0] == "make" else []
        params.append(pytest.param(argv, block, id=f"{name}: {shlex.join(argv)}", marks=marks))
    return params


def env() -> dict[str, str]:
    """This environment as a user has it: the repository importable, and without the settings
    conftest.py makes for the suite (``SHARDFX_DEBUG`` verifies the IR after every pass, which
    costs the 80-layer plan seconds) or a ``SHARDFX_DUMP`` the runner may have set."""
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    user = {k: v for k, v in os.environ.items() if k not in ("SHARDFX_DEBUG", "SHARDFX_DUMP")}
    return {**user, "PYTHONPATH": os.pathsep.join(path)}


def check(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode != 0:
        pytest.fail(f"{what} exited with status {done.returncode}; stderr (last 4000 "
                    f"characters):\n{done.stderr[-4000:]}\nstdout (last 1000):\n"
                    f"{done.stdout[-1000:]}", pytrace=False)


def test_every_block_is_run():
    """A block in a language this file does not run would go unchecked."""
    langs = {lang for _, lang, _ in fenced_blocks()}
    assert langs <= KNOWN, f"README.md has {sorted(langs - KNOWN)} blocks; run them here"
    assert python_blocks() and sh_lines()


@pytest.mark.parametrize("source", python_blocks())
def test_python_block(source: str, tmp_path: Path):
    script = tmp_path / "readme_block.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    check(done, f"this README block:\n{source}\n")


@pytest.mark.parametrize("argv, block", sh_lines())
def test_sh_line(argv: list[str], block: str, tmp_path_factory: pytest.TempPathFactory):
    assert argv[0] in ("shardfx", "torchrun", "python"), \
        f"no way to run {shlex.join(argv)!r}: teach test_readme.py"
    if argv[0] == "python":  # an example's script, by this Python
        command = [sys.executable]
    elif argv[0] == "torchrun":  # the same entry point as the torchrun script
        command = [sys.executable, "-m", "torch.distributed.run"]
    else:
        script = Path(sys.executable).with_name("shardfx")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "shardfx"]
    tmp_path = tmp_path_factory.getbasetemp() / f"readme-sh-block-{block}"
    if not tmp_path.exists():
        tmp_path.mkdir()
        (tmp_path / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    done = subprocess.run(command + argv[1:], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    check(done, f"the README command {shlex.join(argv)!r}")
    assert argv[0] == "python" or "shardfx plan:" in done.stdout, done.stdout[-2000:]
    if "--dump" in argv:
        out = tmp_path / argv[argv.index("--dump") + 1]
        assert (out / "plan.txt").is_file() and (out / "program_train.py").is_file(), \
            sorted(p.name for p in out.iterdir()) if out.is_dir() else f"no {out}"
