"""Fused Triton kernels (``passes.fusion``, ``kernels.triton``), run on CPU through Triton's
interpreter: each kind of group against the eager ops it replaces, on awkward shapes (odd,
not a power of two, one row) in fp32, bf16 and fp16; whole models trained with
``kernels="triton"`` against eager; the kernels the Llama and GPT-2 graphs get."""

from __future__ import annotations

import operator
import os
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import shardfx
from shardfx.kernels.triton import FusedKernel, source
from shardfx.passes.fusion import fuse
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches

aten = torch.ops.aten


def rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def residual_rms_norm(x, r, w):
    h = x + r.float()
    return h, rms_norm(h, w)


def swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def swiglu_backward(grad, gate, up):
    return aten.silu_backward(grad * up, gate), grad * torch.nn.functional.silu(gate)


def gelu_erf(x, b):
    return torch.nn.functional.gelu(x + b)


def gelu_backward(grad, x):
    return aten.gelu_backward(grad, x) * 2.0


def gelu_tanh(x):  # GPT-2's gelu_new, as Hugging Face writes it
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def softmax(x, mask):
    return torch.softmax(x + mask, dim=-1)


def softmax_backward(grad, y):
    return aten._softmax_backward_data(grad, y, -1, y.dtype) * 0.5


def layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, 1e-5) + 1.0


def layer_norm_backward(grad, x, w, b):
    _, mean, rstd = aten.native_layer_norm(x, x.shape[-1:], w, b, 1e-5)
    return aten.native_layer_norm_backward(grad, x, x.shape[-1:], mean, rstd, w, b,
                                           [True, True, True])


def log_softmax(x):
    return torch.log_softmax(x * 2.0, dim=-1)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(q, cos, sin):  # as Hugging Face's Llama applies it
    return q * cos + rotate_half(q) * sin


def rope_backward(grad, cos, sin):  # what autograd makes of it: rotate_half transposed
    g, h, d = grad * sin, grad.shape[-1] // 2, grad.shape[-1]
    return aten.slice_backward(-g[..., :h], grad.shape, -1, h, d, 1) + \
        aten.slice_backward(g[..., h:], grad.shape, -1, 0, h, 1) + grad * cos


def partial_rope(q, cos, sin):  # rotary on the first columns only, as GPT-NeoX and Phi
    r = cos.shape[-1]
    return torch.cat((rope(q[..., :r], cos, sin), q[..., r:]), dim=-1)


CASES = {  # name: (function, operand shapes as (rows..., cols), kernels, ATen ops left)
    "rms_norm": (rms_norm, [(3, 5, 37), (37,)], 1, 0),
    "residual_rms_norm": (residual_rms_norm, [(1, 37), (1, 37), (37,)], 1, 0),
    "swiglu": (swiglu, [(7, 33), (7, 33)], 1, 0),
    # the two gradients share operands but no op: two kernels (no horizontal fusion yet)
    "swiglu_backward": (swiglu_backward, [(7, 33), (7, 33), (7, 33)], 2, 0),
    "gelu_erf": (gelu_erf, [(2, 3, 129), (129,)], 1, 0),
    "gelu_backward": (gelu_backward, [(5, 19), (5, 19)], 1, 0),
    "gelu_tanh": (gelu_tanh, [(4, 65)], 1, 0),
    "softmax": (softmax, [(2, 3, 11, 11), (11, 11)], 1, 0),
    "softmax_backward": (softmax_backward, [(6, 17), (6, 17)], 1, 0),
    "log_softmax": (log_softmax, [(1, 1000)], 1, 0),
    "rope": (rope, [(2, 3, 7, 22), (7, 22), (7, 22)], 1, 0),
    "rope_backward": (rope_backward, [(1, 3, 5, 18), (5, 18), (5, 18)], 1, 0),
    "partial_rope": (partial_rope, [(2, 3, 7, 22), (7, 14), (7, 14)], 1, 0),
    "layer_norm": (layer_norm, [(3, 5, 37), (37,), (37,)], 1, 0),
    # the forward's mean and rstd with the input gradient's row ops in one kernel; the
    # weight's and the bias's gradients are sums over rows, left to ATen
    "layer_norm_backward": (layer_norm_backward, [(3, 5, 37), (3, 5, 37), (37,), (37,)], 1, 2),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def inputs(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# LayerNorm is decomposed for fusion in fp32 only: mixed precision runs it in fp32
PAIRS = [pytest.param(case, dtype, id=f"{case}-{name}") for case in CASES
         for name, dtype in DTYPES.items()
         if dtype == torch.float32 or not case.startswith("layer_norm")]


@pytest.mark.parametrize("case, dtype", PAIRS)
def test_a_fused_group_computes_what_its_ops_do(case, dtype):
    """Every op of the function in its kernels; the outputs equal eager's: fp32 to 1e-5, a low
    dtype within its own rounding (the kernel computes in fp32, eager rounds after each op)."""
    fn, shapes, kernels, left = CASES[case]
    args = inputs(shapes, dtype)
    if case == "residual_rms_norm":
        args[1] = args[1].to(torch.bfloat16)  # a cast in the group
    gm = make_fx(fn, tracing_mode="fake")(*args)
    groups = fuse(gm.graph)
    gm.recompile()
    assert len(groups) == kernels, [[o.source for o in g.ops] for g in groups]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    others = [n.target for n in calls
              if not isinstance(n.target, FusedKernel) and n.target is not operator.getitem]
    assert len(others) == left, others
    tuples = (lambda x: x if isinstance(x, tuple) else (x,))
    want, eager, got = tuples(fn(*[a.double() for a in args])), tuples(fn(*args)), tuples(gm(*args))
    for w, e, g in zip(want, eager, got):
        err = ((g.double() - w).norm() / w.norm()).item()
        assert g.dtype == e.dtype and g.shape == e.shape
        assert err < TOLERANCE[dtype], (case, err)


def test_strided_and_broadcast_operands():
    """A transposed operand and a broadcast one are read through their strides."""
    x = torch.randn(9, 5).t()  # (5, 9), strides (1, 5)
    b = torch.randn(5, 1)
    gm = make_fx(lambda x, b: torch.exp(x - b) * 2.0, tracing_mode="fake")(x, b)
    assert len(fuse(gm.graph)) == 1
    gm.recompile()
    torch.testing.assert_close(gm(x, b), torch.exp(x - b) * 2.0, rtol=1e-6, atol=0)


def test_the_kernel_source_reads_as_a_tutorial():
    gm = make_fx(swiglu, tracing_mode="fake")(*inputs([(7, 33), (7, 33)], torch.float32))
    (group,) = fuse(gm.graph)
    text = FusedKernel(group).source
    for line in ["@triton.jit",
                 "x0_ptr,  # in: gate_1 f32[7, 33] (full)",
                 "out0_ptr,  # out: mul f32[7, 33], contiguous",
                 "BLOCK: tl.constexpr,  # 64: a row, padded to a power of two",
                 "# one program per row of [7, 33]: 7 programs",
                 "# bytes moved: 2772 (the 2 ops unfused: 4620)",
                 "v0 = (x0 * tl.sigmoid(x0))  # silu: silu.default",
                 "v1 = (v0 * x1)  # mul: mul.Tensor"]:
        assert line in text, f"{line!r} not in:\n{text}"


def test_groups_stop_at_ops_they_cannot_hold():
    """A matmul, a reduction over another dimension and a reader between two members stay
    outside; what is left on either side of them is fused on its own."""
    def f(x, w):
        h = torch.relu(x) * 2.0
        s = h.sum(0)  # over rows: not a row kernel
        return torch.sigmoid(h @ w) + 1.0, s

    args = (torch.randn(6, 10), torch.randn(10, 10))
    gm = make_fx(f, tracing_mode="fake")(*args)
    groups = fuse(gm.graph)
    gm.recompile()
    assert [[o.source for o in g.ops] for g in groups] == [["relu", "mul"], ["sigmoid", "add"]]
    for g, w in zip(gm(*args), f(*args)):
        torch.testing.assert_close(g, w)


def kinds(plan) -> list[set[str]]:
    """Per kernel, the names of the ops in it (``mul``, ``rsqrt``, ...)."""
    return [{str(o.target).split(".")[1] for o in k.group.ops} for k in plan.kernels()]


def test_llama_trains_like_eager_with_triton_kernels(tmp_path):
    """RMSNorm (one kernel: the residual add, pow, mean, eps, rsqrt and both muls; in the
    backward, the row sum and what reads it), SwiGLU forward and backward, RoPE with its
    ``rotate_half`` forward and backward: fused, and training equals eager fp32."""
    report = compare_training(tiny("llama", 2), token_batches(2), lm_loss, kernels="triton")
    k = kinds(report.plan)
    assert sum({"pow", "mean", "add", "rsqrt", "mul"} <= x for x in k) == 5  # 2 x 2 + final
    assert sum({"mul", "sum"} <= x for x in k) == 5  # their backward's row sums
    assert sum({"silu", "mul"} <= x for x in k) == 2
    assert sum("silu_backward" in x for x in k) == 2
    rope = {"mul", "slice", "neg", "cat", "add"}  # q * cos + rotate_half(q) * sin
    assert sum(x == rope for x in k) == 4  # q and k, in 2 layers
    assert sum(x == {"mul", "slice", "neg", "slice_backward", "add"} for x in k) == 4
    assert "Kernels: " in str(report.plan)
    report.plan.dump(tmp_path)  # the dump lists the same kernels, each with its source
    assert len((tmp_path / "kernels.txt").read_text().splitlines()) == len(k)
    assert len(list((tmp_path / "kernels").glob("*.py"))) == len(k)


def test_gpt2_on_tp2_and_llama_on_pp2_train_like_eager_with_triton_kernels():
    """GPT-2 on tp=2, on local shards: the tanh GELU forward and backward of each layer, and
    LayerNorm (with the residual add before it) forward and backward (``passes.decompose``):
    2 per layer and the final one. Llama on pp=2: the kernels of the one-device plan, each
    inside one stage's F, B or W part (a kernel never spans a stage cut)."""
    for k, (names, pp) in shardfx.launch(_tp2_and_pp2, nprocs=2):
        assert sum({"tanh", "pow", "mul", "add"} <= x for x in k) == 2, k
        assert sum({"tanh_backward", "pow", "mul"} <= x for x in k) == 2, k
        assert sum({"mean", "sub", "rsqrt", "mul", "add"} <= x for x in k) == 5, k
        assert sum(x == {"mean", "sub", "mul"} for x in k) == 5, k
        assert sum({"pow", "mean", "add", "rsqrt", "mul"} <= x for x in pp) == 5, pp
        assert sum(x == {"mul", "slice", "neg", "cat", "add"} for x in pp) == 4, pp
        assert sum("silu_backward" in x for x in pp) == 2, pp
        parts = {n.split("_fused")[0] for n in names}
        assert {"stage0_F", "stage0_B", "stage1_F", "stage1_B"} <= parts <= {
            f"stage{s}_{p}" for s in (0, 1) for p in "FBW"}, names


def _tp2_and_pp2():
    tp = compare_training(tiny("gpt2", 2), token_batches(2), lm_loss, kernels="triton",
                          mesh={"tp": 2}, shard="megatron")
    pp = compare_training(tiny("llama", 2), token_batches(2), lm_loss, kernels="triton",
                          mesh={"pp": 2}, microbatches=2)
    return kinds(tp.plan), ([k.group.name for k in pp.plan.kernels()], kinds(pp.plan))


def test_unknown_kernels_is_a_named_error():
    (args, targets), = token_batches(1)
    with pytest.raises(shardfx.InputError, match=r"unknown kernels 'cuda'"):
        shardfx.partition(tiny("llama", 2), args, lm_loss, targets, kernels="cuda")


def test_auto_runs_aten_ops_on_every_device():
    """The fused kernels are opt-in: measured on a GPU they are not faster yet
    (``passes.program.uses_triton``)."""
    from types import SimpleNamespace

    from shardfx.passes.program import uses_triton

    for device in ("cpu", "cuda"):
        assert not uses_triton(SimpleNamespace(kernels="auto", device=torch.device(device)))
        assert uses_triton(SimpleNamespace(kernels="triton", device=torch.device(device)))


GOLDEN = Path(__file__).with_name("golden")


@pytest.mark.parametrize("case, dtype", [("rms_norm", "fp32"), ("rope", "bf16"),
                                         ("softmax_backward", "fp16")])
def test_kernel_source_matches_its_golden_file(case, dtype):
    """The generated Triton, character for character: a change to codegen shows up here as a
    diff to read (``SHARDFX_GOLDEN=update`` rewrites the files after reading it)."""
    fn, shapes, _, _ = CASES[case]
    gm = make_fx(fn, tracing_mode="fake")(*inputs(shapes, DTYPES[dtype]))
    text = "\n\n".join(source(g) for g in fuse(gm.graph))
    path = GOLDEN / f"{case}-{dtype}.txt"
    if os.environ.get("SHARDFX_GOLDEN") == "update":
        path.write_text(text)
    assert text == path.read_text(), \
        f"{path.name} differs from the generated source; SHARDFX_GOLDEN=update accepts it"
