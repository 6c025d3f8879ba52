"""Named recompute policies: what Megatron and TorchTitan users ask for by name.

    partition(..., recompute="auto" | "none" | "selective" | "full")

- ``"auto"`` (the default): remat's own choice under ``memory_budget`` (``auto.remat``), the
  least recomputation that fits; nothing without a budget.
- ``"none"``: nothing is recomputed; a ``memory_budget`` is checked, not met by recomputing.
- ``"selective"``: the attention core is recomputed in the backward (Megatron's selective
  activation recomputation, Korthikanti et al. 2022; TorchTitan's ``selective``): the values
  between the query-key product and the product with the values, the scores, their softmax
  and its dropout, whose size grows with the square of the sequence, from q, k and v, which are
  kept, as is the core's output (the output projection's input). A fused attention kernel
  (``scaled_dot_product_attention``) is its own core: its forward runs again for what its
  backward reads besides its output (the log-sum-exp rows).
- ``"full"``: every repeated block's activations are recomputed from the block's input, which
  alone is kept (Megatron's full recomputation with one layer per checkpoint, TorchTitan's
  ``full``, ``torch.utils.checkpoint`` around each block).

A policy is stated as which forward values may be recomputed (``allowed``); remat's ILP
(``auto.remat.Problem``, offload off) then keeps the fewest bytes with only those recomputable,
under the same rules (random ops and collectives' inputs are never recomputed, a block
recomputes from its own input), and ``auto.remat_choice.apply`` puts the copies in the
backward.

Requires: PHASE, COST on every op; SHARDING on a tp mesh; STAGE in a pipeline (as remat).
Ensures:  the policy's recomputation applied (REMAT copies in the backward), its ``Choice``.
"""

from __future__ import annotations

import operator

import numpy as np
import torch
import torch.fx as fx

from shardfx.auto.remat import Choice, Problem, forward_values
from shardfx.auto.remat_search import choose
from shardfx.ir import meta as M
from shardfx.passes.stage_cut import block_of

aten = torch.ops.aten
FUSED_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default}
_MATMULS = {aten.bmm.default, aten.mm.default, aten.matmul.default}


def apply_policy(gm: fx.GraphModule, policy: str, group_of, weight_of,
                 split_backward: bool = False) -> Choice | None:
    """Recompute what ``policy`` names (``"selective"``, ``"full"``) in ``gm``; None when it
    names nothing the graph has (no block, no attention)."""
    allowed = allowed_values(gm, policy)
    if not allowed:
        return None
    problem = Problem(gm, group_of, weight_of, split_backward)
    mask = np.zeros(problem.n, dtype=bool)
    for node in allowed & problem.var.keys():
        mask[problem.var[node]] = True
    problem.can_recompute &= mask | ~problem.can_keep  # a view is recomputed, never kept
    problem.can_offload[:] = False
    keep, again, off = problem.smallest()
    if not (again & ~keep).any():
        return None
    return choose(gm, problem, (keep, again, off))


def allowed_values(gm: fx.GraphModule, policy: str) -> set[fx.Node]:
    """The forward values ``policy`` recomputes where it can."""
    forward = forward_values(gm)
    if policy == "full":
        return {n for n in forward if block_of(n) is not None}
    if policy == "selective":
        return attention_cores(forward)
    return set()


def attention_cores(forward: list[fx.Node]) -> set[fx.Node]:
    """The values of every attention core but its output: a fused attention op (and all of its
    results but the output), or in attention written out, the ops from the query-key matmul to
    the matmul with the values (``_core``)."""
    out: set[fx.Node] = set()
    for node in forward:
        if node.target in FUSED_ATTENTION:
            out.add(node)
            out.update(u for u in node.users if u.target is not operator.getitem or u.args[1] != 0)
        elif node.target in (aten._softmax.default, aten.softmax.int):
            out |= _core(node)
    return out


def _core(softmax: fx.Node) -> set[fx.Node]:
    """The ops between the query-key product ``softmax`` normalises and the product of its
    probabilities with the values (both matmuls of two activations), the first included, the
    last not: empty where ``softmax`` is not attention's (no such products around it)."""
    scores = _back_to_matmul(softmax)
    product = _on_to_matmul(softmax)
    if scores is None or product is None:
        return set()
    between, todo = set(), [product]
    while todo:  # ancestors of the product that descend from the scores
        node = todo.pop()
        for a in node.all_input_nodes:
            if a not in between and a.meta.get(M.PHASE) is M.Phase.FORWARD and \
                    (a is scores or _descends(a, scores)):
                between.add(a)
                todo.append(a)
    return between


def _activations(node: fx.Node) -> bool:
    """A matmul of two values computed in the forward (not a weight: q k^T, p v)."""
    return node.target in _MATMULS and all(
        a.op == "call_function" for a in node.all_input_nodes[:2])


def _back_to_matmul(node: fx.Node, depth: int = 8) -> fx.Node | None:
    for _ in range(depth):
        ins = [a for a in node.all_input_nodes if a.op == "call_function"]
        if not ins:
            return None
        node = max(ins, key=_numel)  # the scores, not a mask or a scale
        if _activations(node):
            return node
    return None


def _on_to_matmul(node: fx.Node, depth: int = 8) -> fx.Node | None:
    for _ in range(depth):
        users = [u for u in node.users if u.meta.get(M.PHASE) is M.Phase.FORWARD]
        if not users:
            return None
        for u in users:
            if _activations(u):
                return u
        node = users[0]
    return None


def _descends(node: fx.Node, root: fx.Node, depth: int = 12) -> bool:
    frontier = {node}
    for _ in range(depth):
        frontier = {a for n in frontier for a in n.all_input_nodes if a.op == "call_function"}
        if root in frontier:
            return True
        if not frontier:
            return False
    return False


def _numel(node: fx.Node) -> int:
    val = node.meta.get(M.VAL)
    return val.numel() if isinstance(val, torch.Tensor) else 0
