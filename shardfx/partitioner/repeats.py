"""Repeated blocks: the ``nn.ModuleList`` of identical layers that makes a model deep.

A Llama's 80 decoder layers are one block written 80 times. Tracing all 80 costs 80 times one,
and every pass after would pay the same again. Instead ``capture`` traces the model with each
such list cut to its first ``TRACED`` (two) instances and ``stamp`` copies the second one's
part of the graph for the rest. That is the full trace only if every instance computes what
the second one does, given its own parameters. Two checks before tracing and one during:

- ``find_repeats``: a list is a candidate when it has more than ``TRACED`` children, all of one
  class, with the same module tree, the same parameter and buffer names, shapes, dtypes and
  ``requires_grad``, the same ``training`` flags, no tensor shared between two instances (a
  shared layer is one parameter, not many) and no hooks.
- ``reading_attributes``: while the cut model is traced, every read of a plain attribute of an
  instance's modules (``self.attention_type``, ``self.sliding_window``, a config object) is
  recorded, from the instance itself or from code around it. ``differing_reads`` then
  compares what the second instance read with what every untraced instance holds under the
  same names, by type and state rather than identity (``alike``: the helpers each block makes
  for itself, such as transformers' per-module ``_kernel_funcs``, are alike): a layer that
  behaves differently (Gemma 3's sliding and full attention layers) differs there, and the
  model is traced whole. Attributes ``forward`` never reads (the ``layer_idx`` a KV cache
  uses) do not matter.
- ``glue_between``: the cut model cannot show what the code around the blocks does between
  blocks it never reaches (``if i == 7: x = pipe_split(x)`` in the loop over them). So the
  whole model first runs forward once on the meta device (no memory, no trace; the blocks past
  the pair as stand-ins), its ops recorded with the block they ran in: every block must run
  once, in order, and no op may run between two of them.
- ``stamp`` checks that the two traced instances are the same graph, wired the same way.

Repeated blocks refused by any of these are traced in full, and say why: in the capture path
(``refused``) and in a ``NotStampedWarning``, since planning a deep model then takes many times
longer.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.utils._python_dispatch
from torch._export.utils import _compiling_state_context

from shardfx.partitioner.alike import Alike

log = logging.getLogger("shardfx.capture")

TRACED = 2  # instances of each repeated list that are traced: the first, and the template
_INTERNALS = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping attributes
_HOOKS = tuple(a for a in _INTERNALS if "hook" in a)
_MISSING = object()  # an attribute another block does not have


@dataclass(frozen=True)
class Repeat:
    """Blocks ``first`` .. ``count``-1 of the list at module path ``path`` (``model.layers``) are
    interchangeable. Blocks ``first`` and ``first + 1`` are traced as the pair ``stamp``
    compares (``instance(0)`` and ``instance(1)``, the template), with every block before them;
    the others are stamped."""

    path: str
    count: int  # blocks in the list
    first: int = 0

    def instance(self, i: int) -> str:
        """The module path of the i-th block of the repeat (0: the first of the pair)."""
        return f"{self.path}.{self.first + i}"

    @property
    def blocks(self) -> int:
        return self.count - self.first

    @property
    def traced(self) -> int:
        return self.first + TRACED

    def later(self) -> "Repeat | None":
        """The pair one block further on, when blocks are left to stamp: for a first block
        unlike the rest (its input needs no gradient, so its backward has fewer ops)."""
        return Repeat(self.path, self.count, self.first + 1) if self.blocks > TRACED + 1 else None

    def __str__(self) -> str:
        return f"{self.path}: {self.traced} of {self.count} blocks traced, " \
               f"{self.count - self.traced} stamped"


def find_repeats(model: torch.nn.Module) -> tuple[list[Repeat], list[str], list[str]]:
    """The candidate lists (outermost only: a list inside a candidate's block is left to the
    block), each from the first block from which all are interchangeable (a first dense layer
    before many mixture-of-experts ones is traced as it is); for each list of more than TRACED
    blocks alike in their modules and parameters that is refused all the same (hooks, a tensor
    two blocks share), why; and for each other list of more than TRACED modules why it is not
    one."""
    repeats: list[Repeat] = []
    refused: list[str] = []
    why_not: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) <= TRACED:
            continue
        if any(path.startswith(r.path + ".") for r in repeats):
            continue
        blocks = list(module)
        signatures = [(type(b), _signature(b)) for b in blocks]
        start = len(blocks) - 1
        while start > 0 and signatures[start - 1] == signatures[-1]:
            start -= 1
        if len(blocks) - start <= TRACED:
            why_not.append(f"{path}: {_unlike(blocks, start - 1)}")
        elif reason := _not_interchangeable(blocks, start):
            refused.append(f"{path}: {reason}")
        else:
            repeats.append(Repeat(path, len(blocks), start))
    return repeats, refused, why_not


def _unlike(blocks: list[torch.nn.Module], i: int) -> str:
    if type(blocks[i]) is not type(blocks[-1]):
        return f"[{i}] is a {type(blocks[i]).__name__}, [{len(blocks) - 1}] a " \
               f"{type(blocks[-1]).__name__}"
    return f"[{i}] differs from [{len(blocks) - 1}] in its modules, parameters or buffers"


def _not_interchangeable(blocks: list[torch.nn.Module], start: int) -> str | None:
    seen: set[int] = set()
    for i in range(start, len(blocks)):
        for name, m in blocks[i].named_modules():
            if any(getattr(m, h, None) for h in _HOOKS):
                return f"[{i}]{'.' + name if name else ''} has hooks"
        ids = {id(t) for t in [*blocks[i].parameters(), *blocks[i].buffers()]}
        if ids & seen:
            return f"[{i}] shares a parameter or buffer with an earlier block"
        seen |= ids
    return None


def _signature(block: torch.nn.Module) -> tuple:
    return (tuple((name, type(m), m.training) for name, m in block.named_modules()),
            tuple((name, tuple(t.shape), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter))
                  for name, t in [*block.named_parameters(), *block.named_buffers()]))


# --- saying why blocks were not stamped ---------------------------------------------------

FULL = "full trace"  # the capture path of a model traced whole


class NotStampedWarning(UserWarning):
    """A model's repeated blocks are traced one by one, not stamped: the plan is the same,
    planning takes time in proportion to their number."""


def refused(why: str) -> str:
    """The capture path of a model whose repeated blocks are traced in full, and why."""
    return f"{FULL} ({why})"


def refusal(path: str) -> str | None:
    """Why a capture path's repeated blocks were traced in full (``refused``); None when they
    were stamped or the model has none."""
    return path[len(FULL) + 2:-1] if path.startswith(FULL + " (") else None


def warn_not_stamped(model: str, why: str) -> None:
    """A ``NotStampedWarning`` naming the model, and what keeps its blocks from stamping."""
    warnings.warn(
        f"{model}: repeated blocks not stamped, every one traced: {why}. The plan is the same, "
        "but planning takes time in proportion to the number of blocks. Where the blocks do "
        "compute alike, make them alike in what differs (an attribute: the same value in every "
        "block, or one object they share)", NotStampedWarning, stacklevel=3)


# --- tracing the cut model ---------------------------------------------------------------


Reads = dict[str, set[tuple[str, str]]]  # list path -> {(module path in a block, attribute)}


@contextlib.contextmanager
def cut_to_traced(model: torch.nn.Module, repeats: list[Repeat]) -> Iterator[Reads]:
    """Within: each repeated list holds only its first TRACED blocks, and the plain attributes
    their modules are read are recorded (the returned dict fills in as the model is traced)."""
    reads: Reads = {r.path: set() for r in repeats}
    swapped: list[tuple[torch.nn.Module, type]] = []
    restore: list[tuple[dict, str, torch.nn.Module]] = []
    try:
        for r in repeats:
            parent_path, _, name = r.path.rpartition(".")
            parent = model.get_submodule(parent_path)
            full = parent._modules[name]
            restore.append((parent._modules, name, full))
            parent._modules[name] = torch.nn.ModuleList(list(full)[:r.traced])
            for block in list(full)[:r.traced]:
                for sub, m in block.named_modules():
                    swapped.append((m, type(m)))
                    m.__class__ = _recording(type(m))
                    object.__setattr__(m, "_shardfx_reads", (reads[r.path], sub))
        yield reads
    finally:
        for m, cls in reversed(swapped):
            m.__class__ = cls
            object.__delattr__(m, "_shardfx_reads")
        for modules, name, full in restore:
            modules[name] = full


_RECORDING: dict[type, type] = {}


def _recording(cls: type) -> type:
    """``cls`` with every read of a plain instance attribute recorded: same name, module and
    qualified name, so traces and messages name the user's class."""
    if cls not in _RECORDING:
        get = cls.__getattribute__

        def __getattribute__(self, name: str) -> Any:
            value = get(self, name)
            if name not in _INTERNALS and name in object.__getattribute__(self, "__dict__"):
                record = object.__getattribute__(self, "__dict__").get("_shardfx_reads")
                if record is not None and name != "_shardfx_reads":
                    record[0].add((record[1], name))
            return value

        _RECORDING[cls] = type(cls.__name__, (cls,), {
            "__getattribute__": __getattribute__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _RECORDING[cls]


def differing_reads(model: torch.nn.Module, repeat: Repeat, reads: Reads) -> str | None:
    """Why the blocks past the traced ones may compute something else: the first attribute
    the template block read whose value another block's does not match (``alike``: by type
    and state, not identity), named down to the part that differs; None when none does."""
    template = model.get_submodule(repeat.instance(TRACED - 1))
    for i in range(TRACED, repeat.blocks):
        block = model.get_submodule(repeat.instance(i))
        alike = Alike(template, block)
        for sub, name in sorted(reads[repeat.path]):
            a = getattr(template.get_submodule(sub), name)
            b = getattr(block.get_submodule(sub), name, _MISSING)
            if found := alike.difference(a, b):
                below, x, y = found
                where = f"{repeat.instance(i)}{'.' + sub if sub else ''}.{name}{below}"
                names = {id(m): n for n, m in model.named_modules()}
                return f"{where} is {_short(y, names)}, {repeat.instance(TRACED - 1)}'s is " \
                       f"{_short(x, names)}"
    return None


def _short(x: Any, modules: dict[int, str]) -> str:
    """``x`` in a message: a module of the model by its path, a short value as itself."""
    if x is _MISSING:
        return "missing"
    if id(x) in modules:
        return f"the module {modules[id(x)] or 'model'}"
    text = repr(x)
    return text if len(text) <= 40 else f"a {type(x).__name__}"


# --- the dry run -------------------------------------------------------------------------


def glue_between(model: torch.nn.Module, repeats: list[Repeat], meta_args: tuple,
                 train: bool) -> str | None:
    """Why stamping would miss something the full trace has (see the module docstring); None
    when nothing. ``meta_args``: the model's inputs on the meta device, as its own tensors are
    (``fake.on_meta``); ``train``: run with grad on, as the trace will. The run tells code that
    asks that it is being exported, as the trace does (Hugging Face's mixture-of-experts layers
    take another path in eager). Blocks past the pair run as stand-ins returning the
    template's output: the code around them is what the run is for, and it stays fast (meta
    kernels are Python: a real 80-layer run takes about a second)."""
    events: list = []
    undo = []
    for r in repeats:
        blocks = list(model.get_submodule(r.path))
        out: list = []
        for i, block in enumerate(blocks):
            tag = (r.path, i)
            undo.append(block.register_forward_pre_hook(
                lambda m, a, tag=tag: events.append(("enter", tag))).remove)
            undo.append(block.register_forward_hook(
                _on_exit(events, tag, out if i == r.traced - 1 else None)).remove)
            if i >= r.traced:
                undo.append(_stand_in(block, out))
    try:
        with torch.set_grad_enabled(train), _compiling_state_context(), _Recorder(events):
            model(*meta_args)
    except Exception as e:  # noqa: BLE001 (anything: then the full trace decides)
        return f"the model did not run on the meta device to check its blocks: " \
               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for step in reversed(undo):
            step()
    for r in repeats:
        if why := _calls(r, events):
            return why
    return None


def _on_exit(events: list, tag: tuple, out: list | None):
    """A forward hook noting the block's exit (and keeping the template's output in ``out``)."""
    def hook(module, args, output) -> None:
        events.append(("exit", tag))
        if out is not None:
            out.append(output)
    return hook


def _stand_in(block: torch.nn.Module, out: list):
    """Make ``block.forward`` return ``out[0]`` (the template's output); returns the undo."""
    own = block.__dict__.get("forward")
    block.forward = lambda *args, **kwargs: out[0]

    def undo():
        del block.forward
        if own is not None:
            block.forward = own
    return undo


def _calls(repeat: Repeat, events: list) -> str | None:
    """Blocks of ``repeat`` ran once each, in order, the pair the same ops, and nothing ran
    between two of them."""
    ops: dict[int, list] = {}
    current, last, gap = None, -1, []
    for kind, what in events:
        if kind == "enter" and what[0] == repeat.path:
            i = what[1]
            if current is not None or i != last + 1:
                return f"{repeat.path}[{i}] runs out of order (after [{last}])"
            if i > repeat.first and gap:
                return f"{gap[0]} runs between {repeat.path}[{i - 1}] and [{i}]: code around " \
                       "the blocks does something between some of them"
            current, ops[i], gap = i, [], []
        elif kind == "exit" and what[0] == repeat.path:
            current, last = None, what[1]
        elif kind == "op":
            (ops[current] if current is not None else gap).append(what)
    if last != repeat.count - 1:
        return f"{repeat.path}[{last + 1}] never runs"
    return None


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Appends ("op", name) for every op run."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.events.append(("op", str(func)))
        return func(*args, **(kwargs or {}))

