"""Reading a checkpoint's record, for ``runtime.checkpoint``: finding the complete one at a path
(or the ``.old`` one a save killed between its renames left), and checking, before a tensor is
read, that it is whole and one save's own:

- ``shardfx.json`` is JSON with every field of the right type and range (``FIELDS``, and in its
  ``meta`` the entries shardfx's savers write, ``META``), in a format this shardfx reads, and
  its fields are those the save wrote: its own checksum (``digest``, over every other field) still
  matches, so a field edited since (``"step": 4`` made 5, a file's recorded checksum) is named,
  never resumed from;
- ``.metadata``, ``shardfx.json`` and every data file carry the same save id (each data file in
  its trailer, ``checkpoint_digest``), and each file is as long as the save recorded;
- each file's contents match the checksum recorded when it was written (``verify_contents``;
  ``open_checkpoint(contents=False)`` leaves the data files' contents to the caller, which
  ``checkpoint.load`` verifies while it reads);
- this torch can read ``.metadata``, and the keys and shapes fit what a runner holds.

Each refusal is an ``InputError`` naming the file or field, the cause and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from shardfx.errors import InputError
from shardfx.runtime.checkpoint_digest import digest_of, read_trailer, trailer

try:
    __version__ = version("shardfx")  # recorded in every checkpoint: what wrote it
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

FORMAT = 3  # the layout of shardfx.json (2: the save's id and each file's checksum; 3: its own
            # checksum); a reader reads 2 with a warning and refuses any other
UNSEALED = 2  # the format before shardfx.json had its own checksum
RECORD = "shardfx.json"
INDEX = ".metadata"  # DCP's

log = logging.getLogger("shardfx.checkpoint")


def _whole(v: Any, least: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (least is None or v >= least)


def _files(v: Any) -> bool:
    return isinstance(v, dict) and INDEX in v and all(
        isinstance(name, str) and "/" not in name and isinstance(f, dict) and
        _whole(f.get("bytes"), 0) and isinstance(f.get("digest"), str) for name, f in v.items())


def _tensors(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
        and all(_whole(n, 0) for n in t["shape"]) for t in v.values())


# The fields of shardfx.json after "format": each one's test and what it must be.
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "shardfx": (lambda v: isinstance(v, str), "a version string"),
    "torch": (lambda v: isinstance(v, str), "a version string"),
    "world_size": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "save": (lambda v: isinstance(v, str) and len(v) >= 8, "the save's id, a string"),
    "files": (_files, f'an object of file name -> {{"bytes": a whole number >= 0, "digest": '
                      f'a string}}, {INDEX} among them'),
    "meta": (lambda v: isinstance(v, dict), "a JSON object"),
    "tensors": (_tensors, 'an object of key -> {"shape": a list of whole numbers >= 0, '
                          '"dtype": a string}'),
}
# The entries of meta that runner.save (runtime/saving.py) and shardfx run (shardfx/run/train.py)
# write, checked where present: a damaged one is named before any process plans.
META: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (lambda v: _whole(v, 0), "a whole number >= 0"),
    "seed": (_whole, "a whole number"),
    "data_position": (lambda v: _whole(v, 0), "a whole number >= 0"),
    "run_seed": (_whole, "a whole number"),
    "loss_scaler": (lambda v: v is None or isinstance(v, dict), "null or a JSON object"),
    "optimizer": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("class"), str)
                                         and isinstance(v.get("hyperparameters"), list)
                                         and all(isinstance(g, dict)
                                                 for g in v["hyperparameters"])),
                  'null or {"class": a string, "hyperparameters": a list of objects}'),
}


def open_checkpoint(path: str | os.PathLike, *, contents: bool = True,
                    ) -> tuple[Path, dict[str, Any], Metadata]:
    """The complete checkpoint at ``path``: its folder, ``shardfx.json`` and DCP's index, each
    file checked (module docstring); ``contents=False``: all but the data files' checksums."""
    folder = _folder(Path(path))
    record = read_record(folder)
    index, intact = _read_index(folder, record)
    _check_files(folder, record, index, intact)
    if contents:
        verify_contents(folder, record, data_files(record))
    return folder, record, index


def data_files(record: dict[str, Any]) -> list[str]:
    """The data files a save wrote (every rank's), by name."""
    return sorted(name for name in record["files"] if name != INDEX)


def verify_contents(folder: Path, record: dict[str, Any], names: list[str]) -> None:
    """Each of the data files ``names`` read whole: an ``InputError`` for the first whose
    contents do not match the checksum the save recorded."""
    for name in names:
        saved = record["files"][name]
        if digest_of(folder / name, saved["bytes"]) != saved["digest"]:
            raise damaged(folder, name, f"its {saved['bytes']} bytes no longer match the "
                          "checksum recorded when it was saved")


def read_record(folder: Path) -> dict[str, Any]:
    """``shardfx.json``, every field checked (``FIELDS``, ``META``) and, together, against its
    own checksum (``record_digest``)."""
    where = folder / RECORD
    try:
        record = json.loads(where.read_text())
    except ValueError as e:  # UnicodeDecodeError is one
        raise incomplete(folder, f"{RECORD} is not JSON ({e})") from e
    if not isinstance(record, dict):
        raise _malformed(where, None, "a JSON object", record)
    theirs = record.get("format")
    if not _whole(theirs):
        raise _malformed(where, "format", "a whole number, the format's version", theirs,
                         "format" not in record)
    if theirs not in (FORMAT, UNSEALED):
        by = record.get("shardfx", "?")
        raise InputError(
            f"checkpoint format {theirs} (written by shardfx {by}) cannot be read by this "
            f"shardfx {__version__}, which reads formats {UNSEALED} and {FORMAT}",
            where=str(where),
            fix="upgrade shardfx" if theirs > FORMAT else
            f"load it with a shardfx that reads format {theirs} (format 2 added the save's "
            "id and each file's checksum), then save it again with this one")
    for name, (ok, want) in FIELDS.items():
        if name not in record or not ok(record[name]):
            raise _malformed(where, name, want, record.get(name), name not in record)
    for name, (ok, want) in META.items():
        if name in record["meta"] and not ok(record["meta"][name]):
            raise _malformed(where, f"meta.{name}", want, record["meta"][name])
    if theirs == UNSEALED:
        log.warning("%s is format %d, from before shardfx.json had a checksum of its own: its "
                    "fields (the step, the seed, the data position) cannot be verified; the "
                    "next save writes format %d", where, UNSEALED, FORMAT)
    elif record.get("digest") != record_digest(record):
        raise damaged(folder, RECORD, "its fields no longer match the checksum recorded when "
                      "it was saved (a field was edited or damaged since: a changed step, seed "
                      "or file checksum would resume wrong)")
    return record


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``digest``, its checksum, set (``read_record`` checks it)."""
    return {**record, "digest": record_digest(record)}


def record_digest(record: dict[str, Any]) -> str:
    """BLAKE2b-128 of every field of ``record`` but ``digest``, written as canonical JSON (keys
    sorted, no spaces): the same fields give the same checksum however the file is laid out."""
    fields = {k: v for k, v in record.items() if k != "digest"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _malformed(where: Path, field: str | None, want: str, value: Any, missing: bool = False,
               ) -> InputError:
    """``field`` (None: the whole file) of ``shardfx.json`` is ``value``, or ``missing``."""
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    what = (f"holds {shown}" if field is None else f"has no {field!r}" if missing else
            f"{field!r} is {shown}")
    return InputError(f"{RECORD} {what}; it must be {want}",
                      where=str(where) if field is None else f"{where}, field {field}",
                      fix=f"put back the {RECORD} this save wrote, or resume from an earlier "
                          "checkpoint")


def _check_files(folder: Path, record: dict[str, Any], index: Metadata, intact: bool) -> None:
    """The save ids of ``.metadata`` and every data file against ``shardfx.json``'s, each
    file's length, and ``.metadata``'s checksum (``intact``; the data files' contents:
    ``verify_contents``)."""
    save, files = record["save"], record["files"]
    names = data_files(record)
    marks = {n: read_trailer(folder / n) for n in names if (folder / n).is_file()}
    theirs = getattr(index.storage_meta, "save_id", None)
    if theirs != save:
        if {m["save"] for m in marks.values() if m} <= {theirs}:
            raise InputError(
                f"{RECORD} is from another save: it records save {save}, and {INDEX} and the "
                f"data files carry save {theirs}", where=str(folder / RECORD),
                fix=f"put back the {RECORD} written with these files (a checkpoint directory is "
                    "copied whole), or resume from the checkpoint it belongs to")
        raise _other_save(folder, INDEX, theirs, save)
    if not intact:
        raise damaged(folder, INDEX, "it does not match the checksum recorded when it was saved")
    if unlisted := sorted({i.relative_path for i in index.storage_data.values()} - set(names)):
        raise damaged(folder, INDEX, f"it names {', '.join(unlisted)}, which {RECORD} does not")
    for name in names:
        if not (folder / name).is_file():
            raise incomplete(folder, f"{name} is missing")
        if marks[name] is not None and marks[name]["save"] != save:
            raise _other_save(folder, name, marks[name]["save"], save)
        saved = files[name]
        want = saved["bytes"] + len(trailer(save, saved["bytes"], saved["digest"]))
        have = (folder / name).stat().st_size
        if have < want:
            raise incomplete(folder, f"{name} holds {have} bytes, {RECORD} says {want}")
        if have > want or marks[name] != {"save": save, **saved}:
            raise damaged(folder, name, f"its end is not the trailer the save wrote ({have} "
                          f"bytes, {RECORD} says {want})")


def _other_save(folder: Path, name: str, theirs: str | None, save: str) -> InputError:
    return InputError(f"{name} is from another save: it carries save id {theirs}, and this "
                      f"checkpoint's {RECORD} records {save}", where=str(folder / name),
                      fix="copy a checkpoint directory whole, never files of two saves into "
                          "one; resume from an earlier checkpoint if this one's own file is lost")


def damaged(folder: Path, name: str, why: str) -> InputError:
    return InputError(f"{name} of the checkpoint {folder} is damaged: {why}",
                      where=str(folder / name),
                      fix="copy the checkpoint again from where it was saved, or resume from an "
                          "earlier checkpoint")


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


def _read_index(folder: Path, record: dict[str, Any]) -> tuple[Metadata, bool]:
    """DCP's ``.metadata`` (a pickle of torch's classes: another torch may not read it), and
    whether it matches the checksum ``shardfx.json`` records for it."""
    saved, theirs = record["files"][INDEX], record["torch"]
    intact = (folder / INDEX).stat().st_size == saved["bytes"] and digest_of(
        folder / INDEX, saved["bytes"]) == saved["digest"]
    differ = minor(theirs) != minor(torch.__version__)
    try:
        index = FileSystemReader(folder).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling failure
        cause = f"{INDEX} cannot be read ({type(e).__name__}: {e})"
        if not intact:
            raise damaged(folder, INDEX, f"it does not match the checksum recorded when it "
                          f"was saved, and {cause}") from e
        if differ:
            raise InputError(f"the checkpoint was written by torch {theirs} and this torch "
                             f"{torch.__version__} cannot read it: {cause}", where=str(folder),
                             fix=f"load it with torch {minor(theirs)}") from e
        raise incomplete(folder, cause) from e
    if differ:
        log.warning("%s was written by torch %s; this is torch %s", folder, theirs,
                    torch.__version__)
    return index, intact


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
