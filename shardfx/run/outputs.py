"""Where a ``shardfx run`` writes: every path checked before any process starts, and an export
that cannot go where it was asked written somewhere the error names.

    [checkpoint] save          a directory of step-N/ checkpoints
    [checkpoint] export_hf     a directory: the trained model as a Hugging Face checkpoint
    [metrics] jsonl, trace     files          [metrics] tensorboard   a directory

``check`` runs in ``preflight``, before any process starts. Each path must be one the run can
make and write: what exists of it is of its kind (a file, a directory) and the nearest
directory that exists takes a new entry (one is made and removed). The export directory must
be new, empty or a Hugging Face checkpoint (``runtime.hf_save`` replaces nothing else), on a
disk with room for the model; no other output may be it or lie inside it (the export would
find it there and refuse); a ``step-N`` the run will save must not be something other than a
checkpoint. Each failure is an ``InputError`` naming the flag, the path and the fix: no run
trains for hours and then finds that it cannot write.

A run takes its time, and things change meanwhile (a process writes into the export
directory, the disk fills), so ``export`` looks again after the last step: rank 0 looks,
every rank hears its verdict (one broadcast), and every rank writes the model to the first of
the export directory, a new ``DIR.step-N`` beside it and (when every rank is on this machine)
a new directory in the system's temporary directory that can take it. Anywhere but the export
directory is an ``InputError`` on every rank that names where the model went. Only when none
can take it are the trained weights left in the run's last checkpoint alone (``--save``), or
lost without one; the error says which, and how to export a checkpoint later (``--resume CK
--export-hf DIR`` with the checkpoint's own step count trains nothing and exports).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from shardfx.errors import InputError
from shardfx.run import checkpoints as run_checkpoints
from shardfx.run.config import RunConfig
from shardfx.runtime.checkpoint import _refusal as checkpoint_refusal
from shardfx.runtime.hf_save import _refusal as hf_refusal
from shardfx.runtime.launch import rank, world_size

# each output's flag, and whether it is a directory (else a file)
OUTPUTS = {"save": True, "export_hf": True, "jsonl": False, "tensorboard": True, "trace": False}


def check(config: RunConfig, model: torch.nn.Module, start: int = 0) -> None:
    """Every output path of ``config`` (module docstring); ``start``: the step a resumed run
    starts from. Raises an InputError naming the first that cannot be written."""
    given = {name: Path(value) for name in OUTPUTS if (value := getattr(config, name))}
    for name, path in given.items():
        why = unwritable(path, OUTPUTS[name])
        if why:
            kind = "a directory" if OUTPUTS[name] else "a file in a directory"
            raise InputError(why, where=_flag(name, path),
                             fix=f"give --{_dashed(name)} {kind} this process can make or write")
    export = given.get("export_hf")
    if export is not None:
        for name, path in given.items():
            if name != "export_hf" and _within(path, export):
                raise InputError(
                    f"--{_dashed(name)} {path} is inside --export-hf {export}: the run would "
                    "write it there, and the export would then refuse a directory that is "
                    "not only a Hugging Face checkpoint", where=_flag(name, path),
                    fix=f"put it outside {export}, or export elsewhere")
        why = hf_refusal(export)
        if why:
            raise InputError(why, where=_flag("export_hf", export),
                             fix=f"export to a new or empty directory (or a Hugging Face "
                                 f"checkpoint to replace), or empty {export} first")
        why = no_room(export, model_bytes(model))
        if why:
            raise InputError(why, where=_flag("export_hf", export),
                             fix="make room on that disk, or export to another")
    if "save" in given:
        saves = _saved_steps(config, start)
        for step, path in run_checkpoints.saved(str(given["save"])):
            why = checkpoint_refusal(path) if step in saves else None
            if why:
                raise InputError(f"{why}, and this run saves step {step} there",
                                 where=_flag("save", given["save"]),
                                 fix="save to a new directory, or remove it first")


def export(config: RunConfig, runner, step: int) -> tuple[Path, InputError | None]:
    """On every rank: write the model as a Hugging Face checkpoint (module docstring); where
    it went, and the error to raise when that is not the export directory."""
    asked = Path(config.export_hf)
    agreed: list = [_place(asked, step, model_bytes(runner.plan.model))] if rank() == 0 \
        else [None]
    if world_size() > 1:
        dist.broadcast_object_list(agreed, src=0)  # every rank writes to the same place
    path, refused = agreed[0]
    last = run_checkpoints.step_dir(config.save, step) if config.save else None
    kept = f" The trained weights are in the checkpoint {last}." if last else ""
    if path is None:
        raise InputError(
            f"the trained model could not be exported: {'; '.join(refused)}." +
            (kept or " It was not saved anywhere: the run had no --save."),
            where=_flag("export_hf", asked),
            fix="make room or fix the directory" + (
                f", then export the checkpoint: the same command with --resume {last} "
                f"--export-hf {asked} trains no further and exports" if last
                else ", and give --save DIR next time"))
    try:
        written = runner.save_hf(path)
    except (OSError, InputError) as e:  # the disk changed in the instant since rank 0 looked
        raise InputError(f"writing the Hugging Face checkpoint {path} failed: {e}.{kept}",
                         where=_flag("export_hf", asked),
                         fix="make room or fix the directory, and export again") from e
    if not refused:
        return written, None
    return written, InputError(
        f"the trained model could not be exported to {asked}: {refused[0]}. It was written "
        f"as a Hugging Face checkpoint to {written} instead.{kept}",
        where=_flag("export_hf", asked),
        fix=f"move {written} where you want it (from_pretrained loads it from anywhere)")


def unwritable(path: Path, directory: bool) -> str | None:
    """Why this process cannot make and write ``path`` (a directory, else a file), or None."""
    if path.exists():
        if directory != path.is_dir():
            return f"{path} is a {'file' if directory else 'directory'}, not a " \
                   f"{'directory' if directory else 'file'}"
        if not directory:
            try:
                open(path, "a").close()  # appends nothing: the file stays as it is
            except OSError as e:
                return f"{path} cannot be written ({e.strerror})"
            return None
    here = _nearest(path)
    if not here.is_dir():
        return f"{here} is a file, so {path} cannot be made in it"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".shardfx-probe-", dir=here))
    except OSError as e:
        return f"{path} cannot be made: {here} cannot be written ({e.strerror})"
    return None


def no_room(path: Path, nbytes: int) -> str | None:
    """Why the disk ``path`` would be on cannot hold ``nbytes`` more, or None."""
    free = shutil.disk_usage(_nearest(path)).free
    if free >= nbytes:
        return None
    return f"the disk of {path} has {free / 2**30:.2f} GiB free; the model takes " \
           f"{nbytes / 2**30:.2f} GiB"


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of what an export writes: each tensor of the state dict once (tied ones
    are one)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _place(asked: Path, step: int, nbytes: int) -> tuple[Path | None, list[str]]:
    """On rank 0: the first place the model can be exported to, and why each before it
    could not take it."""
    name = f"{asked.resolve().name}.step-{step:06d}"
    places = [asked, _new(asked.resolve().with_name(name))]
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) >= world_size():  # one machine:
        places.append(_new(Path(tempfile.gettempdir()) / f"shardfx-{name}"))  # every rank's
    reasons = []
    for place in places:
        why = hf_refusal(place) or unwritable(place, True) or no_room(place, nbytes)
        if why is None:
            return place, reasons
        reasons.append(why)
    return None, reasons


def _new(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ...: the first that does not exist."""
    i, candidate = 0, path
    while candidate.exists():
        i += 1
        candidate = path.with_name(f"{path.name}.{i}")
    return candidate


def _saved_steps(config: RunConfig, start: int) -> set[int]:
    every = config.every
    return {s for s in range(start + 1, config.steps + 1)
            if s == config.steps or (every and s % every == 0)}


def _nearest(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    return next(p for p in (path, *path.parents) if p.exists()) if path.parents else path


def _within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _flag(name: str, path: Path) -> str:
    return f"--{_dashed(name)} {path}"
