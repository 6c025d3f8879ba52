"""Attention on the plan's device (``kernels.attention``): every trace has the CPU's flash
attention op (``partitioner.fake.run_device``: models on a GPU or on meta are traced as on the
CPU); ``place`` swaps it for kernels of the plan's device. What runs without a GPU is checked
here: the math kernel (the GPU's fallback) against the CPU op, and the swap itself.
tests/test_cuda.py checks the flash and memory-efficient kernels on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfx.partitioner.fake import run_device
from shardfx.kernels import attention as A


def _operands(t=11, head=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, t, head, generator=g, dtype=torch.float64) for _ in range(4)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "float", "bool"])
def test_the_math_kernel_computes_the_cpu_ops_outputs_and_gradients(causal, mask):
    q, k, v, go = _operands()
    t = q.shape[2]
    g = torch.Generator().manual_seed(1)
    masks = {None: None, "float": torch.randn(1, 1, t, t, generator=g, dtype=torch.float64),
             "bool": torch.rand(2, 1, t, t, generator=g) > 0.3}
    m = masks[mask]
    if m is not None and m.dtype == torch.bool:
        m[..., 0] = True  # every row attends somewhere
    # the CPU op takes an additive mask of q's dtype
    cpu_mask = m if m is None or m.dtype != torch.bool else \
        torch.zeros(m.shape, dtype=q.dtype).masked_fill(~m, float("-inf"))
    out, lse = A.CPU_FORWARD(q, k, v, 0.0, causal, attn_mask=cpu_mask)
    grads = A.CPU_BACKWARD(go, q, k, v, out, lse, 0.0, causal, attn_mask=cpu_mask)
    m_out, m_lse = A._math_forward(q, k, v, causal, m, None)
    m_grads = A._math_backward(go, q, k, v, out, lse, causal, m, None)
    for got, want in [(m_out, out), (m_lse, lse), *zip(m_grads, grads)]:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def _traced():
    def f(q, k, v, go):
        out, lse = A.CPU_FORWARD(q, k, v, 0.0, True)
        return A.CPU_BACKWARD(go, q, k, v, out, lse, 0.0, True)
    return make_fx(f)(*_operands())


def test_place_swaps_the_cpu_kernels_for_the_devices_on_a_gpu_plan_only():
    gm = _traced()
    assert A.lower(gm, torch.device("cpu")) == 0
    assert A.lower(gm, torch.device("cuda", 0)) == 2
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert A.attention in targets and A.attention_backward in targets
    assert not targets & {A.CPU_FORWARD, A.CPU_BACKWARD}
    gm.recompile()  # on the CPU the swapped functions are the CPU ops
    operands = _operands()
    want = _traced()(*operands)
    for got, w in zip(gm(*operands), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


def test_models_off_the_cpu_are_traced_as_on_the_cpu():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert run_device(model, (x,)) is None  # all on the CPU: traced as they are
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    assert run_device(meta, (x,)) == torch.device("cpu")
    assert run_device(model, (x.to("meta"),)) == torch.device("cpu")
