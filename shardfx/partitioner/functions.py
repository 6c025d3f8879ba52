"""Custom ``torch.autograd.Function``s keep their own backward through capture.

torch.export's non-strict trace runs a Function's ``forward`` like any other code and records
its ATen ops: the user's ``backward`` is gone from the exported program, and the joint trace
differentiates the forward's ops instead. For a straight-through estimator (``round`` forward,
identity backward) that is a gradient of exactly 0; for Hugging Face PhiMoE's router
(``PhimoeMultiplier``) a different gradient. Silently.

While shardfx traces, ``Function.apply`` is routed through one carrier op,
``shardfx::autograd_function(tensors, key)``, so the exported program holds each call as one
node. ``key`` indexes a ``Call`` kept for the trace: the Function's class and the call's
non-tensor arguments. The op has no kernel below autograd: its Autograd kernel calls the
user's own ``Function.apply``. So in the joint trace (``aot_export_joint_with_descriptors``,
which runs the exported program under autograd) the Function's forward ops are traced into
the forward and, when autograd differentiates, the user's ``backward`` ops into the backward,
exactly as eager autograd would run them. The carrier op never reaches the IR.

Two torch Functions are special:
- ``torch.utils.checkpoint``'s reentrant ``CheckpointFunction`` runs its function under
  ``no_grad`` and recomputes it in the backward with ``torch.autograd.backward``; traced, that
  is a forward without gradients. Checkpointing changes what is kept, not what is computed,
  and what to keep is shardfx's own decision (``remat``): the function is traced as plainly
  called, with the same gradients. (When no input of the region needs a gradient, eager's
  reentrant checkpoint gives the region's parameters none, and torch warns; the trace keeps
  that.)
- A Function that changes an input in place (``ctx.mark_dirty``), or takes a module as an
  argument (its parameters are not the traced program's), is refused, naming the Function and
  its file:line: the carrier op is functional, and later readers of that input would not see
  the change. So is any Function whose forward or backward fails to trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from shardfx.errors import CaptureError

_LIB = torch.library.Library("shardfx", "FRAGMENT")
_LIB.define("autograd_function(Tensor[] tensors, int key) -> Tensor[]")
OP = torch.ops.shardfx.autograd_function.default


@dataclasses.dataclass
class Call:
    """One ``Function.apply`` call met while tracing: what the carrier op needs to call it
    again on the traced tensors."""

    function: type  # the torch.autograd.Function subclass
    spec: pytree.TreeSpec  # of (args, kwargs)
    leaves: list  # the flattened (args, kwargs), None where a tensor goes
    tensor_at: list[int]  # which leaves are the tensors, in the op's order
    out_spec: pytree.TreeSpec | None = None  # of what apply returned (after its first run)
    out_tensor_at: list[int] | None = None  # which of those leaves are tensors
    out_leaves: list | None = None  # the non-tensor leaves apply returned

    def arguments(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The user's ``apply`` on ``tensors``; the tensors it returns, in order."""
        args, kwargs = self.arguments(tensors)
        versions = [t._version for t in tensors]
        out = _APPLY.__func__(self.function, *args, **kwargs)
        if [t._version for t in tensors] != versions:
            raise _refuse_in_place(self.function)
        leaves, spec = pytree.tree_flatten(out)
        at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        if self.out_spec is None:
            self.out_spec, self.out_tensor_at, self.out_leaves = spec, at, leaves
        # The op's outputs must not alias its inputs (an identity forward returns its input).
        ins = {id(t) for t in tensors}
        return [leaves[i].clone() if id(leaves[i]) in ins else leaves[i] for i in at]

    def result(self, tensors: list[torch.Tensor]) -> Any:
        """What ``apply`` returned, with the op's output ``tensors`` in their places."""
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_tensor_at, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.out_spec)


_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod itself
_CALLS: list[Call] = []  # while tracing: the calls met, by key
_ROUTING = [False]  # while tracing: Function.apply goes through the carrier op


def _autograd_kernel(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """The carrier op above autograd: the user's Function, forward and backward."""
    call = _CALLS[key]
    try:
        with _direct():
            return call.run(list(tensors))
    except CaptureError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise CaptureError(
            f"the autograd.Function {call.function.__qualname__} could not be traced with its "
            f"own backward: {type(e).__name__}: {first}", where=_where(call.function),
            fix="pass every tensor its forward reads as an argument of apply (not inside a "
                "module or a closure), and keep its forward to tensor ops") from e


_LIB.impl("autograd_function", _autograd_kernel, "Autograd")
_LIB.impl("autograd_function", _autograd_kernel, "CompositeExplicitAutograd")


@contextlib.contextmanager
def _direct() -> Iterator[None]:
    """Within: ``Function.apply`` is the user's, not routed (a Function called inside a
    Function's forward runs as it does in eager)."""
    was, _ROUTING[0] = _ROUTING[0], False
    try:
        yield
    finally:
        _ROUTING[0] = was


def _routed_apply(cls, *args, **kwargs):
    if not _ROUTING[0]:
        return _APPLY.__func__(cls, *args, **kwargs)
    if cls is CheckpointFunction:  # (run_function, preserve_rng_state, *args)
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[2:]):
            return args[0](*args[2:])
        with torch.no_grad():  # no input needs a gradient: eager's region trains nothing
            return args[0](*args[2:])  # (torch warns), and its output needs none
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if modules := [type(v).__name__ for v in leaves if isinstance(v, torch.nn.Module)]:
        raise CaptureError(
            f"the autograd.Function {cls.__qualname__} takes a module ({modules[0]}) as an "
            "argument: the tensors it reads inside are not the traced program's, so its own "
            "backward cannot be kept", where=_where(cls),
            fix="pass the module's parameters to apply as tensors (e.g. F.apply(x, "
                "layer.weight, layer.bias)) and compute with them, or use torch.utils.checkpoint "
                "for recomputation")
    tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if not tensor_at:
        with _direct():
            return _APPLY.__func__(cls, *args, **kwargs)
    call = Call(cls, spec, [None if i in tensor_at else v for i, v in enumerate(leaves)],
                tensor_at)
    _CALLS.append(call)
    outs = OP([leaves[i] for i in tensor_at], len(_CALLS) - 1)
    return call.result(list(outs))


@contextlib.contextmanager
def routed_through_carrier() -> Iterator[None]:
    """Within (export, then the joint trace): every ``torch.autograd.Function.apply`` is one
    carrier-op node, run as the user's Function in the joint trace."""
    torch.autograd.Function.apply = classmethod(_routed_apply)
    _ROUTING[0] = True
    try:
        yield
    finally:
        _ROUTING[0] = False
        torch.autograd.Function.apply = _APPLY
        _CALLS.clear()


def _where(function: type) -> str:
    """``file:line`` of a Function class, for messages."""
    try:
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]} " \
               f"({function.__qualname__})"
    except (OSError, TypeError):
        return function.__qualname__


def _refuse_in_place(function: type) -> CaptureError:
    return CaptureError(
        f"the autograd.Function {function.__qualname__} changes one of its inputs in place "
        "(ctx.mark_dirty): shardfx cannot keep that Function's own backward",
        where=_where(function),
        fix="return a new tensor from its forward instead of writing into the input")
