"""``shardfx.partition``: the entry point."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch

from shardfx.mesh import MeshSpec
from shardfx.partitioner.capture import capture
from shardfx.passes.manager import Options
from shardfx.plan import Plan


def partition(
    model: torch.nn.Module,
    example_args: tuple,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_targets: tuple = (),
    mesh: dict[str, int] | str | None = None,
    shard: str | dict = "auto",
    *,
    debug: bool | None = None,
) -> Plan:
    """Trace ``model`` on ``example_args`` (one global batch) and plan it for ``mesh``.

    With ``loss_fn(model_output, *targets) -> scalar`` the plan trains (forward, loss, backward);
    without, it runs inference. ``mesh`` names the axes and sizes (``{"dp": 2, "tp": 2}``);
    ``shard`` says how parameters are split over them: ``"auto"``, ``"megatron"``,
    ``"replicate"`` or ``{parameter glob: [placement per mesh axis]}``. ``debug=True`` (or ``SHARDFX_DEBUG=1``) verifies the IR after
    every pass; ``SHARDFX_DUMP=dir`` writes ``plan.dump(dir)``.
    """
    spec = MeshSpec.parse(mesh)
    types = {name: type(m).__name__ for name, m in model.named_modules()} \
        if isinstance(model, torch.nn.Module) else {}
    options = Options(mesh=spec, shard=shard, module_types=types)
    if debug is not None:
        options = dataclasses.replace(options, debug=debug)
    captured = capture(model, example_args, loss_fn, example_targets)
    plan = Plan(model, example_args, captured, spec, options)
    if dump := os.environ.get("SHARDFX_DUMP"):
        plan.dump(dump)
    return plan
