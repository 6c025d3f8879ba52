"""``print(plan)``: the summary's tables (``report.summary``) and, under them, every note: what
``shard="auto"`` chose and why, memory, the sequence split, the experts, random draws."""

from __future__ import annotations

from shardfx.ir import meta as M
from shardfx.passes.shard_annotate import megatron_placements, sequence_split
from shardfx.passes.stage_cut import stage_report
from shardfx.report import experts, explain
from shardfx.report.notes import memory_notes
from shardfx.report.summary import render


def plan_text(plan) -> str:
    return render(plan.summary, str(plan.mesh), plan.collectives, plan.replicated_ops(),
                  stage_report(plan.ir) if plan.options.stages > 1 else (),
                  traced=plan.capture_path, memory=plan.memory_rows(),
                  notes=auto_notes(plan) + memory_notes(plan) + _sequence_notes(plan)
                  + experts.notes(plan) + _random_notes(plan),
                  compute=plan.compute_rows(),
                  slices=plan.options.slices if plan.stage_program is not None else 1,
                  predicted=str(plan.predicted_step))


def auto_notes(plan) -> list[str]:
    """What ``shard="auto"`` chose and why (``report.explain``)."""
    report = plan.ir.meta.get(M.AUTO)
    if report is None:
        return []
    megatron = megatron_placements(plan.ir, plan.options) if "tp" in report.axes else None
    return explain.notes(report, megatron)


def _random_notes(plan) -> list[str]:
    report = plan.ir.meta.get(M.RANDOM)  # passes.rng: what draws random values, and how
    return [str(report)] if report is not None else []


def _sequence_notes(plan) -> list[str]:
    split = sequence_split(plan.options)
    return [f"Sequence: {split}"] if split else []
