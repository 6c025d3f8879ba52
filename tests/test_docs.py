"""The docs stay true to the tree: docs/architecture.md's source map names every module of
shardfx/, and every link in the README and docs/ to a heading or a page resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _source_map() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Source map", 1)[1]
    return section.split("```")[1]  # the block under the heading


def _entries(block: str) -> dict[str, str]:
    """The source map's entries under ``shardfx/``: a folder (``ir/``) or a top-level file's
    name, to its text with the lines that continue it."""
    entries: dict[str, str] = {}
    key = None
    for line in block.split("\n"):
        head = line[2:].split(" ", 1)[0] if line.startswith("  ") and line[2] != " " else None
        if head:
            key = head
            entries[key] = line
        elif line.startswith(" ") and key:
            entries[key] += "\n" + line
        else:
            key = None
    return entries


def test_the_source_map_names_every_file_in_its_folder():
    entries = _entries(_source_map())
    missing = []
    for path in sorted((ROOT / "shardfx").rglob("*.py")):
        rel = path.relative_to(ROOT / "shardfx")
        if len(rel.parts) == 1:
            if rel.name != "__main__.py" and rel.name not in entries:
                missing.append(str(rel))
            continue
        entry = entries.get(rel.parts[0] + "/", "")
        if path.name != "__init__.py" and not re.search(rf"\b{path.stem}\b", entry):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's source map does not name, in its folder: {missing}"


def test_the_source_map_check_finds_a_file_named_in_another_folder():
    entries = _entries("shardfx/\n  ir/     meta, text\n  cost/   node\n  api.py  partition\n")
    assert set(entries) == {"ir/", "cost/", "api.py"}
    assert "node" in entries["cost/"] and "node" not in entries["ir/"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_heading_or_a_page_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links, not code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue  # the web: not checked here
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
                continue
            if anchor and linked.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}
                if anchor not in heads:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
