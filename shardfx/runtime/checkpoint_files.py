"""Reading a checkpoint's record, for ``runtime.checkpoint``: finding the complete one at a path
(or the ``.old`` one a save killed between its renames left), checking it is whole before a
tensor is read (``.metadata`` and ``shardfx.json`` there, every data file as long as the index
says), that this shardfx and this torch can read it, and that its keys and shapes fit what a
runner holds: each refusal an ``InputError`` naming the cause, the path and the fix.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from shardfx import __version__
from shardfx.errors import InputError

FORMAT = 1  # the layout of shardfx.json; a reader refuses any other
RECORD = "shardfx.json"
INDEX = ".metadata"  # DCP's

log = logging.getLogger("shardfx.checkpoint")


def open_checkpoint(path: str | os.PathLike) -> tuple[Path, dict[str, Any], Metadata]:
    """The complete checkpoint at ``path``: its folder, ``shardfx.json`` and DCP's index."""
    folder = _folder(Path(path))
    try:
        record = json.loads((folder / RECORD).read_text())
    except ValueError as e:
        raise incomplete(folder, f"{RECORD} is not JSON ({e})") from e
    theirs = record.get("format")
    if theirs != FORMAT:
        raise InputError(
            f"checkpoint format {theirs} (written by shardfx {record.get('shardfx', '?')}) "
            f"cannot be read by this shardfx {__version__}, which reads format {FORMAT}",
            where=str(folder / RECORD), fix="upgrade shardfx" if isinstance(theirs, int) and
            theirs > FORMAT else f"load it with shardfx {record.get('shardfx', '?')}")
    index = _read_index(folder, str(record.get("torch", "?")))
    need: dict[str, int] = {}  # data file -> the bytes .metadata says it holds
    for info in index.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        if not (folder / name).is_file():
            raise incomplete(folder, f"{name} is missing")
        if (have := (folder / name).stat().st_size) < size:
            raise incomplete(folder, f"{name} holds {have} bytes, {INDEX} says {size}")
    return folder, record, index


def _folder(final: Path) -> Path:
    """``final``, or ``final.old`` where a save was killed between its renames."""
    folder = final
    if not final.exists() and old_path(final).is_dir():
        folder = old_path(final)
        log.warning("%s is missing and %s is there: a save was killed between its two renames; "
                    "reading %s, the last complete checkpoint (the next save replaces it)",
                    final, folder, folder)
    if not folder.exists():
        raise InputError(f"there is no checkpoint at {final}", where=str(final),
                         fix="pass the directory a shardfx save wrote")
    ours = any((folder / n).exists() for n in (RECORD, INDEX)) or any(folder.glob("*.distcp"))
    if not (folder.is_dir() and ours):
        raise InputError(f"{folder} is not a shardfx checkpoint: it has no {RECORD}, no {INDEX} "
                         "and no .distcp file", where=str(folder),
                         fix="pass the directory a shardfx save wrote")
    missing = [n for n in (INDEX, RECORD) if not (folder / n).exists()]
    if missing:
        raise incomplete(folder, " and ".join(missing) + " missing")
    return folder


def _read_index(folder: Path, theirs: str) -> Metadata:
    """DCP's ``.metadata``, written by torch ``theirs`` (a pickle of torch's classes: another
    torch may not read it)."""
    differ = minor(theirs) != minor(torch.__version__)
    try:
        index = FileSystemReader(folder).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling failure
        cause = f"{INDEX} cannot be read ({type(e).__name__}: {e})"
        if differ:
            raise InputError(f"the checkpoint was written by torch {theirs} and this torch "
                             f"{torch.__version__} cannot read it: {cause}", where=str(folder),
                             fix=f"load it with torch {minor(theirs)}") from e
        raise incomplete(folder, cause) from e
    if differ:
        log.warning("%s was written by torch %s; this is torch %s", folder, theirs,
                    torch.__version__)
    return index


def check_keys(state: dict[str, tuple], saved: dict[str, Any], strict_optim: bool,
                folder: Path) -> None:
    """One error listing every key missing, unexpected or shaped differently."""
    def optional(k: str) -> bool:
        return not strict_optim and k.startswith("optim/")

    problems = {
        "missing from the checkpoint": [k for k in state if k not in saved and not optional(k)],
        "in the checkpoint, not expected": [k for k in saved if k not in state
                                            and not optional(k)],
        "shaped differently": [f"{k}: checkpoint {saved[k]['shape']}, model {list(shape)}"
                               for k, shape in state.items()
                               if k in saved and saved[k]["shape"] != list(shape)]}
    lines = [f"{what} ({len(keys)}): " + ", ".join(keys[:10]) + (", ..." if len(keys) > 10
                                                                 else "")
             for what, keys in problems.items() if keys]
    if lines:
        raise InputError("the checkpoint does not fit the state to load:\n  " +
                         "\n  ".join(lines), where=str(folder),
                         fix="load a checkpoint of the same model configuration (strict_optim="
                         "False lets the optimizer's state be missing)")


def incomplete(folder: Path, why: str) -> InputError:
    return InputError(f"the checkpoint {folder} is incomplete: {why}; it was cut during a save "
                      "(or damaged since)", where=str(folder),
                      fix="resume from an earlier checkpoint, or save this one again")


def old_path(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])
