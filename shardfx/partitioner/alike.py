"""Whether a value one block holds makes it behave as the template's value does.

``repeats.differing_reads`` compares, name by name, what the template block's ``forward``
read with what every untraced block holds. Identity is the wrong test there: a block may
hold helpers made for it alone that behave exactly as the template's do (since transformers
5.25 each attention module keeps its own ``_kernel_funcs``, a dict of fresh kernel-function
modules), and a stamped model must not turn into a full trace because of them. What a value
does follows from its type and its state, so that is what is compared:

- numbers, strings, dtypes, devices, None: equal, of the same type;
- tuples, lists, dicts (keys in the same order), sets: their items alike;
- functions: the same code, globals and defaults, and alike closed-over values; bound methods
  and ``functools.partial``: the same function with alike arguments;
- a module of the block itself (a registered submodule, such as ``self.mlp`` reached by
  another name): the one at the same path in the other block (its parameters are the
  block's, stamped by name; its own attributes are checked as the block's are);
- any other object (an unregistered module included): the same class, and alike attributes
  (``__dict__`` and ``__slots__``); an object without either (a C type's) equal by ``==``;
- tensors, classes and Python modules: only the same object.

A value that refers back to itself (a helper holding its owner) is alike when no step of
the cycle differs. Behaviour keyed on an object's identity (``id(self)`` in a registry) is
not seen by this; the traced pair's graphs are still compared op for op by ``stamp``.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_BY_IDENTITY = (torch.Tensor, type, types.ModuleType)
DEEPEST = 16  # levels of nesting compared; deeper values differ unless they are one object

Difference = tuple[str, Any, Any]  # where below the attribute, the template's value, the other's


class Alike:
    """Compares values read from ``template`` with the same names' values in ``block``: two
    instances of one repeated block (see the module docstring)."""

    def __init__(self, template: torch.nn.Module, block: torch.nn.Module):
        self._mine = {id(m): p for p, m in template.named_modules()}
        self._theirs = {id(m): p for p, m in block.named_modules()}
        self._alike: set[tuple[int, int]] = set()  # pairs alike, or being compared (cycles)
        self._held: list = []  # keeps the objects behind the ids in _alike alive

    def difference(self, a: Any, b: Any, at: str = "", depth: int = 0) -> Difference | None:
        """Where ``b`` (the other block's) first differs from ``a`` (the template's): the
        path below the attribute (``"['rotary_pos_emb'].scale"``, ``""`` for the value
        itself) and the two values there; None when they are alike."""
        here, there = self._mine.get(id(a)), self._theirs.get(id(b))
        if here is not None or there is not None:  # one of the blocks' own modules: even the
            return None if here == there else (at, a, b)  # template's own, read by both, differs
        if a is b:
            return None
        if type(a) is not type(b) or isinstance(a, _BY_IDENTITY) or depth > DEEPEST:
            return at, a, b
        if isinstance(a, _PLAIN):
            return None if a == b or (a != a and b != b) else (at, a, b)  # nan is nan here
        key = (id(a), id(b))
        if key in self._alike:
            return None
        self._alike.add(key)
        self._held.append((a, b))
        return self._parts(a, b, at, depth + 1)

    def _parts(self, a: Any, b: Any, at: str, depth: int) -> Difference | None:
        """The first difference between the parts of ``a`` and ``b``, of one type."""
        if isinstance(a, (tuple, list)):
            if len(a) != len(b):
                return at, a, b
            return self._first(((f"{at}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))),
                               depth)
        if isinstance(a, dict):
            if not _equal(list(a), list(b)):
                return at, a, b
            return self._first(((f"{at}[{k!r}]", a[k], b[k]) for k in a), depth)
        if isinstance(a, (set, frozenset)):
            return None if a == b else (at, a, b)
        if isinstance(a, functools.partial):
            return self._first(((f"{at}.func", a.func, b.func), (f"{at}.args", a.args, b.args),
                                (f"{at}.keywords", dict(sorted(a.keywords.items())),
                                 dict(sorted(b.keywords.items())))), depth)
        if isinstance(a, types.MethodType):
            return self._first(((f"{at}.__func__", a.__func__, b.__func__),
                                (f"{at}.__self__", a.__self__, b.__self__)), depth)
        if isinstance(a, types.FunctionType):
            if a.__code__ != b.__code__ or a.__globals__ is not b.__globals__:
                return at, a, b
            cells = [(f"{at}.<closure {n}>", _content(x), _content(y)) for n, x, y in
                     zip(a.__code__.co_freevars, a.__closure__ or (), b.__closure__ or ())]
            return self._first(((f"{at}.__defaults__", a.__defaults__, b.__defaults__),
                                (f"{at}.__kwdefaults__", a.__kwdefaults__, b.__kwdefaults__),
                                *cells, (f"{at}.__dict__", a.__dict__, b.__dict__)), depth)
        state_a, state_b = _state(a), _state(b)
        if state_a is None:  # no attributes to compare: a C type's value
            return None if _equal(a, b) else (at, a, b)
        if list(state_a) != list(state_b):
            return at, a, b
        return self._first(((f"{at}.{k}", v, state_b[k]) for k, v in state_a.items()), depth)

    def _first(self, parts, depth: int) -> Difference | None:
        for at, x, y in parts:
            if found := self.difference(x, y, at, depth):
                return found
        return None


def _content(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return _EMPTY


_EMPTY = object()


def _state(x: Any) -> dict[str, Any] | None:
    """An object's attributes, ``__dict__``'s then its slots'; None when it has neither."""
    state = dict(vars(x)) if hasattr(x, "__dict__") else None
    slots = [s for cls in type(x).__mro__ for s in _names(getattr(cls, "__slots__", ()))
             if s not in ("__dict__", "__weakref__")]
    if slots:
        state = state or {}
        state.update((s, getattr(x, s, _EMPTY)) for s in slots)
    return state


def _names(slots: Any) -> tuple[str, ...]:
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _equal(a: Any, b: Any) -> bool:
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001 (a comparison that fails says nothing alike)
        return False
