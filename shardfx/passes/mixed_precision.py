"""mixed_precision: each op of the joint graph in the precision it should compute in.

Requires: VAL on every node, ROLE on placeholders, OUTPUTS on the output node.
Ensures:  under ``Options.precision`` bf16 or fp16, the ops of ``LOW_PRECISION`` (matmuls,
          convolutions, attention, mixture-of-experts layers' experts; forward and backward)
          read their fp32 operands cast to the low dtype and produce it (the experts' routing
          weights excepted), but the matmuls of MoE routers stay fp32 (``passes.experts_router``);
          the ops of ``FULL_PRECISION`` (softmax, norms, losses,
          exp/log/pow, sums and means) read theirs in the dtype they were traced in (fp32), a
          reduction with a ``dtype`` argument accumulating into it instead of reading a cast
          copy; every other op follows its operands' dtypes by its own promotion rules, as it
          would eagerly (a residual add of an fp32 stream and a bf16 branch is fp32). Casts are
          ``aten._to_copy`` nodes, one per value and dtype, inserted before the value's first
          reader that needs them; a view of a weight is cast as the weight, then viewed, so
          forward and backward share the one low-precision copy. Graph outputs (loss,
          gradients, buffer updates, model outputs) have their traced dtypes: gradients leave
          in fp32, for an fp32 optimizer on fp32 master weights. VAL is updated on every node
          whose dtype changed, PHASE recomputed (``assign_phase``), and ``gm.meta[PRECISION]``
          says what ran where. fp32 leaves the graph as it is. Values of another dtype than
          fp32 (an fp64 model) are not cast, as torch.autocast leaves them; the report counts
          the ops that read them in their own dtype, not in the low one.

This is what ``torch.autocast`` does, applied to the captured forward and backward at ATen
level: the lists follow autocast's CUDA lists, which name composite ops (``linear``,
``layer_norm``, ``softmax``), here in the ATen ops they become (``addmm``,
``native_layer_norm``, ``_softmax``) and with each one's backward, which autograd runs in
whatever dtype its inputs had. One difference on purpose: autocast runs a backward ``sum``
(a bias's gradient) in the low dtype its input arrives in; here sums accumulate in fp32.

An op that cannot run in the low dtype on the device the graph runs on (a CPU kernel without a
bf16 version, such as ``avg_pool3d``'s) keeps its traced dtype, and ``print(plan)`` names it:
each op is tried once per process on small tensors of its operands' dtypes
(``_runs_in``) before it is given them.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from shardfx.kernels.experts import EXPERTS, EXPERTS_BACKWARD
from shardfx.passes.experts_router import router_matmuls
from shardfx.ir import meta as M
from shardfx.ir.graph import fake_mode_of, fake_value, op_nodes
from shardfx.passes.assign_phase import assign_phase
from shardfx.request.precision import DTYPES
from shardfx.ir.contract import contract, on_inputs, on_ops, on_output

aten = torch.ops.aten

# Matmul-class ops: fast in bf16/fp16 (tensor cores), accurate enough there (fp32 accumulation
# inside the kernel). Forward and backward.
LOW_PRECISION = frozenset({
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
    aten.addbmm.default, aten.mv.default, aten.dot.default,
    aten.convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
    EXPERTS, EXPERTS_BACKWARD,
})
# Operands a low-precision op reads as traced: a mixture of experts' routing weights (fp32, as
# its router computes them), and their gradient's inputs.
_KEPT_OPERANDS = {EXPERTS: (2,), EXPERTS_BACKWARD: (3,)}

# Numerically sensitive ops: ranges a low dtype cannot hold (exp, pow), long sums that lose
# their small terms (reductions, norms, the loss), and what reads them back in the backward.
FULL_PRECISION = frozenset({
    aten._softmax.default, aten._softmax_backward_data.default,
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
    aten.native_group_norm.default, aten.native_group_norm_backward.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.native_batch_norm_backward.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default,
    aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default,
    aten.mse_loss.default, aten.mse_loss_backward.default,
    aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default, aten.huber_loss_backward.default,
    aten.binary_cross_entropy.default, aten.binary_cross_entropy_backward.default,
    aten.binary_cross_entropy_with_logits.default, aten.kl_div.default,
    aten.exp.default, aten.expm1.default, aten.log.default, aten.log2.default,
    aten.log10.default, aten.log1p.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.pow.Scalar, aten.rsqrt.default, aten.reciprocal.default, aten.erfinv.default,
    aten.acos.default, aten.asin.default, aten.cosh.default, aten.sinh.default,
    aten.tan.default, aten.softplus.default, aten.softplus_backward.default,
    aten.logsumexp.default, aten.var.correction, aten.var_mean.correction,
    aten.std.correction, aten.linalg_vector_norm.default, aten._cdist_forward.default,
    aten._cdist_backward.default,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.prod.default, aten.prod.dim_int, aten.cumsum.default, aten.cumprod.default,
})

# Of those, the reductions that take the dtype to accumulate in: no cast copy of the input.
_ACCUMULATE = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.mean.default,
                         aten.mean.dim, aten.prod.default, aten.prod.dim_int,
                         aten.cumsum.default, aten.cumprod.default})

# Ops whose output views their first operand; a cast of the view is the view of the cast.
_VIEWS = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
                    aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
                    aten.squeeze.dims, aten.expand.default, aten.alias.default})
# (Not slices: a slice's base can be much larger than the slice.)

@dataclass(frozen=True)
class PrecisionReport:
    """What ``mixed_precision`` did, for ``print(plan)``: only what really runs in the low
    dtype is counted as such. Values in another dtype than fp32 (an fp64 model) are not cast,
    as ``torch.autocast`` leaves them: their matmuls are counted in ``uncast``."""

    compute: str
    low: int  # ops that compute in the low dtype
    full: int  # ops of FULL_PRECISION kept in the dtype they were traced in
    casts: int  # cast nodes inserted
    stayed: tuple[tuple[str, int], ...] = ()  # (op, count) that cannot run in it on the device
    device: str = "cpu"
    full_in: tuple[str, ...] = ("fp32",)  # the dtypes those FULL_PRECISION ops compute in
    uncast: tuple[tuple[str, int], ...] = ()  # (dtype, count): matmul-class ops left in a
    # dtype that is not cast (fp64), as autocast leaves it
    routers: int = 0  # matmuls of mixture-of-experts routers, kept in fp32 (``passes.experts_router``)

    def __str__(self) -> str:
        full = f"{self.full} in {'/'.join(self.full_in) or 'fp32'} (softmax, norms, loss, " \
               f"reductions), {self.casts} casts"
        uncast = ", ".join(f"{n} ops in {dtype}" for dtype, n in self.uncast)
        why = "shardfx casts fp32 values only, as torch.autocast does"
        if self.low == 0 and self.uncast:
            dtypes = "/".join(dtype for dtype, _ in self.uncast)
            text = (f"{self.compute} asked, but no op computes in {self.compute}: the model "
                    f"computes in {dtypes}, which is not cast ({why}): {uncast} (matmuls, "
                    f"attention), {full}")
        else:
            text = f"{self.compute}: {self.low} ops in {self.compute} (matmuls, attention), {full}"
            if self.uncast:
                text += f"; not cast ({why}): {uncast} (matmuls, attention)"
        if self.routers:
            text += f"; {self.routers} matmuls of expert routers in fp32 (forward and backward)"
        if self.stayed:
            ops = ", ".join(f"{op} x{n}" for op, n in self.stayed)
            text += f"; kept in fp32, no {self.compute} kernel on {self.device}: {ops}"
        return text


@contract(requires=[on_ops(M.VAL, "VAL"),
                    on_inputs(M.ROLE, "ROLE"),
                    on_output(M.OUTPUTS, "OUTPUTS")],
          ensures=[on_ops(M.VAL, "VAL")])
def mixed_precision(gm: fx.GraphModule, options) -> fx.GraphModule:
    precision = options.precision
    if not precision.low:
        return gm
    edit = _Edit(gm, precision.dtype, options.device)
    for node in op_nodes(gm.graph):
        edit.visit(node)
    edit.outputs()
    edit.prune()
    gm.graph.lint()
    gm.recompile()
    assign_phase(gm, options)  # the casts: forward where a forward op reads them
    gm.meta[M.PRECISION] = edit.report(precision.compute)
    return gm


class _Edit:
    def __init__(self, gm: fx.GraphModule, low: torch.dtype, device: torch.device):
        self.graph, self.low = gm.graph, low
        self.mode = fake_mode_of(gm.graph)
        self.traced = {n: n.meta.get(M.VAL) for n in gm.graph.nodes}  # dtypes as captured
        self.casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.counts: Counter = Counter()
        self.stayed: Counter = Counter()
        self.uncast: Counter = Counter()  # matmul-class ops by the dtype they stay in
        self.full_in: Counter = Counter()  # FULL_PRECISION ops by the dtype they compute in
        self.device = device  # where the ops run: their kernels are tried there
        self.routers = router_matmuls(gm.graph, LOW_PRECISION, _VIEWS)  # kept in fp32

    # --- one op -----------------------------------------------------------------------------

    def visit(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            node.meta[M.VAL] = node.args[0].meta[M.VAL][node.args[1]]
            return
        if node.target in LOW_PRECISION and node not in self.routers:
            self._low(node)
        elif node in self.routers:
            self.counts["router"] += 1
            self._as_traced(node)
        elif node.target in FULL_PRECISION:
            self.counts["full"] += 1
            self._as_traced(node)
            self.full_in[_dtype_name(_dtype(_first(self.traced[node])))] += 1
        elif any(_dtype(a) != _dtype(self.traced.get(a)) for a in node.all_input_nodes):
            self._follow(node)

    def _low(self, node: fx.Node) -> None:
        wanted = lambda a: self.low if self._lowers(a) else _dtype(a)  # noqa: E731
        if not _runs_in(node.target, node.args, node.kwargs, self.device, wanted):
            self._as_traced(node)  # no kernel in the low dtype here: as traced
            self.stayed[_name(node)] += 1
            return
        kept = {node.args[i] for i in _KEPT_OPERANDS.get(node.target, ())}
        node.args, node.kwargs = fx.node.map_arg(
            (node.args, node.kwargs), lambda a: self.cast(a, self.low, node)
            if self._lowers(a) and a not in kept else a)
        self._revalue(node)
        if any(_dtype(a) == self.low for a in node.all_input_nodes):
            self.counts["low"] += 1
        else:  # no operand in fp32 or the low dtype (an fp64 model): it computes as traced
            self.uncast[_dtype_name(_dtype(node))] += 1

    def _lowers(self, a: fx.Node) -> bool:
        """An fp32 operand a low-precision op reads in the low dtype; not one a low-precision
        op made fp32 on purpose (attention's logsumexp, which its backward reads as is)."""
        made_by = a.args[0] if a.target is operator.getitem else a
        return _dtype(a) == torch.float32 and not (
            made_by.op == "call_function" and made_by.target in LOW_PRECISION)

    def _as_traced(self, node: fx.Node) -> None:
        """Operands back in the dtypes they were traced in; a reduction that can accumulate in
        its traced dtype does so instead of reading a cast copy."""
        out = self.traced[node]
        if node.target in _ACCUMULATE and isinstance(out, torch.Tensor):
            if _dtype(node.args[0]) != out.dtype:
                node.kwargs = {**node.kwargs, "dtype": out.dtype}
        else:
            node.args, node.kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda a: self.cast(a, _dtype(self.traced.get(a)), node)
                if _dtype(a) != _dtype(self.traced.get(a)) else a)
        self._revalue(node)

    def _follow(self, node: fx.Node) -> None:
        """The op's own dtype rules on its operands' new dtypes, where it has a kernel for
        them; else as traced."""
        try:
            self._revalue(node)
        except Exception:  # operands it does not take mixed (a scatter into fp32 zeros)
            self._as_traced(node)
            return
        if not _runs_in(node.target, node.args, node.kwargs, self.device, _dtype):
            self._as_traced(node)
            self.stayed[_name(node)] += 1

    def _revalue(self, node: fx.Node) -> None:
        node.meta[M.VAL] = fake_value(self.mode, node.target, node.args, node.kwargs)

    # --- casts ------------------------------------------------------------------------------

    def cast(self, value: fx.Node, dtype: torch.dtype, before: fx.Node,
             like: fx.Node | None = None) -> fx.Node:
        """``value`` in ``dtype``: one cast per value and dtype, inserted before ``before``
        (its first reader that needs it), where ``like`` (``before``) is in the model; a view
        is taken of its base's cast."""
        key, like = (value, dtype), like or before
        if key in self.casts:
            return self.casts[key]
        if value.op == "call_function" and value.target in _VIEWS \
                and isinstance(value.args[0], fx.Node):
            base = self.cast(value.args[0], dtype, before, like)
            with self.graph.inserting_before(before):
                new = self.graph.call_function(value.target, (base, *value.args[1:]),
                                               dict(value.kwargs))
        else:
            with self.graph.inserting_before(before):
                new = self.graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
            self.counts["casts"] += 1
        new.meta.update({k: v for k, v in like.meta.items()
                         if k in ("nn_module_stack", "fwd_nn_module_stack", "stack_trace")})
        new.meta[M.VAL] = fake_value(self.mode, new.target, new.args, new.kwargs)
        self.casts[key] = new
        return new

    def outputs(self) -> None:
        """Every graph output in its traced dtype: fp32 gradients, loss and buffers, each cast
        right where it is made (its low-precision copy dies there, as autocast's does)."""
        out = self.graph.output_node()
        out.args = (fx.node.map_arg(out.args[0], lambda a: self.cast(
            a, _dtype(self.traced.get(a)), a.next, like=a)
            if _dtype(a) != _dtype(self.traced.get(a)) else a),)

    def prune(self) -> None:
        """Erase the views ``cast`` left without readers (each reader reads the view of a
        cast now). Left in the graph, such a view, phased backward for want of a forward
        reader, would be a backward reader of a forward value: remat would recompute the value
        where the view stands, in the forward, and keep it to its backward."""
        views = {v for v, _ in self.casts if v.op == "call_function" and v.target in _VIEWS}
        for node in reversed(list(self.graph.nodes)):  # a chain of views: its last first
            if node in views and not node.users:
                self.graph.erase_node(node)

    def report(self, compute: str) -> PrecisionReport:
        return PrecisionReport(compute, self.counts["low"], self.counts["full"],
                               self.counts["casts"], tuple(sorted(self.stayed.items())),
                               self.device.type, tuple(sorted(self.full_in)),
                               tuple(sorted(self.uncast.items())), self.counts["router"])


def _dtype(a) -> torch.dtype | None:
    val = a.meta.get(M.VAL) if isinstance(a, fx.Node) else a
    return val.dtype if isinstance(val, torch.Tensor) else None


def _first(val):
    """A value, or the first of several (``native_layer_norm``'s output, mean, rstd)."""
    return val[0] if isinstance(val, (tuple, list)) and val else val


_SHORT = {**{dtype: name for name, dtype in DTYPES.items()}, torch.float64: "fp64"}


def _dtype_name(dtype: torch.dtype | None) -> str:
    """``fp64``, ``fp32``, ``bf16``, ``fp16``; another dtype as torch names it."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _name(node: fx.Node) -> str:
    return str(node.target).removeprefix("aten.").removesuffix(".default")


# --- can it run? --------------------------------------------------------------------------------

_RUNS: dict[tuple, bool] = {}


def _runs_in(op, args, kwargs, device: torch.device, dtype_of) -> bool:
    """Whether ``op`` has a kernel on ``device`` for its operands in ``dtype_of(operand)``:
    tried once per op and dtypes, on real tensors of the operands' ranks with every dimension
    cut to at most 2, or where that does not run in fp32 either (arguments that name sizes), at
    full size if the operands are small (``TRY_ELEMENTS``). An op no trial decides is taken to
    run."""
    if device.type == "meta" or (device.type == "cuda" and not torch.cuda.is_available()):
        return True
    operands: list[fx.Node] = []
    fx.node.map_arg((args, kwargs), operands.append)
    key = (op, tuple(dtype_of(n) for n in operands), device.type)
    if key not in _RUNS:  # tried once: the operands as meta tensors of the wanted dtypes

        def spec(n: fx.Node):
            v = n.meta[M.VAL]
            return torch.empty(v.shape, dtype=dtype_of(n), device="meta") \
                if isinstance(v, torch.Tensor) else v

        vals = fx.node.map_arg((args, kwargs), spec)
        tensors = _tensors(vals)
        _RUNS[key] = True
        for cut in (True, False):
            if not cut and sum(v.numel() for v in tensors) > TRY_ELEMENTS:
                break
            if _tries(op, vals, device, None, cut):
                break
            if _tries(op, vals, device, torch.float32, cut):
                _RUNS[key] = False
                break
    return _RUNS[key]


TRY_ELEMENTS = 1 << 20  # operands small enough to try an op on at their own size


def _tries(op, vals, device, as_dtype, cut: bool) -> bool:
    def real(v):
        if not isinstance(v, torch.Tensor):
            return v
        shape = [min(s, 2) for s in v.shape] if cut else list(v.shape)
        dtype = as_dtype if as_dtype is not None and v.is_floating_point() else v.dtype
        if dtype.is_floating_point:
            return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    args, kwargs = torch.utils._pytree.tree_map(real, vals)
    try:
        with torch.no_grad():
            op(*args, **kwargs)
        return True
    except Exception:
        return False


def _tensors(vals):
    return [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
