"""The compiler, in order: every pass one line, with why it runs where it does.

``capture`` has already turned the model into the IR (the joint forward+backward graph at ATen
level, parameters named by FQN). What follows reads and annotates that IR, then emits the
program each device runs.
"""

from __future__ import annotations

import torch.fx as fx

from shardfx.codegen.program import Program, generate
from shardfx.ir.text import ir_to_text
from shardfx.passes.assign_phase import assign_phase
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.passes.manager import Options, PassRecord, run_passes


def compile_ir(gm: fx.GraphModule, options: Options) -> tuple[fx.GraphModule, Program, list[PassRecord]]:
    history = [PassRecord("capture", ir_to_text(gm))]
    gm = run_passes(gm, [
        assign_phase,   # forward vs backward: the split remat and pipeline stages reason about
        estimate_cost,  # FLOPs and bytes per op: the summary now, the stage cutter and solver later
    ], options, history)
    return gm, generate(gm), history
