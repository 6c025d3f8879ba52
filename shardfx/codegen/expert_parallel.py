"""codegen.expert_parallel: a mixture-of-experts layer with its experts spread over ``ep``.

GShard's layout (Lepikhin et al. 2020): the ep ranks split the batch, as dp ranks do, and each
holds E/ep of every MoE layer's experts (rank r experts r*E/ep .. (r+1)*E/ep - 1). A layer's
forward on each rank:

1. sort its (token, slot) pairs by expert (``kernels.expert_compute.sort_pairs``);
2. exchange counts: an all-to-all of the E pair counts, so each rank knows how many rows every
   other rank will send to each of its experts (with a capacity every count is C: no exchange);
3. dispatch: an all-to-all of the sorted rows, each rank's experts' rows to it (uneven sizes,
   dropless; C rows per expert with a capacity), regrouped by expert;
4. the held experts' MLPs on the rows they received (``kernels.expert_compute``);
5. combine: the reverse all-to-all brings each row's result back to its token's rank, where the
   weighted sum over a token's experts is made.

The backward runs the same route for the gradients: the output gradient is dispatched like the
rows were, the experts' backward computes their weight gradients (each rank the whole gradient
of its own experts: no reduction over ep) and the rows' gradients, which are combined back.
The counts are exchanged again rather than kept: E integers.

``ExpertsParallel`` and ``ExpertsParallelBackward`` are program ops in the place of
``shardfx::experts`` and its backward, emitted by ``codegen.spmd`` where the rule split the
expert weights over ep (``rules.experts``), called with the ep group's name. Each says its
all-to-alls (``exchanges``) for the cost model and the communication report: as counted on
the even routing, each rank keeps 1/ep of its rows and sends the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import Shard

from shardfx.ir import meta as M
from shardfx.kernels.experts import EXPERTS, EXPERTS_BACKWARD, forward_shapes, with_bias_grads
from shardfx.kernels import expert_compute as compute
from shardfx.kernels.expert_compute import Form, Sorted

AXIS = "ep"


class Exchange(NamedTuple):
    """One collective a program op issues: its kind, mesh axis, the bytes of the local tensor it
    takes in (on the even routing), and what it moves."""

    kind: str
    axis: str
    nbytes: int
    what: str


class _Route:
    """Where this rank's sorted rows go on the ep ranks and how the received ones are grouped:
    ``send[j]`` rows to rank j, ``recv[j]`` from it, ``counts[e]`` rows for held expert e."""

    def __init__(self, s: Sorted, pg: dist.ProcessGroup, ranks: int):
        self.pg = pg
        experts = s.counts.numel()
        held = experts // ranks
        counts = s.counts if s.kept is None else torch.full_like(s.counts, s.capacity)
        if s.kept is None:  # uneven: each rank learns what it will receive
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=pg)
        else:
            got = counts
        got = got.view(ranks, held)  # [source rank, held expert]
        self.send = counts.view(ranks, held).sum(1).tolist()
        self.recv = got.sum(1).tolist()
        self.counts = got.sum(0).tolist()
        # Received rows come source by source, each source's expert by expert; the experts'
        # matmuls want them expert by expert: ``order`` lists them so.
        flat = got.flatten()
        starts = (torch.cumsum(flat, 0) - flat).view(ranks, held).t().flatten()
        lengths = got.t().flatten()
        first = torch.cumsum(lengths, 0) - lengths
        total = int(flat.sum())
        self.order = torch.arange(total, device=flat.device) + \
            torch.repeat_interleave(starts - first, lengths, output_size=total)

    def there(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty((sum(self.recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), self.recv, self.send, group=self.pg)
        return out[self.order]

    def back(self, rows: torch.Tensor) -> torch.Tensor:
        by_source = torch.empty_like(rows)
        by_source[self.order] = rows
        out = rows.new_empty((sum(self.send), *rows.shape[1:]))
        dist.all_to_all_single(out, by_source, self.send, self.recv, group=self.pg)
        return out


class _OverEp:
    """``route_for`` of ``kernels.expert_compute``: the experts spread over the ep group's ranks."""

    def __init__(self, group: str, ranks: int):
        self.pg = dist.distributed_c10d._resolve_process_group(group)
        self.ranks = ranks

    def __call__(self, s: Sorted) -> _Route:
        return _Route(s, self.pg, self.ranks)


def _fake(*tensors) -> bool:
    return any(is_fake(t) or t.device.type == "meta" for t in tensors)


@dataclass(frozen=True)
class ExpertsParallel:
    """``(y, xd, h, zs) = op(x, index, weights, w_in, w_out, b_in, b_out, group)``:
    ``shardfx::experts`` with this rank's tokens and its E/ep experts (``w_in``, ``w_out`` and
    the biases where there are any: (E/ep, ...))."""

    form: Form
    size: int  # ranks on ep
    name: str = "experts_parallel"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, x, index, weights, w_in, w_out, b_in, b_out, group: str):
        if _fake(x, w_in):
            return forward_shapes(x, index, w_in, self.form, w_in.shape[0] * self.size)
        return compute.forward(x, index, weights, w_in, w_out, self.form,
                               _OverEp(group, self.size), b_in, b_out)

    def flops(self, x, index, weights, w_in, w_out, *_) -> int:
        rows = forward_shapes(x, index, w_in, self.form, w_in.shape[0] * self.size)[1].shape[0]
        return 2 * rows * (w_in[0].numel() + w_out[0].numel())

    def exchanges(self, x, index, weights, w_in, w_out, *_) -> list[Exchange]:
        """Its collectives: the counts (without a capacity), the dispatch of the rows, the
        combine of their results."""
        return _exchanges(x, index, w_in, self.form, self.size)


@dataclass(frozen=True)
class ExpertsParallelBackward:
    """``(grad x, grad weights, grad w_in, grad w_out, grad b_in, grad b_out) = op(grad_y, x,
    index, weights, w_in, w_out, xd, h, zs, b_in, b_out, group)``, the gradients of
    ``ExpertsParallel``; those of the weights and biases are this rank's experts' whole
    gradients (an absent bias's: empty)."""

    form: Form
    size: int
    name: str = "experts_parallel_backward"

    @property
    def __name__(self) -> str:
        return self.name

    def __call__(self, grad_y, x, index, weights, w_in, w_out, xd, h, zs, b_in, b_out,
                 group: str):
        if _fake(x, w_in):
            return (torch.empty_like(x), torch.empty_like(weights), torch.empty_like(w_in),
                    torch.empty_like(w_out),
                    *(x.new_empty(0) if b is None else torch.empty_like(b) for b in (b_in, b_out)))
        return with_bias_grads(compute.backward(grad_y, x, index, weights, w_in, w_out, xd, h,
                                                zs, self.form, _OverEp(group, self.size), b_in,
                                                b_out), x)

    def flops(self, grad_y, x, index, weights, w_in, w_out, *_) -> int:
        """Twice the forward's: each matmul's input and weight gradients."""
        rows = forward_shapes(x, index, w_in, self.form, w_in.shape[0] * self.size)[1].shape[0]
        return 4 * rows * (w_in[0].numel() + w_out[0].numel())

    def exchanges(self, grad_y, x, index, weights, w_in, w_out, *_) -> list[Exchange]:
        return _exchanges(x, index, w_in, self.form, self.size)


def _exchanges(x, index, w_in, form: Form, ranks: int) -> list[Exchange]:
    experts = w_in.shape[0] * ranks
    out = [] if form.capacity > 0 else \
        [Exchange("all_to_all", AXIS, experts * index.element_size(), "counts")]
    rows = forward_shapes(x, index, w_in, form, experts)[1].shape[0]
    nbytes = rows * x.shape[-1] * x.element_size()
    return out + [Exchange("all_to_all", AXIS, nbytes, "dispatch"),
                  Exchange("all_to_all", AXIS, nbytes, "combine")]


def experts_op(node: fx.Node, inputs: tuple, mesh: list, args: tuple, kwargs: dict):
    """(op, local args, kwargs) running ``node`` (``shardfx::experts`` or its backward): as
    expert parallelism where its rule split the expert weights over ``ep`` (``inputs``: the
    placements of its operands; ``mesh``: the program's ``MeshInputs``), else as it is; a
    forward recomputed in the backward (``auto.remat``) records no routing, its forward
    did. None for other ops."""
    if node.target not in (EXPERTS, EXPERTS_BACKWARD):
        return None
    backward = node.target is EXPERTS_BACKWARD
    tensors, form = args[:-len(Form.ARGS)], Form.from_args(args)
    if not backward and node.meta.get(M.PHASE) is M.Phase.BACKWARD:
        form = replace(form, layer="")  # a recomputation
    axes = [m.axis for m in mesh]
    w_in = inputs[4 if backward else 3]
    split = [axes[i] for i, p in enumerate(w_in) if type(p) is Shard and p.dim == 0]
    if AXIS not in split:
        return node.target, (*tensors, *form.args()), kwargs
    ep = mesh[axes.index(AXIS)]
    kind = ExpertsParallelBackward if backward else ExpertsParallel
    return kind(form, ep.size), (*tensors, ep.group), {}
