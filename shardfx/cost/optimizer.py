"""What an optimizer keeps per parameter and allocates while it steps: the memory model's
view of ``torch.optim`` (``partition(..., optimizer=...)`` names the kind)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from shardfx.cost.values import tensor_bytes
from shardfx.errors import InputError
from shardfx.ir import meta as M

log = logging.getLogger("shardfx.estimate.memory")


@dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer keeps per parameter, and what its step allocates."""

    name: str
    states: int  # tensors the size of each parameter (Adam's two moments)
    step_count: bool  # a scalar step count per parameter (Adam's ``state["step"]``)
    temporaries: int  # per-parameter temporaries of one update, on CPU (one parameter at a time)
    kept: int = 0  # of them, still alive while the next parameter's are made (AdamW's denom)


OPTIMIZERS = {
    "adamw": OptimizerModel("adamw", states=2, step_count=True, temporaries=2, kept=1),
    "adam": OptimizerModel("adam", states=2, step_count=True, temporaries=2, kept=1),
    "sgd-momentum": OptimizerModel("sgd-momentum", states=1, step_count=False, temporaries=1),
    "sgd": OptimizerModel("sgd", states=0, step_count=False, temporaries=1),
    "none": OptimizerModel("none", states=0, step_count=False, temporaries=0),
}


def optimizer_model(name: str | None) -> OptimizerModel:
    key = "none" if name is None else str(name).lower()
    if key not in OPTIMIZERS:
        raise InputError(f"unknown optimizer {name!r} for the memory model",
                         where="partition(..., optimizer=...)",
                         fix=f"use one of {', '.join(OPTIMIZERS)} (the kind of torch optimizer "
                             "plan.runner(...) will build), or None for no optimizer state")
    return OPTIMIZERS[key]


def kind_of_optimizer(optimizer) -> str | None:
    """The memory model's name for a torch optimizer, or None for one it does not know."""
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return "sgd-momentum" if momentum else "sgd"
    return name if name in OPTIMIZERS else None


def check_optimizer(planned: str | None, optimizer) -> None:
    """Warn when the runner's optimizer is not the kind the plan counted the state of."""
    got = "none" if optimizer is None else kind_of_optimizer(optimizer)
    if got != (planned or "none"):
        log.warning("the plan counted %s optimizer state (partition(..., optimizer=%r)) but the "
                    "runner's optimizer is %s: memory_estimate() is off by the difference; plan "
                    "with optimizer=%r", planned or "no", planned,
                    type(optimizer).__name__ if optimizer is not None else "None",
                    got if got in OPTIMIZERS else None)


def optimizer_state(params: Iterable[torch.Tensor], optimizer: OptimizerModel) -> int:
    """Bytes of the optimizer's state for ``params``."""
    return sum(optimizer.states * tensor_bytes(p) + 4 * optimizer.step_count for p in params)


def optimizer_temporaries(params: list, optimizer: OptimizerModel, device: torch.device) -> int:
    """Bytes one update allocates: on CPU torch updates a parameter at a time, in the order of
    ``params`` (temporaries the size of each, while the previous one's ``kept`` are still
    bound: single-tensor Adam's ``denom`` lives until the next parameter's replaces it); on
    CUDA its foreach kernels make them for all at once."""
    if device.type == "cpu":
        sizes = [tensor_bytes(p) for p in params]
        return max((optimizer.temporaries * b + optimizer.kept * a
                    for a, b in zip([0, *sizes], sizes)), default=0)
    return min(optimizer.temporaries, 1) * sum(tensor_bytes(p) for p in params)


def stepped_value(param: fx.Node, layout: M.ZeroShard | None):
    """What the optimizer steps for a parameter input: its value, or ZeRO's rows of it (a
    meta tensor; zero=3's input is the rows already)."""
    val = param.meta[M.VAL]
    if layout is None or M.ZERO in param.meta:
        return val
    return torch.empty(layout.shard_shape, dtype=val.dtype, device="meta")
