"""What one pass of the model costs a device, block by block: the part of a candidate's price
that only its tp, cp and ep axes, its micro-batch and its recompute policy decide.

The model is captured once per micro-batch's rows (``capture`` traces two blocks of its
repeated list and stamps the rest), and planned on its shallow copies (``Captured.at_depth``)
of ``DEPTHS`` blocks over the candidate's tp x cp x ep mesh alone, one microbatch, no ZeRO:
the same passes ``partition`` runs, the same program, priced by ``plan.predicted_step`` and
``plan.memory_breakdown``. What a block adds repeats with every block (the line through the
two depths: ``Line``), so one pass of k blocks is the line at k. On a Llama-3.1-8B shape over
tp=2 x cp=2 the line through 2 and 4 blocks gave the 32-block pass within 0.1% of its
whole plan, time and memory.

What dp, ZeRO and the pipeline add, the parts that repeat over the whole batch or across
ranks, is composed on top (``compose``).

Requires: a model ``partition`` plans; ``request``'s options for it.
Ensures:  ``Blocks.line(tp, cp, ep, mbs, recompute)`` is the ``Line`` of one pass, each
          (capture, plan) made once and kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch.utils._pytree as pytree

from shardfx.compiler.compile import _capture, compile_captured
from shardfx.compiler.driver import deferred_codegen, paused_gc
from shardfx.ir.graph import copy_ir
from shardfx.mesh import MeshSpec
from shardfx.partitioner.capture import Captured, microbatch
from shardfx.plan import Plan
from shardfx.request.options import Options

DEPTHS = (2, 4)  # blocks of the two shallow copies a line is drawn through


@dataclass(frozen=True)
class Pass:
    """One pass (forward and backward of one microbatch) on one device of the tp x cp x ep
    mesh, and what the device holds then. Seconds and bytes; add and scale as vectors."""

    compute: float = 0.0  # seconds of the pass's ops
    exposed: float = 0.0  # seconds of its tp/cp/ep communication that ops do not hide
    forward: float = 0.0  # of compute: the forward's share (FLOPs' share)
    optimizer: float = 0.0  # seconds of the optimizer's step over the device's parameters
    params: float = 0.0  # bytes of parameters and buffers on the device
    gradients: float = 0.0  # bytes of the gradients it keeps
    state: float = 0.0  # bytes of the optimizer's state
    saved: float = 0.0  # bytes of activations kept for the backward
    other: float = 0.0  # bytes of temporaries and communication buffers at the peak

    def __add__(self, other: "Pass") -> "Pass":
        return Pass(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "Pass") -> "Pass":
        return self + other * -1

    def __mul__(self, k: float) -> "Pass":
        return Pass(*(getattr(self, f.name) * k for f in fields(self)))

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed


@dataclass(frozen=True)
class Line:
    """A pass as a function of its blocks: ``base`` (embedding, head, loss) + k ``block``."""

    base: Pass
    block: Pass
    blocks: int  # the model's

    def at(self, k: float) -> Pass:
        return self.base + self.block * k

    @property
    def whole(self) -> Pass:
        return self.at(self.blocks)


def measured(plan: Plan) -> Pass:
    """A plan of one device of a tp x cp x ep mesh, one microbatch, as a ``Pass``."""
    step = plan.predicted_step
    memory = plan.memory_breakdown()[0]
    fwd, bwd = plan.compute_rows()["whole model"]  # their shares: the forward's seconds
    compute = step.compute - step.optimizer
    return Pass(compute=compute, exposed=step.total - step.compute,
                forward=compute * fwd / max(fwd + bwd, 1), optimizer=step.optimizer,
                params=memory.parameters + memory.buffers,
                gradients=memory.gradients, state=memory.optimizer, saved=memory.saved,
                other=memory.transient + memory.communication)


class Blocks:
    """The lines of one model, made as the search asks for them (module docstring)."""

    def __init__(self, model, example_args: tuple, loss_fn, example_targets: tuple,
                 options: Options):
        self.model, self.loss_fn, self.options = model, loss_fn, options
        self.args, self.targets = example_args, example_targets
        self.rows = _rows(example_args)
        self._captures: dict[int, tuple[Captured, tuple]] = {}
        self._lines: dict[tuple, Line] = {}
        self.plans = 0  # shallow plans made

    def captured(self, rows: int) -> tuple[Captured, tuple]:
        """The model captured on ``rows`` rows of the batch, and those rows' args."""
        if rows not in self._captures:
            args, targets = microbatch(self.args, self.targets, self.rows // rows)
            with paused_gc():
                cap = _capture(self.model, args, self.loss_fn, targets,
                               dataclasses.replace(self.options, microbatches=1))
            self._captures[rows] = (cap, args)
        return self._captures[rows]

    @property
    def layers(self) -> int:
        """Blocks of the model's repeated list (1: none stamped)."""
        return max(self.captured(self.rows)[0].depth, 1)

    def line(self, tp: int, cp: int, ep: int, mbs: int, recompute: str) -> Line:
        key = (tp, cp, ep, mbs, recompute)
        if key not in self._lines:
            self._lines[key] = self._draw(*key)
        return self._lines[key]

    def _draw(self, tp: int, cp: int, ep: int, mbs: int, recompute: str) -> Line:
        cap, args = self.captured(ep * mbs)
        mesh = {a: n for a, n in (("cp", cp), ("tp", tp), ("ep", ep)) if n > 1}
        options = dataclasses.replace(self.options, mesh=MeshSpec.parse(mesh or None),
                                      microbatches=1, zero=0, recompute=recompute,
                                      shard="megatron", memory_budget=None)
        depths = sorted({min(d, cap.depth) for d in DEPTHS})
        p1 = self._plan(cap, depths[0], args, options)
        if len(depths) == 1:  # nothing stamped, or only the traced pair: the whole pass
            return Line(p1, Pass(), max(cap.depth, 1))
        d1, d2 = depths
        p2 = self._plan(cap, d2, args, options)
        block = (p2 - p1) * (1 / (d2 - d1))
        return Line(p1 - block * d1, block, cap.depth)

    def _plan(self, cap: Captured, depth: int, args: tuple, options: Options) -> Pass:
        gm = cap.at_depth(depth) if 0 < depth < cap.depth else copy_ir(cap.gm)
        with deferred_codegen(), paused_gc():
            compiled = compile_captured(dataclasses.replace(cap, gm=gm), options)
        self.plans += 1
        return measured(Plan(self.model, args, compiled))


def _rows(args: tuple) -> int:
    for t in pytree.tree_leaves(args):
        if getattr(t, "dim", lambda: 0)():
            return t.shape[0]
    return 1
