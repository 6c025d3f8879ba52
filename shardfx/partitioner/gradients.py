"""A training graph has a gradient for every trainable parameter the loss depends on.

torch can trace a backward that is silently incomplete: an op whose autograd kernel is missing
(a custom op registered without one; torch 2.13's ``nll_loss`` on meta tensors) is
differentiated by autograd's fallback, which only warns and passes no gradient on. A plan
built on such a graph would "train" with some parameters frozen, or none updated at all. Two
checks make it an error instead:

- ``no_silent_backward``: while tracing, that warning is an error naming the op;
- ``check_gradients``: after tracing, where a trainable parameter the program reads has no
  gradient output, eager autograd is asked (the step run eagerly on fake tensors: no memory,
  no arithmetic): a parameter eager would train and the program would not is an error,
  whatever made the trace lose it (code that turns gradients off in a way the exported graph
  does not show, such as an autograd.Function that runs its forward under ``no_grad`` and its
  own backward). One eager gives no gradient either is frozen in both, as it should be: used
  only under ``torch.no_grad()`` or through ``detach``, or given ``None`` by a Function's own
  ``backward`` (eager's "no gradient"), though its value reaches the loss.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Callable, Iterator

import torch
import torch.fx as fx

from shardfx.errors import CaptureError
from shardfx.ir import meta as M

_NO_AUTOGRAD = re.compile(r"(\S+): an autograd kernel was not registered to the Autograd key")


@contextlib.contextmanager
def no_silent_backward(model: torch.nn.Module) -> Iterator[None]:
    """Within: autograd's "no autograd kernel registered" warning raises a CaptureError naming
    the op. Other warnings are passed on as they came."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if m := _NO_AUTOGRAD.search(str(w.message)):
            raise CaptureError(
                f"torch has no backward for {m[1]} here: tracing {type(model).__name__}'s "
                "training step, autograd skipped it and would pass no gradient through it",
                where=f"{m[1]} in {type(model).__name__}'s forward or loss_fn",
                fix="register an autograd formula for that op (torch.library.register_autograd) "
                    "or write that step with differentiable ATen ops")
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def check_gradients(gm: fx.GraphModule, ep: torch.export.ExportedProgram,
                    model: torch.nn.Module, prefix: str,
                    eager_graded: Callable[[], set[str]]) -> None:
    """Requires: ROLE on placeholders, OUTPUTS on the output (capture); ``ep`` the exported
    training callable (its parameters named ``prefix`` + FQN). Where a trainable parameter the
    program reads has no gradient output, raises CaptureError naming the first one that
    ``eager_graded()`` (the parameters eager autograd gives a gradient) has."""
    roles = gm.graph.output_node().meta[M.OUTPUTS]
    graded = {r.name for r in roles if r.kind is M.OutputKind.GRAD}
    traced = {n.removeprefix(prefix) for n in ep.graph_signature.inputs_to_parameters.values()}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if all(name in graded for name in trainable if name in traced):
        return
    eager = eager_graded()
    missing = [name for name in trainable if name in eager and name not in graded]
    if not missing:  # eager gives them none either: frozen in eager as in the program
        return
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise CaptureError(
        f"the traced training step has no gradient for {missing[0]}{more}, although eager "
        f"PyTorch gives it one from the same step ({len(graded)} of the trainable parameters "
        "have one)", where=f"{type(model).__name__}.{missing[0]}",
        fix="if forward uses it under torch.no_grad() or .detach() on purpose, set "
            "requires_grad_(False) on it; otherwise an op on its path has no backward in "
            "torch: write that step with differentiable ops, or report it to shardfx")
