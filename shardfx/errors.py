"""The exceptions shardfx raises on bad input.

Every message names three things: the cause, where it is (parameter, input, module, node or
pass), and what the user can do about it. Catch ``ShardfxError`` to catch them all.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path


class ShardfxError(Exception):
    """Base class of every error shardfx raises on purpose."""

    def __init__(self, cause: str, *, where: str | None = None, fix: str | None = None):
        self.cause, self.where, self.fix = cause, where, fix
        lines = [cause]
        if where:
            lines.append(f"  where: {where}")
        if fix:
            lines.append(f"  fix:   {fix}")
        super().__init__("\n".join(lines))


class InputError(ShardfxError, TypeError):
    """The model, the example inputs, or a step's inputs are not what shardfx can take."""


class CaptureError(ShardfxError):
    """The model could not be traced into a graph."""


class LossError(ShardfxError):
    """The loss function cannot take the model's output, or does not return a scalar."""


class MeshError(ShardfxError, ValueError):
    """The mesh is malformed or does not match the devices at hand."""


class PassError(ShardfxError):
    """A compiler pass failed or left the IR in a state ``verify`` rejects."""


class VerifyError(ShardfxError):
    """The IR breaks one of its invariants (see ``shardfx.ir.verify``)."""


class ParseError(ShardfxError, ValueError):
    """Text is not in the IR's text form (see ``shardfx.ir.text``)."""


class ShardingError(ShardfxError, ValueError):
    """A sharding request that cannot be applied: unknown placement, no matching parameter,
    a dimension not divisible by its mesh axis."""


class PipelineError(ShardfxError, ValueError):
    """A pipeline request that cannot be met: more stages than cut points, markers that do
    not match the stage count, a schedule that deadlocks."""


class CheckpointError(ShardfxError, OSError):
    """A checkpoint could not be written (a disk full, a directory not writable, on any rank):
    the previous checkpoint is left as it was."""


class SearchError(ShardfxError, ValueError):
    """``shardfx.search`` found no candidate: no mesh of the device count runs the model and
    batch (the message names what each axis needs and the nearest counts that work)."""


class MemoryBudgetError(ShardfxError, ValueError):
    """A memory budget no plan can meet: the message gives the lowest peak shardfx's search
    reaches (a budget it meets) and what it is made of."""


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n?[ \t]*([^\n]*)')


def user_frame(stack_trace: str | None) -> tuple[str, int, str, str] | None:
    """The innermost frame of ``stack_trace`` (the node meta torch.export records) outside
    torch and shardfx: ``(file, line, function, code)``; None when there is none."""
    return _user_frame(stack_trace or "")


@functools.lru_cache(maxsize=4096)  # dumps print every op after every pass; traces repeat
def _user_frame(stack_trace: str) -> tuple[str, int, str, str] | None:
    import torch  # not at the top: this module is imported before anything else of shardfx

    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    frames = [f for f in _FRAME.findall(stack_trace) if not f[0].startswith(skip)]
    if not frames:
        return None
    file, line, fn, code = frames[-1]
    return file, int(line), fn, code.strip()


def user_line(stack_trace: str | None) -> str | None:
    """Where in the user's code a traced node comes from, as ``file:line in fn: code``; None
    when its stack trace has no frame outside torch and shardfx."""
    frame = user_frame(stack_trace)
    return None if frame is None else "{}:{} in {}: {}".format(*frame)


def path_arg(value, call: str, example: str) -> Path:
    """``value`` as a ``pathlib.Path``, or an ``InputError`` saying what it is instead (None, a
    number): for the path argument of ``call`` (``runner.load_hf``), ``example`` its use."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(value)
    kind = type(value).__name__
    got = "an empty string" if value == "" else "None" if value is None else \
        f"{value!r:.40} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"
    raise InputError(f"the path given to {call} is {got}, not a path",
                     where=f"{call}({value!r:.40})",
                     fix=f"pass a directory as a str or a pathlib.Path, e.g. {example}")
