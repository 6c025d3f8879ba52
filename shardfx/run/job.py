"""What ``shardfx run`` and ``shardfx inspect`` train: a factory named ``MODULE:FACTORY`` (or
``path/to/file.py:FACTORY``), imported and called, its dict checked (``Job``). Imports no
torch: a bad spec is said before torch loads."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from shardfx.errors import InputError, ShardfxError

if TYPE_CHECKING:
    import torch


FACTORY_KEYS = ("model", "args", "loss_fn", "targets", "batches")


FACTORY_SHAPE = ('return {"model": module, "args": (x,), "loss_fn": fn, "targets": (y,)} '
                 "or (module, (x,), fn, (y,)); loss_fn and targets are optional")


_MISSING = object()


class SpecError(ShardfxError):
    """MODULE:FACTORY on the command line does not name a usable factory (exit code 2)."""


@dataclass(frozen=True)
class Job:
    """What a factory returned, checked: the arguments of ``shardfx.partition``."""

    model: torch.nn.Module
    args: tuple
    loss_fn: Callable[..., Any] | None = None
    targets: tuple = ()
    batches: Any = None  # for run: an iterable of (args, targets)


def load_job(spec: str) -> Job:
    """Import the module ``spec`` names, call its factory, and check what it returned."""
    module_name, colon, attr = spec.rpartition(":")
    if not colon or not module_name or not attr:
        raise SpecError(f"{spec!r} does not name a factory", where=spec,
                        fix="write MODULE:FACTORY, e.g. mypkg.models:make or "
                        "examples/nanogpt.py:make")
    module = _import(module_name)
    factory = getattr(module, attr, _MISSING)
    if factory is _MISSING:
        defined = [name for name, v in vars(module).items() if _defined_function(v, module)]
        listed = ", ".join(defined[:12]) + (", ..." if len(defined) > 12 else "")
        raise SpecError(f"module {module_name!r} has no attribute {attr!r}", where=spec,
                        fix=f"name one of its functions ({listed or 'it defines none'})")
    if not callable(factory):
        raise SpecError(f"{attr!r} in {module_name!r} is {_a(factory)}, not a callable",
                        where=spec, fix=f"name a function that takes no arguments and will "
                        f"{FACTORY_SHAPE}")
    _check_no_required_args(factory, spec)
    try:
        made = factory()
    except OSError as e:  # a data file not made yet (examples/prepare_text.py), unreadable
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise InputError(f"the factory could not read what it needs: {type(e).__name__}: {e}",
                        where=f"{spec} ({frame.filename}:{frame.lineno} in {frame.name})",
                        fix="make or point to the file it reads (its message above says how), "
                            "then run again") from None
    return _job(made, spec)


def _import(name: str) -> ModuleType:
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(Path(name))
    # Like `python -m`: modules and packages in the current directory are importable.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # the module exists; something it imports does not: the user's traceback
        raise SpecError(f"no module named {name!r} (looked for {e.name!r} on the import path)",
                        where=f"{name} (from {os.getcwd()})",
                        fix="check the spelling, run from the directory that contains the "
                        "package, or give the path to the .py file instead "
                        f"(e.g. {name.replace('.', '/')}.py:FACTORY)") from None


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise SpecError(f"no file {str(path)!r}", where=f"{path.resolve()}",
                        fix="give the path of a .py file, relative to the current directory or "
                        "absolute, or a dotted module name (mypkg.models:FACTORY)")
    # Named after the file, as `import` would, unless that would replace an unrelated module
    # (the file's own `if __name__ == "__main__":` block does not run).
    name = path.stem
    other = sys.modules.get(name)
    if other is not None and getattr(other, "__file__", None) != str(path.resolve()):
        name = f"_shardfx_cli_.{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path.resolve())
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"cannot import {str(path)!r} as a Python module", where=str(path),
                        fix="give the path of a .py file")
    module = importlib.util.module_from_spec(module_spec)
    # Like `python path/to/file.py`: its directory is on the path, for its sibling imports.
    if str(path.resolve().parent) not in sys.path:
        sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _a(value: Any) -> str:
    """``a Tensor``, ``an int``: the type of ``value`` for a message."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _defined_function(value: Any, module: ModuleType) -> bool:
    return inspect.isfunction(value) and value.__module__ == module.__name__ \
        and not value.__name__.startswith("_")


def _check_no_required_args(factory: Callable, spec: str) -> None:
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise SpecError(f"the factory {spec.rpartition(':')[2]}{inspect.signature(factory)} "
                        "has required parameters; the command line calls it with none",
                        where=spec,
                        fix="give its parameters defaults, or add a function without parameters "
                        "that calls it") from None
    except ValueError:  # no signature to read (a builtin): let the call decide
        pass


def _job(value: Any, spec: str) -> Job:
    """A Job from a factory's dict or tuple, naming the wrong part if there is one."""
    import torch

    if isinstance(value, dict):
        unknown = [k for k in value if k not in FACTORY_KEYS]
        missing = [k for k in ("model", "args") if k not in value]
        if unknown or missing:
            problem = "; ".join(filter(None, [
                unknown and f"unknown keys {', '.join(map(repr, unknown))}",
                missing and f"missing keys {', '.join(map(repr, missing))}"]))
            raise SpecError(f"the factory returned a dict with {problem}", where=spec,
                            fix=f"use the keys {', '.join(FACTORY_KEYS)}: {FACTORY_SHAPE}")
        parts = dict(value)
    elif isinstance(value, (tuple, list)) and 2 <= len(value) <= 4:
        parts = dict(zip(FACTORY_KEYS, value))
    else:
        what = f"a {len(value)}-tuple" if isinstance(value, (tuple, list)) else _a(value)
        raise SpecError(f"the factory returned {what}, not a dict or a 2- to 4-tuple",
                        where=spec, fix=f"make it {FACTORY_SHAPE}")

    def wrong(key: str, want: str, fix: str) -> SpecError:
        return SpecError(f"the factory's {key} is {_a(parts[key])}, not {want}", where=spec,
                         fix=fix)

    if not isinstance(parts["model"], torch.nn.Module):
        raise wrong("model", "a torch.nn.Module", "return the module itself")
    for key in ("args", "targets"):
        if isinstance(parts.get(key), list):
            parts[key] = tuple(parts[key])
        if key in parts and not isinstance(parts[key], tuple):
            raise wrong(key, "a tuple", "wrap a single tensor in a tuple: (x,)")
    if parts.get("loss_fn") is not None and not callable(parts["loss_fn"]):
        raise wrong("loss_fn", "a callable", "return loss_fn(output, *targets) -> scalar, or None")
    return Job(**parts)
