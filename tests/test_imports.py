"""The import graph of shardfx, read from the source (imports inside functions count; those
under ``if TYPE_CHECKING:`` name types and never run): every import goes down the layers or
stays in its own, no two modules import each other even through others, a lazy import says
why, and at most 8 modules sit loose at the top. docs/architecture.md, "Imports go down", is
the same list in words.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A module's layer is its longest prefix here; it may import its own layer's
# modules and those of any layer below.
LAYERS = [
    ["shardfx.errors", "shardfx.mesh"],  # the words every layer uses
    ["shardfx.request"],  # what the user asked: Options, hints, precision
    ["shardfx.ir"],  # the graph, its meta keys, text, units, layouts
    ["shardfx.schedule"],  # pipeline schedules as data
    ["shardfx.kernels"],  # the ops programs call that shardfx implements; the device
    ["shardfx.rules"],  # sharding rules beside DTensor's
    ["shardfx.cost"],  # what one op costs; the device model; optimizer state; value sizes
    ["shardfx.partitioner"],  # capture: a model into the IR
    ["shardfx.codegen"],  # the IR into per-device programs
    ["shardfx.passes"],  # IR passes and program passes
    ["shardfx.ir.parse"],  # the text reader: derives declared placements with shard_propagate
    ["shardfx.estimate"],  # a program's memory, step time and summary
    ["shardfx.auto"],  # the solvers: sharding, the ZeRO stage, remat
    ["shardfx.compiler"],  # the driver: the passes in order, every re-emit
    ["shardfx.report"],  # print(plan), plan.html
    ["shardfx.runtime"],  # runners on torch.distributed, launch, checkpoints
    ["shardfx.plan"],  # the compiler's result and the methods users call
    ["shardfx.api", "shardfx", "shardfx.testing"],  # partition() and the public names
    ["shardfx.cluster"],  # the plan for N devices: candidates priced, finalists planned
    ["shardfx.run", "shardfx.metrics", "shardfx.__main__"],  # the command line and trainer
]
TOP_LEVEL_LIMIT = 8


def layer(name: str) -> int | None:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in graph.items() for b in bs if layer(b) > layer(a))


def lazy_without_reason(path: Path) -> list[int]:
    """Lines of imports of shardfx inside a function with no comment saying why."""
    lines = path.read_text().split("\n")
    out = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    names = [inner.module or ""] if isinstance(inner, ast.ImportFrom) else \
                        [a.name for a in inner.names]
                    if any(n == "shardfx" or n.startswith("shardfx.") for n in names) and \
                            "#" not in lines[inner.lineno - 1]:
                        out.append(inner.lineno)
    return sorted(set(out))


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


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
    for node in _runtime_nodes(ast.parse(path.read_text())):
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


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``, which name types for
    annotations and never run."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                stack.extend(child.orelse)
            else:
                stack.append(child)


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


def test_every_module_has_a_layer():
    assert not [m for m in modules() if layer(m) is None], \
        "a new folder or top-level module: add it to LAYERS and docs/architecture.md"


def test_imports_go_down():
    up = upward(graph())
    assert not up, ("a module imports one above its layer (imports inside functions count); "
                    f"move the shared code down, or the caller up: {up}")


def test_no_import_circle():
    found = [sorted(c) for c in circles(graph())]
    assert not found, ("modules import each other in a circle (imports inside functions "
                       f"count); move the shared code down a layer: {found}")


def test_a_lazy_import_says_why():
    found = {str(p.relative_to(ROOT)): lines for p in modules().values()
             if (lines := lazy_without_reason(p))}
    assert not found, ("an import inside a function, with no comment on its line saying why "
                       f"it is not at the top (e.g. --help staying fast): {found}")


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "shardfx").glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, top


MEASURES = ("shardfx.cost", "shardfx.estimate")  # the cost model: what ops and programs cost
MADE = ("shardfx.codegen", "shardfx.passes")  # what makes the programs


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def costing_code(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of code generation or passes by the cost model."""
    return sorted((a, b) for a, bs in graph.items() for b in bs
                  if _under(a, MEASURES) and _under(b, MADE))


def test_the_cost_model_imports_no_code_generation():
    """Ops state their own cost (``workspace``, ``steps_optimizer``, FLOPs and bytes through
    ``cost.node``) and the programs the memory model walks are handed to it (ZeRO's gather
    programs, a pipeline stage's reductions in the split module's meta): cost/ and estimate/
    import neither codegen/ nor passes/."""
    found = costing_code(graph())
    assert not found, ("the cost model imports code generation: let the op state what it costs "
                       f"or pass the program in: {found}")


def test_the_checks_find_what_they_look_for(tmp_path):
    """An upward edge, a circle through an import inside a function, an unexplained lazy
    import and code generation imported by the cost model are each found; none is found where
    there is none."""
    assert upward({"shardfx.ir.graph": {"shardfx.plan"}, "shardfx.plan": {"shardfx.ir.graph"}}) \
        == [("shardfx.ir.graph", "shardfx.plan")]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert costing_code({"shardfx.estimate.memory": {"shardfx.codegen.zero", "shardfx.ir.meta"},
                         "shardfx.compiler.shallow": {"shardfx.passes.zero"}}) == \
        [("shardfx.estimate.memory", "shardfx.codegen.zero")]
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from shardfx.plan import Plan\n    from shardfx.api import "
                    "partition  # lazy: a reason\n    return Plan, partition\n")
    assert lazy_without_reason(lazy) == [2]


TORCH_MODULE = {"_buffers", "_parameters", "_modules"}  # nn.Module's own, read by name
OWNERS = {"shardfx/plan.py": {"Plan"}, "shardfx/compiler/compiled.py": {"Compiled"},
          "shardfx/runtime/runner.py": {"Runner"}, "shardfx/runtime/pipeline.py": {"PipelineRunner"}}


def _private_members(path: Path, classes: set[str]) -> set[str]:
    """``_name`` attributes and methods the classes define (``self._name = ...``, ``def _name``)."""
    out = set()
    for cls in ast.walk(ast.parse(path.read_text())):
        if isinstance(cls, ast.ClassDef) and cls.name in classes:
            for n in ast.walk(cls):
                name = n.attr if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                    and n.value.id == "self" else getattr(n, "name", None) \
                    if isinstance(n, ast.FunctionDef) else None
                if name and name.startswith("_") and not name.startswith("__"):
                    out.add(name)
    return out


def private_uses(owners: dict[str, set[str]], files: list[Path] | None = None) -> list[str]:
    """Uses of those members in any module (of ``files``: shardfx's) but the one that defines
    them."""
    members = {path: _private_members(ROOT / path, classes) for path, classes in owners.items()}
    everywhere = set().union(*members.values())
    found = []
    for path in files or sorted((ROOT / "shardfx").rglob("*.py")):
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        tree = ast.parse(path.read_text())
        classes = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
        own = _private_members(path, classes) | TORCH_MODULE  # its own classes', nn.Module's
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in everywhere - own:
                found.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    return found


def test_no_module_reads_the_private_state_of_a_plan_or_a_runner():
    assert not private_uses(OWNERS), private_uses(OWNERS)


def test_the_private_state_check_finds_a_use(tmp_path):
    user = tmp_path / "user.py"
    user.write_text("class Mine:\n    def f(self, plan):\n        self._own = 1\n"
                    "        return plan._inference, self._own\n")
    assert private_uses({"shardfx/plan.py": {"Plan"}}, [user]) == ["user.py:4 plan._inference"]
