"""fused_loss: the LM head's matmul and its cross-entropy, forward and backward, in chunks.

Requires: a per-device program's graph (``codegen``): ``meta["val"]`` FakeTensors on every
          node, PHASE (and STAGE under pp) where the IR had them.
Ensures:  every LM head found (below) reads its logits nowhere else: its ops are gone, a
          ``LinearCrossEntropy`` node computes the loss and the count of targets in their
          place, and the gradients of ``h`` and of the weight come where the two backward
          matmuls were (``kernels.linear_ce``): with ``early`` (and not in fp16), computed in
          the forward's op and scaled there by ``LinearCrossEntropyGrads`` (nothing
          recomputed; a copy of ``h`` that ``auto.remat`` made for the backward is gone),
          else by ``LinearCrossEntropyBackward`` from the logits again. The (tokens, vocab)
          logits, their log-softmax and their gradient are never materialised. The values
          that leave keep their nodes' VAL; everything else is unchanged. Returns one
          ``FusedLoss`` per head, for the plan's report.

The pattern, as the joint graph writes ``F.cross_entropy(h @ w.T, target)`` (views,
``detach`` and casts between the ops are looked through):

    forward   z = mm(h, t(w)) [-> _to_copy(fp32)];  lsm = _log_softmax(z, 1)
              loss, total = nll_loss_forward(lsm, target, None, mean|sum, ignore_index)
    backward  g = nll_loss_backward(grad, lsm, target, ..., total)
              d = _log_softmax_backward_data(g, lsm) [-> _to_copy(low)]
              grad_h = mm(d, w) (``t(t(w))``);  grad_w = mm(t(d), h) (or its transpose)

Anything else reading the logits, their log-softmax or their gradient (a model that returns
its logits, an accuracy metric, a bias's gradient) leaves the head as it is; so does a
vocabulary sharded over tp (its collectives sit between the ops).

**When** (``partition(..., fused_loss="auto")``, the default): the chunked head moves the
same bytes a chunk at a time, with the same FLOPs (gradients in the forward) or a third more
(the logits again in the backward), so on the device model it never saves time (a 64-token
microbatch's head ran 1.7x slower on a pipeline's last stage, recomputing). It saves the
logits, their log-softmax and their gradient, which matters only where memory is short:
``fusing_reason`` says when (the plan without it over ``memory_budget``, or over ``NEAR`` of
the device model's memory), and the plan fuses only then, and only if the peak drops
(``compiler.compile.choose_fused_loss``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from shardfx.kernels.linear_ce import (LinearCrossEntropy, LinearCrossEntropyBackward,
                                       LinearCrossEntropyGrads, chunk_rows)
from shardfx.ir import meta as M
from shardfx.ir.graph import fake_mode_of, fake_value, inherit_place, tensor_val as _val
from shardfx.ir.units import nbytes

aten = torch.ops.aten

_VIEWS = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default,
                    aten.alias.default, aten.detach.default})


NEAR = 0.9  # of the device's memory: a plan over it fuses its head


def fusing_reason(peak: int, budget: int | None, memory: float) -> str:
    """Why a plan whose unfused peak is ``peak`` bytes should fuse its LM head, or "": it is
    over ``budget`` (``memory_budget``) or over ``NEAR`` of the device's ``memory`` (0: unknown)."""
    if budget is not None and peak > budget:
        return f"without it the peak, {nbytes(peak)}, is over memory_budget {nbytes(budget)}"
    if memory and peak > NEAR * memory:
        return (f"without it the peak, {nbytes(peak)}, is over {NEAR:.0%} of the device's "
                f"{nbytes(int(memory))}")
    return ""


def fusable(ir: fx.Graph) -> bool:
    """Whether the planned IR has an LM head ``fuse_loss`` could fuse in its program: the
    pattern (``_match``), its logits and their log-softmax placed alike and neither split on
    the vocabulary nor partial (else collectives sit between its ops in the program, as with a
    vocabulary-parallel head). Checked before ``fused_loss="auto"`` emits a fused program to
    compare: on a 70B-shaped Llama over dp=8 x tp=8 (80 layers) that emission fused nothing,
    and skipping it took the choice from 2.76 to 0.46 s (the unfused peak's walk)."""
    for nll in ir.find_nodes(op="call_function", target=aten.nll_loss_forward.default):
        head = _match(nll)
        if head is None:
            continue
        placed = {_placements(n) for n in (head.mm, head.lsm)}
        if len(placed) == 1 and not any(isinstance(p, Partial) or isinstance(p, Shard) and
                                        p.dim != 0 for p in placed.pop()):
            return True
    return False


def _placements(node: fx.Node) -> tuple:
    sharding = node.meta.get(M.SHARDING)
    return tuple(sharding.out) if sharding is not None else ()


@dataclass(frozen=True)
class FusedLoss:
    """One LM head fused with its loss: what it saves, for ``print(plan)``."""

    weight: str  # the program value the head multiplies by (``lm_head_weight``)
    tokens: int
    vocab: int
    hidden: int
    rows: int  # per chunk
    early: bool = True  # gradients in the forward; else the logits again in the backward

    @classmethod
    def of(cls, node: fx.Node) -> "FusedLoss":
        """The report of a program's ``LinearCrossEntropy`` node."""
        h, w, _ = node.args
        tokens, hidden = _val(h).shape
        weight = w.args[0] if w.target is aten._to_copy.default else w  # its low-precision copy
        return cls(weight.name, tokens, _val(w).shape[0], hidden, node.target.rows,
                   node.target.grads)

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.rows)

    @property
    def logits_bytes(self) -> int:
        return self.tokens * self.vocab * 4  # fp32: the only log-softmax it replaces


@dataclass
class _Head:
    mm: fx.Node
    h: fx.Node
    w: fx.Node  # what ``t`` read: the weight, or its cast
    lsm: fx.Node
    nll: fx.Node
    grad_h: fx.Node | None = None  # the backward's matmuls
    grad_w: fx.Node | None = None
    transposed: bool = False  # grad_w computed as w.T's gradient
    nll_backward: fx.Node | None = None
    lsm_backward: fx.Node | None = None
    h_backward: fx.Node | None = None  # h as the backward reads it (remat may recompute it)
    nll_copies: list[fx.Node] = field(default_factory=list)  # remat's


def fuse_loss(graph: fx.Graph, early: bool = True, model=None) -> list[FusedLoss]:
    """``early``: the head's backward follows its forward at once (one device, dp, tp, a
    pipeline's 1F1B), so its gradients may be computed in the forward. ``model``: the
    ``DeviceModel`` the chunks are sized for (``kernels.linear_ce.chunk_rows``)."""
    found = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.nll_loss_forward.default and \
                not node._erased and M.REMAT not in node.meta:
            head = _match(node)
            if head is not None:
                found.append(_replace(graph, head, early, model))
    return found


def _dead(n: fx.Node) -> bool:
    """A view (or transpose) nothing reads, but such views: mixed precision leaves some."""
    return n.op == "call_function" and n.target in (*_VIEWS, aten.t.default) and \
        all(_dead(u) for u in n.users)


def _live_users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if not _dead(u)]


def _back(n: fx.Node) -> fx.Node:
    """Up through single-reader views and casts to what they view."""
    while n.op == "call_function" and n.target in (*_VIEWS, aten._to_copy.default) and \
            isinstance(n.args[0], fx.Node) and len(_live_users(n.args[0])) == 1:
        n = n.args[0]
    return n


def _down(n: fx.Node) -> fx.Node:
    """Down through single-reader views and casts."""
    while len(users := _live_users(n)) == 1 and (users[0].target in _VIEWS or
                                                  users[0].target is aten._to_copy.default):
        n = users[0]
    return n


def _match(nll: fx.Node) -> _Head | None:
    lsm, target, weight, reduction, ignore = nll.args
    if weight is not None or reduction not in (1, 2) or lsm.target is not aten._log_softmax.default:
        return None
    z, dim, half = lsm.args
    if _val(z) is None or _val(z).dim() != 2 or _val(z).dtype != torch.float32 or \
            dim not in (1, -1) or half:
        return None  # the chunked ops compute the loss in fp32, as mixed precision keeps it
    mm = _back(z)
    if mm.target is not aten.mm.default or tuple(_val(mm).shape) != tuple(_val(z).shape):
        return None
    h, wt = mm.args
    if wt.target is not aten.t.default or _val(h).dtype != _val(mm).dtype:
        return None
    head = _Head(mm, h, wt.args[0], lsm, nll)
    # the log-softmax: read by the loss, its backward, and views of it the backward reads
    backward = [u for u in lsm.users if u.target is aten.nll_loss_backward.default]
    lsm_backward = _log_softmax_backwards(lsm)
    if len(backward) != 1 or len(lsm_backward) != 1 or \
            lsm_backward[0].args[0] is not backward[0] or len(backward[0].users) != 1:
        return None
    # remat may compute the loss again in the backward, for the count of targets
    head.nll_copies = [u for u in lsm.users if u.target is aten.nll_loss_forward.default
                       and u.meta.get(M.REMAT) == nll.name]
    if not _only_read_by(lsm, {nll, *head.nll_copies, backward[0], lsm_backward[0]}):
        return None
    head.nll_backward, head.lsm_backward = backward[0], lsm_backward[0]
    if not _backward_matmuls(head, _down(lsm_backward[0])):
        return None
    return head


def _log_softmax_backwards(lsm: fx.Node) -> list[fx.Node]:
    out, stack = [], [lsm]
    while stack:
        for u in stack.pop().users:
            if u.target in _VIEWS:
                stack.append(u)
            elif u.target is aten._log_softmax_backward_data.default:
                out.append(u)
    return out


def _only_read_by(lsm: fx.Node, readers: set) -> bool:
    """``lsm`` and its views are read by ``readers`` (and unread views) only."""
    stack = [lsm]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.target in _VIEWS:
                stack.append(u)
            elif u not in readers:
                return False
    return True


def _untransposed(n: fx.Node) -> tuple[fx.Node, bool]:
    """What ``n`` is a chain of ``t`` of, and whether their number is odd."""
    odd = False
    while n.op == "call_function" and n.target is aten.t.default:
        n, odd = n.args[0], not odd
    return n, odd


def _backward_matmuls(head: _Head, d: fx.Node) -> bool:
    """``d`` (the logits' gradient, 2-D) is read by exactly the two matmuls of the head's
    backward: ``mm(d, w)`` and ``mm(t(d), h)`` or ``mm(t(h), d)``."""
    readers = _live_users(d)
    for r in readers:
        if r.target is aten.mm.default and r.args[0] is d:
            base, odd = _untransposed(r.args[1])
            if base is not head.w or odd or head.grad_h is not None:
                return False
            head.grad_h = r
        elif r.target is aten.t.default and len(_live_users(r)) == 1 and \
                (mm := _live_users(r)[0]).target is aten.mm.default and head.grad_w is None:
            if mm.args[0] is r and _is_h(mm.args[1], head):  # d.T @ h: w's gradient
                head.grad_w, head.transposed, head.h_backward = mm, False, mm.args[1]
            elif mm.args[1] is r and _is_h_t(mm.args[0], head):  # h.T @ d: w.T's
                head.grad_w, head.transposed = mm, True
                head.h_backward = _untransposed(mm.args[0])[0]
            else:
                return False
        elif r.target is aten.mm.default and r.args[1] is d and head.grad_w is None and \
                _is_h_t(r.args[0], head):
            head.grad_w, head.transposed, head.h_backward = r, True, _untransposed(r.args[0])[0]
        else:
            return False
    return head.grad_h is not None and head.grad_w is not None


def _is_h(n: fx.Node, head: _Head) -> bool:
    """``n`` is the head's input ``h``: the forward's node, or the copy of it that
    ``auto.remat`` recomputes in the backward."""
    return n is head.h or n.meta.get(M.REMAT) == head.h.name


def _is_h_t(n: fx.Node, head: _Head) -> bool:
    base, odd = _untransposed(n)
    return odd and _is_h(base, head)


def _replace(graph: fx.Graph, head: _Head, early: bool, model) -> FusedLoss:
    tokens, hidden = _val(head.h).shape
    vocab = _val(head.w).shape[0]
    _, target, _, reduction, ignore = head.nll.args
    rows = chunk_rows(tokens, vocab, hidden, model=model, dtype=_val(head.h).dtype)
    early = early and _val(head.h).dtype != torch.float16  # (kernels.linear_ce: why)
    mode = fake_mode_of(graph)
    old = [head.mm, head.lsm, head.nll, head.nll_backward, head.lsm_backward, head.grad_h,
           head.grad_w]

    forward = LinearCrossEntropy(reduction, ignore, rows, grads=early)
    with graph.inserting_before(head.nll):
        call = graph.call_function(forward, (head.h, head.w, target))
    call.meta[M.VAL] = fake_value(mode, forward, call.args, {})
    inherit_place(head.nll, call)
    items = _items(graph, call, 4 if early else 3)
    for nll in (head.nll, *head.nll_copies):  # getitem(nll, 0): the loss, 1: the count
        for u in list(nll.users):
            u.replace_all_uses_with(items[u.args[1]])
            old.append(u)
        old.append(nll)

    grad, _, _, _, _, _, total = head.nll_backward.args  # dp: the count over all ranks
    first = min(head.grad_h, head.grad_w, key=lambda n: _order(graph)[n])
    if early:
        backward = LinearCrossEntropyGrads(reduction, _val(head.h).dtype, head.transposed)
        args = (grad, total, items[2], items[3])
    else:
        backward = LinearCrossEntropyBackward(reduction, ignore, rows, head.transposed)
        args = (grad, head.h_backward, head.w, target, total, items[2])
    with graph.inserting_before(first):
        bcall = graph.call_function(backward, args)
    bcall.meta[M.VAL] = fake_value(mode, backward, bcall.args, {})
    inherit_place(first, bcall)
    grad_h, grad_w = _items(graph, bcall, 2)
    head.grad_h.replace_all_uses_with(grad_h)
    head.grad_w.replace_all_uses_with(grad_w)
    _erase_dead(graph, old)
    if early and head.h_backward is not head.h:
        _erase_unread_recomputation(graph, head.h_backward)
    return FusedLoss.of(call)


def _erase_unread_recomputation(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node``, a value ``auto.remat`` recomputed that nothing reads now, and the
    recomputed values only it read."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n._erased or n.users or M.REMAT not in n.meta:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack += inputs


def _items(graph: fx.Graph, call: fx.Node, n: int) -> list[fx.Node]:
    items = []
    with graph.inserting_after(call):
        for i in reversed(range(n)):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta[M.VAL] = call.meta[M.VAL][i]
            inherit_place(call, item)
            items.insert(0, item)
    return items


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _erase_dead(graph: fx.Graph, roots: list[fx.Node]) -> None:
    """Erase ``roots`` and, transitively, what only they read, once nothing reads them:
    the views, casts and transposes around the replaced ops (never a placeholder)."""
    gone: set[fx.Node] = set()

    def erase(n: fx.Node) -> list[fx.Node]:
        for u in list(n.users):
            if _dead(u):
                erase(u)
        if n.users:
            return []
        inputs = n.all_input_nodes
        graph.erase_node(n)
        gone.add(n)
        return inputs

    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in gone or n.op != "call_function":
            continue
        if n in roots or n.target in (*_VIEWS, aten.t.default, aten._to_copy.default,
                                      operator.getitem):
            stack += erase(n)
