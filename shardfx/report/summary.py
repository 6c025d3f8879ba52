"""``print(plan)`` and ``shardfx inspect``: the plan as rich tables, rendered to text."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from shardfx.estimate.analysis import Summary
from shardfx.codegen.redistribute import Collective
from shardfx.ir.text import block_pattern
from shardfx.estimate.memory import KINDS, DeviceMemory
from shardfx.ir.units import flops, nbytes
from shardfx.partitioner.repeats import refusal


def render(summary: Summary, mesh: str, collectives: list[Collective] = (),
           replicated: list[str] = (), stages: list[dict] = (), traced: str = "",
           memory: dict[str, DeviceMemory] | None = None, notes: list[str] = (),
           compute: dict[str, tuple[int, int]] | None = None, slices: int = 1,
           predicted: str = "") -> str:
    """The plan as text tables. Each says whose numbers it holds: the whole model (the
    parameters, the compute of a step, the activations of the traced batch) or one device
    (``compute``'s other columns, the memory at the peak, the communication, the ``predicted``
    step time, a line under the memory table)."""
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=False, color_system=None)
    s = summary
    title = f"shardfx plan: {s.model} ({s.mode}, mesh {mesh})"

    nodes = Table(title="Nodes by kind", title_justify="left")
    nodes.add_column("kind")
    nodes.add_column("count", justify="right")
    for kind, n in s.nodes.items():
        nodes.add_row(kind, str(n))

    work = Table(title="Compute per step (estimated FLOPs)", title_justify="left")
    work.add_column("")
    rows = compute or {"whole model": (s.flops_fwd, s.flops_bwd)}
    for who in rows:
        work.add_column(who if who == "whole model" else f"per device: {who}", justify="right")
    work.add_row("forward", *(flops(f) for f, _ in rows.values()))
    if s.mode == "train":
        work.add_row("backward", *(flops(b) for _, b in rows.values()))

    per = "one slice of the batch" if slices > 1 else "the whole batch"
    cost = Table(title=f"Activations of the whole model on one device, {per} (per device: "
                 "the memory table)", title_justify="left")
    cost.add_column("")
    cost.add_column("forward", justify="right")
    cost.add_column("backward", justify="right")
    cost.add_row("peak activations", nbytes(s.peak_fwd_bytes),
                 nbytes(s.peak_bwd_bytes) if s.mode == "train" else "-")
    cost.add_row("saved for backward", nbytes(s.saved_bytes) if s.mode == "train" else "-", "")

    state = Table(title="State of the whole model", title_justify="left")
    state.add_column("")
    state.add_column("count", justify="right")
    state.add_column("bytes", justify="right")
    state.add_row("parameters", f"{s.param_count:,}", nbytes(s.param_bytes))
    state.add_row("buffers", "", nbytes(s.buffer_bytes))

    ops = Table(title="Most frequent ops", title_justify="left")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in s.top_ops:
        ops.add_row(op, str(n))

    console.print(title)
    if traced:
        console.print(f"Traced: {traced}")
    if refusal(traced):
        console.print("Repeated blocks not stamped (why above): every block was traced, so "
                      "planning takes time in proportion to their number")
    for table in (nodes, state, work, cost, ops):
        console.print(table)
    if memory:
        console.print(_memory(memory))
    if predicted:
        console.print(predicted)
    for note in notes:
        console.print(note)
    if stages:
        console.print(_stages(stages))
    if collectives:
        console.print(_communication(collectives))
        if any(c.module for c in collectives):
            console.print(_by_module(collectives))
        console.print(_largest(collectives))
    if replicated:
        shown = ", ".join(replicated[:12]) + (" ..." if len(replicated) > 12 else "")
        console.print(f"{len(replicated)} ops have no sharding rule and run replicated: {shown}")
    return buf.getvalue()


def _memory(memory: dict[str, DeviceMemory]) -> Table:
    """The predicted peak per device (or per group of devices that run alike), by what holds
    it, and when in the step it happens."""
    table = Table(title="Memory at the peak (per device, predicted)", title_justify="left")
    table.add_column("")
    for who in memory:
        table.add_column(who, justify="right")
    for kind in KINDS:
        table.add_row(kind, *(nbytes(getattr(m, kind)) for m in memory.values()))
    table.add_row("total", *(nbytes(m.total) for m in memory.values()))
    table.add_row("when", *(m.when for m in memory.values()))
    return table


def _stages(stages: list[dict]) -> Table:
    """Each pipeline stage: ops, estimated time share, parameters, what it sends on."""
    total = sum(s["time"] for s in stages) or 1.0
    table = Table(title="Pipeline stages", title_justify="left")
    for col in ("stage", "fwd ops", "time share", "params", "sends to later stages"):
        table.add_column(col, justify="left" if col.startswith("sends") else "right")
    for s in stages:
        sends = ", ".join(f"{name} {nbytes(b)} -> {','.join(map(str, to))}"
                          for name, b, to in s["sends"])
        table.add_row(str(s["stage"]), str(s["ops"]), f"{s['time'] / total:.0%}",
                      nbytes(s["param_bytes"]), sends or "-")
    return table


def _communication(collectives: list[Collective]) -> Table:
    """Per mesh axis and kind: count and bytes; then the largest with the reason for each."""
    table = Table(title="Communication per step (per device, bytes in)", title_justify="left")
    for col in ("axis", "collective", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for (axis, kind), (n, b) in collective_totals(collectives).items():
        table.add_row(axis, kind, str(n), nbytes(b))
    return table


def collective_totals(collectives: list[Collective]) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, kind) -> (count, bytes in), sorted by axis and kind."""
    totals: dict[tuple[str, str], list[int]] = {}
    for c in collectives:
        t = totals.setdefault((c.axis, c.kind), [0, 0])
        t[0] += 1
        t[1] += c.nbytes
    return {key: (n, b) for key, (n, b) in sorted(totals.items())}


def by_module(collectives: list[Collective]) -> list[tuple]:
    """(module, phase, axis, kind, per block: count, bytes; blocks) of the collectives a
    module's ops need, a repeated block's index as ``*`` (``ir.text.block_pattern``); the
    largest first. Gradient buckets and the like, needed by no one op, are "(program)"."""
    groups: dict[tuple[str, str, str, str], list] = {}
    for c in collectives:
        key = (block_pattern(c.module) if c.module else "(program)", c.phase, c.axis, c.kind)
        g = groups.setdefault(key, [0, 0, set()])
        g[0] += 1
        g[1] += c.nbytes
        g[2].add(c.module)
    rows = [(*key, n // len(paths), b // len(paths), len(paths))
            for key, (n, b, paths) in groups.items()]
    return sorted(rows, key=lambda r: -r[5] * r[6])


def _by_module(collectives: list[Collective], n: int = 10) -> Table:
    rows = by_module(collectives)
    table = Table(title=f"Communication by module, per block ({min(n, len(rows))} of "
                  f"{len(rows)})", title_justify="left")
    for col in ("module", "phase", "axis", "collective", "count", "bytes", "blocks"):
        table.add_column(col, justify="right" if col in ("count", "bytes", "blocks")
                         else "left")
    for module, phase, axis, kind, count, b, blocks in rows[:n]:
        table.add_row(module, phase, axis, kind, str(count), nbytes(b), str(blocks))
    return table


def _largest(collectives: list[Collective], n: int = 8) -> Table:
    """The biggest collectives and why each is there (all of them: plan.dump's collectives.txt)."""
    table = Table(title=f"Largest collectives ({min(n, len(collectives))} of {len(collectives)})",
                  title_justify="left")
    for col in ("collective", "axis", "bytes", "why: node, placement change"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for c in sorted(collectives, key=lambda c: -c.nbytes)[:n]:
        table.add_row(c.kind, c.axis, nbytes(c.nbytes), c.reason)
    return table
