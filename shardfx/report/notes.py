"""The notes under ``print(plan)``'s tables about memory: what each device holds through a
step and why (``Plan.__str__``)."""

from __future__ import annotations

from shardfx.auto import zero_stage
from shardfx.compiler.budget import Candidate
from shardfx.codegen.gradients_to_host import gradients_to_host
from shardfx.codegen.step_in_backward import step_parameters
from shardfx.ir import meta as M
from shardfx.auto.remat_choice import by_module, group_name, module_rows
from shardfx.ir.units import flops, nbytes
from shardfx.codegen.redistribute import Purpose


def memory_notes(plan) -> list[str]:
    """What the plan holds per device and why: the optimizer counted, the precision, the
    training state, ZeRO, the optimizer in the backward or offloaded, fused kernels and the
    fused LM head, and what ``memory_budget`` made it recompute or try."""
    opt = plan.options.optimizer if plan.mode is M.Mode.TRAIN else None
    notes = [f"Optimizer state counted for: {opt or 'none'} (partition(..., optimizer=...))",
             f"Precision: {plan.precision}"]
    if plan.mode is M.Mode.TRAIN:
        notes.append("Training state per device (parameters / gradients as stepped / "
                     "optimizer state): " + "; ".join(
                         f"{label}: {nbytes(p)} / {nbytes(g)} / {nbytes(o)}"
                         for label, (p, g, o) in plan.state_rows().items()))
    if plan.options.folded_from is not None:
        asked = plan.options.folded_from
        notes.append(f"HSDP folded (zero=\"auto\"): mesh {asked} asked; no ZeRO stage within "
                     f"dp={asked.axis('dp')} fits memory_budget, so the "
                     f"{asked.axis('dp_replicate')} replicas are folded into dp: mesh "
                     f"{plan.mesh}, the same ranks, ZeRO over all of them")
    if plan.zero_chosen and plan.mesh.axis("dp") > 1:
        notes.append(zero_stage.why(plan.options.zero, plan.mesh.axis("dp")))
    if plan.options.zero:
        k, dp = plan.options.zero, plan.mesh.axis("dp")
        held = {1: "the optimizer state", 2: "the optimizer state and gradients",
                3: "the optimizer state, gradients and parameters"}[k]
        gathers = [c for c in plan.collectives if c.kind == "all_gather" and c.purpose is Purpose.ZERO]
        notes.append(f"ZeRO-{k} over dp={dp}: each rank keeps 1/{dp} of {held} ("
                     f"{len(plan.zero_layouts)} parameters, dim-0 rows, padded)"
                     + (f"; {len(gathers)} parameter all-gathers per step, a block at a "
                        "time, each issued before the previous one is waited for"
                        if k == 3 else "; updated rows all-gathered after the optimizer "
                        "step"))
        replicas = plan.mesh.axis("dp_replicate")
        if replicas > 1:
            notes.append(f"HSDP: {replicas} replicas of the dp={dp} group (dp_replicate), each "
                         "holding the same rows; " + (
                             "each bucket's rows all-reduced across them after its "
                             f"reduce-scatter over dp (1/{dp} of the gradients)"
                             if k >= 2 else "the whole gradients all-reduced across them"))
    if plan.options.optimizer_in_backward and plan.program is not None:
        steps = plan.program.module.graph.find_nodes(op="call_function",
                                                     target=step_parameters)
        notes.append(f"Optimizer in the backward: {len(steps)} steps, each block's "
                     "parameters (any other parameter alone) stepped where their "
                     "gradients are final, the gradients freed there: the step never "
                     "holds them all")
    if plan.options.offload_optimizer and plan.mode is M.Mode.TRAIN:
        host = max(m.host for m in plan.memory_breakdown().values())
        if plan.program is not None:
            sends = plan.program.module.graph.find_nodes(op="call_function",
                                                         target=gradients_to_host)
            how = (f"{len(sends)} hand-overs copy each block's gradients to the host where "
                   "they are final and free them on the device")
        else:
            how = ("each stage's gradients, summed over its microbatches, go to the host "
                   "when the schedule ends")
        notes.append(f"Optimizer offloaded: what it steps, its gradients and its state are "
                     f"the host's (up to {nbytes(host)} per device, at the step), and it "
                     f"steps there; {how}; the updated values are copied back after the "
                     "step")
    kernels = plan.kernels()
    if kernels:
        ops = sum(len(k.group.ops) for k in kernels)
        moved = sum(k.group.fused_bytes for k in kernels)
        unfused = sum(k.group.unfused_bytes for k in kernels)
        notes.append(f"Kernels: {len(kernels)} fused Triton kernels of {ops} ops, moving "
                     f"{nbytes(moved)} where the ops one by one move {nbytes(unfused)} "
                     "(plan.dump: kernels/, kernels.txt)")
    for f in plan.fused_losses():
        notes.append(
            f"Linear + cross-entropy fused: {f.weight} ({f.tokens} tokens x {f.hidden} -> "
            f"{f.vocab}) in {f.chunks} chunks of {f.rows} rows, forward and backward: the "
            f"{nbytes(f.logits_bytes)} of logits, their log-softmax and their gradient are "
            f"never materialised; "
            + ("its gradients are computed in the forward, nothing recomputed "
               if f.early else "the backward recomputes a chunk's logits ")
            + (f"(fused_loss=\"auto\" fused it: {plan.fused_loss_reason})"
               if plan.fused_loss_reason else
               "(partition(..., fused_loss=False) keeps the ATen ops)"))
    budget, policy = plan.options.memory_budget, plan.options.recompute
    if policy in ("selective", "full") and plan.remat is None:
        notes.append(f"recompute={policy!r}: nothing to recompute (the model has no "
                     + ("repeated block)" if policy == "full" else "attention)"))
    if budget is not None or (policy != "auto" and plan.remat is not None):
        why = f"recompute={policy!r}" if policy != "auto" else \
            f"Rematerialization under memory_budget {nbytes(budget)}"
        if plan.remat is None:
            notes.append(f"memory_budget {nbytes(budget)}: fits without recomputing")
        else:
            r = plan.remat
            share = r.flops / max(1, plan.summary.flops_fwd)
            kept = ", ".join(f"{group_name(g)}: {nbytes(r.saved_before[g])} -> "
                             f"{nbytes(r.saved_after.get(g, 0))}" for g in r.saved_before)
            notes.append(f"{why}: "
                         f"{len(r.recomputed)} ops recomputed in the backward, "
                         f"{flops(r.flops)} FLOPs ({share:.1%} of the forward's); kept "
                         f"for the backward {kept}; recomputed, by module: "
                         f"{by_module(plan.ir, r.recomputed)}")
            if r.offloaded:
                notes.append(f"Offloaded to host memory under memory_budget: {len(r.offloaded)} "
                             f"activations, {nbytes(r.offloaded_bytes)} "
                             + ("per device, " if plan.stage_program is None else
                                "per microbatch over all stages, ")
                             + "copied out after their last forward reader and back one block "
                             "ahead of the backward that reads them; by module: "
                             + ", ".join(f"{k} ({nbytes(b)}"
                                         + (f" in {n} blocks)" if n > 1 else ")")
                                         for k, _, n, b in module_rows(plan.ir, r.offloaded)))
        if plan.budget_candidates:
            notes.append("Schedules tried under memory_budget (the fastest that fits is "
                         "run):\n" + "\n".join(
                             f"  {'->' if c.schedule is plan.schedule else '  '} {c.name}: "
                             + candidate(c) for c in plan.budget_candidates))
    return notes


def candidate(c: Candidate) -> str:
    """One schedule tried under memory_budget, for ``print(plan)``."""
    if c.skipped:
        return f"not fitted: step {c.step * 1e3:.3g} ms simulated recomputing nothing, slower"
    if not c.fits:
        return "does not fit"
    return f"step {c.step * 1e3:.3g} ms simulated, recomputing {flops(c.recompute_flops)} FLOPs"
