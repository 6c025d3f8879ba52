"""Weight gradients summed where they are made: a pipeline part's (or a program's, under
gradient accumulation) accumulating variant.

A pipeline stage runs its backward once per microbatch, and each run makes every weight's
gradient anew: a linear layer's ``mm(grad_out.T, x)``, an embedding's
``embedding_dense_backward`` (a zero-filled ``[vocab, hidden]`` tensor with the microbatch's
rows added in). The runner then adds it into the sum of the earlier microbatches. On a 64-token
microbatch both are memory-bound: the embedding's gradient writes 65 MB of zeros (vocab 32000,
hidden 512) to add 64 rows, and the addition reads it again with the sum. Autograd runs the
same way (``AccumulateGrad``'s in-place add), as ``torch.distributed.pipelining`` does.

The variant takes, after the part's own inputs, the accumulator of each gradient it can sum
in place and writes into it: ``addmm_(acc, grad_out.T, x)`` for a matmul (BLAS adds into its
output), ``index_add_(acc, 0, ids, rows)`` for an embedding (padding rows masked out, as
``embedding_dense_backward`` leaves them). Eight 64-token microbatches of that embedding take
30 ms instead of 260 ms on one core (measured, fp32). The pipeline runner runs the variant
once every accumulator exists (every microbatch after a gradient's first) and the memory model
walks it there: the fresh gradients are not made. ``runner.step_batches`` does the same from
its second batch on (not under ZeRO, whose optimizer steps rows the program does not make).

Requires: ``part`` a part of ``codegen.stages`` (returns a tuple) with ``M.VAL`` on its nodes.
Ensures: the variant returns what ``part`` returns, except that each fused output is its
accumulator, updated in place (``acc + the part's gradient``); ``part`` is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from shardfx.ir import meta as M

aten = torch.ops.aten


@dataclass(frozen=True)
class Accumulating:
    module: fx.GraphModule  # takes the part's inputs, then one accumulator per index
    indices: tuple[int, ...]  # the part's outputs it sums into their accumulators
    names: tuple[str, ...]  # the parameter each of them is the gradient of


def accumulating(part: fx.GraphModule, outputs) -> Accumulating | None:
    """``part``'s accumulating variant, or None where no gradient output is one it can sum in
    place. ``outputs``: the part's ``codegen.steps.Output`` records; a gradient is fused
    where it is one parameter's and nothing else, not read by a later part nor sent, and
    made by a matmul (through transposes) or an embedding's backward that nothing else
    reads."""
    graph = part.graph
    sums = summable(part, outputs)
    fusable = {index: graph.output_node().args[0][index] for index in sums}
    if not fusable:
        return None
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = copy.graph_copy(graph, env)
    copy.output(out)
    last = next(iter(reversed(copy.find_nodes(op="placeholder"))), None)
    indices = tuple(sorted(fusable))
    for index in indices:
        value = env[fusable[index]]
        maker, transposes = _maker(value, out)
        with copy.inserting_after(last):
            acc = last = copy.placeholder(f"accumulator_{index}")
        acc.meta[M.VAL] = value.meta.get(M.VAL)
        with copy.inserting_before(maker):
            into = copy.call_function(aten.t.default, (acc,)) if transposes % 2 else acc
            summed = _sum_into(copy, maker, into)
        maker.replace_all_uses_with(summed)
        copy.erase_node(maker)
    for node in copy.nodes:
        if node.op == "call_function" and M.VAL not in node.meta:
            node.meta[M.VAL] = _meta_value(node)
    copy.lint()
    return Accumulating(fx.GraphModule(part, copy, class_name=type(part).__name__), indices,
                        tuple(sums[i][0] for i in indices))


def summable(part: fx.GraphModule, outputs) -> dict[int, tuple[str, fx.Node]]:
    """The outputs ``accumulating`` sums in place (see there), each with the parameter it is
    the gradient of and the node in ``part``'s graph whose tensor it no longer makes: what the memory model leaves out of the
    part's walk, with no variant built (a pipeline's memory estimate runs once per candidate
    of a budget, and an 80-layer plan's parts are large)."""
    returned = part.graph.output_node().args[0]
    out = {}
    for o in outputs:
        if [r.kind for r in o.roles] == [M.OutputKind.GRAD] and not o.local and not o.sends:
            found = _maker(returned[o.index], returned)
            if found is not None:
                out[o.index] = (o.roles[0].name, found[0])
    return out


def _maker(value, returned) -> tuple[fx.Node, int] | None:
    """(the op that makes ``value``'s storage, the transposes between them) where it is a
    matmul or an embedding's backward read by nothing but that chain to the output."""
    if not isinstance(value, fx.Node) or sum(v is value for v in returned) != 1 \
            or value.meta.get(M.VAL) is None:
        return None
    transposes, node = 0, value
    while node.target is aten.t.default and len(node.users) == 1:
        transposes, node = transposes + 1, node.args[0]
    if node.op != "call_function" or len(node.users) != 1:
        return None
    if node.target is aten.mm.default:
        return node, transposes
    if node.target is aten.embedding_dense_backward.default and transposes == 0 \
            and not _arg(node, 4, "scale_grad_by_freq", False):
        return node, transposes
    return None


def _sum_into(graph: fx.Graph, maker: fx.Node, acc: fx.Node) -> fx.Node:
    """Nodes that add what ``maker`` makes into ``acc`` in place; the last returns ``acc``."""
    if maker.target is aten.mm.default:
        return graph.call_function(aten.addmm_.default, (acc, *maker.args[:2]))
    grad, ids = maker.args[0], maker.args[1]
    hidden = maker.meta[M.VAL].shape[1]
    rows = graph.call_function(aten.reshape.default, (grad, [-1, hidden]))
    ids = graph.call_function(aten.reshape.default, (ids, [-1]))
    padding = _arg(maker, 3, "padding_idx", -1)
    if padding >= 0:  # embedding_dense_backward leaves the padding row's gradient zero
        keep = graph.call_function(aten.ne.Scalar, (ids, padding))
        keep = graph.call_function(aten.unsqueeze.default, (keep, 1))
        rows = graph.call_function(aten.mul.Tensor, (rows, keep))
    return graph.call_function(aten.index_add_.default, (acc, 0, ids, rows))


def _meta_value(node: fx.Node):
    """What ``node`` computes, on the meta device (shapes for the memory model)."""
    def meta(a):
        v = a.meta[M.VAL] if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v
    return node.target(*fx.node.map_aggregate(node.args, meta),
                       **fx.node.map_aggregate(node.kwargs, meta))


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
