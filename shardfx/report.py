"""``print(plan)`` and ``shardfx inspect``: the plan as rich tables, rendered to text."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from shardfx.analysis import Summary


def render(summary: Summary, mesh: str) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=False, color_system=None)
    s = summary
    title = f"shardfx plan: {s.model} ({s.mode}, mesh {mesh})"

    nodes = Table(title="Nodes by kind", title_justify="left")
    nodes.add_column("kind")
    nodes.add_column("count", justify="right")
    for kind, n in s.nodes.items():
        nodes.add_row(kind, str(n))

    cost = Table(title="Cost per step (one device)", title_justify="left")
    cost.add_column("")
    cost.add_column("forward", justify="right")
    cost.add_column("backward", justify="right")
    cost.add_row("FLOPs", flops(s.flops_fwd), flops(s.flops_bwd) if s.mode == "train" else "-")
    cost.add_row("peak activations", nbytes(s.peak_fwd_bytes),
                 nbytes(s.peak_bwd_bytes) if s.mode == "train" else "-")
    cost.add_row("saved for backward", nbytes(s.saved_bytes) if s.mode == "train" else "-", "")

    state = Table(title="State", title_justify="left")
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
    for table in (nodes, state, cost, ops):
        console.print(table)
    return buf.getvalue()


def nbytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def flops(n: int) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f}" if unit == "" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError
