"""``shardfx.partition``: the entry point."""

from __future__ import annotations

import os
from typing import Callable

import torch

from shardfx.errors import MeshError
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
    *,
    debug: bool | None = None,
) -> Plan:
    """Trace ``model`` on ``example_args`` (one global batch) and plan it for ``mesh``.

    With ``loss_fn(model_output, *targets) -> scalar`` the plan trains (forward, loss, backward);
    without, it runs inference. ``debug=True`` (or ``SHARDFX_DEBUG=1``) verifies the IR after
    every pass; ``SHARDFX_DUMP=dir`` writes ``plan.dump(dir)``.
    """
    spec = MeshSpec.parse(mesh)
    if spec.size != 1:
        raise MeshError(
            f"mesh {spec} has {spec.size} devices; this version of shardfx plans for one device",
            where="partition(..., mesh=...)",
            fix="use mesh={} (or all axes of size 1) until data/tensor parallelism lands")
    options = Options() if debug is None else Options(debug=debug)
    captured = capture(model, example_args, loss_fn, example_targets)
    plan = Plan(model, example_args, captured, spec, options)
    if dump := os.environ.get("SHARDFX_DUMP"):
        plan.dump(dump)
    return plan
