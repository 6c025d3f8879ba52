"""decompose: ops that fusion cannot hold whole, written as the ops it can (before ``fuse``).

Requires: a per-device program's graph: ``meta["val"]`` (FakeTensors) on every node.
Ensures:  every fp32 ``native_layer_norm`` over the last dimension is its mean, centring,
          variance, ``rsqrt`` and affine ops, and every fp32 ``native_layer_norm_backward``
          over it is the input gradient's row ops plus, for the weight and bias gradients, sums
          over the rows; the ``getitem`` readers of each output read the op that computes it
          now. New nodes carry the VAL, PHASE and STAGE of the op they replace; nothing else
          changes.

Why: ``native_layer_norm`` is one ATen op with three results, and its backward reduces over
the rows for the weight's gradient; as primitive ops, ``passes.fusion`` puts the forward, and
the backward's input gradient, each in one row kernel (the weight and bias gradients are sums
over rows, left to ATen). Inductor decomposes LayerNorm the same way before it fuses.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from shardfx.ir import meta as M
from shardfx.ir.graph import inherit_place, insert_op

aten = torch.ops.aten


def decompose(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and _fp32_last_dim(node):
            if node.target is aten.native_layer_norm.default:
                _replace(graph, node, _layer_norm(graph, node))
            elif node.target is aten.native_layer_norm_backward.default:
                _replace(graph, node, _layer_norm_backward(graph, node))


def _fp32_last_dim(node: fx.Node) -> bool:
    if node.target is aten.native_layer_norm.default:
        x, shape = node.args[0], node.args[1]
    elif node.target is aten.native_layer_norm_backward.default:
        x, shape = node.args[1], node.args[2]
    else:
        return False
    tensors = [a.meta[M.VAL] for a in node.all_input_nodes]
    return len(shape) == 1 and all(t.dtype == torch.float32 for t in tensors)


def _layer_norm(graph: fx.Graph, node: fx.Node) -> list[fx.Node | None]:
    """(out, mean, rstd) of ``native_layer_norm(x, [n], weight, bias, eps)``."""
    x, _, weight, bias, eps = node.args
    with graph.inserting_before(node):
        op = _inserter(graph, node)
        mean = op(aten.mean.dim, x, [-1], True)
        centred = op(aten.sub.Tensor, x, mean)
        var = op(aten.mean.dim, op(aten.mul.Tensor, centred, centred), [-1], True)
        rstd = op(aten.rsqrt.default, op(aten.add.Tensor, var, eps))
        out = op(aten.mul.Tensor, centred, rstd)
        if weight is not None:
            out = op(aten.mul.Tensor, out, weight)
        if bias is not None:
            out = op(aten.add.Tensor, out, bias)
    return [out, mean, rstd]


def _layer_norm_backward(graph: fx.Graph, node: fx.Node) -> list[fx.Node | None]:
    """(dx, dweight, dbias): ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with
    ``g = grad * weight``, ``xhat = (x - mean) * rstd``; the affine gradients are sums over
    every dimension but the last."""
    grad, x, _, mean, rstd, weight, bias, mask = node.args
    rows = list(range(x.meta[M.VAL].dim() - 1))
    with graph.inserting_before(node):
        op = _inserter(graph, node)
        xhat = op(aten.mul.Tensor, op(aten.sub.Tensor, x, mean), rstd)
        g = op(aten.mul.Tensor, grad, weight) if weight is not None else grad
        dx = dweight = dbias = None
        if mask[0]:
            c1 = op(aten.mean.dim, op(aten.mul.Tensor, g, xhat), [-1], True)
            c2 = op(aten.mean.dim, g, [-1], True)
            inner = op(aten.sub.Tensor, op(aten.sub.Tensor, g, c2), op(aten.mul.Tensor, xhat, c1))
            dx = op(aten.mul.Tensor, rstd, inner)
        if mask[1] and weight is not None:
            dweight = op(aten.sum.dim_IntList, op(aten.mul.Tensor, grad, xhat), rows)
        if mask[2] and bias is not None:
            dbias = op(aten.sum.dim_IntList, grad, rows)
    return [dx, dweight, dbias]


def _inserter(graph: fx.Graph, like: fx.Node):
    def op(target, *args):
        new = insert_op(graph, target, *args)
        inherit_place(like, new)
        return new

    return op


def _replace(graph: fx.Graph, node: fx.Node, outputs: list[fx.Node | None]) -> None:
    """Each ``getitem(node, i)`` reads ``outputs[i]`` instead; then ``node`` goes."""
    for user in list(node.users):
        if user.target is not operator.getitem or outputs[user.args[1]] is None:
            raise AssertionError(f"decompose: {user.format_node()} reads an output not made")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
