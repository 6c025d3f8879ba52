"""Tracing a model that lives on the meta device or a GPU as if it lived on the CPU.

Users plan big models without memory: ``with torch.device("meta"): model = Llama(config)``.
Tracing meta tensors as they are goes wrong in two ways on torch 2.13:

- the joint trace loses gradients. torch registers its Python reference of some composite ops
  (``nll_loss``, hence ``F.cross_entropy``) as their *Meta* kernel; under the Python dispatcher
  that aot_autograd traces with, a Meta kernel makes the op look like a backend op, its
  composite autograd is skipped and autograd's "not implemented" fallback records no backward:
  a training graph with no gradients at all.
- the graph is the meta device's: factory ops inside ``forward`` (``arange`` for positions, the
  causal mask) are recorded with ``device=meta``, and the plan could not run once the model is
  materialized.

So when any parameter, buffer or example input is on meta (or on a GPU), every one of them is
swapped for a ``FakeTensor`` that reports the CPU, all in one ``FakeTensorMode`` that
``torch.export`` and aot_autograd then trace with. The trace is the very graph a model on the
CPU gives, and no memory is touched: one IR whatever device the model sits on, its
device-specific kernels (fused attention) the CPU's, which ``kernels.device.place`` turns into
the plan's device's. The model is restored on exit: the user's module keeps its tensors.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

log = logging.getLogger("shardfx.capture")


def run_device(model: torch.nn.Module, example: tuple) -> torch.device | None:
    """The device a trace of ``model`` on ``example`` is made on: the CPU, whatever device the
    tensors are on, so every model has one IR (the CPU's spelling of device-specific kernels,
    fused attention's above all, which ``kernels.device.place`` turns into the plan's
    device's). None when every tensor is on the CPU already (trace them as they are)."""
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor))]
    if all(t.device.type == "cpu" for t in tensors):
        return None
    return torch.device("cpu")


def traced_as(model: torch.nn.Module, example: tuple, device: torch.device):
    """Within: ``model``'s parameters and buffers are fake tensors on ``device`` (shapes,
    dtypes and ``requires_grad`` kept; one fake per distinct tensor, so tied weights stay tied);
    yields ``example`` made of fakes of the same mode. Restores the model's tensors on exit."""
    mode = FakeTensorMode()
    log.info("%s: tracing the model as on %s", type(model).__name__, device)
    return swapped(model, example, lambda t: mode.fake_tensor_converter.from_meta_and_device(
        mode, t.detach() if t.is_meta else torch.empty_like(t, device="meta"), device))


def on_meta(model: torch.nn.Module, example: tuple):
    """Within: ``model``'s parameters and buffers are meta tensors, and so is the yielded
    ``example``: the model runs forward for its shapes only, at the speed of meta kernels."""
    return swapped(model, example, lambda t: t.detach() if t.is_meta else
                   torch.empty_like(t, device="meta"))


@contextlib.contextmanager
def swapped(model: torch.nn.Module, example: tuple, convert) -> Iterator[tuple]:
    """Within: every parameter and buffer of ``model`` is ``convert(t)`` (one per distinct
    tensor, so tied weights stay tied; a parameter stays a Parameter with its
    ``requires_grad``); yields ``example`` converted. Restores the model's tensors on exit."""
    converted: dict[int, torch.Tensor] = {}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in converted:
            converted[id(t)] = convert(t)
        return converted[id(t)]

    params: dict[int, torch.nn.Parameter] = {}

    def param(p: torch.Tensor) -> torch.nn.Parameter:
        if id(p) not in params:
            params[id(p)] = torch.nn.Parameter(tensor(p), requires_grad=p.requires_grad)
        return params[id(p)]

    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for slots, swap in ((module._parameters, param), (module._buffers, tensor)):
                for name, t in list(slots.items()):
                    if t is not None:
                        saved.append((slots, name, t))
                        slots[name] = swap(t)
        yield pytree.tree_map_only(torch.Tensor, tensor, example)
    finally:
        for slots, name, t in reversed(saved):
            slots[name] = t
