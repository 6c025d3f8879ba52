"""``runner.save(path)`` / ``runner.load(path)``: a runner's training state as a distributed
checkpoint (``runtime.checkpoint``), each rank writing what it holds, loadable on any mesh.

What is saved, by key:

    model/<fqn>            every tensor of the model's ``state_dict`` (a tied weight under each
                           of its names), as this rank's box of it: its tp shard, or under
                           ZeRO-3 its rows of that; a pipeline rank, its stages' tensors
    optim/<fqn>/<name>     each tensor of the optimizer's state of a parameter (Adam's
                           ``exp_avg``, ``exp_avg_sq``: boxed as the rows the optimizer steps;
                           a 0-d ``step``: whole)

and, in the checkpoint's meta: the steps taken (``runner.step_count``), the dropout stream's
seed, the loss scaler's state, the optimizer's class and hyperparameters, the mesh and the
caller's own entries (``shardfx run``'s data position). A box only says where its values sit
in the whole tensor, so a runner on another mesh (dp, tp, pp, ZeRO stage) reads the parts it
holds from whatever boxes were written; ``checkpoint.full_state_dict(path)`` gives plain
PyTorch the model's ``state_dict``.

Loading into an optimizer that has not stepped yet first makes its state (a step with zero
gradients at learning rate 0, which changes no parameter), so there are tensors to fill. The
optimizer's hyperparameters are the runner's own: where the checkpoint's differ (another
``--lr``) a warning says which are kept; another optimizer class is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from shardfx.ir import strided
from shardfx.errors import InputError, path_arg
from shardfx.runtime import checkpoint, nonfinite
from shardfx.runtime.checkpoint import Box

log = logging.getLogger("shardfx.checkpoint")


@dataclass(frozen=True)
class Parts:
    """A strided split (``shardfx.ir.strided``) of dim ``dim``: the rank's slices of ``k`` parts
    of ``m`` each, the first at ``base`` in the whole tensor, the next ones ``stride`` apart."""

    dim: int
    k: int
    m: int
    stride: int
    base: int


@dataclass(frozen=True)
class Held:
    """What a rank holds of one tensor: ``tensor``, whose first ``rows`` rows (all, if None)
    sit at ``offsets`` in the whole tensor; the rest, ZeRO's padding. Under a strided split
    (``parts``) the rows are not one rectangle of the whole tensor but one per part."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    rows: int | None = None
    parts: Parts | None = None

    def box(self, like: torch.Tensor, shape: tuple[int, ...]) -> Box | None:
        """``like`` (the tensor itself, or optimizer state shaped as it), boxed in the whole
        tensor of ``shape``; None when this rank holds none of it."""
        values = like.detach()
        if self.rows is not None:
            if self.rows == 0:
                return None
            values = values[:self.rows] if shape else values.reshape(())
        if self.parts is None:
            return Box.of(values, shape, self.offsets)
        return Box.of(values, shape, self.offsets, (self.parts.dim, self._pieces(values)))

    def regions(self, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, tuple[slice, ...]]]:
        """(a view of ``tensor``, the region of the whole tensor of ``shape`` it holds) for
        each rectangle this rank holds (none, one, or a strided split's parts)."""
        box = self.box(self.tensor, shape)
        if box is None:
            return []
        pieces = box.pieces or ((box.offsets, box.local()),)
        return [(view, tuple(slice(o, o + n) for o, n in zip(at, view.shape)))
                for at, view in pieces if view.numel()]

    def _pieces(self, values: torch.Tensor) -> list[tuple[int, int, tuple[int, ...]]]:
        """(start in ``values``, length, offsets in the whole tensor) along the strided dim,
        a rectangle per part ``values`` reaches (ZeRO's rows may start or end inside one)."""
        p = self.parts
        first = self.offsets[p.dim] - p.base  # ZeRO's rows: where in the tp shard they start
        n = values.shape[p.dim]
        out = []
        for j in range(p.k):
            lo, hi = max(first, j * p.m), min(first + n, (j + 1) * p.m)
            if lo < hi:
                at = list(self.offsets)
                at[p.dim] = p.base + j * p.stride + lo - j * p.m
                out.append((lo - first, hi - lo, tuple(at)))
        return out


def offsets(local_shape, placements, axes, coord: dict[str, int]) -> tuple[int, ...]:
    """Where a tp shard (``placements`` over ``axes``, this rank at ``coord``) starts in the
    whole tensor (under a strided split, its slice of the first part: ``parts``)."""
    out = [0] * len(local_shape)
    for (axis, _), p in zip(axes, placements):
        dim = getattr(p, "dim", None)
        if dim is not None:
            out[dim] += coord[axis] * local_shape[dim] // strided.factor(p)
    return tuple(out)


def parts(local_shape, placements, axes, coord: dict[str, int]) -> Parts | None:
    """The strided split of a tp shard (``offsets``), if it has one."""
    for (axis, n), p in zip(axes, placements):
        k = strided.factor(p)
        if k > 1:
            m = local_shape[p.dim] // k
            return Parts(p.dim, k, m, m * n, coord[axis] * m)
    return None


def zero_held(rows: torch.Tensor, z, index: int, tp_offsets: tuple[int, ...],
              tp_parts: Parts | None = None) -> Held:
    """ZeRO rows (layout ``z``, dp rank ``index``) of a tensor whose tp shard is at
    ``tp_offsets`` (``tp_parts``: its strided split)."""
    start = list(tp_offsets) or [0]
    start[0] += index * z.per_rank
    return Held(rows, tuple(start[:len(tp_offsets)]), z.held_rows(index), tp_parts)


def state(runner, made: bool = True) -> dict[str, torch.Tensor]:
    """This rank's checkpoint state: key -> Box or whole tensor. ``made=False``: a meta model's
    weights as they are, maybe not made yet (a load fills them)."""
    plan = runner.plan
    model, stepped = runner.holdings(made=made)
    out: dict[str, torch.Tensor] = {}
    for fqn in plan.state_names:
        held = model.get(plan.canonical(fqn))
        if held is not None and (box := held.box(held.tensor, plan.state_shapes[fqn])) is not None:
            out[f"model/{fqn}"] = box
    opt = runner.optimizer
    if opt is not None:
        for fqn, (param, held) in stepped.items():
            for name, value in opt.state.get(param, {}).items():
                key = f"optim/{fqn}/{name}"
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    out[key] = value
                elif value.shape == param.shape:
                    if (box := held.box(value, plan.state_shapes[fqn])) is not None:
                        out[key] = box
                else:
                    raise InputError(
                        f"the optimizer keeps {name} of {fqn} as {list(value.shape)}, neither "
                        f"a scalar nor shaped as the parameter {list(param.shape)}: shardfx "
                        "cannot say which part of it a rank holds",
                        where=f"runner.save, {type(opt).__name__}",
                        fix="checkpoint with an elementwise optimizer (SGD, Adam, AdamW)")
    return out


def save(runner, path, extra: dict[str, Any] | None = None):
    """Write ``runner``'s state to ``path`` (every rank; all or nothing)."""
    path = path_arg(path, "runner.save", 'runner.save("ckpt/step-100")')
    tensors = state(runner)
    opt = runner.optimizer
    meta = {
        "step": runner.step_count,
        "seed": int(runner.rng_seed),
        "mesh": str(runner.plan.mesh),
        "zero": runner.plan.options.zero,
        "loss_scaler": None if runner.loss_scaler is None else runner.loss_scaler.state_dict(),
        "optimizer": None if opt is None else {
            "class": type(opt).__name__, "hyperparameters": _hyperparameters(opt)},
        **(extra or {}),
    }
    return checkpoint.save(path, tensors, meta)


def load(runner, path, allow_nonfinite: bool = False) -> dict[str, Any]:
    """Fill ``runner`` from the checkpoint at ``path`` (every rank); returns its meta. The
    checkpoint is checked before anything is made (``checkpoint.check``; its data files' bytes
    against their checksums as ``checkpoint.load`` reads them), and the parameters and
    optimizer state it filled for NaN and Inf (``nonfinite``) unless ``allow_nonfinite``."""
    path = path_arg(path, "runner.load", 'runner.load("ckpt/step-100")')
    meta = checkpoint.check(path, contents=False)
    if "step" not in meta:
        raise InputError(f"{path} is a shardfx checkpoint, but not one runner.save wrote (its "
                         "meta has no step)", where=f"runner.load({str(path)!r})",
                         fix="load a directory runner.save wrote; a checkpoint.save of your own "
                             "state loads with checkpoint.load")
    opt = runner.optimizer
    _check_optimizer(opt, meta.get("optimizer"), path)
    if opt is not None:
        _make_state(runner)
    filled = state(runner, made=False)
    meta = checkpoint.load(path, filled, strict_optim=opt is not None)
    runner.unmade.filled()  # every model tensor was in it (checkpoint.check_keys)
    if not allow_nonfinite:
        params = {n for n, _ in runner.plan.model.named_parameters(remove_duplicate=False)}
        looked = ((k.removeprefix("model/"), v.local() if isinstance(v, Box) else v)
                  for k, v in filled.items()
                  if k.startswith("optim/") or k.removeprefix("model/") in params)
        nonfinite.refuse(nonfinite.found_in(looked), f"the checkpoint {path}",
                         f"runner.load({str(path)!r})",
                         fix="resume from a checkpoint saved before the run diverged (an "
                             "earlier step)")
    runner.step_count = meta["step"]  # a whole number >= 0 (checkpoint_files.META)
    runner.rng_seed = meta.get("seed", runner.rng_seed)
    if runner.loss_scaler is not None and meta.get("loss_scaler"):
        runner.loss_scaler.load_state_dict(meta["loss_scaler"])
    return meta


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params" and
             isinstance(v, (int, float, bool, str, tuple, type(None)))}
            for group in opt.param_groups]


def _check_optimizer(opt, saved: dict | None, path) -> None:
    """Another optimizer class is an error; other hyperparameters a warning (the runner's kept)."""
    if opt is None or saved is None:
        return
    if saved["class"] != type(opt).__name__:
        raise InputError(f"the checkpoint's optimizer state is {saved['class']}'s; this runner's "
                         f"optimizer is {type(opt).__name__}", where=f"runner.load({str(path)!r})",
                         fix=f"build the runner with {saved['class']} to resume, or load the "
                             "model alone: checkpoint.full_state_dict(path) into the model")
    now = _hyperparameters(opt)
    for i, (a, b) in enumerate(zip(saved["hyperparameters"], now)):
        differ = {k: (a[k], b[k]) for k in a.keys() & b.keys() if list(_flat(a[k])) !=
                  list(_flat(b[k]))}
        if differ and _first_rank():  # every rank resumes the same: said once
            log.warning("resuming from %s: param group %d's %s differ from the checkpoint's; "
                        "keeping this run's (the optimizer's state, the step and the data "
                        "position come from the checkpoint)", path, i,
                        ", ".join(f"{k} {_short(old)} -> {_short(new)}"
                                  for k, (old, new) in sorted(differ.items())))


def _first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _short(v) -> str:
    """A hyperparameter as a person reads it: floats to 4 significant digits."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_short(x) for x in v) + ")"
    return repr(v)


def _flat(v):
    return v if isinstance(v, (list, tuple)) else [v]


def _make_state(runner) -> None:
    """Give an optimizer that has not stepped its state: one step of zero gradients at learning
    rate 0 (no parameter moves: Adam's update and weight decay are both scaled by it)."""
    opt = runner.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p in opt.state and opt.state[p] for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, g in zip(params, grads):
        p.grad = g
