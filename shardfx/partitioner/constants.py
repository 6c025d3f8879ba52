"""Tensors the traced code reads that are not the model's: constants of the IR.

A model or loss may read a tensor that is neither a parameter, a buffer nor an input: a tensor
closed over by ``loss_fn`` (``F.cross_entropy(..., weight=class_weights)``), a module-level
global read in ``forward`` (``SCALE``, a mask), a plain tensor attribute (``self.scale =
torch.tensor(2.0)``, not registered as a buffer). Eager PyTorch reads them as they are.
torch.export lifts each such tensor to a ``CONSTANT_TENSOR`` input (``lifted_tensor_0``,
``scale``) and ``ep.module()`` puts it back as a plain attribute, which the joint trace then
meets as a real tensor under its FakeTensorMode and rejects.

So each one becomes a (non-persistent) buffer of the exported module before the joint trace:
aot_autograd lifts it like any buffer, as an input, and capture gives that input the role
``CONSTANT`` with the tensor as its value (``M.CONSTANT``), named as the user's code names it
where that can be found (``class_weights``, ``SCALE``). The runners feed it like the constants
torch makes itself (the index of ``h[:, [0, 1]]``): the same whole tensor on every device, its
value as it was when the model was partitioned.

A constant that requires grad is a tensor the user trains outside the module: as a constant it
would silently stay as it is (torch.export detaches it with a warning). That is an error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from shardfx.errors import InputError, user_line


@dataclass(frozen=True)
class UserConstant:
    """A tensor read by the traced code that is not the model's: its FQN in the exported
    module, the name the IR gives it, and its value."""

    fqn: str  # as torch.export lifted it: "model.lifted_tensor_0", "lifted_tensor_1", "model.scale"
    name: str  # the user's name for it where found ("class_weights"), else the FQN unprefixed
    value: torch.Tensor
    held_by: str | None = None  # what holds it: "class_weights, closed over by the loss_fn at ..."


def user_constants(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                   loss_fn: Callable | None, prefix: str) -> dict[str, UserConstant]:
    """The tensors ``ep`` lifted as constants, by FQN. Raises InputError for one that requires
    grad, naming it, where it is read, and the fix (an ``nn.Parameter`` of the model)."""
    found: dict[str, UserConstant] = {}
    names: set[str] = set()
    for fqn in ep.graph_signature.lifted_tensor_constants:
        value = ep.constants[fqn]
        if not isinstance(value, torch.Tensor):
            continue
        python_name, held_by = _python_name(value, model, loss_fn)
        name = python_name or fqn.removeprefix(prefix)
        if value.requires_grad:
            raise InputError(
                f"{type(model).__name__} or loss_fn reads a tensor that requires grad but is not "
                f"a parameter of the model ({name}, {describe(value)}): shardfx would train "
                "without it, as a constant",
                where=_read_at(ep, fqn) or held_by or name,
                fix="make it an nn.Parameter of the model (self.w = nn.Parameter(w)) so it is "
                    "trained with the others, or .detach() it / set requires_grad=False if it is "
                    "meant to stay fixed")
        unique, i = name, 1
        while unique in names:
            unique, i = f"{name}_{i}", i + 1
        names.add(unique)
        found[fqn] = UserConstant(fqn, unique, value.detach(), held_by)
    return found


def as_buffers(module: torch.nn.Module, constants: dict[str, UserConstant]) -> None:
    """Make each constant a non-persistent buffer of ``module`` (``ep.module()``), so the joint
    trace lifts it to an input instead of meeting a real tensor."""
    for fqn, const in constants.items():
        owner_path, _, attr = fqn.rpartition(".")
        owner = module.get_submodule(owner_path)
        if hasattr(owner, attr):  # a plain attribute, as ep.module() sets constants
            delattr(owner, attr)
        owner.register_buffer(attr, const.value, persistent=False)


def mutated_constant(const: UserConstant, model: torch.nn.Module) -> InputError:
    """The error for a traced step that writes into a constant in place."""
    return InputError(
        f"{type(model).__name__} modifies {const.name} ({describe(const.value)}) in place, a "
        "tensor that is not part of the model: shardfx feeds it as a constant, so the change "
        "would not be kept from one step to the next",
        where=const.held_by or f"{type(model).__name__}.forward or loss_fn, tensor {const.name}",
        fix="register it as a buffer of the model (self.register_buffer(name, tensor)) so its "
            "updates are model state, or compute a new tensor instead of modifying it")


def describe(x) -> str:
    """``Tensor[4, 8] float32``, or the name of a value's type: how errors name an input."""
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _read_at(ep: torch.export.ExportedProgram, fqn: str) -> str | None:
    """Where the user's code reads constant ``fqn``: the first user line of an op using it
    (torch.export records the lines of the model's forward; not those of ``loss_fn``)."""
    placeholder = {spec.target: spec.arg.name for spec in ep.graph_signature.input_specs}[fqn]
    for node in ep.graph.find_nodes(op="placeholder"):
        if node.name == placeholder:
            for user in node.users:
                if line := user_line(user.meta.get("stack_trace")):
                    return line
    return None


def _python_name(value: torch.Tensor, model: torch.nn.Module, loss_fn: Callable | None
                 ) -> tuple[str | None, str | None]:
    """The name the user's code gives ``value`` and what holds it: a variable ``loss_fn`` or a
    module's ``forward`` closes over, a global of ``loss_fn``'s module or of a module defining
    one of the model's classes, or a plain attribute of a submodule (``layers.0.scale``).
    (None, None) when none holds this very tensor."""
    fn = getattr(loss_fn, "func", loss_fn)  # functools.partial: the function it wraps
    code = getattr(fn, "__code__", None)
    at = f"the loss_fn at {code.co_filename}:{code.co_firstlineno}" if code else ""
    if var := _closed_over(fn, value):
        return var, f"{var}, closed over by {at}"
    classes = list(dict.fromkeys(type(m) for m in model.modules()))  # in a stable order
    for cls in classes:
        if var := _closed_over(cls.forward, value):
            return var, f"{var}, closed over by {cls.__qualname__}.forward"
    for var, held in (getattr(fn, "__globals__", None) or {}).items():
        if held is value:
            return var, f"{var}, a global of {fn.__module__} read by {at}"
    for module in dict.fromkeys(cls.__module__ for cls in classes):
        for var, held in getattr(sys.modules.get(module), "__dict__", {}).items():
            if held is value:
                return var, f"{var}, a global of {module}"
    for path, module in model.named_modules():
        for attr, held in vars(module).items():
            if held is value:
                name = f"{path}.{attr}" if path else attr
                return name, f"{type(model).__name__}.{name}, a tensor attribute"
    return None, None


def _closed_over(fn: Callable | None, value: torch.Tensor) -> str | None:
    """The variable of ``fn``'s closure that holds ``value``, if one does."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    for var, cell in zip(code.co_freevars, closure) if code and closure else ():
        if _cell(cell) is value:
            return var
    return None


def _cell(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
