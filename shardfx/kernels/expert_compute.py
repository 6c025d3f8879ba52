"""The arithmetic of a mixture-of-experts layer's experts, forward and backward, on one rank.

Each of a rank's T tokens chose k experts (``index``, (T, k)) with weights (``weights``,
(T, k)); expert e is an MLP ``down_e(gate(up_e(x)))``: its first projection ``w_in[e]`` (2I x H,
Hugging Face's ``gate_up_proj``: the gate and up projections; I x H without a gate), the gate
between (``kernels.expert_gate``: act(gate) * up, or a variant), its down projection ``w_out[e]``
(H x I), each projection with the expert's bias where it has one (GPT-OSS). The layer's output
for token t is ``sum_j weights[t, j] * expert_{index[t, j]}(x[t])``, or, where the weights
scale the inputs instead (``score_before``, Llama 4), ``sum_j expert_{index[t, j]}(weights[t, j]
* x[t])``.

The T*k (token, slot) pairs are sorted by expert (stably: within an expert, in token order),
their rows gathered, and each expert's rows multiplied by its weights in one matmul. Where the
experts live is the ``Route``'s business: ``Local`` keeps every row on this rank (every expert
is here); ``codegen.expert_parallel``'s route sends each expert's rows to the rank that holds
it and brings the results back. The arithmetic between sees only the rows of the experts it
holds, grouped by expert.

With a capacity (``capacity > 0``), each expert takes at most ``C = ceil(capacity * T * k / E)``
of a rank's pairs, the first ones in token order; the others are dropped: they add nothing to
their token's output (the residual connection around the layer carries the token on, as in
Switch Transformer), and their routing weights get no gradient. Every expert then receives
exactly C rows from each rank (padded with zeros), so the shapes do not depend on the routing.

What the backward needs is returned by the forward: the rows each held expert received (``xd``),
their first projection (``h``), and each pair's expert output in sorted order (``zs``; no
columns under ``score_before``, whose backward does not read it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardfx.kernels import expert_load as load
from shardfx.kernels.expert_gate import Gate, activate, activate_backward


@dataclass(frozen=True)
class Form:
    """What the experts compute besides their weights: the ``gate`` between the projections
    (``kernels.expert_gate``), whether the weights are stored (in, out) (``transposed``) rather
    than (out, in), whether the routing weights scale each expert's input (``score_before``,
    Llama 4) rather than its output, the capacity factor (0: no capacity, dropless), and the
    layer's name for the routing record (``kernels.expert_load``)."""

    gate: Gate = Gate()
    transposed: bool = False
    score_before: bool = False
    capacity: float = 0.0
    layer: str = ""

    # The op's arguments after its tensors, in order (``args``, ``from_args``).
    ARGS = ("act", "gated", "interleaved", "alpha", "limit", "offset", "transposed",
            "score_before", "capacity", "layer")

    def args(self) -> tuple:
        g = self.gate
        return (g.act, g.gated, g.interleaved, float(g.alpha), float(g.limit), float(g.offset),
                self.transposed, self.score_before, float(self.capacity), self.layer)

    @classmethod
    def from_args(cls, args) -> "Form":
        """The form of the op's trailing arguments (``ARGS``)."""
        act, gated, interleaved, alpha, limit, offset, transposed, score_before, capacity, \
            layer = args[-len(cls.ARGS):]
        return cls(Gate(act, gated, interleaved, alpha, limit, offset), transposed,
                   score_before, capacity, layer)


@dataclass
class Sorted:
    """This rank's (token, slot) pairs sorted by expert: ``order[i]`` is the flat pair index
    (t * k + j) of sorted row i, ``tokens[i]`` its token; ``counts[e]``: pairs choosing expert
    e; with a capacity, ``kept`` (sorted rows within their expert's capacity) and ``slot`` (the
    row of each kept pair in the (E, C) padded layout)."""

    order: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    capacity: int = 0
    kept: torch.Tensor | None = None
    slot: torch.Tensor | None = None

    @property
    def dropped(self) -> int:
        return 0 if self.kept is None else int((~self.kept).sum())


def sort_pairs(index: torch.Tensor, experts: int, capacity: float) -> Sorted:
    """``index`` (T, k) sorted by expert, and the capacity's choice of rows where there is one."""
    tokens, k = index.shape
    flat = index.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=experts)
    s = Sorted(order, order // k, counts)
    if capacity > 0:
        s.capacity = max(1, math.ceil(capacity * tokens * k / experts))
        starts = torch.cumsum(counts, 0) - counts
        expert = flat[order]
        rank_in_expert = torch.arange(order.numel(), device=index.device) - starts[expert]
        s.kept = rank_in_expert < s.capacity
        s.slot = (expert * s.capacity + rank_in_expert)[s.kept]
    return s


def padded(rows: torch.Tensor, s: Sorted) -> torch.Tensor:
    """Sorted rows into the (E * C, ...) capacity layout: each expert's first C rows, then
    zeros."""
    out = rows.new_zeros((s.counts.numel() * s.capacity, *rows.shape[1:]))
    out[s.slot] = rows[s.kept]
    return out


def unpadded(rows: torch.Tensor, s: Sorted) -> torch.Tensor:
    """The inverse of ``padded`` for the kept rows; a dropped row is zero."""
    out = rows.new_zeros((s.order.numel(), *rows.shape[1:]))
    out[s.kept] = rows[s.slot]
    return out


class Local:
    """Every expert on this rank: rows stay where they are."""

    def __init__(self, s: Sorted):
        self.counts = s.counts.tolist() if s.kept is None else [s.capacity] * s.counts.numel()

    def there(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def back(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


def grouped_mm(rows: torch.Tensor, w: torch.Tensor, counts: list[int], *,
               transpose_w: bool) -> torch.Tensor:
    """Rows grouped by expert (``counts[e]`` rows for ``w[e]``) times their expert's matrix
    (transposed where ``transpose_w``): one ``torch._grouped_mm`` where it takes the operands
    (``_grouped``), else a matmul per expert."""
    m = w.transpose(-2, -1) if transpose_w else w
    if _grouped(rows, m):
        return torch._grouped_mm(rows, m, offs=_offsets(counts, rows.device))
    out = rows.new_empty((rows.shape[0], m.shape[2]))
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(rows[start:start + n], m[e], out=out[start:start + n])
        start += n
    return out


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, counts: list[int],
                        experts: int) -> torch.Tensor:
    """Per expert ``a[rows].T @ b[rows]``: (E, a's width, b's width), zero for an expert with
    no rows."""
    if experts == len(counts) and _grouped(a.t(), b):
        return torch._grouped_mm(a.t(), b, offs=_offsets(counts, a.device))
    out = a.new_zeros((experts, a.shape[1], b.shape[1]))
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start:start + n].t(), b[start:start + n], out=out[e])
        start += n
    return out


_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def _grouped(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` multiplies these: one dtype it has kernels for on the
    device (CUDA: bf16 on sm90 and later), every stride but the unit one a multiple of 16
    bytes. It computes what the loop of matmuls computes (equal bit for bit on CPU), in one
    call instead of one per expert."""
    dtypes = _GROUPED_DTYPES.get(a.device.type, ())
    if a.dtype != b.dtype or a.dtype not in dtypes:
        return False
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    size = a.element_size()
    return all(stride * size % 16 == 0 for t in (a, b) for stride in t.stride() if stride != 1)


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """Each group's end row, as ``torch._grouped_mm`` takes them."""
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _project(rows, w, counts, form: Form):
    """rows @ w[e].T per expert (w stored (out, in)), or rows @ w[e] when ``transposed``."""
    return grouped_mm(rows, w, counts, transpose_w=not form.transposed)


def _project_back(grad, w, counts, form: Form):
    """The input gradient of ``_project``."""
    return grouped_mm(grad, w, counts, transpose_w=form.transposed)


def _project_weight_grad(grad, rows, counts, experts, form: Form):
    """The weight gradient of ``_project``, in w's layout."""
    if form.transposed:
        return grouped_weight_grad(rows, grad, counts, experts)
    return grouped_weight_grad(grad, rows, counts, experts)


def _biased(rows: torch.Tensor, b: torch.Tensor | None, counts: list[int]) -> torch.Tensor:
    """``rows`` grouped by expert (``counts``) plus each one's expert's bias ``b`` (E, width),
    where there is one."""
    if b is None:
        return rows
    n = torch.tensor(counts, device=b.device)
    return rows + b.repeat_interleave(n, dim=0, output_size=rows.shape[0]).to(rows.dtype)


def _bias_grad(grad: torch.Tensor, b: torch.Tensor | None, counts: list[int]):
    """The gradient of ``_biased``'s bias: each expert's rows of ``grad`` summed."""
    if b is None:
        return None
    n = torch.tensor(counts, device=b.device)
    experts = torch.arange(len(counts), device=b.device).repeat_interleave(
        n, output_size=grad.shape[0])
    return torch.zeros(b.shape, dtype=grad.dtype, device=b.device).index_add_(
        0, experts, grad).to(b.dtype)


def forward(x, index, weights, w_in, w_out, form: Form, route_for, b_in=None,
            b_out=None) -> tuple:
    """(y, xd, h, zs): the layer's output (T, H) and what its backward reads. ``route_for(s)``
    is the ``Route`` of this rank's sorted pairs (``Local`` or expert parallel); ``b_in``,
    ``b_out``: the experts' biases (E, 2I) and (E, H), if they have them. Where the routing
    weights scale the inputs (``score_before``) the backward does not read ``zs``: it has no
    columns."""
    s = sort_pairs(index, _experts(w_in, route_for), form.capacity)
    if form.layer:  # not a recomputation (``codegen.expert_parallel.experts_op``)
        load.record(form.layer, s.counts, s.dropped, s.capacity)
    route = route_for(s)
    xs = x[s.tokens]
    if form.score_before:
        w = weights.reshape(-1)[s.order].unsqueeze(-1)
        xs = (xs.to(torch.promote_types(xs.dtype, w.dtype)) * w).to(x.dtype)
    if s.kept is not None:
        xs = padded(xs, s)
    xd = route.there(xs)
    h = _biased(_project(xd, w_in, route.counts, form), b_in, route.counts)
    z = _biased(_project(activate(h, form.gate), w_out, route.counts, form), b_out,
                route.counts)
    zs = route.back(z)
    if s.kept is not None:
        zs = unpadded(zs, s)
    y = combine(zs, None if form.score_before else weights, s, x.shape, x.dtype)
    return y, xd, h, zs[:, :0] if form.score_before else zs


def combine(zs, weights, s: Sorted, shape, dtype) -> torch.Tensor:
    """Each token's sum of its pairs' expert outputs, times their weights where given (in the
    weights' precision where that is wider, as Hugging Face's experts do), in ``dtype``."""
    w = None if weights is None else weights.reshape(-1)[s.order]
    wide = zs.dtype if w is None else torch.promote_types(zs.dtype, w.dtype)
    pairs = torch.empty((s.order.numel(), shape[-1]), dtype=wide, device=zs.device)
    pairs[s.order] = zs if w is None else zs * w.unsqueeze(-1)
    return pairs.view(shape[0], -1, shape[-1]).sum(dim=1).to(dtype)


def backward(grad_y, x, index, weights, w_in, w_out, xd, h, zs, form: Form, route_for,
             b_in=None, b_out=None) -> tuple:
    """(grad x, grad weights, grad w_in, grad w_out, grad b_in, grad b_out) of ``forward``;
    a bias's gradient is None where there is no bias."""
    s = sort_pairs(index, _experts(w_in, route_for), form.capacity)
    route = route_for(s)
    w = weights.reshape(-1)[s.order]
    wide = torch.promote_types(grad_y.dtype, w.dtype)
    g = grad_y[s.tokens].to(wide)
    grad_w = torch.empty_like(weights.reshape(-1))
    if form.score_before:  # the weights scaled the inputs: the outputs' gradient as it is
        gz = g.to(xd.dtype)
    else:
        grad_w[s.order] = (g * zs.to(wide)).sum(-1).to(weights.dtype)
        gz = (g * w.unsqueeze(-1).to(wide)).to(xd.dtype)
    del g
    if s.kept is not None:
        gz = padded(gz, s)
    gzd = route.there(gz)
    held = w_in.shape[0]
    a = activate(h, form.gate)
    grad_w_out = _project_weight_grad(gzd, a, route.counts, held, form)
    grad_b_out = _bias_grad(gzd, b_out, route.counts)
    ga = _project_back(gzd, w_out, route.counts, form)
    del gzd, a
    gh = activate_backward(h, ga, form.gate)
    grad_w_in = _project_weight_grad(gh, xd, route.counts, held, form)
    grad_b_in = _bias_grad(gh, b_in, route.counts)
    gxd = _project_back(gh, w_in, route.counts, form)
    gxs = route.back(gxd)
    if s.kept is not None:
        gxs = unpadded(gxs, s)
    if form.score_before:  # xs * w: the gradient of each factor is the other's
        gxs = gxs.to(wide)
        grad_w[s.order] = (gxs * x[s.tokens].to(wide)).sum(-1).to(weights.dtype)
        gxs = gxs * w.unsqueeze(-1).to(wide)
    grad_x = torch.zeros_like(x).index_add_(0, s.tokens, gxs.to(x.dtype))
    return grad_x, grad_w.view_as(weights), grad_w_in, grad_w_out, grad_b_in, grad_b_out


def _experts(w_in: torch.Tensor, route_for) -> int:
    """All the layer's experts: those held here times the ranks they are spread over."""
    return w_in.shape[0] * getattr(route_for, "ranks", 1)
