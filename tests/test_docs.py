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


def test_the_source_map_names_every_module():
    block = _source_map()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    modules = [p for p in sorted((ROOT / "shardfx").rglob("*.py")) if p.name != "__init__.py"]
    missing = [str(p.relative_to(ROOT)) for p in modules if p.stem not in words]
    assert not missing, f"docs/architecture.md's source map does not name: {missing}"
    folders = {p.parent.name for p in modules if p.parent.name != "shardfx"}
    assert not [f for f in folders if f"{f}/" not in block], folders


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
