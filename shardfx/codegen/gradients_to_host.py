"""Optimizer offload's gradients: each block's gradients handed to host memory where they are
final, and let go of on the device.

With ``partition(..., offload_optimizer=True)`` what the optimizer steps (its own copy of this
rank's parameters, or ZeRO's rows of them) and the optimizer's state live in host memory, and
the optimizer steps there (``runtime.offload``). The program then returns no gradient: it
hands each group of them (a repeated block's, ``model.layers.3.*``, split where they are in two
buckets; any other parameter alone: ``codegen.step_in_backward.hook_gradients``) to
``gradients_to_host(names, *grads)`` as soon as the last of them is final (its bucket's
reduction waited for, one bucket left in flight behind the backward's compute), and the op
hands them to the receiver the runner installs around the program (``receiving``), which
copies them into their host gradients (adding to an earlier accumulated batch's). After the op
nothing on the device reads them, so they go: at most the gradients of the blocks whose
backward is under way exist on the device at once, as with ``optimizer_in_backward``, but the
step itself waits for every gradient (clipping by the global norm, fp16's loss scaling and
gradient accumulation all work as without offload).

``workspace``: the device bytes the receiver allocates while it copies them: ZeRO-1 cuts this
rank's rows from each whole gradient first (``runtime.zero.ZeroRows.grad``), which the memory
model counts at the op.

Requires: the generated program (one device, or a dp/tp mesh after ``codegen.bucketing`` and
the ZeRO passes), its outputs' roles.
Ensures: every gradient output is None; per group of gradients, one ``gradients_to_host`` after
the last of them; each bucket's wait moved as ``wait_one_behind`` moves it; nothing else
changed.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch.fx as fx

from shardfx.codegen.step_in_backward import hook_gradients
from shardfx.errors import InputError
from shardfx.ir import meta as M

_receiver: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("receiver",
                                                                           default=None)


def gradients_to_host(workspace: int, names: tuple[str, ...], *grads) -> None:
    """Hand the gradients ``grads`` of the parameters ``names`` to the receiver the runner
    installed (module docstring)."""
    receiver = _receiver.get()
    if receiver is None:
        raise InputError("this program hands its gradients to the host, and no runner "
                         "installed a receiver", where="a plan made with "
                         "partition(..., offload_optimizer=True)",
                         fix="run it with plan.runner(optimizer)")
    receiver(names, grads)


gradients_to_host.workspace = lambda workspace, names, *grads: workspace  # memory model
gradients_to_host.moves_to_host = True  # the memory model: these gradients are the host's


@contextlib.contextmanager
def receiving(receiver: Callable[[tuple, tuple], None]):
    """Within: ``gradients_to_host`` calls ``receiver(names, grads)``."""
    token = _receiver.set(receiver)
    try:
        yield
    finally:
        _receiver.reset(token)


def send_gradients_to_host(module: fx.GraphModule, outputs: tuple[M.OutputRole, ...],
                           inputs: tuple[M.InputRole, ...],
                           workspace: Callable[[list[tuple[str, fx.Node]]], int]) -> int:
    """Rewrite ``module``'s graph (module docstring); returns how many ``gradients_to_host``
    it has. ``workspace(params)``: the device bytes receiving the gradients of the parameters
    ``(FQN, placeholder)`` allocates."""
    def hand(names: tuple[str, ...], grads: list[fx.Node], params: list[tuple[str, fx.Node]]):
        return gradients_to_host, (workspace(params), names, *grads)

    return hook_gradients(module, outputs, inputs, hand, after_readers=False)
