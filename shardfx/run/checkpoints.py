"""The checkpoints of a ``shardfx run``: ``step-N/`` directories under ``[checkpoint] save``.

    ck/step-000050/   ck/step-000100/   ck/step-000150/      (every = 50, keep = 3)

Each is a whole distributed checkpoint (``runner.save``: all or nothing, so a run killed while
saving leaves the ones before). After a save is in place, rank 0 deletes the oldest beyond
``keep``. ``--resume`` takes one checkpoint directory, or a ``save`` directory: the highest
step in it (a ``step-N.partial-*`` that a killed save left is not a checkpoint, and is
ignored).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from shardfx.errors import InputError

STEP = re.compile(r"step-(\d+)")


def step_dir(root: str, step: int) -> str:
    return str(Path(root) / f"step-{step:06d}")


def saved(root: str) -> list[tuple[int, Path]]:
    """The (step, directory) of each checkpoint under ``root``, by step."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP.fullmatch(p.name))]
    return sorted(found)


def resolve(path: str) -> str:
    """The checkpoint ``--resume path`` names: ``path`` itself when it is one (or was being
    replaced: ``path.old``), else the highest step under it."""
    p = Path(path)
    if (p / "shardfx.json").exists() or Path(f"{path}.old").exists():
        return path
    found = saved(path)
    if found:
        return str(found[-1][1])
    raise InputError(f"no checkpoint at {path!r}" + (" (an empty directory)" if p.is_dir()
                                                     else ""), where=f"--resume {path}",
                     fix="give a directory shardfx run --save wrote, or one of its step-N/")


def prune(root: str, keep: int) -> list[Path]:
    """Delete all but the last ``keep`` checkpoints under ``root`` (0 keeps all), oldest
    first; returns those deleted."""
    if keep <= 0:
        return []
    old = [p for _, p in saved(root)[:-keep]]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old
