"""Draw training curves from metrics files as one self-contained HTML page.

A metrics file has one JSON object per line, e.g. {"step": 10, "loss": 3.21, "lr": 0.0006}. The
page charts --key (default "loss") over "step", one coloured line per file with a legend naming
the file, and under it a smaller chart of "lr" when the files log it. Lines without "step" or
without the key (a {"event": ...} line, a half-written last line) are skipped; a step logged
twice, as by a resumed run, keeps its last value. The charts are inline SVG: no JavaScript, no
network, no plotting library.

    python examples/plot_metrics.py out/metrics.jsonl                    # writes plot.html
    python examples/plot_metrics.py a.jsonl b.jsonl --out cmp.html --key grad_norm
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from pathlib import Path

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]  # matplotlib's tab10; the 11th file reuses the 1st

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px sans-serif; margin: 24px; color: #222; }}
.legend {{ list-style: none; padding: 0; }}
.legend span {{ display: inline-block; width: 24px; height: 3px; margin: 0 8px 4px 0; }}
svg text {{ font: 11px sans-serif; fill: #444; }}
svg .grid {{ stroke: #e4e4e4; }}
svg .frame {{ fill: none; stroke: #888; }}
</style></head>
<body>
<h1>{title}</h1>
<ul class="legend">
{legend}
</ul>
{charts}
</body></html>
"""


class MetricsError(Exception):
    """A metrics file that cannot be drawn (exit code 2, one line on stderr)."""


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_series(path: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every line of ``path`` that has a number under "step" and ``key``."""
    by_step = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a blank line, or the last line of a run still writing it
            if not isinstance(record, dict):
                continue
            step, value = record.get("step"), record.get(key)
            if is_number(step) and is_number(value):
                by_step[step] = float(value)  # a step logged again (a resumed run) wins
    return sorted(by_step.items())


def ticks(lo: float, hi: float, min_gap: float = 0.0, count: int = 5) -> list[float]:
    """About ``count`` round values, 1, 2 or 5 times a power of ten apart, spanning lo..hi."""
    if hi == lo:  # one point, or a flat line: give it room
        lo, hi = lo - (abs(lo) * 0.1 or 1), hi + (abs(hi) * 0.1 or 1)
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    gap = max(next(m * power for m in (1, 2, 5, 10) if m * power >= raw), min_gap)
    first, last = math.floor(lo / gap), math.ceil(hi / gap)
    return [i * gap for i in range(first, last + 1)]


def chart(series: list[tuple[str, list[tuple[int, float]]]], ylabel: str,
          width: int, height: int) -> str:
    """An SVG line chart of ``series`` (colour, points) with ticks, grid and axis labels."""
    xt = ticks(min(s for _, pts in series for s, _ in pts),
               max(s for _, pts in series for s, _ in pts), min_gap=1)  # steps are whole
    yt = ticks(min(v for _, pts in series for _, v in pts),
               max(v for _, pts in series for _, v in pts))
    left, right, top, bottom = 64, width - 16, 12, height - 40  # the plot area, in pixels

    def x(step):
        return left + (step - xt[0]) / (xt[-1] - xt[0]) * (right - left)

    def y(value):
        return bottom - (value - yt[0]) / (yt[-1] - yt[0]) * (bottom - top)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'role="img" aria-label="{html.escape(ylabel)} over step">']
    for v in xt:
        out.append(f'<line class="grid" x1="{x(v):.1f}" x2="{x(v):.1f}" y1="{top}" y2="{bottom}"/>'
                   f'<text x="{x(v):.1f}" y="{bottom + 16}" text-anchor="middle">{v:.6g}</text>')
    for v in yt:
        out.append(f'<line class="grid" x1="{left}" x2="{right}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.6g}</text>')
    out.append(f'<rect class="frame" x="{left}" y="{top}" width="{right - left}" '
               f'height="{bottom - top}"/>')
    out.append(f'<text x="{(left + right) / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    out.append(f'<text transform="translate(14 {(top + bottom) / 2}) rotate(-90)" '
               f'text-anchor="middle">{html.escape(ylabel)}</text>')
    for colour, pts in series:
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts)
        if len(pts) == 1:
            coords += " " + coords  # a zero-length segment: its round cap draws a dot
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" '
                   f'stroke-width="1.5" stroke-linecap="round" stroke-linejoin="round"/>')
    out.append("</svg>")
    return "\n".join(out)


def render(paths: list[Path], key: str = "loss") -> str:
    """The HTML page for the metrics files ``paths``; raises MetricsError if one has no points."""
    colours = [COLOURS[i % len(COLOURS)] for i in range(len(paths))]
    curves = []
    for path in paths:
        points = read_series(path, key)
        if not points:
            raise MetricsError(f'{path}: no line has a number under both "step" and "{key}"')
        curves.append(points)

    legend = [f'<li><span style="background:{c}"></span>{html.escape(str(p))}: '
              f"steps {pts[0][0]:g}&ndash;{pts[-1][0]:g}, last {html.escape(key)} {pts[-1][1]:.6g}"
              "</li>"
              for c, p, pts in zip(colours, paths, curves)]
    charts = [chart(list(zip(colours, curves)), key, width=800, height=400)]
    if key != "lr":
        lrs = [(c, pts) for c, p in zip(colours, paths) if (pts := read_series(p, "lr"))]
        if lrs:
            charts.append(chart(lrs, "lr", width=800, height=200))
    title = f"{html.escape(key)} over step"
    return PAGE.format(title=title, legend="\n".join(legend), charts="\n".join(charts))


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="JSON-lines metrics files")
    parser.add_argument("--out", type=Path, default=Path("plot.html"),
                        help="HTML file to write (default: plot.html)")
    parser.add_argument("--key", default="loss", help='value to chart over "step" (default: loss)')
    ns = parser.parse_args(argv)
    try:
        page = render(ns.metrics, ns.key)
        ns.out.write_text(page, encoding="utf-8")
    except OSError as e:
        print(f"plot_metrics.py: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except MetricsError as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        return 2
    print(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
