"""On a CUDA GPU: plans of models and batches on ``cuda`` train as eager PyTorch does on the
same GPU, checked by ``shardfx.testing.compare_training`` (eager fp32 and fp64 copies on the
GPU, set to shardfx's weights before every step; the update replayed by eager's AdamW).
Skipped, all of them, where there is no CUDA.

- examples/nanogpt.py's default config (4 layers, n_embd 128, vocab 256), 3 steps in fp32,
  ``kernels="triton"``;
- a Hugging Face Llama of TinyLlama-1.1B's shape (random weights), 2 steps in fp32;
- nanoGPT in bf16 with ``kernels="triton"``, within autocast's own error;
- nanoGPT with the optimizer and activations offloaded to pinned host memory.

fp32 means fp32: TF32 matmuls are off during every test (PyTorch's default, made sure of).
"""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.testing import compare_training

from models import example, lm_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
GiB = 2**30


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    torch.cuda.empty_cache()  # the next test's models get the memory


def nanogpt_run(steps: int):
    """examples/nanogpt.py's default model and ``steps`` batches of its text (8 x 64), all on
    the GPU."""
    nanogpt = example("nanogpt")
    cfg = nanogpt.GPTConfig()
    torch.manual_seed(0)
    model = nanogpt.GPT(cfg).to(CUDA)
    text, gen = nanogpt.make_text(cfg), torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        idx, targets = nanogpt.get_batch(text, 8, cfg.block_size, gen)  # (8, 64), (8, 64)
        batches.append(((idx.to(CUDA),), (targets.to(CUDA),)))
    return model, batches, nanogpt.loss_fn


def on_cuda(report) -> list[str]:
    """Parameters or gradients of the trained runner that are not on the GPU."""
    grads = report.runner.grads()
    return [n for n, t in [*report.runner.state_dict().items(), *grads.items()]
            if t.device.type != CUDA.type]


def test_nanogpt_trains_like_eager():
    model, batches, loss_fn = nanogpt_run(3)
    report = compare_training(model, batches, loss_fn, kernels="triton")
    assert len(report.loss) == 3, report
    assert report.plan.kernels()
    assert on_cuda(report) == []


def test_1b_llama_trains_like_eager():
    """TinyLlama-1.1B's shape: hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads,
    vocabulary 32000 (1.10 B parameters); batch 2 x 128, sdpa attention.

    Memory, what compare_training holds at once (1.1 B parameters, 4.4 GB each in fp32): this
    test's model (4.4 GB); the fp64 truth's weights and gradients (17.6); eager fp32's weights,
    gradients, AdamW state and the copies of shardfx's gradients its replay steps with (22);
    shardfx's copy with gradients and AdamW state (17.6); AdamW's foreach temporaries (4.4):
    about 66 GB (62 GiB), activations (256 tokens) aside. It runs on an 80 GB GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    free, _ = torch.cuda.mem_get_info()
    if free < 70 * GiB:
        pytest.skip(f"needs about 70 GiB of free GPU memory, {free / GiB:.0f} GiB free")
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with CUDA:
        model = LlamaForCausalLM(config)
    assert 1.0e9 < sum(p.numel() for p in model.parameters()) < 1.2e9
    g = torch.Generator(device=CUDA).manual_seed(1)
    batches = [tuple((torch.randint(0, 32000, (2, 128), generator=g, device=CUDA),)
                     for _ in range(2)) for _ in range(2)]
    report = compare_training(model, batches, lm_loss)
    assert len(report.loss) == 2, report
    assert on_cuda(report) == []


def test_offloaded_optimizer_and_activations_train_like_eager():
    """``offload_optimizer=True`` and activation offload under a budget, on the GPU: the
    optimizer's tensors pinned on the host, the copies on their own stream (planned on a
    device model whose compute hides the copies, so this small model offloads)."""
    import dataclasses

    from shardfx.cost.device_model import PRESETS

    model, batches, loss_fn = nanogpt_run(3)
    h200 = PRESETS["h200"]
    slow = dataclasses.replace(h200, peak_flops={k: v / 1e4 for k, v in h200.peak_flops.items()},
                               memory_bandwidth=h200.memory_bandwidth / 1e4)
    full = shardfx.partition(model, batches[0][0], loss_fn, batches[0][1], device_model=slow,
                             offload_optimizer=True)
    report = compare_training(model, batches, loss_fn, device_model=slow, offload_optimizer=True,
                              memory_budget=int(0.7 * full.memory_estimate()[0]))
    assert report.max() < 1e-5, report
    assert report.plan.remat is not None and report.plan.remat.offloaded
    assert all(m.is_pinned() for m in report.runner.offload.masters.values())
    assert all(p.is_cuda for p in report.runner.device_parameters())


def test_nanogpt_bf16_with_triton_kernels_trains_like_autocast():
    """Within autocast bf16's own error against fp64; and in bf16 for real (the worst gradient
    far beyond fp32's rounding), parameters and gradients fp32."""
    model, batches, loss_fn = nanogpt_run(2)
    report = compare_training(model, batches, loss_fn, precision="bf16", kernels="triton")
    assert report.plan.kernels()
    worst = max(c.shardfx for c in report.checks if c.kind == "grad")
    assert worst > 1e-4, f"worst gradient error {worst:.1e}: computed in fp32?"
    state, grads = report.runner.state_dict(), report.runner.grads()
    assert {t.dtype for t in [*state.values(), *grads.values()]} == {torch.float32}
    assert on_cuda(report) == []


def test_a_cpu_model_planned_for_the_gpu_trains_there_from_cpu_batches():
    """The model and batches stay where the user made them (CPU); ``device="cuda"`` puts the
    weights on the GPU in place and the runner moves each batch: losses equal eager's on CPU
    for 3 AdamW steps."""
    import copy

    nanogpt = example("nanogpt")
    w = nanogpt.workload()
    model, (idx,), (targets,) = w["model"], w["args"], w["targets"]
    eager = copy.deepcopy(model)
    plan = shardfx.partition(model, (idx,), nanogpt.loss_fn, (targets,), device="cuda")
    assert plan.device.type == "cuda"
    runner = plan.runner(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for _ in range(3):
        loss = runner.step((idx,), (targets,))
        opt.zero_grad()
        ref = nanogpt.loss_fn(eager(idx), targets)
        ref.backward()
        opt.step()
        assert loss.device.type == "cuda"
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()) + 1e-6
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_a_gpu_model_is_not_dragged_to_a_cpu_plan():
    """A model planned for the CPU, then put on the GPU: the runner says so rather than move
    its weights back."""
    from shardfx.errors import InputError

    nanogpt = example("nanogpt")
    w = nanogpt.workload()
    plan = shardfx.partition(w["model"], w["args"], nanogpt.loss_fn, w["targets"])
    w["model"].to(CUDA)
    with pytest.raises(InputError, match="the plan runs on cpu") as info:
        plan.runner()
    assert "device='cuda:0'" in info.value.fix


@pytest.mark.parametrize("dtype,head,mask,kernel", [
    (torch.bfloat16, 64, False, "flash"),
    (torch.float32, 64, False, "efficient"),
    (torch.float32, 64, True, "efficient"),
    (torch.bfloat16, 32, True, "efficient"),
    (torch.float32, 6, False, "math"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_on_cuda_computes_the_cpu_kernels_contract(dtype, head, mask, kernel, causal):
    """Every trace has the CPU's flash attention op; on the GPU ``kernels.attention`` runs it
    with the kernel PyTorch would pick. Its (out, logsumexp) and (dq, dk, dv) equal the CPU
    op's in fp64 within the dtype's rounding (a 37-token sequence: the memory-efficient kernel's
    padded logsumexp and mask rows are exercised)."""
    from shardfx.kernels import attention as A

    torch.manual_seed(0)
    b, h, t = 2, 3, 37
    q, k, v, go = (torch.randn(b, h, t, head) for _ in range(4))
    bias = torch.randn(1, 1, t, t) if mask else None
    ref = A.CPU_FORWARD(q.double(), k.double(), v.double(), 0.0, causal,
                        attn_mask=None if bias is None else bias.double())
    ref_grads = A.CPU_BACKWARD(go.double(), q.double(), k.double(), v.double(), ref[0], ref[1],
                               0.0, causal, attn_mask=None if bias is None else bias.double())
    on = [x.to(CUDA, dtype) for x in (q, k, v, go)]
    cbias = None if bias is None else bias.to(CUDA, dtype)
    assert A._kernel(on[0], cbias) == kernel
    out, lse = A.attention(*on[:3], 0.0, causal, attn_mask=cbias)
    assert lse.shape == (b, h, t) and lse.dtype == torch.float32
    grads = A.attention_backward(on[3], *on[:3], out, lse, 0.0, causal, attn_mask=cbias)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in [(out, ref[0]), (lse, ref[1]), *zip(grads, ref_grads)]:
        err = (got.double().cpu() - want).norm() / want.norm()
        assert err < tol, (kernel, err)

