"""Running passes: one at a time, verified, with the IR after each kept for ``plan.dump``.

A pass is a function ``(gm, options) -> gm``; its docstring has ``Requires:`` and ``Ensures:``
lines naming the meta keys it reads and writes. When a pass fails or breaks the IR, the
``PassError`` names the pass, the passes that ran before it, and the cause; a ``ShardfxError``
about the user's request (a dimension not divisible by its mesh axis) passes through as is. ``verify`` runs after each pass when
``options.debug`` is set or ``SHARDFX_DEBUG=1`` (the test suite sets it).

With ``SHARDFX_DUMP=dir`` a failure writes what exists to ``dir`` (``dump_failure``): the IR after
capture and after each pass that ran, as ``plan.dump`` names them, and the error in ``error.txt``;
without it, the error's fix says to set it.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.fx as fx

from shardfx.errors import PassError, ShardfxError, VerifyError
from shardfx.request.options import Options
from shardfx.ir import meta as M
from shardfx.ir.contract import check
from shardfx.ir.frozen import FrozenGraph, FrozenNode, freeze
from shardfx.ir.text import ir_to_text
from shardfx.ir.units import flops
from shardfx.ir.verify import verify
from shardfx.codegen.program import graphs, verify_program

log = logging.getLogger("shardfx.passes")

Pass = Callable[[fx.GraphModule, "Options"], fx.GraphModule]


class PassRecord:
    """A pass's name and the IR (or program) after it, under a header of what the pass
    changed. ``text`` is rendered when first read (``plan.dump``, a failure's dump): a record
    made with ``render`` keeps only what the text is made of (``ir.frozen``)."""

    def __init__(self, name: str, text: str | None = None,
                 render: Callable[[], str] | None = None):
        assert (text is None) != (render is None), "a record has its text or a way to render it"
        self.name, self._text, self._render = name, text, render

    @property
    def text(self) -> str:
        if self._text is None:
            self._text, self._render = self._render(), None
        return self._text

    def __repr__(self) -> str:
        return f"PassRecord({self.name!r})"


def _ours(key: str) -> bool:
    return key.startswith("shardfx.") or key == "val"


def changes(name: str, before: FrozenGraph, after: FrozenGraph) -> str:
    """A comment header for the IR text after pass ``name``: the nodes it added and removed, and
    the meta keys it wrote on how many nodes (``# wrote cost on 547 nodes``), so a dump shows
    what each pass did even where the printed IR looks alike."""
    nodes = before.by_name
    added = [n.name for n in after.nodes if n.name not in nodes]
    removed = [n for n in nodes if n not in after.by_name]
    wrote: dict[str, int] = {}
    for node in after.nodes:
        old = nodes.get(node.name)
        if old is node:  # kept unchanged from ``before``
            continue
        old_meta = old.meta if old is not None else {}
        for key, value in node.meta.items():
            if _ours(key) and old_meta.get(key) is not value:
                wrote[key] = wrote.get(key, 0) + 1
    lines = [f"# after {name}: {len(added)} nodes added, {len(removed)} removed"]
    for label, names in (("added", added), ("removed", removed)):
        if names:
            lines.append(f"#   {label}: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
    for key, count in wrote.items():
        lines.append(f"#   wrote {key.removeprefix('shardfx.')} on {count} nodes"
                     f"{_totals(key, after.nodes)}")
    for key, value in after.meta.items():
        if _ours(key) and before.meta.get(key) is not value:
            lines.append(f"#   wrote the graph's {key.removeprefix('shardfx.')}")
    if len(lines) == 1:
        lines.append("#   the IR is unchanged")
    return "\n".join(lines) + "\n"


def captured_record(gm: fx.GraphModule) -> PassRecord:
    """The first record of a history: the IR as capture made it; rendered when read."""
    frozen = freeze(gm)
    return PassRecord("capture", render=lambda: ir_to_text(frozen))


def record(name: str, before: FrozenGraph, after: FrozenGraph) -> PassRecord:
    """The record of pass ``name``, which turned ``before`` into ``after``; rendered when read."""
    return PassRecord(name, render=lambda: changes(name, before, after) + ir_to_text(after))


def run_passes(gm: fx.GraphModule, passes: list[Pass], options: Options,
               history: list[PassRecord] | None) -> fx.GraphModule:
    """Apply ``passes`` in order; append the IR after each one to ``history``, rendered as text
    when a record is read (None: nothing kept, for a copy planned only to be measured:
    ``shardfx.compiler.shallow``)."""
    if options.debug:
        verify(gm)
    state = freeze(gm) if history is not None else None  # each "after": the next "before"
    done: list[str] = [r.name for r in history or ()]
    for p in passes:
        name = p.__name__
        before = list(done)
        try:
            if options.debug:
                check(p, gm, "requires")
            gm = p(gm, options)
            if options.debug:
                verify(gm)
                check(p, gm, "ensures")
        except PassError as e:
            dump_failure(e, history or [])
            raise
        except VerifyError as e:  # a pass broke the IR: shardfx's fault
            error = PassError(f"{type(e).__name__}: {e.cause}",
                              where=_where(name, before, e.where), fix=f"{e.fix}; {report_fix()}")
            error.__cause__ = e
            dump_failure(error, history or [])
            raise error from e
        except ShardfxError:  # the user's request cannot be met: its own message says why
            raise
        except Exception as e:
            error = PassError(f"{type(e).__name__}: {e}", where=_where(name, before, None),
                              fix=report_fix())
            error.__cause__ = e
            dump_failure(error, history or [])
            raise error from e
        done.append(name)
        if history is not None:
            after = freeze(gm, state)
            history.append(record(name, state, after))
            state = after
        log.debug("ran %s", name)
    return gm


def run_program_passes(program, passes: list, options: Options,
                       history: list[PassRecord] | None):
    """Apply program passes (``passes.program``) in order, as ``run_passes`` applies IR passes:
    ``verify_program`` after each in debug runs, a failure named with the pass and those before
    it, the program's text after each appended to ``history`` (None: not rendered, for the
    candidates a ``memory_budget`` tries). Returns the last program."""
    before = [r.name for r in history or ()]
    state = _program_freeze(program) if history is not None else None
    for p in passes:
        name = p.__name__
        try:
            if options.debug:
                check(p, program, "requires")
            program = p(program, options)
            if options.debug:
                verify_program(program)
                check(p, program, "ensures")
        except ShardfxError as e:
            if isinstance(e, VerifyError):
                error = PassError(f"{type(e).__name__}: {e.cause}",
                                  where=_where(name, before, e.where),
                                  fix=f"{e.fix}; {report_fix()}")
                dump_failure(error, history or [])
                raise error from e
            raise
        except Exception as e:
            error = PassError(f"{type(e).__name__}: {e}", where=_where(name, before, None),
                              fix=report_fix())
            dump_failure(error, history or [])
            raise error from e
        if history is not None:
            after = _program_freeze(program, state)
            history.append(_program_record(name, state, after))
            state = after
        before.append(name)
        log.debug("ran %s", name)
    return program


@dataclass(frozen=True)
class _ProgramState:
    """A program as it stood after a pass: each module it runs (``ir.frozen``; passes rewrite
    a program's modules in place) and the collectives it issued."""

    graphs: dict[str, FrozenGraph]
    collectives: tuple


def _program_freeze(program, previous: _ProgramState | None = None) -> _ProgramState:
    old = previous.graphs if previous is not None else {}
    return _ProgramState({name: freeze(m, old.get(name, old.get("program")))
                          for name, m in graphs(program)}, tuple(program.collectives))


def _program_record(name: str, before: _ProgramState, after: _ProgramState) -> PassRecord:
    return PassRecord(name, render=lambda: _program_changes(name, before, after)
                      + program_text(after))


def _program_changes(name: str, before: _ProgramState, after: _ProgramState) -> str:
    """The header of a program pass's text: nodes added and removed, per module."""
    lines = []
    for module, frozen in after.graphs.items():
        old = before.graphs.get(module, before.graphs.get("program"))
        old_names = [n.name for n in old.nodes] if old is not None else []
        nodes = [n.name for n in frozen.nodes]
        old_set, new_set = set(old_names), set(nodes)  # once: per node it was quadratic
        added = [n for n in nodes if n not in old_set]
        removed = [n for n in old_names if n not in new_set]
        where = "" if module == "program" else f" in {module}"
        lines.append(f"# after {name}: {len(added)} nodes added, {len(removed)} removed{where}")
        for label, names in (("added", added), ("removed", removed)):
            if names:
                lines.append(f"#   {label}: {', '.join(names[:12])}"
                             f"{' ...' if len(names) > 12 else ''}")
    return "\n".join(lines) + "\n"


def program_text(state: _ProgramState) -> str:
    """A program as text: its IR text (each module's, for a pipeline's parts), then the
    collectives it issues."""
    parts = [ir_to_text(m) if name == "program" else f"# part {name}\n{ir_to_text(m)}"
             for name, m in state.graphs.items()]
    lines = [f"# {c.kind} {c.axis} {c.nbytes} B  {c.reason}" for c in state.collectives]
    return "".join(parts) + ("# collectives:\n" + "\n".join(lines) + "\n" if lines else "")


def _where(name: str, before: list[str], inner: str | None) -> str:
    s = f"pass {name} (after {', '.join(before) or 'capture'})"
    return f"{s}; {inner}" if inner else s


def _totals(key: str, nodes: list[FrozenNode]) -> str:
    """What the written values add up to, for the keys where a sum says something: the
    estimated FLOPs per phase, the ops per pipeline stage, the ops no sharding rule covered."""
    values = [(n, n.meta[key]) for n in nodes if key in n.meta]
    if key == M.COST:
        per: dict[str, int] = {}
        for n, cost in values:
            phase = str(n.meta.get(M.PHASE, "-"))
            per[phase] = per.get(phase, 0) + cost.flops
        return ": " + ", ".join(f"{phase} {flops(f)}FLOP" for phase, f in per.items())
    if key == M.STAGE:
        per_stage: dict[int, int] = {}
        for n, stage in values:
            if n.op == "call_function":
                per_stage[stage] = per_stage.get(stage, 0) + 1
        return ": ops per stage " + ", ".join(f"{s}: {c}" for s, c in sorted(per_stage.items()))
    if key == M.SHARDING:
        return f": {sum(1 for _, v in values if v.replicated)} ops without a rule run replicated"
    return ""


def report_fix() -> str:
    """What to do about a failure that is shardfx's fault: report it, with the IR dump."""
    if directory := os.environ.get("SHARDFX_DUMP"):
        return (f"this is a shardfx bug; please report it with the IR dump written to "
                f"{directory} (the IR after capture and after each pass that ran, the error)")
    return ("this is a shardfx bug; set SHARDFX_DUMP=dir and run again to write the IR after "
            "capture and after each pass that ran, then report it with that directory")


def dump_failure(error: BaseException, history: list[PassRecord],
                 gm: fx.GraphModule | None = None) -> None:
    """With ``SHARDFX_DUMP=dir``, write what exists when planning fails: the IR text of each
    record in ``history`` (``00-capture.txt``, then one file per pass that ran), ``gm`` as it
    stood when given (``ir-at-failure.txt``), and the error with its traceback (``error.txt``).
    Once per error: the first place that catches it knows the most."""
    directory = os.environ.get("SHARDFX_DUMP")
    if not directory or getattr(error, "dumped", False):
        return
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for i, record in enumerate(history):
        (out / f"{i:02d}-{record.name}.txt").write_text(record.text)
    if gm is not None:
        try:
            text = ir_to_text(gm)
        except Exception as e:  # a broken IR may not print: say so instead
            text = f"the IR could not be printed: {e!r}\n"
        (out / "ir-at-failure.txt").write_text(text)
    (out / "error.txt").write_text("".join(traceback.format_exception(error)))
    error.dumped = True
    log.warning("planning failed; wrote the IR and the error to %s", out)
