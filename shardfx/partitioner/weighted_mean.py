"""A class-weighted mean loss, written as what it is: a weighted sum over the total weight.

``F.cross_entropy(logits, targets, weight=w)`` (reduction "mean") traces to
``nll_loss_forward(lsm, targets, w, mean, ignore_index)``, which returns
``sum_i w[t_i] * -lsm[i, t_i] / sum_i w[t_i]`` and that total weight. Its denominator depends
on the targets, so the mean of a batch is not the mean of its shards' means: split over dp,
DTensor's rule averages the shards' losses (``Partial("avg")``), which is right only when
every shard's targets weigh the same. (Its backward reads the total weight, summed over the
shards, and is right.)

Capture rewrites each such op into ``nll_loss_forward(..., sum, ...)`` and a division of its two
results: the same numbers on one device (ATen's mean is that division), and a form every
placement handles, since both the sum and the total weight are partial sums across shards that
are reduced before the division. (An unweighted mean over targets some of which are ignored,
``ignore_index``, has the same denominator; it is left as it is, being what
``passes.fused_loss`` matches.)

Requires: VAL on every node. Ensures: no ``nll_loss_forward``/``nll_loss2d_forward`` with a
weight and reduction "mean"; the readers of its loss read the division, those of its total
weight the sum's; the new nodes carry the replaced op's meta (stack, module).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from shardfx.ir import meta as M
from shardfx.ir.graph import insert_op

aten = torch.ops.aten

_NLL = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_MEAN, _SUM = 1, 2  # torch's Reduction enum


def weighted_means_as_sums(graph: fx.Graph) -> None:
    for node in [n for target in _NLL for n in graph.find_nodes(op="call_function",
                                                                target=target)]:
        x, target, weight, reduction, ignore_index = node.args
        if weight is None or reduction != _MEAN:
            continue
        context = {k: v for k, v in node.meta.items() if k != M.VAL}
        with graph.inserting_after(node):
            summed = insert_op(graph, node.target, x, target, weight, _SUM, ignore_index)
        with graph.inserting_after(summed):
            loss_sum = insert_op(graph, operator.getitem, summed, 0)
        with graph.inserting_after(loss_sum):
            total = insert_op(graph, operator.getitem, summed, 1)
        with graph.inserting_after(total):
            mean = insert_op(graph, aten.div.Tensor, loss_sum, total)
        for new in (summed, loss_sum, total, mean):
            new.meta.update(context)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(mean if user.args[1] == 0 else total)
                graph.erase_node(user)
        if not node.users:  # (fx reads a tuple's parts through getitem: always the case)
            graph.erase_node(node)
