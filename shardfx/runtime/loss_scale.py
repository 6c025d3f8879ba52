"""Dynamic loss scaling for fp16 plans: gradients that fp16 would flush to zero are kept by
scaling the loss, and a step whose gradients overflowed is skipped.

The runner seeds the backward with ``scale`` instead of 1 (the program's tangent input), so
every gradient comes out multiplied by it; before the optimizer, ``LossScaler.unscale``
divides them back, in fp32, and says whether any of them is inf or nan on any rank (one
all-reduce over every process: a tp shard, a pipeline stage or a dp replica that overflowed
makes every rank skip, so the replicas' weights stay the same). Then ``update``: on overflow
the step is skipped (no optimizer step: parameters and optimizer state unchanged) and the scale
is multiplied by ``backoff_factor``; after ``growth_interval`` steps in a row without one it is
multiplied by ``growth_factor``. The defaults are ``torch.amp.GradScaler``'s.

``runner.loss_scale`` is the current scale; ``runner.loss_scaler.state_dict()`` and
``load_state_dict`` carry it (and the count of clean steps) across a checkpoint, as
``GradScaler``'s do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from shardfx.errors import InputError
from shardfx.kernels.device import collective_device


@dataclass(frozen=True)
class LossScaling:
    """Settings of dynamic loss scaling (``plan.runner(..., loss_scaling=LossScaling(...))``)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        where = "plan.runner(..., loss_scaling=LossScaling(...))"
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise InputError(f"invalid loss scaling {self}", where=where,
                             fix="init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                                 "growth_interval a positive int")


class LossScaler:
    def __init__(self, settings: LossScaling):
        self.settings = settings
        self.scale = float(settings.init_scale)
        self.good_steps = 0  # steps in a row without inf/nan since the scale last changed
        self.skipped = 0  # steps skipped so far
        self.last_skipped = False

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale, in place; True if any is inf or nan on any rank."""
        grads = [g for g in grads if g is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        # a sum is inf or nan when any element is (fp32 sums of unscaled gradients do not
        # overflow), and costs no tensor of a gradient's size
        bad = torch.zeros(1, device=collective_device())
        if grads:
            bad[0] = float(not bool(torch.stack([g.sum().float() for g in grads]).isfinite().all()))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def update(self, found_inf: bool) -> None:
        s = self.settings
        self.last_skipped = found_inf
        if found_inf:
            self.scale *= s.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= s.growth_interval:
            self.scale *= s.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "settings": asdict(self.settings)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: ``scale`` a finite positive number, ``good_steps`` and
        ``skipped`` (optional: 0, as before it was saved) non-negative ints. Anything else is
        an InputError naming the key, and the scaler is left as it was."""
        where = "runner.loss_scaler.load_state_dict"
        fix = "pass what runner.loss_scaler.state_dict() returned: {'scale': a finite " \
              "positive number, 'good_steps': an int >= 0, 'skipped': an int >= 0}"
        if not isinstance(state, Mapping):
            raise InputError(f"a loss scaler state must be a dict, got {type(state).__name__}",
                             where=where, fix=fix)
        missing = [k for k in ("scale", "good_steps") if k not in state]
        if missing:
            raise InputError(f"the loss scaler state lacks {', '.join(map(repr, missing))} "
                             f"(it has {sorted(map(str, state))})", where=where, fix=fix)
        scale = state["scale"]
        if not (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
                and math.isfinite(scale) and scale > 0):
            raise InputError(f"loss scale must be a finite positive number, got "
                             f"{type(scale).__name__} {scale!r}", where=f"{where}: 'scale'",
                             fix=fix)
        counts = {"good_steps": state["good_steps"], "skipped": state.get("skipped", 0)}
        for key, value in counts.items():
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                    and value >= 0):
                raise InputError(f"{key} must be a non-negative int, got "
                                 f"{type(value).__name__} {value!r}", where=f"{where}: {key!r}",
                                 fix=fix)
        self.scale = float(scale)
        self.good_steps, self.skipped = int(counts["good_steps"]), int(counts["skipped"])


def loss_scaler(precision, loss_scaling) -> LossScaler | None:
    """The runner's scaler: ``loss_scaling`` None follows the plan (fp16 scales, fp32 and bf16
    do not), False turns it off, a ``LossScaling`` (or True: the defaults) turns it on."""
    if loss_scaling is None:
        loss_scaling = precision.scales_loss
    if loss_scaling is False:
        return None
    if loss_scaling is True:
        loss_scaling = LossScaling()
    if not isinstance(loss_scaling, LossScaling):
        raise InputError(f"loss_scaling must be a LossScaling, True, False or None, got "
                         f"{type(loss_scaling).__name__}",
                         where="plan.runner(..., loss_scaling=...)",
                         fix="shardfx.LossScaling(init_scale=2**16, growth_interval=2000)")
    return LossScaler(loss_scaling)


def seed(scaler: LossScaler | None) -> float:
    """What the backward starts from, times the runner's own factor: the scale, or 1."""
    return 1.0 if scaler is None else scaler.scale
