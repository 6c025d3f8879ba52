"""The router of each mixture-of-experts layer, found in the joint graph.

A router scores every expert for each token (a matmul of the tokens by its weight, then a
softmax or a sigmoid) and keeps the top k: those choices and their weights are the
``shardfx::experts`` op's ``index`` and ``weights``. Walking up from them, the first matmul on
every path is the router's. ``passes.mixed_precision`` keeps it in fp32 under bf16/fp16
(GShard, Switch Transformer and Megatron-LM do: a rounding of the scores changes which expert a
token goes to), with the matmuls of its backward: those reading the router's weight, and the one
making the weight's gradient.
"""

from __future__ import annotations

import torch.fx as fx

from shardfx.kernels.experts import EXPERTS
from shardfx.ir import meta as M


def router_matmuls(graph: fx.Graph, matmuls: frozenset, views: frozenset) -> set[fx.Node]:
    """The matmuls (ops of ``matmuls``) of the graph's routers, forward and backward; ``views``:
    the ops through which a weight is read as it is (a transpose, a view)."""
    found: set[fx.Node] = set()
    weights: set[fx.Node] = set()
    for experts in graph.find_nodes(op="call_function", target=EXPERTS):
        stack, seen = [experts.args[1], experts.args[2]], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, fx.Node) or node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if node.target in matmuls:
                found.add(node)
                weights |= {p for a in node.all_input_nodes if (p := _param(a, views))}
                continue
            stack.extend(node.all_input_nodes)
    for node in graph.nodes:  # the backward's: reading the weight, or making its gradient
        if node.op == "call_function" and node.target in matmuls and \
                any(_param(a, views) in weights for a in node.all_input_nodes):
            found.add(node)
    out = graph.output_node()
    names = {w.meta[M.ROLE].name for w in weights}
    for value, role in zip(out.args[0], out.meta.get(M.OUTPUTS, ())):
        if role is not None and role.kind is M.OutputKind.GRAD and role.name in names:
            while isinstance(value, fx.Node) and value.op == "call_function" and \
                    value.target in views:
                value = value.args[0]
            if isinstance(value, fx.Node) and value.target in matmuls:
                found.add(value)
    return found


def _param(node: fx.Node, views: frozenset) -> fx.Node | None:
    """The parameter ``node`` reads as it is (through views), if any."""
    while node.op == "call_function" and node.target in views and \
            isinstance(node.args[0], fx.Node):
        node = node.args[0]
    role = node.meta.get(M.ROLE) if node.op == "placeholder" else None
    return node if role is not None and role.kind is M.InputKind.PARAM else None
