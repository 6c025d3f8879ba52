"""``plan.html``: what shardfx decided for a plan, as one page to open in a browser.

The page shows, top to bottom: the model, mode, mesh and device, the FLOPs of a step for the
whole model and per device, and the step time predicted on the plan's device model; a pipeline
plan's stages (time share, parameters, saved activations, memory of their pp rank) and its
schedule as a grid of ranks by time slots, every action one slot wide as ``str(schedule)``
draws it; the predicted memory per device; the
collectives, totalled per axis and kind, then one by one with the reason for each; and every
parameter as a row, under its layer in model order, with its full shape, its placement on each
mesh axis (``S(0)``, ``R``, ``P``), its pipeline stage and its bytes per device; with
``shard="auto"``, what the solver chose, its predicted step next to the named plans', and where it
departs from Megatron's; every global rank's coordinates on the mesh. A plan that
splits sequences (``megatron-sp``, a ``cp`` axis) says how in the header; the collectives are
also shown by the module whose op needs them.

The file is self-contained: inline CSS, no script, no fonts, images or anything fetched, so it
opens offline and can be attached to a bug report. ``shardfx.report.summary`` is the same plan as text.
"""

from __future__ import annotations

import math
from html import escape

from shardfx.codegen.spmd import local_shape
from shardfx.ir import meta as M
from shardfx.estimate.memory import KINDS
from shardfx.auto.remat_choice import module_rows
from shardfx.passes.shard_annotate import sequence_split
from shardfx.passes.stage_cut import stage_report, weight_stages
from shardfx.ir.units import flops, nbytes
from shardfx.report.summary import by_module, collective_totals
from shardfx.schedule.check import simulate
from shardfx.report.experts import expert_layers
from shardfx.report.text import auto_notes

CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1300px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px}
table{border-collapse:collapse;margin-bottom:8px} caption{text-align:left;color:#666;padding:4px 0}
th,td{padding:2px 8px;border-bottom:1px solid #e4e4e4;text-align:left}
th{background:#f4f4f4;font-weight:600} .num{text-align:right;white-space:nowrap}
code,.mono,.placement,.action{font-family:ui-monospace,monospace;font-size:12px}
dl{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:8px;margin:12px 0}
dl div{background:#f6f8fa;border-radius:6px;padding:6px 10px} dt{color:#666;font-size:12px}
dd{margin:0;font-size:16px;font-weight:600}
tr.module td{background:#eef2f7;font-weight:600;padding-top:6px}
tr.param td:first-child{padding-left:24px} .placement{text-align:center}
.shard{background:#cfe8cf} .replicate{background:#eee} .partial{background:#f9dcc4}
.share{white-space:nowrap} .bar{display:inline-block;height:10px;background:#5b8def}
#schedule td{border:1px solid #fff;width:38px;text-align:center;padding:2px 0}
.F{background:#8ab6f9} .B{background:#f7a8a0} .W{background:#b5dfa6}
.action.odd{filter:brightness(.9)} .idle{background:#f7f7f7} .key{padding:2px 10px;margin-right:6px}
"""


def plan_html(plan) -> str:
    """The whole page for ``plan`` (a ``shardfx.Plan``)."""
    s = plan.summary
    title = f"shardfx plan: {s.model} ({s.mode}, mesh {plan.mesh})"
    parts = [_header(plan)]  # the short sections first, the long table of weights last
    if plan.schedule is not None:
        parts += [_stages(plan), _schedule(plan.schedule)]
    parts += [_solver(plan), _memory(plan), _experts(plan), _collectives(plan.collectives),
              _ranks(plan), _layers(plan)]
    return (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{escape(title)}"
            f"</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(parts)
            + "\n</body></html>\n")


def _table(head: list[str], rows: list[str], caption: str = "") -> str:
    """A table from header labels and rows already rendered as ``<tr>...</tr>``."""
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    ths = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "\n".join(rows)
    return f"<table>{cap}<thead><tr>{ths}</tr></thead><tbody>\n{body}\n</tbody></table>"


def _td(text: object, cls: str = "", **attrs: object) -> str:
    """A cell; ``data_axis="tp"`` becomes the attribute ``data-axis="tp"``."""
    attrs = {"class": cls, **attrs} if cls else attrs
    more = "".join(f' {k.replace("_", "-")}="{escape(str(v))}"' for k, v in attrs.items())
    return f"<td{more}>{escape(str(text))}</td>"


def _header(plan) -> str:
    s = plan.summary
    train = s.mode is M.Mode.TRAIN
    facts = [("model", s.model), ("mode", s.mode), ("mesh", plan.mesh), ("device", plan.device),
             ("parameters", f"{s.param_count:,}"), ("parameter bytes", nbytes(s.param_bytes)),
             ("buffer bytes", nbytes(s.buffer_bytes))]
    if sequence_split(plan.options):
        facts.append(("sequence", sequence_split(plan.options)))
    if plan.schedule is not None:
        sched = plan.options.schedule
        facts.append(("schedule", f"{sched if isinstance(sched, str) else 'custom'}, "
                                  f"{plan.schedule.microbatches} microbatches"))
    step = plan.predicted_step
    facts.append((f"step on {step.model}, predicted", step.duration))
    cards = "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(str(v))}</dd></div>" for k, v in facts)
    compute = plan.compute_rows()
    rows = [f"<tr><th>{phase}</th>" + "".join(_td(flops(v[i]), "num") for v in compute.values())
            + "</tr>" for i, phase in enumerate(["forward", "backward"][:1 + train])]
    head = ["FLOPs", *(w if w == "whole model" else f"per device: {w}" for w in compute)]
    return (f"<header><h1>shardfx plan: {escape(s.model)}</h1><dl>{cards}</dl>"
            + _table(head, rows, "compute per step, estimated")
            + f"<p>{escape(str(step))}</p></header>")


# --- layers -------------------------------------------------------------------------------

def _layers(plan) -> str:
    """One row per parameter, under a heading row per layer (``model.layers.0``) in model
    order; the embeddings, final norm and head under "outside the layers"."""
    annotated = plan.ir.meta[M.GRAPH].mesh  # the axes ANNOTATION is over (a pipeline's: tp)
    axes = [a for a, _ in plan.mesh.axes if a != "pp"]  # pp's "placement" is the stage column
    pipeline = plan.schedule is not None
    head = ["parameter", "shape", "dtype", *axes, *(["stage"] * pipeline), "bytes / device"]
    stages = weight_stages(plan.ir) if pipeline else {}  # a tied weight: every stage using it
    rows, group = [], None
    for node in plan.ir.graph.find_nodes(op="placeholder"):
        role = node.meta[M.ROLE]
        if role.kind is not M.InputKind.PARAM:
            continue
        layer, leaf = _layer_of(role.name)
        if layer != group:
            group = layer
            name = layer or "outside the layers"
            rows.append(f"<tr class=\"module\">{_td(name, colspan=len(head))}</tr>")
        val, placements = node.meta[M.VAL], node.meta.get(M.ANNOTATION) or ()
        on = dict(zip((a for a, _ in annotated), placements))
        cells = [_td(leaf + "".join(f"  (= {a})" for a in role.aliases), "mono"),
                 _td(list(val.shape), "mono"), _td(str(val.dtype).removeprefix("torch."))]
        for axis in axes:  # an axis the IR is not sharded over holds whole copies (dp replicas)
            text = M.placements_str((on[axis],)) if axis in on else "R"
            kind = {"S": "shard", "R": "replicate"}.get(text[0], "partial")
            cells.append(_td(text, f"placement {kind}", data_axis=axis))
        if pipeline:
            cells.append(_td(", ".join(map(str, stages.get(role.name, ()))) or "-", "num"))
        local = math.prod(local_shape(val.shape, placements, annotated)) * val.element_size()
        cells.append(_td(nbytes(local), "num"))
        rows.append(f'<tr class="param" data-fqn="{escape(role.name)}">{"".join(cells)}</tr>')
    legend = ("<p><span class='key shard'>S(d)</span>sharded on dim d "
              "<span class='key replicate'>R</span>replicated "
              "<span class='key partial'>P</span>partial sums</p>")
    return (f'<section id="layers"><h2>Layers</h2>{legend}'
            + _table(head, rows, "every parameter in model order, under its layer")
            + "</section>")


def _layer_of(fqn: str) -> tuple[str, str]:
    """``model.layers.3.mlp.up_proj.weight`` -> (``model.layers.3``, ``mlp.up_proj.weight``):
    the layer is the path up to its first index; a parameter in none is ('', its name)."""
    parts = fqn.split(".")
    index = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
    if index is None:
        return "", fqn
    return ".".join(parts[:index + 1]), ".".join(parts[index + 1:])


# --- stages, memory -----------------------------------------------------------------------

def _stages(plan) -> str:
    """Each pipeline stage: its share of the forward time, parameters, saved activations, and
    the predicted peak of the pp rank that runs it."""
    stages = stage_report(plan.ir)
    total = sum(s["time"] for s in stages) or 1.0
    memory = plan.memory_rows()
    rows = []
    for s in stages:
        rank = plan.schedule.rank_of(s["stage"])
        share = s["time"] / total
        peak = memory.get(f"pp rank {rank}")
        bar = f'<span class="bar" style="width:{share * 200:.0f}px"></span> {share:.0%}'
        sends = ", ".join(f"{name} {nbytes(b)} -> {','.join(map(str, to))}"
                          for name, b, to in s["sends"])
        rows.append(f'<tr class="stage" data-stage="{s["stage"]}">' + _td(s["stage"], "num")
                    + _td(rank, "num") + _td(s["ops"], "num") + f'<td class="share">{bar}</td>'
                    + _td(nbytes(s["param_bytes"]), "num") + _td(nbytes(s["saved_bytes"]), "num")
                    + _td(nbytes(peak.total) if peak else "-", "num") + _td(sends or "-", "mono")
                    + "</tr>")
    head = ["stage", "pp rank", "fwd ops", "time share", "params", "saved / microbatch",
            "rank's peak memory", "sends to later stages"]
    return '<section id="stages"><h2>Pipeline stages</h2>' + _table(head, rows) + "</section>"


def _memory(plan) -> str:
    """The predicted peak per device (one column per group of devices that run alike)."""
    memory = plan.memory_rows()
    devices = list(memory.values())

    def row(label: str, values: list, cls: str = "num") -> str:
        return f"<tr><th>{escape(label)}</th>" + "".join(_td(v, cls) for v in values) + "</tr>"

    rows = [row(kind, [nbytes(getattr(m, kind)) for m in devices]) for kind in KINDS]
    rows += [row("total", [nbytes(m.total) for m in devices]),
             row("when", [m.when for m in devices], "mono")]
    if any(m.host for m in devices):
        rows.append(row("host (not in total)", [nbytes(m.host) for m in devices]))
    state = ""
    if plan.mode is M.Mode.TRAIN:
        kept = list(plan.state_rows().values())
        zero = f" (ZeRO-{plan.options.zero} over dp)" if plan.options.zero else ""
        state = _table(["", *memory], [row(kind, [nbytes(k[i]) for k in kept]) for i, kind in
                                       enumerate(("parameters", "gradients", "optimizer"))],
                       f"the training state each device keeps{zero}")
    return ('<section id="memory"><h2>Memory per device (predicted)</h2>'
            + _table(["", *memory], rows, "the peak of a step, by what holds it") + state
            + _offloaded(plan) + "</section>")


def _offloaded(plan) -> str:
    """The activations remat sends to host memory, by module (empty where none)."""
    if plan.remat is None or not plan.remat.offloaded:
        return ""
    rows = [f"<tr>{_td(k, 'mono')}{_td(n, 'num')}{_td(b, 'num')}{_td(nbytes(size), 'num')}</tr>"
            for k, n, b, size in module_rows(plan.ir, plan.remat.offloaded)]
    return _table(["module", "values per block", "blocks", "bytes"], rows,
                  "activations offloaded to host memory (memory_budget), bytes per device: "
                  "copied out after their last forward reader, back one block ahead of the "
                  "backward that reads them")


# --- collectives --------------------------------------------------------------------------

def _collectives(collectives) -> str:
    """Totals per (axis, kind), then every collective with why it is there."""
    if not collectives:
        return '<section id="collectives"><h2>Collectives</h2><p>no collectives</p></section>'
    totals = [f"<tr>{_td(axis)}{_td(kind)}{_td(n, 'num')}{_td(nbytes(b), 'num')}</tr>"
              for (axis, kind), (n, b) in collective_totals(collectives).items()]
    each = [f'<tr class="collective">{_td(c.kind)}{_td(c.axis)}{_td(nbytes(c.nbytes), "num")}'
            f'{_td(c.reason, "mono")}</tr>' for c in collectives]
    modules = [f"<tr>{_td(m, 'mono')}{_td(phase)}{_td(axis)}{_td(kind)}{_td(n, 'num')}"
               f"{_td(nbytes(b), 'num')}{_td(blocks, 'num')}</tr>"
               for m, phase, axis, kind, n, b, blocks in by_module(collectives)]
    return ('<section id="collectives"><h2>Collectives</h2>'
            + _table(["axis", "collective", "count", "bytes"], totals,
                     "per step, per device, bytes in")
            + _table(["module", "phase", "axis", "collective", "count", "bytes", "blocks"],
                     modules, "by the module whose op needs them, per block of a repeated "
                     "module")
            + _table(["collective", "axis", "bytes", "why: node, placement change"], each,
                     f"all {len(collectives)}") + "</section>")


def _solver(plan) -> str:
    """What ``shard="auto"`` chose and why (empty for a plan it did not make)."""
    lines = auto_notes(plan)
    if not lines:
        return ""
    items = "".join(f"<li>{escape(line.strip())}</li>" for line in lines[1:])
    return (f'<section id="solver"><h2>Sharding solver</h2><p>{escape(lines[0])}</p>'
            f'<ul class="mono">{items}</ul></section>')


def _experts(plan) -> str:
    """Each mixture-of-experts layer: its experts and where they live, its capacity, and the
    last step's routing where a runner took one (empty without experts)."""
    layers = expert_layers(plan)
    if not layers:
        return ""
    scope, routed = plan.routing or ("", {})
    rows = []
    for layer in layers:
        r = routed.get(layer.name)
        rows.append("<tr>" + _td(layer.name, "mono") + _td(layer.experts, "num")
                    + _td(layer.where())
                    + _td(f"{layer.capacity:g}" if layer.capacity else "dropless")
                    + _td(r.tokens if r else "") + _td(r.dropped if r and r.capacity else "",
                                                       "num") + "</tr>")
    moved = sum(c.nbytes for c in plan.collectives if c.kind == "all_to_all")
    caption = (f"tokens per expert and dropped: {scope}, the last step" if scope else
               "tokens per expert: after a runner's step") + (
        f"; all-to-all bytes in per step: {nbytes(moved)}" if moved else "")
    return ('<section id="experts"><h2>Mixture of experts</h2>'
            + _table(["layer", "experts", "where", "capacity", "tokens per expert",
                      "dropped"], rows, caption) + "</section>")


RANKS_SHOWN = 256


def _ranks(plan) -> str:
    """Every global rank's coordinates on the mesh (row-major: the last axis fastest)."""
    axes = list(plan.options.mesh.axes)
    if not axes:
        return ""
    rows, total = [], math.prod(n for _, n in axes)
    for rank in range(min(total, RANKS_SHOWN)):
        coords, rest = [], rank
        for _, n in reversed(axes):
            coords.append(rest % n)
            rest //= n
        rows.append(f"<tr>{_td(rank, 'num')}" + "".join(_td(c, "num") for c in reversed(coords))
                    + "</tr>")
    return ('<section id="ranks"><h2>Ranks</h2>'
            + _table(["global rank", *(a for a, _ in axes)], rows,
                     "each process's place on the mesh" + (
                         f" (the first {RANKS_SHOWN} of {total}; the rest follow row-major)"
                         if total > RANKS_SHOWN else "")) + "</section>")


# --- schedule -----------------------------------------------------------------------------

def _schedule(schedule) -> str:
    """Ranks by time slots, each F, B and W one slot wide (sends and receives take none), laid
    out as ``shardfx.schedule.check.grid`` does."""
    timeline = simulate(schedule, lambda a: 0.0 if a.kind.is_comm else 1.0)
    spans = [s for s in timeline.spans if not s.action.kind.is_comm]
    slots = int(max((s.end for s in spans), default=0))
    cells = [['<td class="idle"></td>'] * slots for _ in range(schedule.ranks)]
    for s in spans:
        a = s.action
        odd = " odd" if a.microbatch % 2 else ""
        cells[s.rank][int(s.start)] = (f'<td class="action {a.kind.value}{odd}" '
                                       f'data-action="{a}" title="stage {a.stage}, {a.kind.name}, '
                                       f'microbatch {a.microbatch}">{a}</td>')
    head = "<tr><th></th>" + "".join(f"<th class='num'>{t}</th>" for t in range(slots)) + "</tr>"
    rows = "\n".join(f"<tr><th>rank {r}</th>{''.join(row)}</tr>" for r, row in enumerate(cells))
    legend = ("<p><span class='key F'>F</span>forward "
              "<span class='key B'>B</span>backward"
              + (" (input gradient)" if schedule.split_backward else "")
              + (" <span class='key W'>W</span>weight gradient" if schedule.split_backward
                 else "")
              + " <span class='key idle'>&nbsp;</span>idle; <code>0F1</code> is stage 0, "
                "microbatch 1; odd microbatches are darker</p>")
    return (f'<section id="schedule"><h2>Schedule</h2>{legend}'
            f"<table><caption>{schedule.ranks} ranks, {schedule.stages} stages, "
            f"{schedule.microbatches} microbatches; every action one slot wide</caption>"
            f"<thead>{head}</thead><tbody>\n{rows}\n</tbody></table></section>")
