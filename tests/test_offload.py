"""``partition(..., offload_optimizer=True)`` (``runtime.offload``,
``codegen.gradients_to_host``): what the optimizer steps, its gradients and its state live on
the host and it steps there; training equals eager on one device, dp with each ZeRO stage and
dp x tp, and in pipelines, with accumulation, clipping and fp16's loss scale; the device's and
the host's measured peaks are the memory model's; a checkpoint moves between offloaded and plain
runners; what it cannot run with is a named error."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.codegen.gradients_to_host import gradients_to_host
from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw, compare_training

from models import lm_loss, tiny, token_batches


def _train(cases: list[tuple]) -> list[float]:
    return [compare_training(tiny(name), token_batches(3), lm_loss, mesh=mesh,
                             shard="megatron" if "tp" in mesh else "replicate",
                             offload_optimizer=True, **(rest[0] if rest else {})).max()
            for name, mesh, *rest in cases]


def test_one_device_trains_as_eager_does():
    """Tied embeddings (GPT-2), accumulated batches and clipping (on the host's gradients),
    and fp16's loss scale (unscaled there, a skipped step leaving every tensor as it was)."""
    errors = _train([("llama", {}), ("gpt2", {}),
                     ("llama", {}, {"accumulate": 2, "clip_grad_norm": 0.05}),
                     ("gpt2", {}, {"precision": "fp16",
                                    "loss_scaling": shardfx.LossScaling(init_scale=1024.0)})])
    assert max(errors) < 1e-5, errors


def test_zero_stages_train_as_eager_does():
    """Each rank's host steps its rows: cut from the whole gradient on the device (zero=1),
    the reduce-scattered rows (zero=2), the rows the program gathers its parameters from
    (zero=3); zero=1, 2 gather the updated rows after they come back."""
    cases = [("llama", {"dp": 2}, {"zero": 1}), ("gpt2", {"dp": 2}, {"zero": 2}),
             ("llama", {"dp": 2}, {"zero": 3, "accumulate": 2, "clip_grad_norm": 0.05})]
    for errors in shardfx.launch(_train, cases, nprocs=2, timeout=120, deadline=600):
        assert max(errors) < 1e-5, errors


def _dp_tp() -> list:
    """(training errors on dp=2 x tp=2 and on pp=2 x dp=2, ZeRO-2; this rank's measured and
    predicted peaks of the device and the host on dp=2 x tp=2, offloaded and not)."""
    errors = _train([("llama", {"dp": 2, "tp": 2}, {"zero": 2}),
                     ("llama", {"pp": 2, "dp": 2}, {"zero": 2, "microbatches": 2})])
    return [errors, _peaks(mesh={"dp": 2, "tp": 2}, shard="megatron", zero=2)]


def test_dp_tp_trains_as_eager_does_and_peaks_as_predicted():
    for errors, peaks in shardfx.launch(_dp_tp, nprocs=4, timeout=180, deadline=900):
        assert max(errors) < 1e-5, errors
        _check_peaks(peaks)


def _peaks(**kw) -> list[tuple]:
    """(measured device, predicted device, measured host, predicted host) of this rank's
    second step, without and with offload."""
    rows = []
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for offload in (False, True):
        batches = token_batches(3, batch=4)
        plan = shardfx.partition(tiny("llama", 4), *batches[0][:1], lm_loss, batches[0][1],
                                 offload_optimizer=offload, **kw)
        runner = plan.runner(adamw)
        runner.step(*batches[0])
        (x,), (y,) = batches[1]
        peak = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y)
        predicted = plan.memory_breakdown()[rank]
        rows.append((peak.total - x.nbytes - y.nbytes, predicted.total, peak.host,
                     predicted.host))
    return rows


def _check_peaks(rows: list[tuple]) -> None:
    (plain, plain_predicted, no_host, _), (device, predicted, host, host_predicted) = rows
    assert no_host == 0, rows
    for measured, want in ((plain, plain_predicted), (device, predicted), (host, host_predicted)):
        assert abs(want - measured) <= 0.02 * measured, rows
    assert device < 0.8 * plain, rows  # AdamW's moments and the gradients left the device


def test_one_device_peaks_as_predicted_and_the_program_hands_gradients_over():
    _check_peaks(_peaks())
    batches = token_batches(1)
    plan = shardfx.partition(tiny("llama"), *batches[0][:1], lm_loss, batches[0][1],
                             offload_optimizer=True)
    program = plan.program
    assert not any(v is not None for v, r in zip(program.module.graph.output_node().args[0],
                                                  program.outputs)
                   if r.kind is M.OutputKind.GRAD)
    sends = [n for n in program.module.graph.nodes if n.target is gradients_to_host]
    handed = [name for n in sends for name in n.args[1]]
    params = [name for name, p in plan.model.named_parameters() if p.requires_grad]
    assert sorted(handed) == sorted(set(params)), handed
    assert len(sends) > 2  # a block at a time, not all at the end
    assert f"{len(sends)} hand-overs" in " ".join(str(plan).split())


def test_a_checkpoint_moves_between_offloaded_and_plain_runners(tmp_path):
    """The host's copies and the optimizer's state are what a checkpoint saves; a runner that
    loads it, offloaded or not, trains on exactly as the one that saved it."""
    batches = token_batches(4)
    model = tiny("llama")

    def runner(offload: bool):
        plan = shardfx.partition(model, *batches[0][:1], lm_loss, batches[0][1],
                                 offload_optimizer=offload)
        return plan.runner(adamw)

    saver = runner(True)
    for b in batches[:2]:
        saver.step(*b)
    saver.save(tmp_path / "ckpt")
    want = saver.step(*batches[2]).item(), saver.step(*batches[3]).item()
    for offload in (True, False):
        loader = runner(offload)
        loader.load(tmp_path / "ckpt")
        got = loader.step(*batches[2]).item(), loader.step(*batches[3]).item()
        assert got == want, (offload, got, want)
        state = loader.state_dict()
        assert all(torch.equal(state[k], v) for k, v in saver.state_dict().items())


@pytest.mark.parametrize("kw, words", [
    (dict(optimizer_in_backward=True), "optimizer_in_backward"),
    (dict(optimizer=None), "no state"),
    (dict(loss_fn=None), "inference"),
])
def test_what_it_cannot_run_with_is_named(kw, words):
    (x,), (y,) = token_batches(1, batch=4)[0]
    loss = kw.pop("loss_fn", lm_loss)
    with pytest.raises(InputError, match=words) as error:
        shardfx.partition(tiny("llama"), (x,), loss, (y,) if loss else (),
                          offload_optimizer=True, **kw)
    assert "offload_optimizer" in str(error.value)
    with pytest.raises(InputError, match="True or False"):
        shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), offload_optimizer="yes")


def _pipeline() -> list:
    """Training errors on pp=2 (1F1B, 2 microbatches; with accumulation and clipping), each
    stage's owner stepping on its host; this rank's peaks, offloaded and not."""
    errors = _train([("llama", {"pp": 2}, {"microbatches": 2}),
                     ("gpt2", {"pp": 2}, {"microbatches": 2, "accumulate": 2,
                                          "clip_grad_norm": 0.05})])
    return [errors, _peaks(mesh={"pp": 2}, microbatches=2)]


def test_a_pipeline_trains_as_eager_does_and_peaks_as_predicted():
    for errors, peaks in shardfx.launch(_pipeline, nprocs=2, timeout=180, deadline=900):
        assert max(errors) < 1e-5, errors
        _check_peaks(peaks)


def test_a_budget_only_offload_meets_names_it_and_offload_meets_it():
    from shardfx.errors import MemoryBudgetError

    (x,), (y,) = token_batches(1, batch=1)[0]
    with pytest.raises(MemoryBudgetError) as lowest:
        shardfx.partition(tiny("llama", 4), (x,), lm_loss, (y,), memory_budget=1)
    least = lowest.value.least
    budget = least.total - least.optimizer // 2  # no recomputation reaches it; offload does
    with pytest.raises(MemoryBudgetError, match=r"offload_optimizer=True\) would keep"):
        shardfx.partition(tiny("llama", 4), (x,), lm_loss, (y,), memory_budget=budget)
    plan = shardfx.partition(tiny("llama", 4), (x,), lm_loss, (y,), memory_budget=budget,
                             offload_optimizer=True)
    assert plan.memory_estimate()[0] <= budget
