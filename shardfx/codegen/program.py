"""codegen: the IR becomes the program a device runs.

On one device the program is the IR itself, stripped of analysis metadata, compiled by torch.fx to
Python that calls ATen ops in order. Later stages of the compiler add here: local shapes,
explicit collectives and send/recv (spmd), and Triton kernels for fused groups. The runner only
knows ``Program``: a callable with a list of input roles and a list of output roles.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.fx as fx

from shardfx.hints import strip_hints
from shardfx.ir import meta as M


@dataclass(frozen=True)
class Program:
    """A runnable per-device program and its calling convention."""

    module: fx.GraphModule  # call as module(*inputs) -> tuple of outputs
    inputs: tuple[M.InputRole, ...]
    outputs: tuple[M.OutputRole, ...]

    @property
    def source(self) -> str:
        """Readable Python: a header naming what each input and output is, then the code."""
        lines = ["# shardfx program", "# inputs:"]
        lines += [f"#   {name}: {role}" for name, role in zip(self.input_names, self.inputs)]
        lines += ["# outputs (in order):"] + [f"#   {role}" for role in self.outputs]
        return "\n".join(lines) + "\n" + self.module.code

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.module.graph.find_nodes(op="placeholder"))


def generate(gm: fx.GraphModule) -> Program:
    """Requires: ROLE on placeholders, OUTPUTS on the output node. Leaves ``gm`` untouched."""
    graph = copy.deepcopy(gm.graph)
    strip_hints(graph)
    module = fx.GraphModule(gm, graph, class_name="ShardfxProgram")
    inputs = tuple(n.meta[M.ROLE] for n in graph.find_nodes(op="placeholder"))
    outputs = tuple(graph.output_node().meta[M.OUTPUTS])
    return Program(module, inputs, outputs)
