"""The LM head and its cross-entropy in chunks (``passes.fused_loss``, ``kernels.linear_ce``):
training equals eager on one device, in bf16, on dp and across a pipeline cut; ignored targets
and a summed loss; the logits never exist, and the measured peak drops by at least their size,
as the memory model predicts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.kernels.linear_ce import chunk_rows
from shardfx.cost.device_model import PRESETS
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw, compare_training

from models import lm_loss, tiny, token_batches

# what the chunked ops stand for: none of them may be left in the program
UNFUSED = ("_log_softmax", "nll_loss", "linear_cross_entropy")


def head_ops(plan) -> list[str]:
    return sorted(n.name for n in plan.program_nodes() if n.op == "call_function"
                  and any(k in n.name for k in UNFUSED) and "getitem" not in n.name)


EARLY = ["linear_cross_entropy", "linear_cross_entropy_grads"]  # gradients in the forward
AGAIN = ["linear_cross_entropy", "linear_cross_entropy_backward"]  # the logits again


def test_llama_trains_like_eager_with_its_head_fused():
    report = compare_training(tiny("llama", 2), token_batches(2), lm_loss, fused_loss=True)
    assert head_ops(report.plan) == EARLY
    f, = report.plan.fused_losses()
    assert (f.weight, f.tokens, f.vocab, f.hidden, f.rows) == ("lm_head_weight", 32, 64, 32, 16)
    assert "Linear + cross-entropy fused: lm_head_weight (32 tokens x 32 -> 64) in 2 chunks" \
        in str(report.plan)
    assert "its gradients are computed in the forward, nothing recomputed" in \
        " ".join(str(report.plan).split())


def test_off_keeps_the_aten_ops():
    (args, targets), = token_batches(1)
    plan = shardfx.partition(tiny("llama", 1), args, lm_loss, targets, fused_loss=False)
    assert not plan.fused_losses()
    assert {"_log_softmax", "_log_softmax_backward_data"} <= set(head_ops(plan))


def summed_loss_ignoring(out, targets):
    """A summed cross-entropy where every third target is padding (-100)."""
    t = targets.flatten().clone()
    t[::3] = -100
    return F.cross_entropy(out.logits.flatten(0, 1), t, reduction="sum")


def test_ignored_targets_and_a_summed_loss():
    report = compare_training(tiny("gpt2", 2), token_batches(2), summed_loss_ignoring,
                              fused_loss=True)
    assert len(report.plan.fused_losses()) == 1


def test_bf16_trains_within_autocast():
    report = compare_training(tiny("llama", 2), token_batches(2), lm_loss, precision="bf16",
                              fused_loss=True)
    assert head_ops(report.plan) == EARLY


def test_fp16_computes_the_logits_again_in_the_backward():
    """Unscaled, fp16's probabilities would fall below its normal range: the gradients wait
    for the loss scale, in the backward."""
    report = compare_training(tiny("llama", 2), token_batches(2), lm_loss, precision="fp16",
                              fused_loss=True)
    assert head_ops(report.plan) == AGAIN


def _flops(step) -> int:
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    def addmm_(*args, out_val=None, **kwargs):  # the registry's addmm, for its in-place form
        return flop_registry[torch.ops.aten.addmm](*args, out_val=out_val, **kwargs)

    addmm_._get_raw = True
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as c:
        step()
    return c.get_total_flops()


def test_nothing_is_recomputed():
    """With its gradients in the forward, a step of the fused head does eager's FLOPs."""
    (args, targets), = token_batches(1)
    model = tiny("llama", 2)
    plan = shardfx.partition(model, args, lm_loss, targets, fused_loss=True)
    runner = plan.runner(keep_grads=True)
    fused = _flops(lambda: runner.step(args, targets))  # no optimizer: no update
    eager = _flops(lambda: lm_loss(model(*args), *targets).backward())
    assert fused == eager > 0


def _dp_and_pp():
    dp = compare_training(tiny("llama", 2), token_batches(2), lm_loss, mesh={"dp": 2},
                          fused_loss=True)
    pp = compare_training(tiny("nanogpt", 2), token_batches(2), lm_loss, mesh={"pp": 2},
                          microbatches=2, fused_loss=True)
    gpipe = compare_training(tiny("nanogpt", 2), token_batches(2), lm_loss, mesh={"pp": 2},
                             microbatches=2, schedule="gpipe", fused_loss=True)
    return [head_ops(r.plan) for r in (dp, pp, gpipe)]


def test_dp_and_a_pipeline_train_like_eager_with_the_head_fused():
    """dp: the backward scales by the count of targets over all ranks, as eager's mean does;
    pp: the gradients (1F1B) or the log-sum-exp (GPipe, whose backward comes after every
    microbatch's forward) cross from the last stage's forward part to its backward part."""
    ranks = shardfx.launch(_dp_and_pp, nprocs=2)
    assert ranks[0][0] == ranks[1][0] == EARLY
    assert ranks[1][1:] == [EARLY, AGAIN]  # the last stage


def big_vocab_llama() -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096))


def _peak(fused: bool) -> tuple[int, int, int]:
    """(measured, predicted) peak of a second training step, and the logits' bytes."""
    batches = token_batches(2, batch=8)
    plan = shardfx.partition(big_vocab_llama(), *batches[0][:1], lm_loss, batches[0][1],
                             fused_loss=fused)
    runner = plan.runner(adamw)
    runner.step(*batches[0])
    (x,), (y,) = batches[1]
    peak = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y)
    return peak.total - x.nbytes - y.nbytes, plan.memory_estimate()[0], x.numel() * 4096 * 4


def test_the_peak_drops_by_at_least_the_logits():
    """Vocabulary 4096 over hidden 32: the head dominates the step's activations. Unfused,
    the logits, their log-softmax and their gradient are live at once; fused, one chunk of
    rows is. The memory model predicts both."""
    fused, predicted_fused, logits = _peak(True)
    unfused, predicted_unfused, _ = _peak(False)
    assert unfused - fused >= logits, (unfused, fused, logits)
    for measured, predicted in ((fused, predicted_fused), (unfused, predicted_unfused)):
        assert abs(predicted - measured) <= 0.05 * measured, (measured, predicted)


@pytest.mark.parametrize("tokens,vocab,hidden,rows", [
    (64, 4096, 32, 32), (32, 64, 32, 16), (8192, 128256, 4096, 256), (5, 10, 100, 5),
    (2048, 32000, 1024, 256), (4096, 4096, 4096, 4096)])
def test_a_chunk_of_logits_is_about_the_size_of_the_hidden_states(tokens, vocab, hidden, rows):
    """Liger's rule (a vocabulary no larger than hidden: one chunk, the logits no larger than
    h), raised to 256 rows where that leaves 2 chunks (the weight gradient's matmuls are slow
    with fewer rows); the tiny test models get 2 chunks."""
    assert chunk_rows(tokens, vocab, hidden) == rows


def test_chunks_are_sized_so_the_weight_traffic_hides_behind_the_flops():
    """On an H100 in bf16 a chunk reading the weight again and adding into its gradient is
    memory-bound below 591 rows (``ridge_rows``): Liger's rule's 256-row chunks of a
    128k-vocabulary head would be, so the plan's device model raises them to 1024. The device
    model prices what chunking costs: at 256 rows the head's time is its weight traffic, at
    the rows chosen its FLOPs, at the rate such a matmul reaches. On the CPU preset the ridge
    is 27 rows: 256, as before."""
    from shardfx.kernels.linear_ce import LinearCrossEntropy, ridge_rows

    h100, cpu = PRESETS["h100"], PRESETS["cpu"]
    assert ridge_rows(h100, torch.bfloat16) == 591
    assert chunk_rows(8192, 128256, 4096, model=h100, dtype=torch.bfloat16) == 1024
    assert chunk_rows(8192, 128256, 4096, model=cpu, dtype=torch.bfloat16) == 256
    assert chunk_rows(64, 32000, 768, model=h100, dtype=torch.bfloat16) == 32  # 2 chunks

    graph = torch.fx.Graph()
    h, w, t = (graph.placeholder(n) for n in "hwt")
    h.meta["val"] = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    w.meta["val"] = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
    rate = h100.peak(torch.bfloat16) * h100.throughput.matmul_efficiency(1, 1024, 128256, 4096)
    flops = 6 * 8192 * 4096 * 128256 / rate  # at what the matmul of 1024-row chunks reaches
    seconds = {}
    for rows in (256, 1024):
        node = graph.call_function(LinearCrossEntropy(1, -100, rows, grads=True), (h, w, t))
        seconds[rows] = h100.node_seconds(node)
    assert seconds[256] > 1.5 * flops and seconds[1024] == pytest.approx(flops)

    import transformers as T

    with torch.device("meta"):  # 4096 tokens, a vocabulary of 32 x hidden: Liger's 128 rows
        model = T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=2048))
    ids = torch.zeros(8, 512, dtype=torch.long)
    for device_model, rows in (("h100", 1024), ("cpu", 256)):
        plan = shardfx.partition(model, (ids,), lm_loss, (ids,), device="meta", precision="bf16",
                                 fused_loss=True, device_model=device_model)
        assert [f.rows for f in plan.fused_losses()] == [rows], device_model


def test_fused_loss_takes_a_bool_or_auto():
    (args, targets), = token_batches(1)
    with pytest.raises(shardfx.InputError,
                       match=r"fused_loss must be True, False or \"auto\", got 'no'"):
        shardfx.partition(tiny("llama", 1), args, lm_loss, targets, fused_loss="no")


def test_auto_fuses_only_where_the_memory_matters():
    """By default the head stays ATen ops (fused, it recomputes its matmul: never faster);
    it is fused when the plan without it is over the budget or near the device's memory,
    and print(plan) says why."""
    batches = token_batches(1, batch=8)
    plan = shardfx.partition(big_vocab_llama(), *batches[0][:1], lm_loss, batches[0][1])
    assert not plan.fused_losses() and not plan.fused_loss_reason
    peak = max(plan.memory_estimate().values())
    fused = shardfx.partition(big_vocab_llama(), *batches[0][:1], lm_loss, batches[0][1],
                              fused_loss=True)
    between = (peak + max(fused.memory_estimate().values())) // 2
    under = shardfx.partition(big_vocab_llama(), *batches[0][:1], lm_loss, batches[0][1],
                              memory_budget=between)
    assert len(under.fused_losses()) == 1 and "over memory_budget" in under.fused_loss_reason
    assert 'fused_loss="auto" fused it' in " ".join(str(under).split())
    assert under.remat is None  # the fused head alone brings it under
    small = dataclasses.replace(PRESETS["h100"], memory=peak)
    near = shardfx.partition(big_vocab_llama(), *batches[0][:1], lm_loss, batches[0][1],
                             device_model=small)
    assert len(near.fused_losses()) == 1 and "of the device's" in near.fused_loss_reason
    roomy = shardfx.partition(big_vocab_llama(), *batches[0][:1], lm_loss, batches[0][1],
                              device_model="h100")  # 80 GB: no reason to
    assert not roomy.fused_losses()


def test_a_head_split_on_the_vocabulary_is_not_tried():
    """A head whose logits are split on the vocabulary (or partial) has collectives between
    its ops, so fuse_loss cannot fuse it: "auto" does not emit a fused program to find that
    out, even where memory would ask for it."""
    from torch.distributed.tensor import Replicate, Shard

    from shardfx.passes.fused_loss import fusable

    batches = token_batches(1, batch=8)
    args, targets = batches[0]

    def plan(head, **kw):
        return shardfx.partition(big_vocab_llama(), args, lm_loss, targets, mesh={"tp": 2},
                                 shard={"lm_head.weight": head, "*": "auto"}, **kw)

    assert fusable(plan([Replicate()]).ir.graph)
    vocab = plan([Shard(0)])
    assert not fusable(vocab.ir.graph)
    assert not plan([Shard(0)], fused_loss=True).fused_losses()  # as the program finds
    assert plan([Replicate()], fused_loss=True).fused_losses()
