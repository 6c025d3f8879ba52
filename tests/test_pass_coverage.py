"""Every pass has a unit test in the IR's text form: each IR pass a tests/test_pass_<name>.py,
each program pass a tests/test_program_pass_<name>.py, and every file under shardfx/passes/ is
imported by one of them (a new pass without its text test fails here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shardfx.compiler.driver import ir_passes
from shardfx.mesh import MeshSpec
from shardfx.passes.program import program_passes
from shardfx.request.options import Options

ROOT = Path(__file__).resolve().parent.parent
EVERYTHING = Options(mesh=MeshSpec.parse({"dp": 2, "cp": 2, "tp": 2}), shard="auto",
                     fused_loss=True, zero=3, optimizer_in_backward=True, kernels="triton")
PIPELINE = dataclasses.replace(EVERYTHING, mesh=MeshSpec.parse({"pp": 2, "dp": 2, "tp": 2}), zero=0,
                               optimizer_in_backward=False)


def _name(f) -> str:
    return f.__name__.removesuffix("_pass")


def test_every_ir_pass_has_a_text_test():
    names = [_name(f) for f in ir_passes(EVERYTHING, EVERYTHING.mesh)] + ["stage_cut"]
    missing = [n for n in names if not (ROOT / "tests" / f"test_pass_{n}.py").exists()]
    assert len(names) >= 9 and not missing, missing


def test_every_program_pass_has_a_text_test():
    names = {_name(f) for f in program_passes(EVERYTHING) + program_passes(PIPELINE)}
    missing = [n for n in names if not (ROOT / "tests" / f"test_program_pass_{n}.py").exists()]
    assert len(names) >= 7 and not missing, missing


# Each file under shardfx/passes/, and the text test of the pass it is (or helps).
COVERED_BY = {
    "assign_phase": "test_pass_assign_phase", "causal_mask": "test_pass_causal_mask",
    "decompose": "test_pass_decompose", "estimate_cost": "test_pass_estimate_cost",
    "experts_router": "test_pass_mixed_precision", "mixed_precision": "test_pass_mixed_precision",
    "random_draws": "test_pass_rng_stream", "rng": "test_pass_rng_stream",
    "shard_annotate": "test_pass_shard_annotate", "shard_propagate": "test_pass_shard_propagate",
    "stage_cut": "test_pass_stage_cut", "fused_loss": "test_program_pass_chunked_loss",
    "fusion": "test_program_pass_triton_fusion", "zero": "test_program_pass_zero_gather",
    "program": "test_program_pass_split_stages",
}


def test_every_file_under_passes_has_its_text_test():
    files = {p.stem for p in (ROOT / "shardfx" / "passes").glob("*.py") if p.stem != "__init__"}
    assert files == set(COVERED_BY), ("a pass file without its text test (name it here): "
                                      f"{sorted(files ^ set(COVERED_BY))}")
    assert all((ROOT / "tests" / f"{t}.py").exists() for t in COVERED_BY.values())
