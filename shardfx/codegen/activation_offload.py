"""Activation offload in the program: each value ``auto.remat`` chose to offload goes to host
memory after its last forward reader and comes back before its first backward reader.

``auto.remat`` marks an offloaded value (``OFFLOAD``) with the op of the backward before which
it comes back: one block ahead of the block that first reads it (``auto.remat`` says why).
Here, in the generated program, the value's forward readers read it as before; right after
the last of them, ``to_host(value)`` copies it to host memory, and nothing on the device reads
the value after that, so it goes; before the marked op (or the first backward reader, if that
comes first or the op is not in the program), ``from_host`` brings it back, and every backward
reader reads that copy. ``kernels.host_copy`` runs the copies (on CUDA on a copy stream of
their own); the memory model counts ``to_host``'s result as the host's.

A value with no backward reader left in the program (a fused loss reads it whole) is left as
it was.

Requires: the generated program before it is cut into stages, PHASE on its ops.
Ensures: per offloaded value read in the backward, one ``to_host`` after its last forward
reader and one ``from_host`` before its first backward reader, which the backward reads instead;
nothing else changed. Returns how many values it offloads.
"""

from __future__ import annotations

import torch.fx as fx

from shardfx.cost.values import tensor_bytes
from shardfx.ir import meta as M
from shardfx.ir.graph import phases
from shardfx.kernels.host_copy import from_host, to_host


def offload_activations(module: fx.GraphModule) -> int:
    """Rewrite ``module``'s graph (module docstring); returns how many values go to host."""
    graph = module.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    phase = phases(graph)
    count = 0
    for value in [n for n in nodes if M.OFFLOAD in n.meta]:
        readers = [u for u in value.users if u.op == "call_function"]
        backward = [u for u in readers if phase[u] is M.Phase.BACKWARD]
        forward = [u for u in readers if phase[u] is not M.Phase.BACKWARD]
        if not backward or len(backward) + len(forward) < len(value.users):
            continue
        last = max(forward, key=order.get, default=value)
        first = min(backward, key=order.get)
        point = by_name.get(value.meta[M.OFFLOAD])
        if point is None or not order[last] < order[point] <= order[first] or \
                point.meta.get(M.STAGE) != value.meta.get(M.STAGE):
            point = first  # (in a pipeline, the copy comes back in its own stage's backward)
        with graph.inserting_after(last):
            host = graph.call_function(to_host, (value,))
        with graph.inserting_before(point):
            back = graph.call_function(from_host, (host,))
        for node, at in ((host, last), (back, point)):
            node.meta[M.VAL] = value.meta[M.VAL]
            node.meta[M.PHASE] = phase[at] if node is host else M.Phase.BACKWARD
            if M.STAGE in value.meta:
                node.meta[M.STAGE] = value.meta[M.STAGE]
        for reader in backward:
            reader.replace_input_with(value, back)
        count += 1
    if count:
        graph.lint()
        module.recompile()
    return count


def offloaded(program) -> dict[str, int]:
    """The values a program (or a pipeline's, its parts) sends to host memory: name -> bytes."""
    module = getattr(program, "module", program)
    return {n.args[0].name: tensor_bytes(n.meta[M.VAL]) for m in module.modules()
            if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.target is to_host}
