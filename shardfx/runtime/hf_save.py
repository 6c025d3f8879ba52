"""``runner.save_hf(path)``: the trained model as a Hugging Face checkpoint, written by every
rank, one whole tensor at a time.

    runner.save_hf("out/")                              # on every rank
    AutoModelForCausalLM.from_pretrained("out/")        # the same logits, in one process

What is written is what ``save_pretrained`` writes: ``config.json`` (and
``generation_config.json``) for a transformers model; the tensors in safetensors files of at
most ``max_shard_bytes`` each (``model.safetensors``, or ``model-00001-of-0000N.safetensors``
and ``model.safetensors.index.json`` naming each tensor's file); each tensor under the name
and in the layout transformers saves (``hf_names.checkpoint_tensors``: Mixtral's fused experts
back into one tensor per expert and projection); a tied weight once.

Every rank knows the whole layout before a byte is written: the files, which tensors each
holds (in the model's order, a file filled up to ``max_shard_bytes``) and which rank writes it
(file i: rank i mod the world's size). Then, file by file, every rank takes part in gathering
each tensor whole (``runner.whole``: one tensor's collectives); the file's writer keeps it
until its file is written, the others let it go. So a rank holds its shards, one whole tensor
and at most one file's tensors.

All or nothing, as ``runner.save``: the files go into ``path.partial-<id>``, are fsynced,
and the directory takes ``path``'s place by two renames (``checkpoint._install``). A directory
at ``path`` that is not a Hugging Face checkpoint (nor empty) is refused, not replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from shardfx.errors import InputError, path_arg
from shardfx.runtime import hf_names
from shardfx.runtime.hf_load import INDEX, SINGLE
from shardfx.runtime.checkpoint import _fsync_dir, _install, attempted, failures, not_written
from shardfx.runtime.launch import rank, world_size

SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"


def layout(model: torch.nn.Module, names: list[str], max_bytes: int
           ) -> list[list[tuple[str, dict[str, tuple]]]]:
    """The files, in order: each a list of (model FQN, {checkpoint key: shape}) whose bytes
    together stay within ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    files: list[list] = [[]]
    size = 0
    for fqn in names:
        t = tensors[fqn]
        keys = hf_names.checkpoint_tensors(model, fqn, torch.empty(t.shape, dtype=t.dtype,
                                                                    device="meta"))
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append((fqn, {k: tuple(v.shape) for k, v in keys.items()}))
        size += nbytes
    return files


def file_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def save_hf(runner, path, max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``runner``'s model to ``path`` (every rank; the module docstring)."""
    from safetensors.torch import save_file

    path = path_arg(path, "runner.save_hf", 'runner.save_hf("finetuned/")')
    where = f"runner.save_hf({str(path)!r})"
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InputError(f"max_shard_bytes={max_shard_bytes!r} is not a positive whole number",
                         where=where, fix="bytes per file, e.g. 5 * 10**9 (the default)")
    plan, model = runner.plan, runner.plan.model
    final = Path(path)
    names = list(dict.fromkeys(plan.canonical(fqn) for fqn in plan.state_names))
    files = layout(model, names, max_shard_bytes)
    called = file_names(len(files))
    agreed = [uuid.uuid4().hex[:12], _refusal(final)] if rank() == 0 else [None, None]
    if world_size() > 1:
        dist.broadcast_object_list(agreed, src=0)
    save_id, refusal = agreed
    if refusal:
        raise InputError(refusal, where=where, fix="save to a new directory, or remove it first")
    staging = final.with_name(f"{final.name}.partial-{save_id}")
    first = rank() == 0
    _settled(final, staging, failures(attempted(lambda: staging.mkdir(parents=True))
                                      if first else None))
    error = None  # this rank could not write a file: it writes no more, its peers go on
    for i, (file, name) in enumerate(zip(files, called)):
        mine = i % world_size() == rank()
        tensors: dict[str, torch.Tensor] = {}
        for fqn, _ in file:
            full = runner.whole(fqn)  # every rank: this tensor's collectives
            if mine:
                written = hf_names.checkpoint_tensors(model, fqn, full.detach().cpu())
                tensors.update({k: v.contiguous() for k, v in written.items()})
            del full
        if mine and error is None:
            error = attempted(lambda: (save_file(tensors, str(staging / name),
                                                 metadata={"format": "pt"}),
                                       _fsync(staging / name)))
    _settled(final, staging, failures(error))  # every file written and fsynced, every rank's
    _settled(final, staging, failures(attempted(lambda: (
        _write_index(staging, files, called, model), _write_config(staging, model),
        _fsync_dir(staging), _install(staging, final))) if first else None))
    return final  # no rank returns before the checkpoint is in place (the collective above)


def _settled(final: Path, staging: Path, failures: dict[int, str]) -> None:
    """Where any rank failed (``failures``): its files removed, and the same CheckpointError on
    every rank."""
    if failures:
        if rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise not_written(final, failures)



def _write_index(staging: Path, files: list, called: list[str], model) -> None:
    if len(files) == 1:
        return
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    total = sum(tensors[fqn].numel() * tensors[fqn].element_size()
                for file in files for fqn, _ in file)
    weight_map = {key: name for file, name in zip(files, called)
                  for _, keys in file for key in keys}
    with open(staging / INDEX, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(
            weight_map.items()))}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _write_config(staging: Path, model) -> None:
    """config.json (and generation_config.json) as ``save_pretrained`` writes them."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(staging)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained") and \
            getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(staging)
    for written in staging.glob("*.json"):
        _fsync(written)


def _fsync(file: Path) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _refusal(final: Path) -> str | None:
    """Why a save must not replace ``final`` (a directory that is not a Hugging Face
    checkpoint), or None."""
    if not final.exists():
        return None
    if final.is_dir() and (not any(final.iterdir()) or (final / SINGLE).exists()
                           or (final / INDEX).exists()):
        return None
    return f"{final} exists and is not a Hugging Face checkpoint: a save will not replace it"
