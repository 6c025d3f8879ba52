"""``plan.dump(dir)``: every pass's IR, the programs (a pipeline's parts, and each stage's sum
over dp), the schedule, the summary, plan.html and the fused kernels, as files a person can
read."""

from __future__ import annotations

import os
from pathlib import Path

from shardfx.ir import meta as M
from shardfx.kernels.triton import FusedKernel
from shardfx.report.html import plan_html


def write_dump(plan, directory: str | os.PathLike) -> Path:
    """``Plan.dump``: the files it lists, in ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for i, done in enumerate(plan.history):
        (out / f"{i:02d}-{done.name}.txt").write_text(done.text)
    if plan.program is not None:
        (out / f"program_{plan.mode}.py").write_text(plan.program.source)
    for i, program in enumerate(plan.zero_gather_programs):  # ZeRO-1/2, after each step
        (out / f"program_zero_gather{i}.py").write_text(program.source)
    if plan.stage_program is not None:
        for name, part in plan.stage_program.named_children():  # stage0_F, stage1_B, ...
            (out / f"{name}.py").write_text(part.code)
        (out / "stages.py").write_text(plan.stage_program.code)  # the order parts feed
        for stage, reduction in plan.stage_program.meta.get(M.REPLICAS, {}).items():
            (out / f"stage{stage}_replicas.py").write_text(reduction.source)  # dp's sums
        (out / "schedule.txt").write_text(f"{plan.schedule}\n\n"
                                          f"{plan.schedule.format_lists()}\n")
    (out / "plan.txt").write_text(str(plan))
    (out / "plan.html").write_text(plan_html(plan))  # one page, no network: open it
    kernels = plan.kernels()
    if kernels:
        (out / "kernels").mkdir(exist_ok=True)
        for k in kernels:
            (out / "kernels" / f"{k.group.name}.py").write_text(k.source)
        (out / "kernels.txt").write_text("".join(f"{_kernel_line(k)}\n" for k in kernels))
    if plan.collectives:
        (out / "collectives.txt").write_text("".join(
            f"{c.kind} {c.axis} {c.nbytes} B  {c.reason}\n" for c in plan.collectives))
    return out


def _kernel_line(k: FusedKernel) -> str:
    """One fused kernel for ``kernels.txt``: its shape, its ops, the bytes it moves."""
    g = k.group
    ops = ", ".join(f"{o.source}={str(o.target).removeprefix('aten.')}" for o in g.ops)
    return f"{g.name} {list(g.shape)}: {ops}; moves {g.fused_bytes} B, unfused {g.unfused_bytes} B"
