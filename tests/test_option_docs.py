"""Each option of ``shardfx.partition`` has one text (``request/option_docs.py``): partition's
docstring lists exactly its options from there, ``shardfx run --help`` takes the [parallel]
flags' help from there, and the README and docs/ name only options that exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import shardfx
from shardfx.request.option_docs import OPTIONS, summary
from shardfx.run.config import Parallel, config_fields

ROOT = Path(__file__).resolve().parent.parent
POSITIONAL = {"model", "example_args", "loss_fn", "example_targets"}


def test_every_option_of_partition_has_its_text_and_no_other():
    options = set(inspect.signature(shardfx.partition).parameters) - POSITIONAL
    assert options == set(OPTIONS), options ^ set(OPTIONS)
    doc = shardfx.partition.__doc__
    assert all(f"\n    {name}: " in doc for name in OPTIONS)


def test_run_help_for_partition_options_is_their_text():
    parallel = [f for section, f in config_fields() if section == "parallel"]
    assert {f.name for f in parallel} <= set(OPTIONS)
    assert all(f.metadata["help"] == summary(f.name) for f in parallel)
    assert len(parallel) == len(Parallel.__dataclass_fields__) >= 8


def test_the_docs_name_only_options_that_exist():
    """``partition(..., name=...)`` and ``partition(name=...)`` in prose, and keyword
    arguments of partition calls in code blocks, are options of partition."""
    named = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for call in re.finditer(r"partition\(((?:[^()]|\([^()]*\))*)\)", text):
            for name in re.findall(r"(?<![\w.])([a-z_]+)=(?!=)", call.group(1)):
                named.setdefault(name, page.name)
    unknown = {n: p for n, p in named.items() if n not in OPTIONS and n not in POSITIONAL}
    assert len(named) >= 8 and not unknown, unknown
