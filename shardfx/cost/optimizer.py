"""What an optimizer keeps per parameter and allocates while it steps: the memory model's
view of ``torch.optim`` (``partition(..., optimizer=...)`` names the kind).

Adam, AdamW and SGD step with torch's fused kernel wherever the runner may choose it
(``fused_step``): the user's optimizer left ``foreach`` and ``fused`` unset, which torch's
documentation reads as "let the implementation pick", and every parameter it steps is float32 or
float64 on CPU or CUDA. On CPU torch picks its for-loop then, a parameter at a time: measured
on a 58M Llama's 75 parameters (one thread, ``bench/optimizer.py``) the for-loop's step took
385 ms (median), foreach 391 ms, fused 96 ms, equal to the for-loop's within a rounding in
float32 (one unit in the last place of a parameter where they differ: the order of an update's
operations). The fused step makes no temporaries, so the memory model counts none for it.
"""

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
    fused: bool = False  # torch has a fused step for it, which the runner uses (``fused_step``)


OPTIMIZERS = {
    "adamw": OptimizerModel("adamw", states=2, step_count=True, temporaries=2, kept=1,
                            fused=True),
    "adam": OptimizerModel("adam", states=2, step_count=True, temporaries=2, kept=1, fused=True),
    "sgd-momentum": OptimizerModel("sgd-momentum", states=1, step_count=False, temporaries=1,
                                   fused=True),
    "sgd": OptimizerModel("sgd", states=0, step_count=False, temporaries=1, fused=True),
    "none": OptimizerModel("none", states=0, step_count=False, temporaries=0),
}


FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
FUSED_DTYPES = (torch.float32, torch.float64)  # the runner's choice: equal to the for-loop's
FUSED_DEVICES = ("cpu", "cuda")


def fused_applies(optimizer: OptimizerModel, params: Iterable, device: torch.device) -> bool:
    """Whether the runner steps ``params`` (tensors or meta values) with the fused kernel,
    when the user leaves the choice to it (module docstring)."""
    return optimizer.fused and all(_fusable(p, device) for p in params)


def _fusable(p, device: torch.device) -> bool:
    return device.type in FUSED_DEVICES and p.dtype in FUSED_DTYPES


def fused_step(optimizer) -> bool:
    """Make the user's ``optimizer`` step with torch's fused kernel where the choice is left
    open (module docstring): an Adam, AdamW or SGD (not a subclass) that has not stepped yet,
    every group with ``foreach`` and ``fused`` unset and not ``differentiable``, every parameter
    float32 or float64 on CPU or CUDA. The same object, its groups' ``fused`` set to True as
    ``fused=True`` would have set them. Returns whether it does."""
    groups = getattr(optimizer, "param_groups", None)
    if type(optimizer) not in FUSED_CLASSES or optimizer.state or not groups:
        return False
    params = [p for g in groups for p in g["params"]]
    if any(g.get("foreach") is not None or g.get("fused") is not None
           or g.get("differentiable") for g in groups) or not params or \
            not all(_fusable(p, p.device) for p in params):
        return False
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # as the constructor sets it for fused=True
    return True


def grads_laid_out_as_params(optimizer) -> None:
    """Before a fused step: give each gradient whose strides differ from its parameter's the
    parameter's layout (a copy). torch's fused kernels walk a gradient in its parameter's
    memory order whatever the gradient's strides: a transposed gradient (a pipeline's
    accumulator, summed as the transpose of a matmul's output) stepped the wrong elements, 7%
    off after one step on a tp=2 Llama's ``up_proj``. The for-loop reads strides."""
    for group in optimizer.param_groups:
        if group.get("fused"):
            for p in group["params"]:
                if p.grad is not None and p.grad.stride() != p.stride():
                    p.grad = torch.empty_like(p).copy_(p.grad)


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
    """Warn when the runner's optimizer is not the kind the plan counted the state of, or
    steps with temporaries the plan did not count (the user chose foreach or the for-loop where
    the plan counted the fused step's none)."""
    got = "none" if optimizer is None else kind_of_optimizer(optimizer)
    model = OPTIMIZERS.get(got)
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]
    if got == planned and model is not None and params and \
            fused_applies(model, params, params[0].device) and \
            not all(g.get("fused") for g in optimizer.param_groups):
        log.warning("the plan counted no temporaries for the %s step (torch's fused kernel) but "
                    "the runner's optimizer sets foreach or fused itself: its step makes "
                    "temporaries the size of its parameters that memory_estimate() does not "
                    "count; leave both unset to step fused", type(optimizer).__name__)
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
    CUDA its foreach kernels make them for all at once; the fused step makes none."""
    if fused_applies(optimizer, params, device):
        return 0
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
