"""``shardfx.partition``: the entry point."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

import torch

from shardfx.errors import InputError
from shardfx.mesh import MeshSpec
from shardfx.partitioner.capture import capture, capture_leaves, microbatch
from shardfx.partitioner.microbatching import loss_reduction
from shardfx.passes.manager import Options
from shardfx.plan import Plan


def parse_bytes(size: int | str | None) -> int | None:
    """``"8GiB"``, ``"512MB"``, ``1 << 30`` -> bytes."""
    if size is None or isinstance(size, int):
        return size
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", size)
    if not m or m[2].upper() not in units:
        raise InputError(f"cannot read memory size {size!r}", where="partition(..., memory_budget=...)",
                         fix='write bytes as an int or like "8GiB", "512MB"')
    return int(float(m[1]) * units[m[2].upper()])


def partition(
    model: torch.nn.Module,
    example_args: tuple,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_targets: tuple = (),
    mesh: dict[str, int] | str | None = None,
    shard: str | dict = "auto",
    microbatches: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    memory_budget: int | str | None = None,
    *,
    debug: bool | None = None,
) -> Plan:
    """Trace ``model`` on ``example_args`` (one global batch) and plan it for ``mesh``.

    With ``loss_fn(model_output, *targets) -> scalar`` the plan trains (forward, loss, backward);
    without, it runs inference. ``mesh`` names the axes and sizes (``{"dp": 2, "tp": 2}``);
    ``shard`` says how parameters are split over them: ``"auto"``, ``"megatron"``,
    ``"replicate"`` or ``{parameter glob: [placement per mesh axis]}``. With a ``pp`` axis the
    model is cut into stages that run ``schedule`` (gpipe | 1f1b | interleaved-1f1b |
    zero-bubble) over ``microbatches`` slices of the batch; ``virtual_stages`` per rank for the
    interleaved one (default 2). ``memory_budget`` (bytes or "8GiB", per device) bounds how many
    microbatches' activations a schedule may keep: one that would hold more is rejected. ``debug=True`` (or ``SHARDFX_DEBUG=1``) verifies the
    IR after every pass; ``SHARDFX_DUMP=dir`` writes ``plan.dump(dir)``.
    """
    spec = MeshSpec.parse(mesh)
    types = {name: type(m).__name__ for name, m in model.named_modules()} \
        if isinstance(model, torch.nn.Module) else {}
    if virtual_stages is None:
        virtual_stages = 2 if schedule == "interleaved-1f1b" else 1
    options = Options(mesh=spec, shard=shard, module_types=types, microbatches=microbatches,
                      schedule=schedule, virtual_stages=virtual_stages,
                      memory_budget=parse_bytes(memory_budget))
    if debug is not None:
        options = dataclasses.replace(options, debug=debug)
    # The programs run one microbatch at a time: trace on the first microbatch's shapes.
    slices = options.slices
    mb_args, mb_targets = microbatch(example_args, example_targets, slices)
    captured = capture(model, mb_args, loss_fn, mb_targets)
    if slices > 1:  # steps take the whole batch: check them against its shapes
        captured.leaves = capture_leaves(example_args, example_targets)
        if loss_fn is not None:  # and the slices' losses must make the batch's
            reduction = loss_reduction(loss_fn, captured.output, example_targets, slices)
            options = dataclasses.replace(options, loss_reduction=reduction)
    plan = Plan(model, example_args, captured, spec, options)
    if dump := os.environ.get("SHARDFX_DUMP"):
        plan.dump(dump)
    return plan
