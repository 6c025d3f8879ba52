"""``plan_html``: the plan as one self-contained page, checked as parsed HTML and in Chromium.

Two tiny Llama plans, built once: dp=2,tp=2 (SPMD, collectives) and pp=2 under zero-bubble
(stages and a schedule). The page must fetch nothing; its rows and cells must say what the IR
says (a parameter's placement on each axis is its ANNOTATION, its stage its STAGE); the
schedule grid must hold every F, B and W once. Then real headless Chromium renders it: the DOM
it dumps has the sections and counts, and its screenshot is a picture, not a blank page.
"""

from __future__ import annotations

import struct
import subprocess
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import shardfx
from shardfx.report.html import plan_html
from shardfx.ir import meta as M
from shardfx.ir.units import flops

from models import SEQ, VOCAB, lm_loss, tiny

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def plans() -> dict[str, shardfx.Plan]:
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    return {"tp": shardfx.partition(tiny("llama"), (ids,), lm_loss, (ids,), mesh="dp=2,tp=2",
                                    shard="megatron"),
            "pp": shardfx.partition(tiny("llama"), (ids,), lm_loss, (ids,), mesh="pp=2",
                                    microbatches=4, schedule="zero-bubble")}


class Page(HTMLParser):
    """The parts of a page the tests read: section ids, and every ``tr``/``td`` with its
    attributes (a ``td``'s text too), rows holding their cells."""

    def __init__(self, text: str):
        super().__init__()
        self.sections: list[str] = []
        self.rows: list[dict] = []
        self.cells: list[dict] = []
        self._cell: dict | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        attrs["class"] = set((attrs.get("class") or "").split())
        if tag == "section":
            self.sections.append(attrs.get("id"))
        elif tag == "tr":
            self.rows.append({**attrs, "cells": []})
        elif tag == "td":
            self._cell = {**attrs, "text": ""}
            self.cells.append(self._cell)
            self.rows[-1]["cells"].append(self._cell)

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data

    def rows_of(self, cls: str) -> list[dict]:
        return [r for r in self.rows if cls in r["class"]]

    def cells_of(self, cls: str) -> list[dict]:
        return [c for c in self.cells if cls in c["class"]]


def params(plan) -> list[fx.Node]:
    """The IR's parameter placeholders, in model order."""
    return [n for n in plan.ir.graph.find_nodes(op="placeholder")
            if n.meta[M.ROLE].kind is M.InputKind.PARAM]


def compute_actions(plan) -> list[str]:
    """The schedule's F, B and W actions (``0F1``), none for an SPMD plan."""
    acts = plan.schedule.actions if plan.schedule is not None else ()
    return [str(a) for rank in acts for a in rank if not a.kind.is_comm]


def check_page(plan, page: Page) -> None:
    """What both the parsed source and Chromium's DOM must show for ``plan``."""
    pipeline = plan.schedule is not None
    assert page.sections == [*(["stages", "schedule"] * pipeline), "memory", "collectives",
                             "ranks", "layers"]
    rows = {r["data-fqn"]: r for r in page.rows_of("param")}
    assert list(rows) == [n.meta[M.ROLE].name for n in params(plan)]  # all, in model order
    assert len(page.rows_of("collective")) == len(plan.collectives)
    actions = sorted(c["data-action"] for c in page.cells_of("action"))
    assert actions == sorted(compute_actions(plan))


def test_page_says_what_the_ir_says(plans):
    for plan in plans.values():
        text = plan_html(plan)
        for outside in ("http://", "https://", "src=", "<link", "@import", "url("):
            assert outside not in text, f"the page fetches something: {outside}"
        check_page(plan, Page(text))

    tp, pp = plans["tp"], plans["pp"]
    page = Page(plan_html(tp))
    rows = {r["data-fqn"]: r for r in page.rows_of("param")}
    for node in params(tp):  # the SPMD IR is annotated over the whole mesh, in its axis order
        cells = {c["data-axis"]: c["text"] for c in rows[node.meta[M.ROLE].name]["cells"]
                 if "placement" in c["class"]}
        assert cells == {axis: M.placements_str((p,)) for (axis, _), p
                         in zip(tp.mesh.axes, node.meta[M.ANNOTATION])}
    q = rows["model.layers.0.self_attn.q_proj.weight"]
    assert [c["text"] for c in q["cells"] if "placement" in c["class"]] == ["R", "S(0)"]
    assert "2.0 KiB" in [c["text"] for c in q["cells"]]  # 32 x 32 fp32, half per tp rank
    layers = [r["cells"][0]["text"] for r in page.rows_of("module")]
    assert layers == ["outside the layers", "model.layers.0", "model.layers.1",
                      "outside the layers"]  # embeddings; the layers; final norm and head
    whole, each = (tp.compute_rows()[k][0] for k in ("whole model", "each of 4"))
    assert each < whole / 2  # a device runs its shard of the work
    assert [flops(whole), flops(each)] == [c["text"] for c in page.rows[1]["cells"]]  # forward

    page = Page(plan_html(pp))
    for node in params(pp):
        row = next(r for r in page.rows_of("param") if r["data-fqn"] == node.meta[M.ROLE].name)
        assert str(node.meta[M.STAGE]) in [c["text"] for c in row["cells"]]
    assert len(page.cells_of("action")) == len(compute_actions(pp)) == 2 * 4 * 3  # F, B, W
    assert page.cells_of("idle")  # zero-bubble still waits at the start
    assert len(page.rows_of("stage")) == 2
    rows = pp.compute_rows()  # each op runs on one pp rank, once per microbatch: the sum is all
    assert [sum(r[i] for k, r in rows.items() if k != "whole model") for i in (0, 1)] == \
        list(rows["whole model"])

    assert "no collectives" in plan_html(pp)  # pp=2 alone sends, but runs no collectives


def test_a_tied_weight_shows_every_stage_using_it():
    """GPT-2's embedding is its LM head too: stage 0 embeds, the last stage projects."""
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    plan = shardfx.partition(tiny("gpt2"), (ids,), lm_loss, (ids,), mesh="pp=2", microbatches=2)
    row = next(r for r in Page(plan_html(plan)).rows_of("param")
               if r["data-fqn"] == "transformer.wte.weight")
    assert row["cells"][0]["text"] == "transformer.wte.weight  (= lm_head.weight)"
    assert "0, 1" in [c["text"] for c in row["cells"]]


def chromium(*flags: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", *flags],
        capture_output=True, text=True, timeout=60, check=True)


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed (still filtered) scanlines of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, at = b"", 8
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"IDAT":
            idat += data[at + 8:at + 8 + size]
        at += 12 + size
    return width, height, zlib.decompress(idat)


def test_chromium_renders_the_page(plans, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: `make test` installs Chromium")
    start = time.perf_counter()
    for name, plan in plans.items():
        path = plan.dump(tmp_path / name) / "plan.html"  # what a user opens
        dom = chromium("--dump-dom", path.as_uri(), profile=tmp_path / "profile").stdout
        check_page(plan, Page(dom))

    png = tmp_path / "pp.png"
    page = (tmp_path / "pp" / "plan.html").as_uri()
    chromium(f"--screenshot={png}", "--window-size=1400,2000", page, profile=tmp_path / "profile")
    width, height, pixels = png_pixels(png)
    assert (width, height) == (1400, 2000)
    assert png.stat().st_size > 20_000  # a blank page of this size compresses to a few KiB
    assert len(set(pixels)) > 64  # text and coloured cells, not one colour
    print(f"chromium: {time.perf_counter() - start:.1f} s for 2 DOM dumps and a screenshot")
