"""Hugging Face families shardfx was not written against, trained through it and checked
against eager PyTorch: the quick subset of ``bench/heldout.py`` (a dense family, a MoE one and
PhiMoE's random routing through a custom ``autograd.Function``; one device, dp=2, tp=2, ep=2).

Every run must pass ``compare_training`` or be refused by a named shardfx error; a mismatch,
any other exception, a hang or a crash fails the test with each such run's first line. Slow (a
launch per mesh): ``python -m bench.heldout`` sweeps every family and mesh with a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed

from bench.heldout import QUICK_FAMILIES, QUICK_MESHES, sweep  # noqa: E402


@pytest.mark.slow
def test_quick_families_pass_or_are_refused_by_name():
    results = sweep(QUICK_FAMILIES.split(","), QUICK_MESHES.split(","), steps=2)
    assert results and all(r.family and r.kind for r in results)
    bad = [f"{r.family} x {r.mesh}: {r.kind} {r.headline()}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    assert any(r.kind == "pass" and r.mesh == "ep2" for r in results), \
        "no MoE family ran on ep=2"
