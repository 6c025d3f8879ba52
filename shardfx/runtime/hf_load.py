"""``runner.load_hf(path)``: a Hugging Face checkpoint straight into each rank's shards.

    runner = plan.runner(optimizer)          # the model may be on meta: nothing is made twice
    runner.load_hf("Llama-3.2-1B/")          # model.safetensors, or its shards and their index

A checkpoint directory holds ``model.safetensors``, or several files and
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Every rank reads, for
each tensor it holds (``runner.holdings()``: its tp slice, its ZeRO rows, its pipeline stage's,
its experts), only the rows of the checkpoint tensor that make it up (``safetensors_file``: read
a chunk at a time through one small buffer), so no rank reads or holds the whole model; it
casts them to the model's dtype as it copies them in. Tensors transformers converts as it loads
(``hf_names``: Mixtral's per-expert weights into one fused tensor) are read whole, one group at
a time, converted as ``from_pretrained`` converts them, and cut. A tied weight is read once,
from whichever of its names the checkpoint has.

Before anything is copied, the whole checkpoint is checked against the model from the files'
headers: a missing file, a file that is cut short, not safetensors (a Git LFS pointer, a
pickle) or whose header fails any check safetensors makes (ranges that overlap, leave a gap or
run past the file: ``safetensors_file``), a tensor the model lacks (beyond those the model says
to skip), a tensor the checkpoint lacks, one that two keys would fill, a shape that differs, or
a dtype that cannot become the model's (anything but floating point into floating point, or the
same dtype) is one ``InputError`` naming it, and the runner is left as it was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from shardfx.errors import InputError, path_arg
from shardfx.runtime import hf_names, nonfinite
from shardfx.runtime.safetensors_file import DOWNLOAD_AGAIN, DTYPES, Damaged, SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Checkpoint:
    """The tensors of a checkpoint directory, by name: their files, shapes and dtypes read from
    the headers (``safetensors_file``); the values read by row span, each file opened once."""

    def __init__(self, path: str | os.PathLike):
        self.path = path_arg(path, "runner.load_hf", 'runner.load_hf("Llama-3.2-1B/")')
        where = f"runner.load_hf({str(path)!r})"
        self.where = where
        files = self._files(where)
        self._open: dict[Path, SafetensorsFile] = {}
        self.file: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        for file, names in files.items():
            try:
                handle = self._open[file] = SafetensorsFile(file)
            except (Damaged, OSError) as e:
                self.close()
                raise InputError(f"{file.name} cannot be read as safetensors: {e}",
                                 where=where, fix=getattr(e, "fix", DOWNLOAD_AGAIN)) from None
            present = handle.tensors
            lost = [n for n in names if n not in present] if names is not None else []
            if lost:
                self.close()
                raise InputError(f"{INDEX} places {lost[0]} (and {len(lost) - 1} more) in "
                                 f"{file.name}, which does not hold it", where=where,
                                 fix="the index and the files are from different saves: "
                                     "copy the directory again")
            for name in (names if names is not None else sorted(present)):
                self.file[name] = file
                self.dtype[name], self.shape[name], _ = present[name]

    def _files(self, where: str) -> dict[Path, list[str] | None]:
        """File -> the names the index places in it (None: a single file, all it holds)."""
        if not self.path.is_dir():
            raise InputError(f"{self.path} is not a directory", where=where,
                             fix="the directory save_pretrained wrote (config.json and "
                                 "model.safetensors, or its shards with their index)")
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (ValueError, KeyError, TypeError, AssertionError) as e:
                raise InputError(f"{INDEX} has no readable weight_map ({e!r})", where=where,
                                 fix="copy the checkpoint's index again") from None
            files: dict[Path, list[str] | None] = {}
            for name, file in weight_map.items():
                files.setdefault(self.path / file, []).append(name)
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise InputError(f"{INDEX} names {len(absent)} files that are not there: "
                                 f"{', '.join(sorted(absent)[:3])}", where=where,
                                 fix="copy every shard of the checkpoint")
            return files
        if (self.path / SINGLE).is_file():
            return {self.path / SINGLE: None}
        raise InputError(f"{self.path} holds neither {SINGLE} nor {INDEX}", where=where,
                         fix="save with model.save_pretrained(path) (safetensors, the default)")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` whole, in its own dtype (a new tensor)."""
        return self._open[self.file[name]].read(name)

    def copy(self, out: torch.Tensor, name: str, region: tuple[slice, ...] | None) -> None:
        """``out.copy_(tensor[region])``, cast: the region's rows read as one span of the
        file, cut in later dimensions in memory (a tp slice of columns); no region: all."""
        handle = self._open[self.file[name]]
        shape = self.shape[name]
        if not shape:
            out.copy_(handle.read(name))
            return
        region = region or (slice(0, shape[0]),)
        rest = region[1:]
        if all(r == slice(0, n) for r, n in zip(rest, shape[1:])):
            rest = ()
        handle.copy_rows(name, region[0], out, rest)

    def nonfinite(self) -> dict[str, frozenset[str]]:
        """The tensors read so far that hold NaN or Inf (``SafetensorsFile.nonfinite``)."""
        out: dict[str, frozenset[str]] = {}
        for handle in self._open.values():
            out.update(handle.nonfinite)
        return out

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()


def load_hf(runner, path: str | os.PathLike, allow_nonfinite: bool = False) -> None:
    """Fill ``runner``'s tensors from the Hugging Face checkpoint at ``path`` (every rank; the
    module docstring). Values that are not finite are refused once every tensor is filled
    (``nonfinite``), unless ``allow_nonfinite``."""
    ckpt = Checkpoint(path)
    try:
        _load(runner, ckpt)
    finally:
        ckpt.close()
    if not allow_nonfinite:
        nonfinite.refuse(ckpt.nonfinite(), f"the checkpoint {ckpt.path}", ckpt.where,
                         fix="load a good copy of it: a conversion or a cast to a narrower "
                             "dtype that overflowed makes Inf, a run that diverged NaN")


def _load(runner, ckpt: Checkpoint) -> None:
    plan = runner.plan
    model = plan.model
    made, unexpected, twice = hf_names.sources(model, list(ckpt.file))
    unexpected = [k for k in unexpected if not hf_names.ignored(model, k)]
    wanted = _wanted(plan)
    chosen = {fqn: next((made[n] for n in names if n in made), None)
              for fqn, names in wanted.items()}
    _check(ckpt, plan, chosen, unexpected, twice)
    held, _ = runner.holdings(made=False)  # tensors still to make are filled here instead
    with torch.no_grad():
        for fqn, source, regions in _plan_reads(plan, held, chosen):
            if source.converter is None:
                key = source.keys[0]
                for view, region in regions:
                    ckpt.copy(view, key, region)  # from the file, cast
            else:
                whole = source.realize(ckpt.read, model)[fqn]
                for view, region in regions:
                    view.copy_(whole[region] if region else whole)
                del whole
    runner.unmade.filled()  # every tensor the state dict has was filled (``_check``)


def _wanted(plan) -> dict[str, list[str]]:
    """Each tensor of the model's state dict once (its canonical FQN) -> all its names."""
    out: dict[str, list[str]] = {}
    for fqn in plan.state_names:
        out.setdefault(plan.canonical(fqn), []).append(fqn)
    for fqn, names in out.items():
        names.sort(key=lambda n: n != fqn)  # its own name first
    return out


def _plan_reads(plan, held: dict, chosen: dict) -> Iterator[tuple]:
    """(FQN, Source, [(view of the held tensor, its region of the whole)]) per held tensor,
    converted groups one after the other."""
    for fqn, h in held.items():
        source = chosen.get(fqn)
        if source is None:  # not in the state dict: a buffer the runner computes
            continue
        regions = h.regions(plan.state_shapes[fqn])
        if regions:
            yield fqn, source, regions


def _check(ckpt: Checkpoint, plan, chosen: dict, unexpected: list[str],
           twice: list[str]) -> None:
    """Every problem with the checkpoint against the model, as one InputError, before any
    tensor is copied."""
    fix = "load a checkpoint of this model's configuration (save_pretrained of the same " \
          "architecture and sizes)"
    missing = sorted(fqn for fqn, s in chosen.items() if s is None)
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model's tensors are not in it: "
                        f"{', '.join(missing[:3])}")
    if unexpected:
        problems.append(f"{len(unexpected)} of its tensors are not the model's: "
                        f"{', '.join(sorted(unexpected)[:3])}")
    if twice:
        problems.append(f"{len(twice)} of the model's tensors would be filled twice: "
                        f"{', '.join(twice[:3])}")
    tensors = dict(plan.model.named_parameters()) | dict(plan.model.named_buffers())
    for fqn, source in chosen.items():
        if source is None:
            continue
        want, dtype = plan.state_shapes[fqn], tensors[fqn].dtype
        for key in source.keys:
            got = DTYPES.get(ckpt.dtype[key])
            if got is None or not (got == dtype or got.is_floating_point and
                                   dtype.is_floating_point):
                problems.append(f"{key} is {ckpt.dtype[key]}, which cannot become the "
                                f"model's {str(dtype).removeprefix('torch.')}")
        if source.converter is None and ckpt.shape[source.keys[0]] != want:
            problems.append(f"{source.keys[0]} has shape {list(ckpt.shape[source.keys[0]])}, "
                            f"the model's {fqn} {list(want)}")
        elif source.converter is not None:
            shape = _converted_shape(ckpt, source, plan.model, fqn)
            if shape != want:
                made = list(shape) if isinstance(shape, tuple) else shape
                problems.append(f"{fqn} made from {len(source.keys)} tensors ({source.keys[0]}, "
                                f"...) has shape {made}, the model's {list(want)}")
    if problems:
        raise InputError(f"{ckpt.path} does not fit the model: " + "; ".join(problems[:6]),
                         where=ckpt.where, fix=fix)


def _converted_shape(ckpt: Checkpoint, source: hf_names.Source, model, fqn: str):
    """The shape transformers' conversion gives ``fqn`` from the checkpoint's shapes (run on
    meta: no values read), or the error it raised."""
    def empty(key: str) -> torch.Tensor:
        return torch.empty(ckpt.shape[key], dtype=DTYPES.get(ckpt.dtype[key], torch.float32),
                           device="meta")

    try:
        return tuple(source.realize(empty, model)[fqn].shape)
    except Exception as e:  # transformers' ops say what did not fit
        return f"not made ({type(e).__name__}: {e})"
