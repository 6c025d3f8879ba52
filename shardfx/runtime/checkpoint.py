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
      shardfx.json      ours: FORMAT, shardfx's and torch's versions, the world size, each key's
                        global shape and dtype, and the caller's ``meta``

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
save deletes. ``check`` refuses what it cannot vouch for (``.metadata`` or ``shardfx.json``
missing, a data file missing or shorter than ``.metadata`` says) before any tensor is read.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import signal
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                         _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from shardfx import __version__
from shardfx.errors import InputError
from shardfx.runtime.checkpoint_files import (FORMAT, INDEX, RECORD, check_keys, old_path,
                                              open_checkpoint)
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
    final = Path(path)
    where = f"shardfx save({str(path)!r}, ...)"
    _check_values(state, where)
    tensors = _every_rank({k: {"shape": list(_global_shape(v)),
                               "dtype": str(v.dtype).removeprefix("torch.")}
                           for k, v in state.items()})
    record = {"format": FORMAT, "shardfx": __version__, "torch": torch.__version__,
              "world_size": world_size(), "meta": dict(meta or {}),
              "tensors": dict(sorted(tensors.items()))}
    try:
        text = json.dumps(record, indent=1)
    except (TypeError, ValueError) as e:
        raise InputError(f"meta cannot be written as JSON: {e}", where=where,
                         fix="pass numbers, strings, lists and dicts in meta") from e
    agreed = [uuid.uuid4().hex[:12], _refusal(final)] if rank() == 0 else [None, None]
    if world_size() > 1:
        dist.broadcast_object_list(agreed, src=0)  # every rank the same staging, or refusal
    suffix, refusal = agreed
    if refusal:
        raise InputError(refusal, where=where,
                         fix="save to a new directory, or remove this one first")
    staging = final.with_name(f"{final.name}.partial-{suffix}")
    with _quiet():
        dcp.save(_dcp_state(state), storage_writer=_Writer(staging), no_dist=world_size() == 1)
    if rank() == 0:
        with open(staging / RECORD, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
        _install(staging, final)
    if world_size() > 1:
        dist.barrier()  # no rank returns before the checkpoint is in place
    return final


def check(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meta`` saved with the complete checkpoint at ``path`` (or at ``path.old``, see the
    module's docstring), or an ``InputError`` saying why it cannot be loaded. Reads no tensor
    and needs no process group."""
    return open_checkpoint(path)[1]["meta"]


def load(path: str | os.PathLike, state: dict[str, torch.Tensor], *,
         strict_optim: bool = True) -> dict[str, Any]:
    """Fill ``state``'s boxes and tensors in place from the checkpoint at ``path``, whatever
    boxes it was saved in; on every rank together. Returns the saved ``meta``.

    The keys and global shapes of every rank's ``state`` together (a pipeline rank holds its
    stages' keys only) are checked against the checkpoint before anything is read.
    ``strict_optim=False``: keys under ``optim/`` may be missing from either side (a runner
    without an optimizer loads a training checkpoint); those the state has keep their values.
    """
    _check_values(state, f"shardfx load({str(path)!r}, state)")
    folder, record, _ = open_checkpoint(path)
    saved = record["tensors"]
    check_keys(_every_rank({k: _global_shape(v) for k, v in state.items()}), saved,
               strict_optim, folder)
    wanted = {k: v for k, v in _dcp_state(state).items() if k in saved}
    with _quiet():
        dcp.load(wanted, storage_reader=FileSystemReader(folder), planner=_Planner(),
                 no_dist=world_size() == 1)
    return record["meta"]


def full_state_dict(path: str | os.PathLike, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """The whole tensors under ``prefix`` in the checkpoint at ``path``, keyed without it:
    ``model.load_state_dict(full_state_dict("ckpt"))``. One process, no process group."""
    folder, _, index = open_checkpoint(path)
    keys = {k for k in index.state_dict_metadata if k.startswith(prefix)}
    if not keys:
        tops = sorted({k.split("/", 1)[0] + "/" for k in index.state_dict_metadata})
        raise InputError(f"no tensor's key starts with {prefix!r}; the keys start with "
                         f"{', '.join(map(repr, tops)) or 'nothing'}", where=str(folder),
                         fix="pass one of those as prefix=")
    out: dict[str, Any] = {}
    with _quiet():  # DCP's own helper for one process (format_utils.dcp_to_torch_save uses it)
        _load_state_dict(out, storage_reader=FileSystemReader(folder),
                         planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return {k[len(prefix):]: out[k] for k in sorted(out)}


# --- saving --------------------------------------------------------------------------------


class _Writer(FileSystemWriter):
    """DCP's file writer (data files fsynced, ``.metadata`` written last through a temporary
    file and a rename), with the test hook before ``.metadata``."""

    def finish(self, metadata: Metadata, results) -> None:
        _pause("before-metadata")
        super().finish(metadata, results)


class _Planner(DefaultLoadPlanner):
    """DCP's load planner, less its check that a tensor's ``size()`` is the saved global size
    (torch/distributed/checkpoint/default_planner.py, ``create_default_local_load_plan``): a
    Box's is its box's. ``load`` has checked the global shapes before (``_check_keys``)."""

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
