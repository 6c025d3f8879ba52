"""A training graph has a gradient for every trainable parameter the loss depends on.

torch can trace a backward that is silently incomplete: an op whose autograd kernel is missing
(a custom op registered without one; torch 2.13's ``nll_loss`` on meta tensors) is
differentiated by autograd's fallback, which only warns and passes no gradient on. A plan
built on such a graph would "train" with some parameters frozen, or none updated at all. Two
checks make it an error instead:

- ``no_silent_backward``: while tracing, that warning is an error naming the op;
- ``check_gradients``: after tracing, every parameter with ``requires_grad`` whose value reaches
  the loss through floating-point ops has a gradient output. Which parameters reach it is read
  off torch.export's graph, where ``detach`` and ``torch.no_grad()`` regions are still visible
  (the joint graph has neither): a parameter used only there gets no gradient in eager either.
  Where a traced parameter still has no gradient output, eager autograd is asked (the step
  run eagerly on fake tensors: no memory, no arithmetic): a parameter eager would train and
  the program would not is an error too, whatever made the trace lose it (code that turns
  gradients off in a way the exported graph does not show, such as an autograd.Function
  that runs its forward under ``no_grad`` and its own backward).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Callable, Iterator

import torch
import torch.fx as fx
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from shardfx.errors import CaptureError
from shardfx.ir import meta as M

_NO_AUTOGRAD = re.compile(r"(\S+): an autograd kernel was not registered to the Autograd key")
# Ops through which a value reaches the loss without being differentiated.
_NOT_DIFFERENTIATED = {torch.ops.aten.detach.default}
_SET_GRAD = wrap_with_set_grad_enabled  # its first argument: whether grad is on inside


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
                    eager_graded: Callable[[], set[str]] | None = None) -> None:
    """Requires: ROLE on placeholders, OUTPUTS on the output (capture); ``ep`` the exported
    training callable (its parameters named ``prefix`` + FQN). Raises CaptureError naming the
    first trainable parameter the loss depends on that has no gradient output, or, where
    some traced parameter has none, that ``eager_graded()`` (the parameters eager autograd
    gives a gradient) has."""
    roles = gm.graph.output_node().meta[M.OUTPUTS]
    graded = {r.name for r in roles if r.kind is M.OutputKind.GRAD}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    param_of = ep.graph_signature.inputs_to_parameters
    reached = {param_of[n.name].removeprefix(prefix) for n in _reaching(ep.graph.output_node())
               if n.name in param_of}
    missing = [name for name in trainable if name in reached and name not in graded]
    traced = {name.removeprefix(prefix) for name in param_of.values()}
    depends = "the loss depends on it"
    if not missing and eager_graded is not None and \
            any(name in traced and name not in graded for name in trainable):
        missing = [name for name in trainable if name in eager_graded() and name not in graded]
        depends = "eager PyTorch gives it one from the same step"
    if not missing:
        return
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise CaptureError(
        f"the traced training step has no gradient for {missing[0]}{more}, although {depends} "
        f"({len(graded)} of the trainable parameters have one)",
        where=f"{type(model).__name__}.{missing[0]}",
        fix="if forward uses it under torch.no_grad() or .detach() on purpose, set "
            f"requires_grad_(False) on it; otherwise an op on its path has no backward in "
            "torch: write that step with differentiable ops, or report it to shardfx")


def _reaching(value: fx.Node) -> set[fx.Node]:
    """Nodes of an exported graph whose value reaches ``value`` differentiably: through
    floating-point values, not through ``detach`` nor out of a ``torch.no_grad()`` region."""
    seen: set[fx.Node] = set()
    todo = [value]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and (node.target in _NOT_DIFFERENTIATED or (
                node.target is _SET_GRAD and node.args[0] is False)):
            continue
        todo.extend(a for a in node.all_input_nodes if _floating(a.meta.get(M.VAL)))
    return seen


def _floating(val) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_floating(v) for v in val)
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())
