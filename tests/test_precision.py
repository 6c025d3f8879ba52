"""Mixed precision (``passes.mixed_precision``, ``runtime.loss_scale``): bf16 and fp16 plans
train as ``torch.autocast`` does on one device, within autocast's own error against fp64 and
not equal to fp32, on one device, tp=2 and pp=2 under 1F1B, with fp32 parameters and
gradients; fp16's dynamic loss scale skips an overflowing step on every rank; the memory
estimate follows bf16's smaller activations."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.errors import InputError
from shardfx.ir.text import ir_to_text
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw, compare_training

from models import lm_loss, tiny, token_batches

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def trains_like_autocast(name: str, precision: str, **kw) -> list[str]:
    """Two steps against eager fp64, bounded by autocast's own error; the casts happened (the
    worst gradient is far beyond fp32's rounding) and the state stayed fp32. Returns the
    problems found (none on success) with the report, for launched ranks to send back."""
    torch.manual_seed(0)
    report = compare_training(tiny(name, 2), token_batches(2), lm_loss, precision=precision,
                              **kw)
    worst = max(c.shardfx for c in report.checks if c.kind == "grad")
    state, grads = report.runner.state_dict(), report.runner.grads()
    problems = [f"worst gradient error {worst:.1e}: computed in fp32?"] if worst < 1e-4 else []
    problems += [f"{n} is {t.dtype}" for n, t in {**state, **grads}.items()
                 if t.is_floating_point() and t.dtype != torch.float32]
    return problems


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_one_device_trains_like_autocast(name, precision):
    assert trains_like_autocast(name, precision) == []


def test_on_a_mesh():
    """tp=2 and pp=2 under 1F1B (2 microbatches), in bf16 and fp16, and dp=2 summing its
    gradients in bf16: every rank's check passes."""
    for rank in shardfx.launch(_on_a_mesh, nprocs=2):
        assert rank == [], rank


def _on_a_mesh():
    problems = []
    for precision in ("bf16", "fp16"):
        problems += trains_like_autocast("llama", precision, mesh={"tp": 2}, shard="megatron")
        problems += trains_like_autocast("llama", precision, mesh={"pp": 2}, microbatches=2,
                                         schedule="1f1b")
    problems += trains_like_autocast("llama", shardfx.Precision("bf16", reduce="bf16"),
                                     mesh={"dp": 2})
    return problems


def test_on_products_of_meshes():
    """pp=2 x tp=2 in bf16, dp=2 x pp=2 in fp16 summing gradients in bf16, dp=2 x tp=2 in
    bf16: four processes, every rank's check passes."""
    for rank in shardfx.launch(_on_products, nprocs=4):
        assert rank == [], rank


def _on_products():
    return [*trains_like_autocast("llama", "bf16", mesh={"pp": 2, "tp": 2}, shard="megatron",
                                  microbatches=2),
            *trains_like_autocast("llama", shardfx.Precision("fp16", reduce="bf16"),
                                  mesh={"dp": 2, "pp": 2}, microbatches=2),
            *trains_like_autocast("llama", "bf16", mesh={"dp": 2, "tp": 2}, shard="megatron")]


def test_the_ir_shows_each_ops_dtype_and_casts_once():
    (args, targets), = token_batches(1)
    plan = shardfx.partition(tiny("llama", 2), args, lm_loss, targets, precision="bf16")
    text = ir_to_text(plan.ir)
    mms = [line for line in text.splitlines() if "= aten.mm.default(" in line]
    assert mms and all(": bf16[" in line for line in mms), mms[:3]
    assert ": f32[" in next(line for line in text.splitlines() if "aten._log_softmax" in line)
    casts = [(n.args[0], n.kwargs["dtype"]) for n in plan.ir.graph.nodes
             if n.target is torch.ops.aten._to_copy.default]
    assert len(casts) == len(set(casts))  # once per value and dtype
    weight = "model_layers_0_self_attn_q_proj_weight"  # forward and backward read one copy
    assert sum(1 for src, _ in casts if src.name == weight) == 1
    assert "Precision: bf16:" in str(plan)


def test_dp_gradients_are_summed_in_fp32_unless_asked():
    (args, targets), = token_batches(1)
    sent = {}
    for label, precision in [("fp32", "fp32"), ("bf16", "bf16"),
                             ("bf16-reduce", shardfx.Precision("bf16", reduce="bf16"))]:
        plan = shardfx.partition(tiny("llama", 2), args, lm_loss, targets, mesh={"dp": 2},
                                 precision=precision)
        sent[label] = sum(c.nbytes for c in plan.collectives if "gradient bucket" in c.reason)
    assert sent["fp32"] == sent["bf16"] == 2 * sent["bf16-reduce"]


def test_bf16_memory_is_measured_and_predicted():
    """Activations in bf16 are half fp32's: the measured peak drops, and the estimate follows
    it within 5%; under a budget of 85% of that, remat counts bf16 activations at their size
    and the measured peak fits."""
    peaks = {p: _peak(p)[0] for p in ("fp32", "bf16")}
    assert peaks["bf16"] < 0.9 * peaks["fp32"], peaks
    budget = int(0.85 * peaks["bf16"])
    peak, plan = _peak("bf16", memory_budget=budget)
    assert peak <= budget and plan.remat.recomputed


def _peak(precision: str, **kw) -> tuple[int, shardfx.Plan]:
    """The measured peak of a step (AdamW's state existing), checked against the estimate."""
    batches = token_batches(2, batch=32)
    plan = shardfx.partition(tiny("llama", 4), *batches[0][:1], lm_loss, batches[0][1],
                             precision=precision, **kw)
    runner = plan.runner(adamw)
    runner.step(*batches[0])  # AdamW's state exists from here
    (x,), (y,) = batches[1]
    measured = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y).total \
        - x.nbytes - y.nbytes
    predicted = plan.memory_estimate()[0]
    assert abs(predicted - measured) <= 0.05 * measured, (precision, kw, predicted, measured)
    return measured, plan


def test_fp16_overflow_skips_the_step_on_every_rank():
    """Rank 1's gradients overflow (a poisoned gradient); rank 0's do not: both skip, the scale
    halves, parameters and AdamW's state are untouched. Then the scale doubles after
    ``growth_interval`` clean steps, and a new runner loaded from the scaler's state dict goes
    on with the same scale."""
    for rank in shardfx.launch(_overflow, nprocs=2):
        assert rank == [], rank


def _overflow():
    problems = []
    batches = token_batches(4)
    plan = shardfx.partition(tiny("llama", 2), *batches[0][:1], lm_loss, batches[0][1],
                             mesh={"tp": 2}, shard="megatron", precision="fp16")
    scaling = shardfx.LossScaling(init_scale=1024.0, growth_interval=2)
    runner = plan.runner(adamw, loss_scaling=scaling)
    runner.step(*batches[0])  # clean: AdamW's state exists
    params = runner._params  # this rank's shards, by name
    before = {n: p.detach().clone() for n, p in params.items()}
    moments = [s["exp_avg"].clone() for s in runner.optimizer.state.values()]
    if torch.distributed.get_rank() == 1:
        unscale = runner.loss_scaler.unscale
        runner.loss_scaler.unscale = lambda grads: unscale([grads[0].fill_(float("inf")),
                                                            *grads[1:]])
    runner.step(*batches[1])
    runner.loss_scaler.unscale = type(runner.loss_scaler).unscale.__get__(runner.loss_scaler)
    if not runner.loss_scaler.last_skipped or runner.loss_scale != 512.0:
        problems.append(f"not skipped: scale {runner.loss_scale}")
    problems += [f"{n} changed" for n, p in before.items() if not torch.equal(p, params[n])]
    if not all(torch.equal(m, s["exp_avg"])
               for m, s in zip(moments, runner.optimizer.state.values())):
        problems.append("AdamW's state changed")
    runner.step(*batches[2])
    runner.step(*batches[3])  # two clean steps: the scale grows
    if runner.loss_scale != 1024.0 or runner.loss_scaler.skipped != 1:
        problems.append(f"no growth: scale {runner.loss_scale}")
    resumed = plan.runner(adamw, loss_scaling=scaling)
    resumed.loss_scaler.load_state_dict(runner.loss_scaler.state_dict())
    if resumed.loss_scale != 1024.0:
        problems.append(f"resumed at {resumed.loss_scale}")
    return problems


def test_an_op_without_a_low_precision_kernel_stays_fp32():
    """CPU has no bf16 ``avg_pool3d``: a video model's pooling stays fp32, the plan says so,
    and it trains like autocast (which keeps it in fp32 on CPU as well)."""
    model = torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.AvgPool3d(2),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 2 * 2 * 2, 3))
    x, y = torch.randn(2, 2, 4, 4, 4), torch.tensor([0, 2])
    loss = torch.nn.functional.cross_entropy
    report = compare_training(model, [((x,), (y,))] * 2, loss, precision="bf16")
    text = str(report.plan)
    assert "kept in fp32, no bf16 kernel on cpu: avg_pool3d" in text, text
    assert "convolution x" not in text.split("kept in fp32")[1]  # the convolution ran in bf16


def test_unknown_precision_is_a_named_error():
    (args, targets), = token_batches(1)
    with pytest.raises(InputError, match=r"(?s)unknown precision 'fp8'.*fp32, bf16, fp16"):
        shardfx.partition(tiny("llama", 2), args, lm_loss, targets, precision="fp8")
