"""What the solver decided, and why, in words: ``print(plan)`` and ``plan.html`` show these lines.

The why is the cost terms: the chosen plan's predicted compute and communication next to those
of the named plans (``megatron``, ``replicate``): planned in full where the integer program
priced them close to its choice (``compiler.finalists``), else as it priced them; and the
parameters where the choice departs from Megatron's, one line per parameter of a block (the
same for every block of a stamped list).
"""

from __future__ import annotations

import re

from shardfx.ir import meta as M
from shardfx.ir.units import nbytes
from shardfx.compiler.finalists import idle_axes, idle_words


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _terms(seconds: float, compute: float) -> str:
    return f"{_ms(seconds)} (compute {_ms(compute)}, communication " \
           f"{_ms(max(0.0, seconds - compute))})"


def notes(report, megatron: dict[str, M.Placements] | None = None) -> list[str]:
    """``report``: the ``AutoReport``; ``megatron``: Megatron's placements by FQN (None: the
    mesh has no tp)."""
    axes = ", ".join(report.axes)
    planned = report.planned
    if report.kept != "auto" and "auto" not in planned:
        lines = [f'Sharding (shard="auto") on {axes}: {report.kept}, predicted '
                 f"{_terms(*planned[report.kept])} a step: the solver's choice (priced at "
                 f"{_ms(report.seconds)}) did not fit the memory budget once planned"]
    elif report.kept != "auto":
        lines = [f'Sharding (shard="auto") on {axes}: {report.kept}, planned next to the '
                 f"solver's choice and predicted faster: {_terms(*planned[report.kept])} a step",
                 f"  the solver's choice, planned, would take {_terms(*planned['auto'])} (the "
                 f"integer program priced it at {_ms(report.seconds)})"]
    else:
        lines = [f'Sharding chosen by the solver (shard="auto") on {axes}: predicted '
                 f"{_terms(*planned.get('auto', (report.seconds, report.compute)))} a step"
                 + (f" (the integer program priced it at {_ms(report.seconds)})"
                    if "auto" in planned else "")]
    for name, (seconds, compute) in report.named.items():
        if name == report.kept:
            continue
        if name in planned:
            lines.append(f"  {name:<9} would take {_terms(*planned[name])} (planned)")
        else:
            lines.append(f"  {name:<9} would take {_terms(seconds, compute)} (the integer "
                         "program's price: not close enough to plan)")
    if report.budget is not None:
        lines.append(f"  memory: {nbytes(report.memory)} of parameters, gradients, optimizer "
                     f"state and saved activations per device, budget {nbytes(report.budget)}")
    lines.append(f"  integer program: {report.size}; candidates in "
                 f"{report.enumerate_seconds:.2f} s, solved in {report.solve_seconds:.2f} s "
                 f"(within {report.gap:.1%} of the cheapest, proved)")
    if report.zero_chosen and "dp" in report.mesh_axes:
        lines.append(f"  ZeRO stage {report.zero} over dp priced with the placements "
                     f'(zero="auto": the cheapest stage whose state fits)')
    used = _batch_axes(report)
    if used:
        lines.append(f"  the batch is split over {used} as well: that axis serves as data "
                     "parallel")
    if idle_axes(report):
        lines.append(f"  {idle_words(report)}")
    if megatron is not None and report.kept == "auto":
        lines += departures(report.params, megatron)
    return lines


def _batch_axes(report) -> str:
    names = set()
    for placements in report.inputs.values():
        for axis, p in zip(report.mesh_axes, placements):
            if axis in report.axes and type(p).__name__ == "Shard" and p.dim == 0:
                names.add(axis)
    return ", ".join(sorted(names))


def departures(chosen: dict[str, M.Placements], megatron: dict[str, M.Placements],
               limit: int = 12) -> list[str]:
    """Parameters placed unlike Megatron's plan, a block's index written ``*``."""
    seen: dict[str, tuple[str, str]] = {}
    for fqn, placements in chosen.items():
        want = megatron.get(fqn)
        got = M.placements_str(placements)
        mine = M.placements_str(want) if want is not None else "R" * len(placements)
        if got == mine:
            continue
        seen.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), (got, mine))
    if not seen:
        return ["  every parameter is placed as Megatron places it"]
    out = [f"  placed unlike Megatron ({len(seen)}): parameter chosen (megatron)"]
    for fqn, (got, mine) in list(seen.items())[:limit]:
        out.append(f"    {fqn}: {got} ({mine})")
    if len(seen) > limit:
        out.append(f"    ... and {len(seen) - limit} more")
    return out
