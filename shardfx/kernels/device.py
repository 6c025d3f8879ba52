"""Where a plan runs: one device per process, the programs' tensors made there.

    partition(model, args, ..., device=None)   # where this rank's programs run

The device of a plan (``plan.device``) is chosen once, when it is made:

1. ``partition(..., device=...)`` when given;
2. under a process group that talks CUDA (NCCL), ``cuda:LOCAL_RANK``: one GPU per process,
   torchrun's convention (``shardfx.launch`` sets the same variable and device);
3. else the model's device (its first tensor not on meta), else the example inputs', else CPU.

A model traced on one device runs on another: ``place`` rewrites the ``device=`` of every op
that makes a tensor (``arange``, ``full``, a ``_to_copy``) to the plan's device, and the
runners put the weights, the batch slices and every tensor they make there. So a model built
on the CPU (or on meta) and planned on each rank of an NCCL run trains on that rank's GPU,
with CPU batches (each rank moves only its slice).
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.errors import InputError
from shardfx.kernels import attention


def local_device() -> torch.device | None:
    """This process's GPU under a process group that talks CUDA: ``cuda:LOCAL_RANK`` (else
    the current CUDA device); None otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or "nccl" not in str(dist.get_backend()):
        return None
    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    return torch.device("cuda", index)


def collective_device() -> torch.device:
    """Where a tensor of the default group's collectives must be: its GPU under NCCL."""
    return local_device() or torch.device("cpu")


def choose_device(requested, model: torch.nn.Module, example_args) -> torch.device:
    """The plan's device (the module docstring's order); a request this machine cannot meet
    is an InputError."""
    if requested is not None:
        try:
            device = torch.device(requested)
        except (RuntimeError, TypeError) as e:
            raise InputError(f"device={requested!r} is not a device ({e})",
                             where="partition(..., device=...)",
                             fix='e.g. device="cuda", "cuda:1" or "cpu"') from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError(f"device={requested!r}, but CUDA is not available here",
                                 where="partition(..., device=...)",
                                 fix="leave device unset (CPU), or run on a machine with a GPU")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= torch.cuda.device_count():
                raise InputError(f"device={requested!r}, but this machine has "
                                 f"{torch.cuda.device_count()} GPUs",
                                 where="partition(..., device=...)",
                                 fix=f"a device from cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return device
    gpu = local_device()
    if gpu is not None:
        return gpu
    tensors = itertools.chain(model.parameters(), model.buffers(), pytree.tree_leaves(example_args))
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta),
                torch.device("cpu"))


def place(module: fx.GraphModule, device: torch.device) -> int:
    """Make every tensor ``module``'s graph (and its submodules': pipeline parts) creates on
    ``device``: each ``device=`` keyword of an op set to it. Returns how many changed.

    The CPU's attention kernels, which every trace has (``kernels.attention``), become ones
    that run on ``device``.

    Ensures: no node's ``device`` keyword names another device; the ``VAL`` metadata keeps the
    traced device (the memory model and the IR text do not depend on it).
    """
    changed = 0
    for gm in [module, *(m for m in module.modules() if isinstance(m, fx.GraphModule))]:
        lowered = attention.lower(gm, device)
        changed += lowered
        edited = lowered > 0
        for node in gm.graph.nodes:
            dev = node.kwargs.get("device")
            if isinstance(dev, torch.device) and dev != device:
                node.kwargs = {**node.kwargs, "device": device}
                changed += 1
                edited = True
        if edited:
            gm.recompile()
    return changed


def check_weights(model: torch.nn.Module, device: torch.device) -> None:
    """The model's tensors can go to ``device``: each is there, on the CPU (the runner copies
    it) or on meta (the runner makes it: ``runtime.materialize``). One on another accelerator
    would be dragged off it (a model planned on meta, then materialized on a GPU the plan was
    not told of): an InputError naming the tensor and the fix."""
    for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
        where = f"{type(model).__name__}.{fqn}"
        if t.device != device and t.device.type not in ("cpu", "meta"):
            raise InputError(f"{fqn} is on {t.device}; the plan runs on {device}",
                             where=where, fix=f"plan for the model's device: partition(..., "
                             f"device={str(t.device)!r}), or keep the model on the CPU")


def move(model: torch.nn.Module, device: torch.device) -> None:
    """Move ``model``'s parameters and buffers to ``device`` in place, a tied weight once and
    still tied. CPU to CUDA and back keeps the Parameter objects (their data is swapped, as
    ``Module.to`` does), so an optimizer made on them stays valid; to a device whose tensors
    cannot take another's data (meta) each becomes a new Parameter, everywhere it is used."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device == device:
                    continue
                if id(t) not in moved:
                    data = t.detach().to(device)
                    if isinstance(t, torch.nn.Parameter) and \
                            not torch._has_compatible_shallow_copy_type(t, data):
                        moved[id(t)] = torch.nn.Parameter(data, requires_grad=t.requires_grad)
                    elif isinstance(t, torch.nn.Parameter):
                        t.data = data
                        moved[id(t)] = t
                    else:
                        moved[id(t)] = data
                table[name] = moved[id(t)]
