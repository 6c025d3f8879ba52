"""``partition(..., microbatches=m)`` without a pp axis: gradient accumulation inside the plan.
The program is traced on a slice of the batch; every step runs ``m`` slices one after the
other, sums their gradients and steps once, equal to one device on the whole batch; the memory
model holds the earlier slices' gradients through the later ones (measured); the predicted step
prices the whole global batch."""

from __future__ import annotations

import pytest
import torch

import shardfx
from shardfx.errors import InputError, PipelineError
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw, compare_training

from models import lm_loss, tiny, token_batches

ROWS = 16


def summed_loss(out, targets):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(),
                                             reduction="sum")


@pytest.mark.parametrize("loss", [lm_loss, summed_loss], ids=["mean", "sum"])
def test_accumulated_slices_train_equal_to_one_device(loss):
    report = compare_training(tiny("llama"), token_batches(2, ROWS), loss, microbatches=4)
    ids = report.plan.program.module.graph.find_nodes(op="placeholder")
    assert any(n.meta["val"].shape[:1] == (ROWS // 4,) for n in ids)  # traced on a slice


def test_dropout_draws_each_rows_values_as_on_one_device():
    """Each slice draws the random values of its rows' places in the whole batch."""
    compare_training(_gpt2_with_dropout(), token_batches(2, ROWS), lm_loss, microbatches=2)


def _gpt2_with_dropout():
    import transformers as T

    from models import HIDDEN, SEQ, VOCAB

    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=4,
                                          n_positions=2 * SEQ, vocab_size=VOCAB,
                                          resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0))


def test_the_earlier_slices_gradients_are_held_as_predicted():
    batches = token_batches(3, ROWS)
    (x,), (y,) = batches[0]
    plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), microbatches=4)
    runner = plan.runner(adamw)
    runner.step(*batches[1])
    (x,), (y,) = batches[2]
    measured = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y).total \
        - x.nbytes - y.nbytes
    predicted = plan.memory_breakdown()[0]
    assert predicted.when.startswith("a later microbatch"), predicted.when
    assert abs(predicted.total - measured) <= 0.02 * measured, (predicted.total, measured)


def test_the_predicted_step_prices_every_slice_and_one_optimizer_step():
    (x,), (y,) = token_batches(1, ROWS)[0]
    one = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), microbatches=1).predicted_step
    four = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), microbatches=4).predicted_step
    pass_four = (four.compute - four.optimizer) / 4  # one slice's program
    assert four.optimizer == pytest.approx(one.optimizer)
    assert 0.25 * (one.compute - one.optimizer) <= pass_four < one.compute - one.optimizer
    assert four.total == pytest.approx(four.compute + four.communication)


def _on_meshes() -> None:
    for mesh, kw in (({"dp": 4}, {"zero": 2}), ({"dp": 2, "tp": 2}, {"shard": "megatron"})):
        compare_training(tiny("llama"), token_batches(2, ROWS), lm_loss, mesh=mesh,
                         microbatches=2, **kw)


@pytest.mark.multiprocess
def test_accumulated_slices_train_equal_to_one_device_on_meshes():
    shardfx.launch(_on_meshes, nprocs=4, timeout=300, deadline=1200)


def test_what_cannot_accumulate_is_named():
    (x,), (y,) = token_batches(1, ROWS)[0]
    with pytest.raises(InputError, match=r"optimizer_in_backward with microbatches=2: the "
                                         r"gradients are summed over the microbatches"):
        shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), microbatches=2,
                          optimizer_in_backward=True)
    with pytest.raises(InputError, match=r"batch size 16, which does not split into "
                                         r"microbatches=3"):
        shardfx.partition(tiny("llama"), (x,), lm_loss, (y,), microbatches=3)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 2))
    with pytest.raises(PipelineError, match=r"the plan runs the batch in 2 slices, each "
                                            r"normalized by its own rows"):
        shardfx.partition(net, (torch.randn(8, 4),), torch.nn.functional.mse_loss,
                          (torch.randn(8, 2),), microbatches=2)
