"""assign_phase: mark every op as forward or backward.

Requires: ROLE on placeholders, OUTPUTS on the output node.
Ensures:  PHASE on every call_function node.

Forward is what the forward outputs (the loss, the model output, buffer updates) need; everything
else — whatever reads the tangent, and ops only feeding gradients (such as a weight transpose
used only by the backward matmul) — is backward. This is the split the remat and pipeline passes
reason about: forward values read by a backward op are the saved activations.
"""

from __future__ import annotations

import torch.fx as fx

from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.ir.contract import contract, on_inputs, on_ops, on_output

FORWARD_OUTPUTS = (M.OutputKind.LOSS, M.OutputKind.OUTPUT, M.OutputKind.BUFFER_UPDATE)


@contract(requires=[on_inputs(M.ROLE, "ROLE"), on_output(M.OUTPUTS, "OUTPUTS")],
          ensures=[on_ops(M.PHASE, "PHASE")])
def assign_phase(gm: fx.GraphModule, options) -> fx.GraphModule:
    out = gm.graph.output_node()
    roots = [v for v, r in zip(out.args[0], out.meta[M.OUTPUTS]) if r.kind in FORWARD_OUTPUTS]
    forward: set[fx.Node] = set()
    stack = [v for v in roots if isinstance(v, fx.Node)]
    while stack:
        node = stack.pop()
        if node in forward:
            continue
        forward.add(node)
        stack.extend(node.all_input_nodes)
    for node in op_nodes(gm.graph):
        node.meta[M.PHASE] = M.Phase.FORWARD if node in forward else M.Phase.BACKWARD
    return gm
