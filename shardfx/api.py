"""``shardfx.partition``: the entry point."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Callable

import torch

from shardfx.cost.device_model import DeviceModel
from shardfx.cost.device_model import device_model as choose_device_model
from shardfx.errors import InputError, MemoryBudgetError, PipelineError
from shardfx.codegen.step_in_backward import check as check_optimizer_in_backward
from shardfx.runtime.offload import check as check_offload_optimizer
from shardfx.cost.optimizer import optimizer_model
from shardfx.mesh import MeshSpec
from shardfx.partitioner.capture import check_model, microbatch
from shardfx.partitioner.microbatching import check_slices
from shardfx.request.options import RECOMPUTE, Options
from shardfx.compiler.driver import deferred_codegen, paused_gc
from shardfx.plan import Plan
from shardfx.request.precision import Precision
from shardfx.kernels.device import choose_device
from shardfx.schedule import GENERATORS, Schedule
from shardfx.compiler.compile import compile_model
from shardfx.request import option_docs

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*")
_SCHEDULE_TEXT = re.compile(r"\s*rank\s+0\b")  # the first line of either text form


def parse_bytes(size: int | float | str | None) -> int | None:
    """``"8GiB"``, ``"512MB"``, ``1 << 30``, ``1.5e9`` -> a positive number of bytes; None: no
    budget."""
    if size is None:
        return None
    where = "partition(..., memory_budget=...)"
    fix = 'give bytes per device as a positive number, or a size like "8GiB" or "512MB"'
    if isinstance(size, str):
        m = _SIZE.fullmatch(size)
        if not m or m[2].upper() not in _UNITS:
            raise InputError(f"cannot read memory size {size!r}", where=where,
                             fix=f"{fix} (units: {', '.join(u for u in _UNITS if u)})")
        value = float(m[1]) * _UNITS[m[2].upper()]
    elif isinstance(size, numbers.Real) and not isinstance(size, bool):
        value = size
    else:
        raise InputError(f"memory_budget must be bytes or a size string, got "
                         f"{type(size).__name__} {size!r}", where=where, fix=fix)
    if not math.isfinite(value) or value < 1:
        raise InputError(f"memory_budget must be a positive number of bytes, got {size!r}",
                         where=where, fix=f"{fix}; None for no budget")
    return int(value)


def _kernels(kernels: str) -> str:
    if kernels not in ("auto", "compiled", "triton", "aten"):
        raise InputError(f"unknown kernels {kernels!r}", where="partition(..., kernels=...)",
                         fix='"auto", "compiled" (each program lowered by Inductor), "triton" '
                             "(on CPU through Triton's interpreter) or \"aten\"")
    return kernels


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}",
                         where=f"partition(..., {name}=...)", fix=f"{name}=True or {name}=False")
    return value


def _recompute(value: object, training: bool) -> str:
    if value not in RECOMPUTE:
        raise InputError(f"recompute must be one of {', '.join(map(repr, RECOMPUTE))}, got "
                         f"{value!r}", where="partition(..., recompute=...)",
                         fix='"selective" (the attention core) or "full" (each block from its '
                             'input), as Megatron and TorchTitan name them; "auto" fits '
                             "memory_budget")
    if value in ("selective", "full") and not training:
        raise InputError(f"recompute={value!r} without a loss_fn: an inference plan has no "
                         "backward to recompute anything in",
                         where="partition(..., recompute=...)",
                         fix="pass loss_fn (and example_targets) to train, or drop recompute")
    return value


def _fused_loss(value: object) -> bool | str:
    if value == "auto":
        return "auto"
    if not isinstance(value, bool):
        raise InputError(f"fused_loss must be True, False or \"auto\", got {value!r}",
                         where="partition(..., fused_loss=...)",
                         fix='fused_loss="auto" (fuse where memory matters), True or False')
    return value


def _zero(zero: object, spec: MeshSpec) -> int | str:
    """``zero`` is a ZeRO stage this mesh can run (``passes.zero``), or "auto": the plan
    chooses the cheapest that fits the memory (``auto.zero_stage``)."""
    where = f"partition(..., zero={zero!r}) on mesh {spec}"
    if zero == "auto":
        return "auto"
    if not isinstance(zero, int) or isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise InputError(f"zero must be 0, 1, 2, 3 or \"auto\", got {zero!r}", where=where,
                         fix="0: replicas keep everything; 1: shard the optimizer state over "
                             "dp; 2: and the gradients; 3: and the parameters; \"auto\": the "
                             "cheapest stage that fits the memory")
    if zero and spec.axis("dp") == 1:
        replicas = spec.axis("dp_replicate") > 1
        why = " (dp_replicate only holds replicas of a dp group)" if replicas else ""
        raise InputError(f"zero={zero} shards over the dp axis, and the mesh has none{why}",
                         where=where, fix="add a dp axis to the mesh (mesh={'dp': 2, ...}"
                         + (": HSDP is {'dp_replicate': R, 'dp': D}" if replicas else "")
                         + "), or drop zero")
    if zero == 3 and spec.axis("pp") > 1:
        raise InputError("zero=3 inside a pipeline is not supported: each stage would gather "
                         "its parameters once per microbatch", where=where,
                         fix="use zero=1 or zero=2 with pp (the optimizer state and gradients "
                             "sharded over dp), or zero=3 without pp")
    return zero


def _check_shard(shard: object, spec: MeshSpec) -> None:
    """``shard="megatron-sp"`` splits the tokens over tp: without a tp axis it would do
    nothing (``shard_annotate.sequence_parallel``)."""
    if shard == "megatron-sp" and spec.axis("tp") == 1:
        raise InputError(
            'shard="megatron-sp" splits the tokens over the tp axis between the parallel '
            "matmuls, and the mesh has no tp axis of more than one device: it would do "
            "nothing",
            where=f'partition(..., shard="megatron-sp") on mesh {spec}',
            fix='add a tp axis to the mesh, e.g. mesh={"tp": 2}, or use shard="megatron" or '
                '"auto"')


def _check_inference_request(loss_fn: Callable | None, zero: object,
                             optimizer_in_backward: object) -> None:
    """Without ``loss_fn`` the plan runs inference: a training setting it would ignore is an
    error. (``zero="auto"``, the default, is 0 there; ``fused_loss`` keeps the ATen ops where
    no cross-entropy follows the head, as in training.)"""
    if loss_fn is not None:
        return
    train = "or pass a loss_fn (and its example_targets) to plan training"
    if zero in (1, 2, 3) and not isinstance(zero, bool):
        raise InputError(f"zero={zero} shards the training state over dp, and this plan is for "
                         "inference (no loss_fn): it has no optimizer state or gradients, and "
                         "would do nothing", where=f"partition(..., zero={zero}) without loss_fn",
                         fix=f"drop zero= (inference keeps the parameters whole), {train}")
    if optimizer_in_backward is True:
        raise InputError("optimizer_in_backward=True steps the optimizer in the backward, and "
                         "this plan is for inference (no loss_fn): it has no backward and no "
                         "optimizer step", where="partition(..., optimizer_in_backward=True) "
                                                "without loss_fn",
                         fix=f"drop optimizer_in_backward, {train}")


def _capacity(factor: object) -> float | None:
    """``capacity_factor`` is None (dropless) or a positive number."""
    if factor is None:
        return None
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or \
            not math.isfinite(factor) or factor <= 0:
        raise InputError(f"capacity_factor must be a positive number or None, got {factor!r}",
                         where=f"partition(..., capacity_factor={factor!r})",
                         fix="e.g. capacity_factor=1.25 (each expert takes up to 1.25x its even "
                             "share of the tokens), or None: dropless, no token dropped")
    return float(factor)


def _check_pipeline_request(spec: MeshSpec, microbatches, schedule, virtual_stages) -> None:
    """``microbatches``, ``schedule`` and ``virtual_stages`` are valid, whatever the mesh: a
    setting the plan would ignore or misread is an error, not a surprise later."""
    for name, value in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise PipelineError(f"{name} must be a positive int, got {value!r}",
                                where=f"partition(..., {name}=...)",
                                fix=f"e.g. {name}=2, or leave it out")
    if spec.axis("pp") > 1 and spec.axis("dp_replicate") > 1:
        raise PipelineError(
            "HSDP (a dp_replicate axis) with a pipeline is not supported: the pipeline runner "
            "reduces its stages' gradients over dp only",
            where=f"partition(..., mesh=...) on mesh {spec}",
            fix=f"fold the replicas into dp (dp={spec.axis('dp_replicate') * spec.axis('dp')}, "
                "with zero=1 or zero=2), or drop pp")
    if isinstance(schedule, Schedule) or (isinstance(schedule, str) and (
            schedule in GENERATORS or _SCHEDULE_TEXT.match(schedule))):
        return
    raise PipelineError(
        f"unknown schedule {schedule!r}", where="partition(..., schedule=...)",
        fix=f"use one of {', '.join(GENERATORS)}, or a Schedule (or its text form: one "
            "'rank r: 0F0 0B0 ...' line per pp rank)")


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
    memory_budget: int | float | str | None = None,
    optimizer: str | None = "adamw",
    precision: str | Precision = "fp32",
    kernels: str = "auto",
    fused_loss: bool | str = "auto",
    zero: int | str = "auto",
    *,
    optimizer_in_backward: bool = False,
    offload_optimizer: bool = False,
    recompute: str = "auto",
    capacity_factor: float | None = None,
    device: str | torch.device | None = None,
    device_model: str | os.PathLike | DeviceModel | None = None,
    debug: bool | None = None,
) -> Plan:
    """Trace ``model`` on ``example_args`` (one global batch) and plan it for ``mesh``.

    With ``loss_fn(model_output, *targets) -> scalar`` the plan trains (forward, loss, backward);
    without, it runs inference. ``SHARDFX_DUMP=dir`` writes ``plan.dump(dir)``, or when planning
    fails, the IR so far and the error. Every setting is checked whatever the mesh: one the plan
    would ignore or misread (an unknown schedule name, ``"megatron-sp"`` without a tp axis,
    ``zero=1-3`` or ``optimizer_in_backward`` without a loss_fn) is an error.

    Options (``request/option_docs.py``, the one text of each):
    """
    check_model(model)  # before anything reads its parameters (choose_device does)
    spec, options = request(model, example_args, loss_fn, mesh, shard, microbatches, schedule,
                            virtual_stages, memory_budget, optimizer, precision, kernels,
                            fused_loss, zero, optimizer_in_backward=optimizer_in_backward,
                            offload_optimizer=offload_optimizer, recompute=recompute,
                            capacity_factor=capacity_factor, device=device,
                            device_model=device_model, debug=debug)
    # The programs run one microbatch at a time: trace on the first microbatch's shapes.
    slices = options.slices
    check_slices(example_args, example_targets, microbatches, slices // microbatches)
    mb_args, mb_targets = microbatch(example_args, example_targets, slices)
    with deferred_codegen(), paused_gc():
        return _plan(model, example_args, loss_fn, example_targets, mb_args, mb_targets, spec,
                     options)


def request(model, example_args, loss_fn, mesh, shard="auto", microbatches=1, schedule="1f1b",
            virtual_stages=None, memory_budget=None, optimizer="adamw", precision="fp32",
            kernels="auto", fused_loss="auto", zero="auto", *, optimizer_in_backward=False,
            offload_optimizer=False, recompute="auto", capacity_factor=None, device=None,
            device_model=None, debug=None) -> tuple[MeshSpec, Options]:
    """``partition``'s arguments checked and resolved into the mesh and ``Options`` the
    compiler takes (``shardfx.search`` plans many requests of one model from them)."""
    spec = MeshSpec.parse(mesh)
    _check_pipeline_request(spec, microbatches, schedule, virtual_stages)
    _check_shard(shard, spec)
    _check_inference_request(loss_fn, zero, optimizer_in_backward)
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    if virtual_stages is None:
        virtual_stages = 2 if schedule == "interleaved-1f1b" else 1
    options = Options(mesh=spec, shard=shard, module_types=types, microbatches=microbatches,
                      schedule=schedule, virtual_stages=virtual_stages,
                      memory_budget=parse_bytes(memory_budget),
                      optimizer=optimizer_model(optimizer).name,
                      precision=Precision.parse(precision), kernels=_kernels(kernels),
                      fused_loss=_fused_loss(fused_loss), zero=_zero(zero, spec),
                      optimizer_in_backward=_flag(optimizer_in_backward,
                                                  "optimizer_in_backward"),
                      offload_optimizer=_flag(offload_optimizer, "offload_optimizer"),
                      recompute=_recompute(recompute, loss_fn is not None),
                      capacity_factor=_capacity(capacity_factor),
                      device=choose_device(device, model, example_args))
    options = dataclasses.replace(options,
                                  device_model=choose_device_model(device_model, options.device))
    if options.optimizer_in_backward:
        check_optimizer_in_backward(options)
    if options.offload_optimizer:
        check_offload_optimizer(options, loss_fn is not None)
    if debug is not None:
        options = dataclasses.replace(options, debug=debug)
    return spec, options


def _folded(args: tuple, spec: MeshSpec, options: Options, error: MemoryBudgetError):
    """Under ``zero="auto"`` on an HSDP mesh, which axis shards is the plan's too: the replicas
    are kept (ZeRO within dp, 1/dp of the gradients all-reduced across them: the least
    traffic on the outer link) unless no stage within dp fits ``memory_budget``; then the plan
    for the same ranks with the replicas folded into dp (ZeRO over all of them), if that fits.
    Else ``error``, the HSDP plan's, with what folding would not fit either."""
    if options.zero != "auto" or spec.axis("dp_replicate") == 1:
        raise error
    folded = spec.folded()
    try:
        return compile_model(*args, folded, dataclasses.replace(options, mesh=folded,
                                                                folded_from=spec))
    except MemoryBudgetError as e:
        least = getattr(e, "least", None)
        lowest = f"its lowest peak is {least.total} bytes" if least is not None else e.cause
        raise MemoryBudgetError(error.cause, where=error.where,
                                fix=f"{error.fix}; with the replicas folded into dp (mesh "
                                    f"{folded}) {lowest}, over the budget too") from None


if partition.__doc__:  # None under python -OO
    partition.__doc__ = partition.__doc__.rstrip(" ") + option_docs.render()

def _plan(model, example_args, loss_fn, example_targets, mb_args, mb_targets, spec: MeshSpec,
          options: Options) -> Plan:
    args = (model, example_args, loss_fn, example_targets, mb_args, mb_targets)
    try:
        compiled = compile_model(*args, spec, options)
    except MemoryBudgetError as e:
        compiled = _folded(args, spec, options, e)
    plan = Plan(model, example_args, compiled)
    if dump := os.environ.get("SHARDFX_DUMP"):
        plan.dump(dump)
    return plan


