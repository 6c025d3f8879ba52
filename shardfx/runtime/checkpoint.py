"""Crash-safe distributed checkpoints that reshard, written through torch.distributed.checkpoint.

    save("ckpt", {"model/w": Box.of(local, (10, 6), (5, 3)), "optim/w/step": step}, {"step": 9})
    meta = load("ckpt", state)                       # fills each Box and tensor of state in place
    model.load_state_dict(full_state_dict("ckpt"))   # one process, plain PyTorch

A state dict is flat: each value is a ``Box`` (this rank's rectangle of a global tensor) or a
plain tensor (the same whole tensor on every rank). DCP does the rest. Ranks holding the same
box (a tensor replicated over dp) write it once: DCP keeps one write per key and offset. A load
reads, for each box the loading rank holds, its overlaps with the boxes that were saved,
whichever mesh saved them: that is the resharding.

On disk a checkpoint is one directory:

    ckpt/
      __0_0.distcp ...  each rank's boxes (DCP's data files, one per rank that wrote any)
      .metadata         DCP's index: each box's offsets and sizes, and the file, byte offset and
                        byte count that hold it; written once every rank's files are fsynced
      shardfx.json      ours: FORMAT, shardfx's and torch's versions, the world size, the save's
                        id, each file's length and checksum, each key's global shape and dtype,
                        the caller's ``meta``, and its own checksum over all of these

Every file is one save's: rank 0 draws the save's id and broadcasts it; DCP's index carries it
(``storage_meta.save_id``), each data file ends with a line carrying it and the checksum of its
bytes, computed as they were written (``checkpoint_digest``), and ``shardfx.json``, written
last, records both for every file.

Why a kill -9 at any moment leaves the previous checkpoint or the new one: a save writes all of
it into ``ckpt.partial-<id>`` (``<id>`` drawn by rank 0), fsyncs it, and only then puts it in
place with two renames, ``ckpt`` -> ``ckpt.old`` and ``ckpt.partial-<id>`` -> ``ckpt``, and
deletes ``ckpt.old``. A rename is atomic and ``ckpt`` only comes into being by the second one,
so at every instant either

- ``ckpt`` exists, and is complete (a ``ckpt.old`` beside it is older, never read: a save was
  killed while deleting it); or
- ``ckpt`` does not, and ``ckpt.old`` is complete (a save was killed between the renames):
  ``check`` and ``load`` read it, with a warning, and the next save deletes it once its own is
  in place.

A save killed before the renames leaves a ``ckpt.partial-*``, which nothing reads and the next
save deletes. ``check`` refuses what it cannot vouch for (``checkpoint_files``: a file missing,
cut short, damaged or from another save, a malformed field of ``shardfx.json``) before any
tensor is read; ``load`` and ``full_state_dict`` check the same, reading the data files' bytes
for their checksums on a thread while DCP reads the tensors (a rank its share of the files), and
raise before they return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import shutil
import signal
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                         _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from shardfx.errors import CheckpointError, InputError, ShardfxError, path_arg
from shardfx.runtime.checkpoint_digest import Digesting
from shardfx.runtime.checkpoint_files import (FORMAT, __version__, INDEX, RECORD, check_keys,
                                              damaged, data_files, old_path, open_checkpoint,
                                              seal, verify_contents)
from shardfx.runtime.launch import rank, world_size

PAUSE_ENV = "SHARDFX_CHECKPOINT_PAUSE"  # test hook, see _pause

log = logging.getLogger("shardfx.checkpoint")


class Box(torch.Tensor):
    """This rank's rectangle of a global tensor: its values, the tensor's ``global_shape`` and
    the box's ``offsets`` in it. DCP checkpoints it as it does a DTensor's local shard, through
    the same protocol (torch/distributed/tensor/_api.py, ``__create_write_items__``). An empty
    box (a size-0 dimension) holds nothing: it writes nothing and reads nothing."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...] = ()  # (offsets, values): Box.of
    __torch_function__ = torch._C._disabled_torch_function_impl  # its ops give plain tensors

    @classmethod
    def of(cls, local: torch.Tensor, global_shape, offsets, pieces=None) -> Box:
        """The box of ``local`` at ``offsets`` in a tensor of ``global_shape``. It shares
        ``local``'s storage, so loading into the box fills ``local``. ``pieces``: where
        ``local`` is not one rectangle of the whole tensor but several along one dim (a
        strided split's parts, ``runtime.saving.Held``), (that dim, [(start in ``local``,
        length, offsets in the whole tensor), ...])."""
        global_shape, offsets = tuple(map(int, global_shape)), tuple(map(int, offsets))
        box = torch.Tensor._make_subclass(cls, local.detach(), False)
        box.global_shape, box.offsets = global_shape, offsets
        if pieces is None:
            cls._check(local, global_shape, offsets)
            return box
        dim, spans = pieces
        box.pieces = tuple((tuple(map(int, at)), local.detach().narrow(dim, start, length))
                           for start, length, at in spans)
        for at, view in box.pieces:
            cls._check(view, global_shape, at)
        return box

    @staticmethod
    def _check(local: torch.Tensor, global_shape, offsets) -> None:
        if not (len(global_shape) == len(offsets) == local.dim()) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, local.shape, global_shape)):
            raise InputError(
                f"a box of shape {list(local.shape)} at offsets {list(offsets)} does not fit "
                f"in a tensor of shape {list(global_shape)}", where="Box.of(local, ...)",
                fix="give one offset per dimension, with offset + local size <= global size")

    def local(self) -> torch.Tensor:
        """The values as a plain tensor (the same storage)."""
        return self.as_subclass(torch.Tensor)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, properties=TensorProperties.create_from_tensor(
                                  self.local()), size=torch.Size(self.global_shape)))
                for chunk in _chunks(self)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return _chunks(self)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for at, values in self.pieces:
            if at == tuple(index.offset):
                return values
        return self.local()

    def __repr__(self) -> str:
        return (f"Box({list(self.shape)} at {list(self.offsets)} of {list(self.global_shape)}, "
                f"{str(self.dtype).removeprefix('torch.')})")


def save(path: str | os.PathLike, state: dict[str, torch.Tensor],
         meta: dict[str, Any] | None = None) -> Path:
    """Write ``state`` and ``meta`` (JSON-able) as the checkpoint ``path``, all or nothing (see
    the module's docstring); on every rank together. Returns ``path`` once it is in place."""
    final = path_arg(path, "checkpoint.save", 'save("ckpt", state)')
    where = f"shardfx save({str(path)!r}, ...)"
    _check_values(state, where)
    tensors = _every_rank({k: {"shape": list(_global_shape(v)),
                               "dtype": str(v.dtype).removeprefix("torch.")}
                           for k, v in state.items()})
    record = {"format": FORMAT, "shardfx": __version__, "torch": torch.__version__,
              "world_size": world_size(), "save": None, "files": None,
              "meta": dict(meta or {}), "tensors": dict(sorted(tensors.items()))}
    try:
        json.dumps(record)
    except (TypeError, ValueError) as e:
        raise InputError(f"meta cannot be written as JSON: {e}", where=where,
                         fix="pass numbers, strings, lists and dicts in meta") from e
    agreed = [uuid.uuid4().hex[:12], _refusal(final)] if rank() == 0 else [None, None]
    if world_size() > 1:
        dist.broadcast_object_list(agreed, src=0)  # every rank the same id, or refusal
    save_id, refusal = agreed
    if refusal:
        raise InputError(refusal, where=where,
                         fix="save to a new directory, or remove this one first")
    staging = final.with_name(f"{final.name}.partial-{save_id}")
    writer = _Writer(staging, save_id)
    try:
        with _quiet():
            dcp.save(_dcp_state(state), storage_writer=writer, no_dist=world_size() == 1)
    except CheckpointException as e:  # a BaseException: each rank's failures, by rank (every
        if rank() == 0:               # rank has them): this save's files are of no use
            shutil.rmtree(staging, ignore_errors=True)
        raise not_written(final, {r: f"{type(exc).__name__}: {exc}"
                                  for r, (exc, _) in e.failures.items()}) from e
    files = _every_rank(writer.written)  # each rank's data file; rank 0's .metadata
    record.update(save=save_id, files=dict(sorted(files.items())))

    def finish() -> None:  # on rank 0
        with open(staging / RECORD, "w") as f:
            f.write(json.dumps(seal(record), indent=1))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
        _install(staging, final)

    if failed := failures(attempted(finish) if rank() == 0 else None):  # every rank hears
        if rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise not_written(final, failed)
    return final  # no rank returns before the checkpoint is in place (the collective above)


def check(path: str | os.PathLike, *, contents: bool = True) -> dict[str, Any]:
    """The ``meta`` saved with the complete checkpoint at ``path`` (or at ``path.old``, see the
    module's docstring), or an ``InputError`` saying why it cannot be loaded: every file read and
    checked against its checksum. ``contents=False``: every check but reading the data files
    whole (``load`` does that as it reads them). Loads no tensor and needs no process group."""
    path = path_arg(path, "checkpoint.check", 'check("ckpt")')
    return open_checkpoint(path, contents=contents)[1]["meta"]


def load(path: str | os.PathLike, state: dict[str, torch.Tensor], *,
         strict_optim: bool = True) -> dict[str, Any]:
    """Fill ``state``'s boxes and tensors in place from the checkpoint at ``path``, whatever
    boxes it was saved in; on every rank together. Returns the saved ``meta``.

    The keys and global shapes of every rank's ``state`` together (a pipeline rank holds its
    stages' keys only) are checked against the checkpoint before anything is read.
    ``strict_optim=False``: keys under ``optim/`` may be missing from either side (a runner
    without an optimizer loads a training checkpoint); those the state has keep their values.

    Every file is checked first (``check``), but for the data files' contents, which each rank
    checks for its share of the files while DCP reads (every rank raises the same InputError):
    a load refused for a damaged file has already written into ``state``, which is then not
    to be used.
    """
    path = path_arg(path, "checkpoint.load", 'load("ckpt", state)')
    _check_values(state, f"shardfx load({str(path)!r}, state)")
    folder, record, _ = open_checkpoint(path, contents=False)
    saved = record["tensors"]
    check_keys(_every_rank({k: _global_shape(v) for k, v in state.items()}), saved,
               strict_optim, folder)
    wanted = {k: v for k, v in _dcp_state(state).items() if k in saved}
    _verified_read(folder, record, data_files(record)[rank()::world_size()], lambda: dcp.load(
        wanted, storage_reader=_Reader(folder), planner=_Planner(), no_dist=world_size() == 1),
        every_rank=True)
    return record["meta"]


def full_state_dict(path: str | os.PathLike, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """The whole tensors under ``prefix`` in the checkpoint at ``path``, keyed without it:
    ``model.load_state_dict(full_state_dict("ckpt"))``. One process, no process group."""
    path = path_arg(path, "checkpoint.full_state_dict", 'full_state_dict("ckpt")')
    folder, record, index = open_checkpoint(path, contents=False)
    keys = {k for k in index.state_dict_metadata if k.startswith(prefix)}
    if not keys:
        tops = sorted({k.split("/", 1)[0] + "/" for k in index.state_dict_metadata})
        raise InputError(f"no tensor's key starts with {prefix!r}; the keys start with "
                         f"{', '.join(map(repr, tops)) or 'nothing'}", where=str(folder),
                         fix="pass one of those as prefix=")
    out: dict[str, Any] = {}
    # DCP's own helper for one process (format_utils.dcp_to_torch_save uses it)
    _verified_read(folder, record, data_files(record), lambda: _load_state_dict(
        out, storage_reader=_Reader(folder), planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True), every_rank=False)
    return {k[len(prefix):]: out[k] for k in sorted(out)}


# --- saving --------------------------------------------------------------------------------


class _Writer(FileSystemWriter):
    """DCP's file writer (data files fsynced, ``.metadata`` written last through a temporary
    file and a rename), each file digested as it is written and each data file ended by its
    trailer (``checkpoint_digest.Digesting``), the save's id in ``.metadata``; with the test hook
    before ``.metadata``. ``written``: file name -> {"bytes", "digest"} of what it wrote."""

    def __init__(self, path: Path, save_id: str) -> None:
        super().__init__(path)
        self.save_id_ = save_id  # DCP's own ``save_id``, drawn per rank, is reset by each save
        self.written: dict[str, dict[str, Any]] = {}
        self.fs = _DigestedFiles(save_id, self.written)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id_)

    def finish(self, metadata: Metadata, results) -> None:
        _pause("before-metadata")
        super().finish(metadata, results)


class _DigestedFiles(FileSystem):
    """DCP's file system, whose files opened for writing are digested as they are written."""

    def __init__(self, save_id: str, written: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.save_id, self.written = save_id, written

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with super().create_stream(path, mode) as raw:  # .metadata.tmp, renamed to .metadata
            stream = Digesting(raw, path, self.save_id if path.suffix == ".distcp" else None,
                               self._done)
            yield stream
            stream.close()

    def _done(self, name: str, size: int, digest: str) -> None:
        self.written[name.removesuffix(".tmp")] = {"bytes": size, "digest": digest}


class _Reader(FileSystemReader):
    """DCP's file reader, one data file at a time, so that a file it cannot read is named."""

    def read_data(self, plan: LoadPlan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path,
                               []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:  # noqa: BLE001 - whatever DCP or torch.load raised
                raise _Unreadable(name, f"{type(e).__name__}: {e}") from e
        done: Future = Future()
        done.set_result(None)
        return done


class _Unreadable(Exception):
    """A data file DCP could not read (``_Reader``): its name and why. Plain arguments, as DCP
    pickles each rank's failure to every rank."""


class _Planner(DefaultLoadPlanner):
    """DCP's load planner, less its check that a tensor's ``size()`` is the saved global size
    (torch/distributed/checkpoint/default_planner.py, ``create_default_local_load_plan``): a
    Box's is its box's. ``load`` has checked the global shapes before (``check_keys``)."""

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        return LoadPlan([item for key, value in self.state_dict.items()
                         for item in create_read_items_for_chunk_list(key, saved[key],
                                                                      _chunks(value))])


def _install(staging: Path, final: Path) -> None:
    """On rank 0: make the complete ``staging`` the checkpoint ``final``, by the two renames of
    the module's docstring; then delete what older saves left."""
    old = old_path(final)
    if final.exists():
        if old.exists():  # left by a save killed while deleting it; final is newer
            shutil.rmtree(old)
        os.rename(final, old)
    _pause("between-renames")
    os.rename(staging, final)
    _fsync_dir(final.parent)
    _pause("before-cleanup")
    for leftover in [old, *final.parent.glob(f"{glob.escape(final.name)}.partial-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _refusal(final: Path) -> str | None:
    """Why a save must not replace ``final`` (something that is not a checkpoint), or None."""
    if not final.exists() or (final / RECORD).exists() or (final / INDEX).exists() or (
            final.is_dir() and not any(final.iterdir())):
        return None
    return f"{final} exists and is not a shardfx checkpoint: a save will not replace it"


def _pause(point: str) -> None:
    """Test hook: with ``SHARDFX_CHECKPOINT_PAUSE=<point>`` a save stops its process (SIGSTOP) at
    ``point``, "before-metadata", "between-renames" or "before-cleanup", for a test to kill."""
    if os.environ.get(PAUSE_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)


# --- helpers -------------------------------------------------------------------------------


def _verified_read(folder: Path, record: dict[str, Any], files: list[str], read, *,
                   every_rank: bool) -> None:
    """``read()`` (DCP reading the checkpoint at ``folder``) while a thread checks the data
    files ``files`` against their checksums (``verify_contents``). Raises, once both are done,
    the InputError a damaged file gives, else the one naming a file DCP could not read;
    ``every_rank``: on every rank alike (a collective), whichever rank found it."""
    failed = None
    with ThreadPoolExecutor(1, thread_name_prefix="shardfx-verify") as pool:
        verified = pool.submit(verify_contents, folder, record, files)
        try:
            with _quiet():
                read()
        except CheckpointException as e:  # a BaseException: each rank's failures, by rank
            failed = e
        try:
            verified.result()
            found = None
        except InputError as e:
            found = (e.cause, e.where, e.fix)
        except Exception as e:  # noqa: BLE001 - an OSError: every rank must hear of it
            found = (f"the data files of {folder} cannot be read for their checksums "
                     f"({type(e).__name__}: {e})", str(folder),
                     "check that the directory is readable, or resume from an earlier checkpoint")
    for problem in _gather(found) if every_rank else [found]:
        if problem:
            cause, where, fix = problem
            raise InputError(cause, where=where, fix=fix) from failed
    if failed is not None:
        raise _unreadable(folder, failed) from failed


def _unreadable(folder: Path, failed: CheckpointException) -> ShardfxError:
    """One InputError for DCP's ``CheckpointException``: the data file it could not read."""
    causes = [exc for exc, _ in failed.failures.values()]
    for exc in causes:
        if isinstance(exc, _Unreadable):
            name, why = exc.args
            return damaged(folder, name, f"DCP cannot read it ({why})")
    for exc in causes:
        if isinstance(exc, ShardfxError):
            return exc
    why = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}"
                    for r, (exc, _) in sorted(failed.failures.items()))
    return InputError(f"DCP cannot read the checkpoint {folder}: {why}", where=str(folder),
                      fix="resume from an earlier checkpoint")


def not_written(final: Path, failures: dict[int, str]) -> CheckpointError:
    """One CheckpointError for a save that failed on the ranks of ``failures`` (rank -> what
    it raised), raised alike on every rank."""
    why = "; ".join(f"rank {r}: {what}" for r, what in sorted(failures.items()))
    return CheckpointError(
        f"the checkpoint {final} could not be written ({why}); the previous checkpoint there, if "
        "any, is as it was", where=str(final),
        fix=f"make room or make {final.parent} writable on every rank named, then save again")


def attempted(work) -> str | None:
    """``work()``; the OSError it raised, in words, or None."""
    try:
        work()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def failures(mine: str | None) -> dict[int, str]:
    """Every rank's failure (``attempted``), by rank: a collective when the world has several,
    so an OSError on one rank is heard by all, and none waits for it at a barrier."""
    return {r: what for r, what in enumerate(_gather(mine)) if what}


def _gather(mine: Any) -> list:
    """``mine`` from every rank, by rank (a collective when the world has several)."""
    if world_size() == 1:
        return [mine]
    every: list = [None] * world_size()
    dist.all_gather_object(every, mine)
    return every


def _check_values(state: dict[str, Any], where: str) -> None:
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            raise InputError(f"state[{k!r}] is a {type(v).__name__}, not a tensor or a Box",
                             where=where, fix="put what is not a tensor in meta")


def _global_shape(value: torch.Tensor) -> tuple[int, ...]:
    return value.global_shape if isinstance(value, Box) else tuple(value.shape)


def _chunks(value: torch.Tensor) -> list[ChunkStorageMetadata]:
    """The part of its global tensor that ``value`` holds: none, one box, or its pieces."""
    if value.numel() == 0:
        return []
    if isinstance(value, Box) and value.pieces:
        return [ChunkStorageMetadata(offsets=torch.Size(at), sizes=v.size())
                for at, v in value.pieces if v.numel()]
    offsets = value.offsets if isinstance(value, Box) else (0,) * value.dim()
    return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=value.size())]


def _every_rank(mine: dict) -> dict:
    """``mine`` merged with every other rank's (a collective when the world has several):
    ranks may hold different keys, a pipeline stage's."""
    if world_size() == 1:
        return mine
    every: list = [None] * world_size()
    dist.all_gather_object(every, mine)
    return {k: v for rank_dict in every for k, v in rank_dict.items()}


def _dcp_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DCP is given: ``state`` less its empty boxes (they hold nothing)."""
    return {k: v for k, v in state.items() if not (isinstance(v, Box) and v.numel() == 0)}


@contextlib.contextmanager
def _quiet():
    """Without DCP's warning that one process saves or loads alone: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
