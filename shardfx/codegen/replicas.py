"""A pipeline stage's gradients combined over its dp replicas, as programs.

An SPMD plan sums each gradient over dp inside its one program (``codegen.spmd`` returns it as
``wait(all_reduce(g, "sum", group_dp))``), and the program passes turn those sums into buckets
(``codegen.bucketing``) or ZeRO's reduce-scatters (``passes.zero``). A pipeline rank's
gradients are final only after its stage's last microbatch, so its runner, not its parts,
combines them. ``replica_program`` writes a stage's sums in the SPMD form, the same program
passes run on it, and ``cut`` splits the result where the runner must act:

    stage1 replicas   inputs: the stage's gradients (GRAD inputs, in the order they are made),
                      group(dp); outputs: each gradient summed over dp (or this rank's rows)
      bucket0 issue   bucket0's gradients, group(dp) -> bucket0's collective, started
      bucket1 issue   ...
      finish          every bucket's started collective -> the outputs (waits, splits, views)

The runner runs a bucket's issue part once its last gradient is final, while the schedule goes
on (the reduction of a late stage runs during the backward of earlier ones, as DDP overlaps
its buckets), and the finish part once the schedule ends. A functional collective's result
is waited for by ``wait_tensor`` wherever it runs: the issue part returns it un-waited.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module

from shardfx.codegen.program import Program
from shardfx.codegen.redistribute import Collective
from shardfx.ir import meta as M
from shardfx.ir.graph import insert_op

c10d = torch.ops._c10d_functional
STARTS = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default)


def replica_program(grads: list[tuple[str, torch.Tensor]]) -> Program:
    """The SPMD form of summing ``grads`` (FQN, fake value of this rank's gradient, in the
    order the stage makes them) over dp: one ``wait(all_reduce(g, "sum", group_dp))`` each."""
    graph = fx.Graph()
    inputs = []
    for fqn, val in grads:
        node = graph.placeholder("grad_" + fqn.replace(".", "_"))
        node.meta[M.ROLE], node.meta[M.VAL] = M.InputRole(M.InputKind.GRAD, fqn), val
        inputs.append(node)
    group = graph.placeholder("group_dp")
    group.meta[M.ROLE], group.meta[M.VAL] = M.InputRole(M.InputKind.MESH, "group(dp)"), "<dp group>"
    outs, records = [], []
    roles = tuple(M.OutputRole(M.OutputKind.GRAD, fqn) for fqn, _ in grads)
    for node, role in zip(inputs, roles):
        reduce = insert_op(graph, c10d.all_reduce.default, node, "sum", group)
        outs.append(insert_op(graph, c10d.wait_tensor.default, reduce))
        for n in (reduce, outs[-1]):
            n.meta[M.PHASE] = M.Phase.BACKWARD
        val = node.meta[M.VAL]
        records.append(Collective("all_reduce", "dp", val.numel() * val.element_size(),
                                  f"return grad {role.name}: P -> R on dp", output=role))
    graph.output(tuple(outs))
    graph.output_node().meta[M.OUTPUTS] = roles
    module = _make_graph_module(torch.nn.Module(), graph, class_name="ShardfxReplicas")
    return Program(module, tuple(n.meta[M.ROLE] for n in (*inputs, group)), roles,
                   tuple(records))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One collective of a stage's reduction: issued once every gradient in ``names`` is final."""

    names: tuple[str, ...]  # the gradients it reads, in ``issue``'s input order (then group(dp))
    issue: fx.GraphModule  # (*gradients, group name) -> (the started collective,)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A stage's gradients combined over dp: ``buckets`` issued as they fill, then ``finish``."""

    buckets: tuple[Bucket, ...]
    finish: fx.GraphModule  # (*each bucket's started collective, in order) -> outputs
    outputs: tuple[M.OutputRole, ...]  # one GRAD per output: the sum, or this rank's rows
    collectives: tuple[Collective, ...]  # one per bucket
    gathers: tuple[Program, ...] = ()  # ZeRO-1/2: every rank's updated rows of the stage's
    #                                    parameters, after the step (``codegen.zero``)

    @property
    def source(self) -> str:
        """The parts as readable Python, in the order the runner calls them."""
        text = [f"# bucket{i} issue: {', '.join(b.names)}\n{b.issue.code}"
                for i, b in enumerate(self.buckets)]
        text += [f"# finish\n{self.finish.code}"]
        text += [f"# ZeRO gather {i}, after the optimizer step\n{g.module.code}"
                 for i, g in enumerate(self.gathers)]
        return "\n".join(text)


def cut(program: Program) -> Reduction:
    """Requires: ``program`` a ``replica_program`` after its program passes: every collective
    it starts is a bucket's, read by nothing but its wait and what follows it.
    Ensures: per started collective, in the order its last gradient is made, an issue part
    (the nodes it is made from); a finish part with every other op; together they compute
    what ``program`` does."""
    graph = program.module.graph
    inputs = graph.find_nodes(op="placeholder")
    made = {n: _made_from(n, set(inputs)) for n in graph.nodes if n.target in STARTS}
    ready = {n: i for i, n in enumerate(inputs)  # the gradients, in the order they are made
             if n.meta[M.ROLE].kind is M.InputKind.GRAD}
    starts = sorted(made, key=lambda s: max(ready[a] for m in made[s] for a in m.all_input_nodes
                                            if a in ready))
    buckets, taken = [], set(inputs)
    for start in starts:  # in the order their last gradient is made
        nodes = _made_from(start, taken)
        taken |= set(nodes)
        reads = [n for n in inputs if any(n in m.all_input_nodes for m in nodes)]
        names = tuple(n.meta[M.ROLE].name for n in reads if n.meta[M.ROLE].kind is M.InputKind.GRAD)
        buckets.append(Bucket(names, _module(reads, nodes, [start], "ShardfxReplicasIssue")))
    rest = [n for n in graph.nodes if n not in taken and n.op == "call_function"]
    out = graph.output_node()
    finish = _module(starts, rest, list(out.args[0]), "ShardfxReplicasFinish")
    return Reduction(tuple(buckets), finish, program.outputs, program.collectives)


def _made_from(node: fx.Node, taken: set[fx.Node]) -> list[fx.Node]:
    """``node`` and what it is computed from, leaving out ``taken``, in program order."""
    mine, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in mine and n not in taken:
            mine.add(n)
            todo += n.all_input_nodes
    return [n for n in node.graph.nodes if n in mine]


def _module(inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[fx.Node],
            name: str) -> fx.GraphModule:
    """A module computing ``outputs`` by ``nodes`` from ``inputs`` (each a placeholder)."""
    graph, env = fx.Graph(), {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return _make_graph_module(torch.nn.Module(), graph, class_name=name)
