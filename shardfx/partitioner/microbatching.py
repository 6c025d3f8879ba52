"""Whether a training step may run microbatch by microbatch, and how the losses combine.

A pipeline runs the model and ``loss_fn`` on slices of the batch (``microbatches``, times the
``dp`` replicas of the pipeline) and combines the slices' losses and gradients. That equals
the one-device step only if

- the forward treats rows independently: an op that mixes rows (BatchNorm in training mode:
  statistics over the batch) sees a slice's rows only. ``check_rows_independent`` rejects it,
  naming the op and module.
- the batch loss is the mean of the slices' losses (``reduction="mean"``: the runner averages)
  or their sum (``reduction="sum"``: the runner adds). ``loss_reduction`` finds which by
  running ``loss_fn`` on random outputs of the model's output shapes, one row per slice, with
  the example targets' first rows (stand-ins of their shapes when they are on the meta
  device): whole vs sliced. A loss that is neither (a mean over the tokens not ignored, when
  slices ignore different numbers of tokens) is rejected.

Before tracing, ``check_slices`` checks the batch divides into the slices (naming what the user
passed: microbatches and dp), and ``check_one_row`` that a BatchNorm in training mode does not
get a slice of a single row.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.errors import InputError, LossError, PipelineError
from shardfx.ir import meta as M

log = logging.getLogger("shardfx.microbatching")

ROWS = 2  # slices of one row each that the loss is tried on
MAX_ELEMENTS = 1 << 26  # larger model outputs are not tried (the check allocates them)

# ATen ops whose result depends on other rows of the batch when their ``training`` is set.
_BATCH_STATS = {"_native_batch_norm_legit_functional", "_native_batch_norm_legit",
                "native_batch_norm"}


def check_rows_independent(gm: fx.GraphModule, slices: int) -> None:
    """Requires: PHASE on ops (assign_phase). Raises PipelineError at the first forward op that
    computes statistics over the batch in training mode."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get(M.PHASE) is not M.Phase.FORWARD:
            continue
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if name not in _BATCH_STATS:
            continue
        names = [a.name for a in node.target._schema.arguments]  # overloads place it apart
        if node.args[names.index("training")] is not True:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        module = next(reversed(stack.values()), ("", ""))[0] if stack else "?"
        raise PipelineError(
            f"{module or 'the model'} normalizes by statistics over the batch ({name} in "
            f"training mode); the plan runs the batch in {slices} slices, each normalized by "
            "its own rows, which differs from one device", where=f"{node.name} ({module})",
            fix="use microbatches=1 without dp, put the norm in eval mode, or use a per-row "
                "norm (LayerNorm, RMSNorm, GroupNorm)")


def _slices_str(microbatches: int, dp: int) -> str:
    """How the batch is sliced, as the user asked: ``microbatches=2 x dp=2 = 4 slices``."""
    if dp == 1:
        return f"microbatches={microbatches}"
    return f"microbatches={microbatches} x dp={dp} = {microbatches * dp} slices"


def check_slices(args: tuple, targets: tuple, microbatches: int, dp: int) -> None:
    """Every tensor of the batch splits along dim 0 into ``microbatches`` x ``dp`` equal slices
    (``dp``: the replicas of a pipeline, each its own rows; 1 without a pipeline). Other leaves
    are left to ``capture``'s checks."""
    n = microbatches * dp
    if n == 1:
        return
    n_args = len(pytree.tree_leaves(args))
    for i, t in enumerate(pytree.tree_leaves((args, targets))):
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] % n):
            name = f"args[{i}]" if i < n_args else f"targets[{i - n_args}]"
            size = f"batch size {t.shape[0]}" if t.dim() else "no batch dimension (0-dim)"
            raise InputError(
                f"{name} has {size}, which does not split into {_slices_str(microbatches, dp)}",
                where=f"partition(..., microbatches={microbatches}"
                      f"{f', mesh dp={dp}' if dp > 1 else ''})",
                fix=f"use a batch that is a multiple of {n}, or fewer microbatches"
                    f"{' (or dp replicas)' if dp > 1 else ''}")


def check_one_row(model: torch.nn.Module, rows: int, microbatches: int, dp: int) -> None:
    """A BatchNorm in training mode needs more than one value per channel: when the slice the
    plan traces has one row, say so before tracing, naming the module (with a pipeline, a
    ``PipelineError``: batch statistics per microbatch differ from one device in any case)."""
    if rows != 1 or not isinstance(model, torch.nn.Module):
        return
    norms = [(name, type(m).__name__) for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if not norms:
        return
    where = f"{type(model).__name__}.{norms[0][0]} ({norms[0][1]})"
    if microbatches * dp == 1:
        raise InputError(
            "the example batch has one row; BatchNorm in training mode needs more than one value "
            "per channel", where=where,
            fix="plan with a batch of at least 2 rows, or put the norm in eval mode")
    raise PipelineError(
        f"each microbatch has one row (a batch of {microbatches * dp} rows in "
        f"{_slices_str(microbatches, dp)}); BatchNorm in training mode needs more than one "
        "value per channel, and computes its statistics over a microbatch's rows, not the "
        "batch's", where=where,
        fix="put the norm in eval mode or use a per-row norm (LayerNorm, RMSNorm, GroupNorm); or "
            "use microbatches=1 without dp")


def loss_reduction(loss_fn: Callable, output: tuple[list, pytree.TreeSpec] | None,
                   targets: tuple, slices: int) -> str:
    """"mean" or "sum": how the whole batch's loss follows from the slices' (see above).
    ``output``: the model output of one slice as traced (`output_of`); ``targets``: the whole
    batch's."""
    if output is None or slices == 1:
        return "mean"
    leaves, spec = output
    tensors = [x for x in leaves if isinstance(x, tuple)]
    rows = tensors[0][0][0] if tensors and tensors[0][0] else 0  # one slice's batch, as traced
    why = None
    if not tensors or any(len(shape) == 0 or shape[0] != rows for shape, _ in tensors):
        why = "the model output is not batch-first"
    elif any(t.dim() == 0 or t.shape[0] != rows * slices for t in pytree.tree_leaves(targets)):
        why = "a target is not batch-first"
    elif sum(ROWS * _numel(shape[1:]) for shape, _ in tensors) > MAX_ELEMENTS:
        why = "the model output is too large to try"
    if why:
        log.warning("%s: assuming loss_fn is a mean over the %d slices of the batch", why, slices)
        return "mean"
    g = torch.Generator().manual_seed(0)
    targets, device = _real(targets, g)
    samples = [[_random((1, *x[0][1:]), x[1], g).to(device) if isinstance(x, tuple) else x
                for x in leaves] for _ in range(ROWS)]
    whole = _loss(loss_fn, [torch.cat(ls) if isinstance(ls[0], torch.Tensor) else ls[0]
                            for ls in zip(*samples)], spec, targets, slice(0, ROWS))
    parts = [_loss(loss_fn, r, spec, targets, slice(i, i + 1)) for i, r in enumerate(samples)]
    for name, combined in (("mean", sum(parts) / ROWS), ("sum", sum(parts))):
        if torch.allclose(whole, combined, rtol=1e-4, atol=1e-6):
            return name
    raise LossError(
        f"loss_fn of the batch ({whole.item():.6g}) is neither the mean "
        f"({sum(parts).item() / ROWS:.6g}) nor the sum ({sum(parts).item():.6g}) of its slices' "
        "losses, so a pipeline's microbatches cannot reproduce it (a mean over non-ignored "
        "tokens is one such loss)", where="loss_fn",
        fix="use a loss that is a mean or a sum over rows (e.g. normalize by a fixed token "
            "count), or microbatches=1 without dp")


def _loss(loss_fn: Callable, leaves: list, spec: pytree.TreeSpec, targets: tuple,
          rows: slice) -> torch.Tensor:
    sliced = pytree.tree_map_only(torch.Tensor, lambda t: t[rows], targets)
    with torch.no_grad():
        return loss_fn(pytree.tree_unflatten(leaves, spec), *sliced).detach().double()


def _real(targets: tuple, g: torch.Generator) -> tuple[tuple, torch.device]:
    """The targets the check runs on, and the device of the outputs it makes: targets on the
    meta device (a model planned without memory) have no values, so stand-ins of their shapes
    take their place on CPU: zeros for integer targets (a valid class index of any loss),
    random values for floating ones."""
    leaves = [t for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    if not any(t.is_meta for t in leaves):
        return targets, next((t.device for t in leaves), torch.device("cpu"))
    log.info("targets on the meta device: the loss reduction is checked on stand-in targets")
    return pytree.tree_map_only(
        torch.Tensor, lambda t: _random(tuple(t.shape), t.dtype, g) if t.is_meta else t.cpu(),
        targets), torch.device("cpu")


def _random(shape: tuple, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def output_of(value: Any) -> tuple[list, pytree.TreeSpec]:
    """A model output seen while tracing: its leaves, each tensor as (shape, dtype), and its
    structure."""
    leaves, spec = pytree.tree_flatten(value)
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
            for t in leaves], spec
