"""Passes' contracts as code (``ir.contract``): in a debug run the pass manager checks what a
pass requires before it runs and what it ensures after, and a broken one is a PassError naming
the pass and the condition; what each IR and program pass ensures is named in
docs/architecture.md's table of passes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardfx.codegen.spmd import generate_spmd
from shardfx.compiler.driver import ir_passes
from shardfx.compiler.manager import run_passes, run_program_passes
from shardfx.errors import PassError
from shardfx.ir import meta as M
from shardfx.ir.contract import contract, on_ops
from shardfx.mesh import MeshSpec
from shardfx.partitioner.capture import capture
from shardfx.passes.program import bucket_gradients_pass, program_passes, zero_reduce_scatter
from shardfx.passes.stage_cut import stage_cut
from shardfx.request.options import Options

ROOT = Path(__file__).resolve().parent.parent


def _mlp_ir():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return capture(model, (torch.randn(4, 4),), F.mse_loss, (torch.randn(4, 4),)).gm


def test_a_pass_run_before_what_it_requires_is_named():
    options = Options(mesh=MeshSpec.parse({"pp": 2}), debug=True)
    with pytest.raises(PassError) as info:
        run_passes(_mlp_ir(), [stage_cut], options, None)  # no PHASE, no COST yet
    assert "stage_cut requires PHASE on every op" in info.value.cause
    assert "stage_cut" in info.value.where


def test_a_pass_that_does_not_leave_what_it_ensures_is_named():
    @contract(ensures=[on_ops(M.STAGE, "STAGE")])
    def forgets_stages(gm, options):
        return gm

    with pytest.raises(PassError) as info:
        run_passes(_mlp_ir(), [forgets_stages], Options(debug=True), None)
    assert "forgets_stages ensures STAGE on every op" in info.value.cause
    run_passes(_mlp_ir(), [forgets_stages], Options(debug=False), None)  # unchecked: no error


def test_program_passes_out_of_order_are_named():
    options = Options(mesh=MeshSpec.parse({"dp": 2}), shard="replicate", zero=2, debug=True,
                      fused_loss=False)
    with pytest.raises(PassError) as info:  # the buckets first, then ZeRO's reduce-scatter
        run_program_passes(_program(options), [bucket_gradients_pass, zero_reduce_scatter],
                           options, None)
    assert "zero_reduce_scatter requires no gradient bucket yet" in info.value.cause
    run_program_passes(_program(options), program_passes(options), options, None)  # in order


def _program(options: Options):
    gm = _mlp_ir()
    gm.meta[M.GRAPH] = dataclasses.replace(gm.meta[M.GRAPH], mesh=options.mesh.axes)
    return generate_spmd(run_passes(gm, ir_passes(options, options.mesh), options, None))


def _rows(heading: str) -> dict[str, str]:
    """docs/architecture.md's pass table under ``heading``: pass name -> its row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split(heading, 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `(?:[\w/]+\.)?(\w+)`", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_what_each_pass_ensures_is_named_in_the_docs_table():
    everything = Options(mesh=MeshSpec.parse({"dp": 2, "cp": 2, "tp": 2}), shard="auto",
                         fused_loss=True, zero=3, optimizer_in_backward=True, kernels="triton")
    pipeline = dataclasses.replace(everything, mesh=MeshSpec.parse({"pp": 2}), zero=0,
                                   optimizer_in_backward=False)
    rows = _rows("**IR passes**")
    missing = []
    for p in [*ir_passes(everything, everything.mesh), stage_cut]:
        missing += [(p.__name__, c.key) for c in getattr(p, "ensures", ())
                    if c.key not in rows.get(p.__name__, "")]
    rows = _rows("**Program passes**")
    for p in program_passes(everything) + program_passes(pipeline):
        missing += [(p.__name__, c.key) for c in getattr(p, "ensures", ())
                    if c.key not in rows.get(p.__name__, "")]
    assert len(rows) >= 7 and not missing, missing
