"""estimate_cost: FLOPs and output bytes of every op.

Requires: VAL on every node; ``options.device_model`` (None: the ``cpu`` preset).
Ensures:  COST (NodeCost) on every call_function node; ``gm.meta[device_model.GRAPH_KEY]``: the
          ``DeviceModel`` the time estimates of later passes use (``remat`` reads it there).

FLOPs come from torch's own per-op formulas (``torch.utils.flop_counter``: matmuls, convolutions,
attention); ops it has no formula for (pointwise, reductions, views) count 0 FLOPs — they are
memory-bound, and their cost is the bytes they write, which we record beside. torch has no
formula for CPU flash attention; ``CPU_ATTENTION_FLOPS`` gives it torch's SDPA formulas (without
them rematerialization would take recomputing attention on CPU for free). How long an op takes
is ``DeviceModel.node_seconds``: the roofline of these FLOPs and the bytes it reads and writes.
"""

from __future__ import annotations

import torch.fx as fx

from shardfx.cost.device_model import GRAPH_KEY, default_model
from shardfx.ir import meta as M
from shardfx.cost.node import node_bytes, node_flops
from shardfx.ir.graph import op_nodes
from shardfx.ir.contract import contract, on_graph, on_ops


@contract(requires=[on_ops(M.VAL, "VAL")],
          ensures=[on_ops(M.COST, "COST"), on_graph(GRAPH_KEY, "DeviceModel")])
def estimate_cost(gm: fx.GraphModule, options) -> fx.GraphModule:
    for node in op_nodes(gm.graph):
        node.meta[M.COST] = M.NodeCost(flops=node_flops(node), out_bytes=node_bytes(node))
    gm.meta[GRAPH_KEY] = default_model(options)
    return gm
