"""The import graph of shardfx, read from the source (imports inside functions count): no new
circle, and none grown. The circles listed are what the layout still owes (docs/architecture.md:
imports go down the layers); this list only shrinks, as modules move to the layer they belong to.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KNOWN = [
    {"shardfx.analysis", "shardfx.codegen.step_in_backward", "shardfx.codegen.triton",
     "shardfx.codegen.triton_ops", "shardfx.device_model", "shardfx.ir.text", "shardfx.memory",
     "shardfx.passes.estimate_cost", "shardfx.report"},
    {"shardfx.schedule.actions", "shardfx.schedule.check"},
    {"shardfx.auto.zero_stage", "shardfx.budget", "shardfx.ir.verify", "shardfx.passes.auto_shard",
     "shardfx.passes.manager", "shardfx.passes.program", "shardfx.pipeline", "shardfx.shallow"},
    {"shardfx.partitioner.capture", "shardfx.partitioner.constants"},
    {"shardfx.api", "shardfx.plan", "shardfx.runtime.checkpoint", "shardfx.runtime.checks",
     "shardfx.runtime.launch", "shardfx.runtime.pipeline", "shardfx.runtime.pipeline_state",
     "shardfx.runtime.runner", "shardfx.runtime.saving"},
    {"shardfx.cli", "shardfx.train"},
]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "shardfx").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The shardfx modules ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                    for a in node.names}
    return {m for m in out if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_new_import_circle_and_none_grown():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    now = circles(graph)
    worse = [sorted(c) for c in now if not any(c <= k for k in KNOWN)]
    assert not worse, ("modules import each other in a circle (imports inside functions count); "
                       f"move the shared code down a layer: {worse}")


def test_the_circles_are_found():
    """The finder itself: a circle through an import inside a function, and none without."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []
