"""Optimizer offload (``partition(..., offload_optimizer=True)``): the optimizer's state, its
step, and what it steps, in host memory.

    plan = shardfx.partition(model, args, loss_fn, targets, mesh={"dp": 2}, zero=2,
                             offload_optimizer=True)
    runner = plan.runner(lambda ps: torch.optim.AdamW(ps, lr=3e-4))  # ps: host tensors

A training step's device memory is the parameters, the activations, the gradients and the
optimizer's state; AdamW's state alone is twice the parameters in fp32. Offloaded, the runner
keeps on the host, per tensor it steps (this rank's parameters, its tp shards; under ZeRO its
rows of them):

- a copy in its own dtype, what the user's optimizer is made over (``Offload.masters``), which
  ``runner.parameters()`` returns and a checkpoint's optimizer state is keyed by;
- its gradient (``.grad`` of that copy), which the program sends block by block as each is
  final (``codegen.gradients_to_host``: ``receive`` copies it in, adding to an accumulated
  batch's), so the device lets it go at once;
- the optimizer's state, made by the optimizer itself next to what it steps.

After the program, every gradient is on the host: the runner unscales, clips and steps there
(``runtime.optimizer_step``, torch's CPU optimizers: AdamW fused), then ``push`` copies the
updated values into the device's tensors, which ZeRO-1/2 then gather as without offload. On
CUDA the host tensors are pinned and the copies run on a stream of their own, the device's
compute waiting only where it reads what they write; the gradients' device memory is kept
until their copy is done (``record_stream``).

Where "device" and host are one memory (a CPU run), the host's tensors are still counted
apart: every storage made by the code here runs under ``kernels.host_copy.on_host``, so
``measured_peak`` reports the device's peak without them and the host's beside it (the
separate pool the memory model predicts: ``estimate.memory``'s ``host``).

When the device's tensors change other than by a step (a load, a state dict, a meta model's
first use), the host's copies are filled from them again before the next step (``stale``).
"""

from __future__ import annotations

import contextlib

import torch

from shardfx.errors import InputError
from shardfx.kernels.host_copy import on_host


class Offload:
    def __init__(self, stepped: dict[str, torch.Tensor], device: torch.device):
        """``stepped``: FQN -> the device tensor the optimizer would step (a parameter, or
        ZeRO's rows of one): each gets a host copy of its shape and dtype, filled on ``pull``."""
        self.device = device
        self._pinned = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._pinned else None
        with on_host():
            self.masters = {name: torch.nn.Parameter(self._empty(t), t.requires_grad)
                            for name, t in stepped.items()}
        self.stale = True  # the host's copies are to be filled from the device's

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pinned)

    def pull(self, stepped: dict[str, torch.Tensor]) -> None:
        """The host's copies from the device's tensors ``stepped`` (when ``stale``)."""
        if not self.stale:
            return
        with torch.no_grad(), on_host():
            for name, master in self.masters.items():
                master.copy_(stepped[name].detach())
        self.stale = False

    def receive(self, name: str, grad: torch.Tensor) -> None:
        """The gradient ``grad`` (on the device) of ``name``'s host copy: copied in, or added
        to the one an earlier accumulated batch left."""
        master = self.masters[name]
        with torch.no_grad(), on_host():
            if master.grad is None:
                master.grad = self._empty(master)
                if self._stream is None:
                    master.grad.copy_(grad)
                    return
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    master.grad.copy_(grad, non_blocking=True)
                grad.record_stream(self._stream)  # its memory is not reused before the copy
            else:
                self.wait()
                master.grad.add_(grad.to("cpu"))

    def wait(self) -> None:
        """Every copy to the host issued so far is done."""
        if self._stream is not None:
            self._stream.synchronize()

    def push(self, stepped: dict[str, torch.Tensor]) -> None:
        """The host's updated copies into the device's tensors ``stepped``; the device's
        compute stream reads them only after the copies."""
        with torch.no_grad():
            if self._stream is None:
                for name, master in self.masters.items():
                    stepped[name].copy_(master)
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for name, master in self.masters.items():
                    stepped[name].copy_(master, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)


@contextlib.contextmanager
def stepping_on_host(offload: Offload | None, stepped: dict[str, torch.Tensor]):
    """Around a runner's ``finish_step``: offloaded, the gradients' copies are waited for, the
    step runs on the host (its temporaries counted there: ``on_host``) and its updates go to
    the device's tensors ``stepped`` after it; else nothing."""
    if offload is None:
        yield
        return
    offload.wait()
    with on_host():
        yield
    offload.push(stepped)


def check(options, train: bool) -> None:
    """``offload_optimizer`` with what it cannot run with: a named error."""
    where = "partition(..., offload_optimizer=True)"
    if not train:
        raise InputError("offload_optimizer=True moves the optimizer's state and step to the "
                         "host, and this plan is for inference (no loss_fn): it has neither",
                         where=f"{where} without loss_fn",
                         fix="drop offload_optimizer, or pass a loss_fn (and its "
                             "example_targets) to plan training")
    if options.optimizer_in_backward:
        raise InputError("offload_optimizer and optimizer_in_backward together: the host steps "
                         "after the backward, once every gradient is there", where=where,
                         fix="one of the two: offload_optimizer moves the state off the device, "
                             "optimizer_in_backward frees each gradient at its step")
    if options.optimizer in (None, "none"):
        raise InputError("offload_optimizer with optimizer=None: there is no state to move",
                         where=where, fix='optimizer="adamw" (or the kind you will pass)')
