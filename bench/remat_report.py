"""bench.remat's report: the table of its rows, the summary of the comparisons it is for (each
with its goal), and the warnings its rows raise. The rows are dicts ``bench.remat`` measures:
"variant", "budget", "peak", "flops", "loss" and, for shardfx's, "fused_loss", "labels",
"target", "predicted"; a row that did not run has "error" instead of its measurements."""

from __future__ import annotations

import math
import statistics

# shardfx's rows come twice, by fused_loss: its default ("auto": the LM head fused with its
# loss where the unfused plan misses the budget) and False, the plain loss the other rows run,
# so that what the fused head saves is not credited to remat. The value: the rows' name prefix.
FAMILIES = {"auto": "shardfx", False: "shardfx unfused"}
LOSS_RTOL = 1e-4
MiB = 2**20


# --- table ------------------------------------------------------------------------------------

def _ran(rows: list[dict], prefix: str) -> list[dict]:
    return [r for r in rows if r["variant"].startswith(prefix) and "error" not in r]


def torch_at(rows: list[dict], nbytes: int) -> dict | None:
    """The torch.compile row that recomputes the fewest FLOPs among those peaking at ``nbytes``."""
    peers = [r for r in _ran(rows, "torch.compile") if r["peak"] == nbytes]
    return min(peers, key=lambda r: r["flops"], default=None)


def table(rows: list[dict], title: str, notes: list[str]) -> str:
    eager = next(r for r in rows if r["variant"] == "eager")
    ac = next(r for r in rows if r["variant"] == "full AC")
    ac_recompute = ac["flops"] - eager["flops"]
    out = [title, "",
           "| variant | budget | measured peak (MiB) | / eager | fwd+bwd peak (MiB) | "
           "predicted (MiB) | predicted vs measured | recompute GFLOPs | / torch.compile's "
           "there | / full AC's | step s wall | step s CPU | fused head | ops recomputed | "
           "loss |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | {r['budget']} | {r['error']} |" + " - |" * 12)
            continue
        recompute = r["flops"] - eager["flops"]
        share = f"{recompute / ac_recompute:.2f}" if ac_recompute else "-"
        fb = "-" if r.get("fwd_bwd") is None else f"{r['fwd_bwd'] / MiB:.1f}"
        predicted = err = vs_torch = "-"
        fused = ops = "-"
        if "predicted" in r:
            predicted = f"{r['predicted'] / MiB:.1f}"
            err = f"{r['predicted'] / r['peak'] - 1:+.2%}"
            peer = torch_at(rows, r["target"])
            if peer is not None:
                theirs = peer["flops"] - eager["flops"]
                vs_torch = f"{recompute / theirs:.2f}" if theirs > 0 else \
                    f"inf (torch {theirs / 1e9:.2f})"
            fused, ops = ("yes" if r["fused"] else "no"), str(r["recomputed"])
        out.append(f"| {r['variant']} | {r['budget']} | {r['peak'] / MiB:.1f} | "
                   f"{r['peak'] / eager['peak']:.2f} | {fb} | {predicted} | {err} | "
                   f"{recompute / 1e9:.2f} | {vs_torch} | {share} | "
                   f"{statistics.median(r['wall']):.2f} | {statistics.median(r['cpu']):.2f} | "
                   f"{fused} | {ops} | {r['loss']:.6f} |")
    return "\n".join(out + [""] + notes)


def summary(rows: list[dict], floors: dict) -> list[str]:
    """The comparisons the bench is for, each with its goal: per family of shardfx rows
    (``FAMILIES``; ``floors``: each one's floor in bytes, or None), then over all of them."""
    ours = [r for r in rows if "fused_loss" in r]
    out = ["Summary:"]
    for fused_loss in FAMILIES:
        out += family_summary(rows, [r for r in ours if r["fused_loss"] == fused_loss],
                              fused_loss, floors[fused_loss])
    errors = [(abs(r["predicted"] / r["peak"] - 1), r) for r in ours if "predicted" in r]
    if errors:
        worst, r = max(errors, key=lambda e: e[0])
        out.append(f"- largest predicted-vs-measured peak error: {worst:.2%} ({r['variant']}: "
                   f"predicted {r['predicted'] / MiB:.1f}, measured {r['peak'] / MiB:.1f} MiB; "
                   f"goal <= 2%: {'met' if worst <= 0.02 else 'NOT met'}); "
                   + ", ".join(f"{r['variant'].removeprefix('shardfx ')} "
                               f"{r['predicted'] / r['peak'] - 1:+.2%}" for _, r in errors)
                   + ".")
    fused = [r["variant"].removeprefix("shardfx at ") for r in ours if r.get("fused")]
    out.append(f"- LM head fused (fused_loss=\"auto\") in: {', '.join(fused) or 'none'}.")
    bad = [r for r in ours if "error" in r or "warn" in r]
    out.append("- shardfx rows that failed or measured over their budget: " + (
        "; ".join(f"{r['variant']}: {r.get('error') or r['warn']}" for r in bad) or "none")
        + ".")
    return out


def family_summary(rows: list[dict], ours: list[dict], fused_loss: bool | str,
                   floor: int | None) -> list[str]:
    """For one family of shardfx rows (``ours``): its recompute against torch.compile's at
    each of their peaks and against full AC's at its peak, and its floor."""
    eager = next(r for r in rows if r["variant"] == "eager")
    ac = next(r for r in rows if r["variant"] == "full AC")
    ac_recompute = ac["flops"] - eager["flops"]
    who = f"{FAMILIES[fused_loss]} (fused_loss={fused_loss!r})".replace("'", '"')
    out = [f"- {who}:"]
    points, wins = [], 0
    for t in [r for r in rows if r["variant"].startswith("torch.compile")]:
        if "error" in t:
            points.append(f"{t['variant']}: torch did not run")
            continue
        s = next((r for r in ours if r.get("target") == t["peak"]), None)
        if s is None or "error" in s:
            points.append(f"{t['variant']} ({t['peak'] / MiB:.1f} MiB): shardfx did not run")
            continue
        theirs, mine = t["flops"] - eager["flops"], s["flops"] - eager["flops"]
        ok = mine <= theirs
        wins += ok
        points.append(f"{t['variant']} ({t['peak'] / MiB:.1f} MiB): shardfx {mine / 1e9:.2f} "
                      f"vs {theirs / 1e9:.2f} GFLOPs ({'<=' if ok else 'MORE'}; shardfx peak "
                      f"{s['peak'] / MiB:.1f} MiB)")
    both = sum("shardfx " in p and "did not run" not in p for p in points)
    out.append(f"  - recompute <= torch.compile's at the same measured peak (goal: every "
               f"point): {wins} of {both} points where both ran. " + "; ".join(points) + ".")
    at_ac = next((r for r in ours if r.get("target") == ac["peak"]), None)
    if at_ac is None or "error" in at_ac:
        out.append(f"  - at full AC's peak ({ac['peak'] / MiB:.1f} MiB): did not run "
                   "(goal <= 0.5 of full AC's recompute).")
    else:
        mine = at_ac["flops"] - eager["flops"]
        ratio = mine / ac_recompute if ac_recompute else float("nan")
        out.append(f"  - at full AC's peak ({ac['peak'] / MiB:.1f} MiB): recomputes "
                   f"{mine / 1e9:.2f} GFLOPs, {ratio:.2f} of full AC's {ac_recompute / 1e9:.2f} "
                   f"(goal <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'}); peak "
                   f"{at_ac['peak'] / MiB:.1f} MiB.")
    if floor is not None:
        f = next((r for r in ours if "floor" in r.get("labels", ())), None)
        state = "not run" if f is None else f"did not run ({f['error']})" if "error" in f \
            else f"measured {f['peak'] / MiB:.1f} MiB, recomputing " \
                 f"{(f['flops'] - eager['flops']) / 1e9:.2f} GFLOPs"
        out.append(f"  - floor (memory_budget=1's MemoryBudgetError, least.total): "
                   f"{floor / MiB:.1f} MiB, {floor / eager['peak']:.2f} of eager's peak; at it: "
                   f"{state}.")
    return out


def checks(rows: list[dict]) -> list[str]:
    """Warnings: losses that differ from eager's, full AC without recompute, compiled rows
    whose graphs did not run as expected or whose static and counted FLOPs differ."""
    eager = next(r for r in rows if r["variant"] == "eager")
    ac = next(r for r in rows if r["variant"] == "full AC")
    out = []
    if ac["flops"] <= eager["flops"]:
        out.append("WARNING: full AC recomputed nothing (its FLOPs are not above eager's)")
    for r in rows:
        if "error" in r:
            continue
        rel = abs(r["loss"] - eager["loss"]) / abs(eager["loss"])
        if rel > LOSS_RTOL:
            out.append(f"WARNING: {r['variant']}: loss {r['loss']:.6f} differs from eager's "
                       f"{eager['loss']:.6f} by {rel:.1e} relative (> {LOSS_RTOL:g})")
        if "warn" in r:
            out.append(f"WARNING: {r['variant']}: {r['warn']}")
        if "static_flops" in r and not math.isclose(r["static_flops"], r["flops"], rel_tol=1e-3):
            out.append(f"WARNING: {r['variant']}: FLOPs counted at run time "
                       f"{r['flops'] / 1e9:.3f} G, summed over its graphs "
                       f"{r['static_flops'] / 1e9:.3f} G")
    return out
