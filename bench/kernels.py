"""shardfx's fused Triton kernels on a GPU: each against a device-to-device copy of the same
bytes, against ``torch.compile`` of the same ops, and against Liger-Kernel where it has the
kernel; the LM head fused with its loss against eager, ``torch.compile`` and Liger's fused
linear cross-entropy; and whole training steps, tokens/s, against eager and ``torch.compile``.

Needs CUDA: on a machine without it the script says so and exits 0 (``--interpret`` runs the
harness at tiny sizes on CPU through Triton's interpreter, to check the script itself: its
timings mean nothing and are not appended).

Kernels (``--dtype`` bf16 by default), at Llama-3-8B's sizes (8192 tokens: 4 x 2048; hidden
4096, intermediate 14336, 32 heads and 8 KV heads of 128) and at a small size (64 tokens,
hidden 256), forward and forward+backward:

- ``rms_norm``: ``w * (x * rsqrt(mean(x^2) + eps))`` with the residual add before it (Liger:
  ``LigerRMSNormFunction``, without the add: the row says so);
- ``swiglu``: ``silu(gate) * up`` (Liger: ``LigerSiLUMulFunction``);
- ``rope``: ``q * cos + rotate_half(q) * sin`` for q and k (Liger: ``LigerRopeFunction``);
- ``layer_norm`` (Liger: ``LigerLayerNormFunction``), ``gelu_tanh`` (GPT-2's), ``softmax``
  (eager attention's, scaled and masked).

Each is traced (``make_fx``: the forward, or the forward and ``torch.autograd.grad``) and its
graph fused (``passes.fusion``), as ``partition(..., kernels="triton")`` does a program; what
is timed is the graph, kernels and the ATen ops left (a weight's gradient is a sum over rows).
Bytes: every input read once and every output written once, the least any implementation
moves; GB/s = those bytes / the median time (``triton.testing.do_bench``). ``copy``: a
``copy_`` moving as many bytes (half read, half written). Goals: >= 85% of the copy's GB/s,
>= 1.0x ``torch.compile`` and Liger.

Fused linear + cross-entropy: ``F.cross_entropy(h @ w.T, t)`` forward and backward for 8192
tokens, hidden 4096, vocabulary 128256: time and ``torch.cuda.max_memory_allocated`` of eager,
``torch.compile``, Liger's ``LigerFusedLinearCrossEntropyFunction`` and shardfx's
``LinearCrossEntropy`` ops (``kernels.linear_ce``), gradients checked against eager's.

Training step: a Hugging Face Llama (``--layers`` 8, hidden 2048, intermediate 5632, 16 heads,
8 KV heads, vocabulary 32000; batch 4 x 1024) on one GPU in bf16: eager under
``torch.autocast``, ``torch.compile`` of the same under autocast, shardfx ``precision="bf16"``
with ``kernels="aten"`` and ``kernels="triton"``; tokens/s, with gradients checked (every
parameter has a finite gradient, not all zero).

    python -m bench.kernels [--dtype bf16] [--interpret] [--no-step] [--append|--no-append]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

SIZES = {"llama-8b": dict(tokens=8192, hidden=4096, inter=14336, heads=32, kv=8, head_dim=128,
                          seq=2048),
         "small": dict(tokens=64, hidden=256, inter=512, heads=4, kv=2, head_dim=64, seq=16)}
TINY = {"tiny": dict(tokens=6, hidden=40, inter=72, heads=2, kv=1, head_dim=10, seq=3)}


# --- the ops ----------------------------------------------------------------------------------

def rms_norm(x, r, w):
    h = x + r
    hf = h.float()
    return h, w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def swiglu(gate, up):
    return F.silu(gate) * up


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def layer_norm(x, w, b):
    return F.layer_norm(x.float(), x.shape[-1:], w, b, 1e-5).to(x.dtype)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x.pow(3))))


def softmax(x, mask):
    return torch.softmax(x.float() * 0.125 + mask, dim=-1).to(x.dtype)


def cases(s: dict, dtype: torch.dtype, device: str) -> dict[str, tuple[Callable, list, Callable | None]]:
    """name -> (function, its inputs, Liger's version or None)."""
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape, dt=dtype):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)

    n, hid, inter, hd = s["tokens"], s["hidden"], s["inter"], s["head_dim"]
    b, seq = n // s["seq"], s["seq"]
    out = {
        "rms_norm": (rms_norm, [t(n, hid), t(n, hid), t(hid)], _liger("rms_norm")),
        "swiglu": (swiglu, [t(n, inter), t(n, inter)], _liger("swiglu")),
        "rope": (rope, [t(b, s["heads"], seq, hd), t(b, s["kv"], seq, hd), t(seq, hd),
                        t(seq, hd)], _liger("rope")),
        "layer_norm": (layer_norm, [t(n, hid), t(hid, dt=torch.float32),
                                    t(hid, dt=torch.float32)], _liger("layer_norm")),
        "gelu_tanh": (gelu_tanh, [t(n, inter)], None),
        "softmax": (softmax, [t(b, s["heads"], seq, seq), t(seq, seq, dt=torch.float32)], None),
    }
    return out


def _liger(name: str) -> Callable | None:
    """Liger-Kernel's version of a case, with the case's signature, if it is installed."""
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return lambda x, r, w: LigerRMSNormFunction.apply(x, w, 1e-6)  # no residual add
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            return LigerSiLUMulFunction.apply
        if name == "rope":
            from liger_kernel.ops.rope import LigerRopeFunction
            return lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos[None], sin[None])
        if name == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            return lambda x, w, b: LigerLayerNormFunction.apply(x, w.to(x.dtype), b.to(x.dtype),
                                                                1e-5)
    except ImportError:
        return None
    return None


def _failure(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


# --- timing -----------------------------------------------------------------------------------

def bench_ms(fn: Callable, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def with_backward(fn: Callable, n_in: int) -> Callable:
    """``fn``'s outputs and the gradients of every floating input, for gradients ``gs`` of
    its outputs: ``(*inputs, *gs) -> (*outputs, *grads)``."""
    def joint(*args):
        inputs = [a.detach().requires_grad_(a.is_floating_point()) for a in args[:n_in]]
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        wrt = [i for i in inputs if i.requires_grad]
        # allow_unused: Liger's rms_norm takes the residual and does not add it
        grads = torch.autograd.grad(outs, wrt, args[n_in:], allow_unused=True)
        return (*(o.detach() for o in outs), *(g for g in grads if g is not None))
    return joint


def fused_graph(fn: Callable, args: list):
    """``fn`` traced and fused as a plan's program is: the graph module and its kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardfx.passes.fusion import fuse

    gm = make_fx(fn, tracing_mode="fake")(*args)
    groups = fuse(gm.graph)
    gm.recompile()
    return gm, groups


def io_bytes(fn: Callable, args: list) -> int:
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return sum(t.numel() * t.element_size() for t in (*args, *outs))


def kernel_rows(size: str, s: dict, dtype: torch.dtype, device: str) -> list[dict]:
    rows = []
    for name, (fn, args, liger) in cases(s, dtype, device).items():
        for mode in ("fwd", "fwd+bwd"):
            row = dict(case=name, size=size, mode=mode)
            rows.append(row)
            try:
                run_fn, run_args = fn, list(args)
                if mode == "fwd+bwd":
                    outs = fn(*args)
                    outs = outs if isinstance(outs, tuple) else (outs,)
                    run_fn = with_backward(fn, len(args))
                    run_args = [*args, *(torch.randn_like(o) for o in outs)]
                    if liger is not None:
                        liger = with_backward(liger, len(args))
                gm, groups = fused_graph(run_fn, run_args)
                nbytes = io_bytes(run_fn, run_args)
                want = run_fn(*run_args)
                got = gm(*run_args)
                row["error"] = max(((g.float() - w.float()).norm() / w.float().norm().clamp_min(
                    1e-30)).item() for g, w in zip(got, want))
                row["kernels"] = len(groups)
                row["bytes"] = nbytes
                row["shardfx"] = bench_ms(lambda: gm(*run_args), device)
                if device == "cuda":
                    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
                    dst = torch.empty_like(src)
                    row["copy"] = bench_ms(lambda: dst.copy_(src), device)
                try:
                    compiled = torch.compile(run_fn, dynamic=False)
                    compiled(*run_args)
                    row["compile"] = bench_ms(lambda: compiled(*run_args), device)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    row["compile_error"] = f"{type(e).__name__}"
                if liger is not None and device == "cuda":
                    try:
                        row["liger"] = bench_ms(lambda: liger(*run_args), device)
                    except Exception as e:  # noqa: BLE001 - reported, not fatal
                        traceback.print_exc()
                        row["liger_error"] = f"{type(e).__name__}"
            except Exception as e:  # noqa: BLE001 - a row that cannot run is reported
                traceback.print_exc()
                row["failed"] = _failure(e)
    return rows


def kernel_table(rows: list[dict]) -> str:
    out = ["| case | size | pass | kernels | MB moved | shardfx GB/s | copy GB/s | shardfx / copy "
           "| compile GB/s | shardfx / compile | Liger GB/s | shardfx / Liger | rel. error |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['case']} | {r['size']} | {r['mode']} | did not run: {r['failed']} "
                       "|" + " - |" * 9)
            continue
        gbs = {k: r["bytes"] / (r[k] * 1e-3) / 1e9 for k in ("shardfx", "copy", "compile", "liger")
               if k in r}

        def col(k):
            return f"{gbs[k]:.0f}" if k in gbs else r.get(f"{k}_error", "-")

        def ratio(k):
            return f"{gbs['shardfx'] / gbs[k]:.2f}" if k in gbs else "-"

        out.append(f"| {r['case']} | {r['size']} | {r['mode']} | {r['kernels']} | "
                   f"{r['bytes'] / 1e6:.1f} | {col('shardfx')} | {col('copy')} | {ratio('copy')} | "
                   f"{col('compile')} | {ratio('compile')} | {col('liger')} | {ratio('liger')} | "
                   f"{r['error']:.1e} |")
    return "\n".join(out)


# --- fused linear + cross-entropy -------------------------------------------------------------

def loss_rows(dtype: torch.dtype, device: str, tokens: int, hidden: int, vocab: int) -> list[dict]:
    from shardfx.kernels.linear_ce import (LinearCrossEntropy, LinearCrossEntropyBackward,
                                           chunk_rows)

    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g, device=device) / hidden ** 0.5).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, device=device) / hidden ** 0.5).to(dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    rows_per_chunk = chunk_rows(tokens, vocab, hidden)
    fwd, bwd = LinearCrossEntropy(1, -100, rows_per_chunk), \
        LinearCrossEntropyBackward(1, -100, rows_per_chunk)

    def eager():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = F.cross_entropy((hh @ ww.t()).float(), t)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    def ours():
        loss, total, lse = fwd(h, w, t)
        gh, gw = bwd(torch.ones((), device=device), h, w, t, total, lse)
        return loss, gh, gw

    contestants = {"eager": eager, "shardfx": ours}
    try:
        compiled = torch.compile(eager)
        compiled()
        contestants["torch.compile"] = compiled
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import \
            LigerFusedLinearCrossEntropyFunction

        def liger():
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss = LigerFusedLinearCrossEntropyFunction.apply(hh, ww, t)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
            return loss.detach(), hh.grad, ww.grad
        if device == "cuda":
            contestants["Liger"] = liger
    except ImportError:
        pass
    from bench.common import cuda_peak  # here, as in main: after shardfx chose Triton's mode

    want = eager()
    rows = []
    for name, fn in contestants.items():
        row = dict(name=name)
        try:
            got = fn()
            row["error"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                               for a, b in zip(got, want))
            if device == "cuda":
                base, peak = cuda_peak(fn)
                row["peak"] = peak - base
            row["ms"] = bench_ms(fn, device)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["failed"] = _failure(e)
        rows.append(row)
    return rows


def loss_table(rows: list[dict], title: str) -> str:
    base = next(r for r in rows if r["name"] == "eager")
    out = [title, "", "| implementation | ms | / eager | peak MiB beyond inputs | rel. error vs eager |",
           "|---|---:|---:|---:|---:|"]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['name']} | did not run: {r['failed']} | - | - | - |")
            continue
        peak = f"{r['peak'] / 2**20:.0f}" if "peak" in r else "-"
        out.append(f"| {r['name']} | {r['ms']:.2f} | {r['ms'] / base['ms']:.2f} | {peak} | "
                   f"{r['error']:.1e} |")
    return "\n".join(out)


# --- training steps ---------------------------------------------------------------------------

def step_rows(a, device: str) -> list[dict]:
    import transformers as T

    import shardfx
    from bench.precision import trained

    torch.manual_seed(0)
    config = T.LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.hidden,
                           intermediate_size=a.inter, num_attention_heads=a.heads,
                           num_key_value_heads=a.kv, vocab_size=a.vocab, use_cache=False,
                           attn_implementation="sdpa")
    base = T.LlamaForCausalLM(config).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    ids, targets = (torch.randint(0, a.vocab, (a.batch, a.seq), generator=g, device=device)
                    for _ in range(2))
    tokens = ids.numel()

    def loss_of(model):
        with torch.autocast(device, dtype=torch.bfloat16):
            return F.cross_entropy(model(ids).logits.flatten(0, 1).float(), targets.flatten())

    def eager_step(model, forward):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = forward(model)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step

    def lm_loss(out, t):
        return F.cross_entropy(out.logits.flatten(0, 1), t.flatten())

    def shardfx_step(model, kernels):
        plan = shardfx.partition(model, (ids,), lm_loss, (targets,), precision="bf16",
                                 kernels=kernels)
        runner = plan.runner(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                             keep_grads=True)
        return (lambda: runner.step((ids,), (targets,))), runner

    rows = []
    makers = {  # name -> model -> (step, the runner whose gradients are checked)
        "eager autocast bf16": lambda m: (eager_step(m, loss_of), None),
        "torch.compile autocast bf16": lambda m: (eager_step(m, torch.compile(loss_of)), None),
        "shardfx bf16, kernels=aten": lambda m: shardfx_step(m, "aten"),
        "shardfx bf16, kernels=triton": lambda m: shardfx_step(m, "triton"),
    }
    for name, make in makers.items():
        row = dict(name=name)
        try:
            model = copy.deepcopy(base)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            step, runner = make(model)
            for _ in range(3):
                step()
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            times = []
            for _ in range(a.steps):
                start = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - start)
            row["tokens_s"] = tokens / statistics.median(times)
            if runner is not None:
                row["warns"] = trained(model, runner, before)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["failed"] = _failure(e)
        rows.append(row)
    return rows


def step_table(rows: list[dict], title: str) -> str:
    base = rows[0]
    out = [title, "", "| step | tokens/s | / eager | / torch.compile |", "|---|---:|---:|---:|"]
    compiled = next((r for r in rows if r["name"].startswith("torch.compile")
                     and "tokens_s" in r), None)
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['name']} | did not run: {r['failed']} | - | - |")
            continue
        vs = f"{r['tokens_s'] / compiled['tokens_s']:.2f}" if compiled else "-"
        out.append(f"| {r['name']} | {r['tokens_s']:.0f} | "
                   f"{r['tokens_s'] / base.get('tokens_s', float('nan')):.2f} | {vs} |")
    warns = [f"WARNING: {r['name']}: {w}" for r in rows for w in r.get("warns", ())]
    return "\n".join(out + warns)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: tiny sizes on CPU through Triton's interpreter, to check "
                             "the script (timings meaningless, nothing appended)")
    parser.add_argument("--step", action=argparse.BooleanOptionalAction, default=True,
                        help="the training-step rows")
    for k, v in dict(layers=8, hidden=2048, inter=5632, heads=16, kv=8, vocab=32000, batch=4,
                     seq=1024, steps=10).items():
        parser.add_argument(f"--{k}", type=int, default=v)
    parser.add_argument("--append", action=argparse.BooleanOptionalAction, default=None)
    a = parser.parse_args()
    if not torch.cuda.is_available() and not a.interpret:
        print("bench/kernels.py needs CUDA: this machine has no GPU. (--interpret checks the "
              "script on CPU at tiny sizes through Triton's interpreter.)")
        return
    import shardfx  # noqa: F401 - sets TRITON_INTERPRET=1 on a machine without CUDA
    from bench.common import append_results, machine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    sizes = SIZES if device == "cuda" else TINY
    start = time.perf_counter()
    rows = [r for size, s in sizes.items() for r in kernel_rows(size, s, dtype, device)]
    parts = [f"kernels: shardfx's fused Triton kernels, {a.dtype}, vs a copy of the same bytes, "
             f"torch.compile and Liger-Kernel", "", kernel_table(rows)]
    tokens, hidden, vocab = (8192, 4096, 128256) if device == "cuda" else (10, 8, 40)
    parts += ["", loss_table(loss_rows(dtype, device, tokens, hidden, vocab),
                             f"linear + cross-entropy, {a.dtype}: {tokens} tokens, hidden {hidden}, "
                             f"vocab {vocab}, forward and backward")]
    if a.step:
        if device == "cpu":
            a.layers, a.hidden, a.inter, a.heads, a.kv, a.vocab, a.batch, a.seq, a.steps = \
                1, 32, 64, 4, 2, 64, 2, 8, 2
        parts += ["", step_table(step_rows(a, device),
                                 f"training step: Llama {a.layers} layers, hidden {a.hidden}, "
                                 f"intermediate {a.inter}, {a.heads} heads, {a.kv} KV heads, "
                                 f"vocab {a.vocab}, batch {a.batch} x {a.seq}, AdamW, bf16; "
                                 f"median of {a.steps} steps after 3")]
    parts += ["", f"wall time: {time.perf_counter() - start:.0f} s"]
    text = "\n".join(parts)
    print(text)
    if device == "cuda" and (a.append if a.append is not None else True):
        append_results("bench/kernels.py", text, machine())
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
