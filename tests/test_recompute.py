"""``partition(..., recompute=)``: the policies Megatron and TorchTitan users name ("none",
"selective": the attention core, "full": each block from its input) applied as remat applies
its choice, each structurally (what is recomputed, what is kept), in memory (predicted and
measured peaks) and numerically (equal to one device, on one device and on meshes)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import shardfx
from shardfx.auto.recompute import allowed_values
from shardfx.cost.node import is_view
from shardfx.errors import InputError, MemoryBudgetError
from shardfx.ir import meta as M
from shardfx.passes.stage_cut import block_of
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw, compare_training

from models import HIDDEN, SEQ, VOCAB, lm_loss, tiny, token_batches

LAYERS, ROWS = 4, 16


def eager_gpt2(layers: int = LAYERS) -> torch.nn.Module:
    """GPT-2 with its attention written out (matmul, softmax, matmul), not fused."""
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(
        n_layer=layers, n_embd=HIDDEN, n_head=4, n_positions=2 * SEQ, vocab_size=VOCAB,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, attn_implementation="eager"))


def planned(model, policy: str, **kw) -> shardfx.Plan:
    (x,), (y,) = token_batches(1, ROWS)[0]
    return shardfx.partition(model, (x,), lm_loss, (y,), recompute=policy, **kw)


def kept_in_blocks(plan: shardfx.Plan) -> dict[str, list[str]]:
    """Per block, the forward values of it that a backward op (not a recomputed copy) reads."""
    out: dict[str, list[str]] = {}
    for n in plan.ir.graph.nodes:
        if n.op != "call_function" or n.meta.get(M.PHASE) is not M.Phase.BACKWARD or \
                M.REMAT in n.meta:
            continue
        for a in n.all_input_nodes:
            block = block_of(a)
            if a.op == "call_function" and a.meta.get(M.PHASE) is M.Phase.FORWARD and block:
                out.setdefault(block, [])
                if a.name not in out[block]:
                    out[block].append(a.name)
    return out


def recomputed_targets(plan: shardfx.Plan) -> set[str]:
    return {str(n.target) for n in plan.ir.graph.nodes if M.REMAT in n.meta}


def test_full_keeps_only_each_blocks_input():
    """Every block's activations come back from its input: the only value of a block the
    backward reads is the block's output, the next block's input (Megatron's full)."""
    for model in (tiny("llama", LAYERS), eager_gpt2()):
        plan = planned(model, "full")
        kept = kept_in_blocks(plan)
        assert kept and all(len(names) == 1 for names in kept.values()), kept
        for block, (name,) in kept.items():
            node = next(n for n in plan.ir.graph.nodes if n.name == name)
            readers = {block_of(u) for u in node.users if u.meta.get(M.PHASE) is M.Phase.FORWARD}
            assert readers - {block}, (block, name, readers)  # read past its own block
        assert {"aten.mm.default", "aten.addmm.default"} & recomputed_targets(plan)  # matmuls
        assert "recompute='full': " in str(plan) and "ops recomputed in the backward" in str(plan)


def test_selective_recomputes_the_attention_core_and_nothing_else():
    """Written-out attention: the scores, their softmax and what is between, from q, k and v
    kept; no matmul of a weight is recomputed, and the core's output stays."""
    plan = planned(eager_gpt2(), "selective")
    again = recomputed_targets(plan)
    assert "aten._softmax.default" in again and "aten.bmm.default" in again
    assert "aten.mm.default" not in again and "aten.addmm.default" not in again
    core = allowed_values(plan.ir, "selective")
    for n in plan.ir.graph.nodes:
        if M.REMAT in n.meta and not is_view(n):  # views come back free, wherever they are
            original = next(o for o in plan.ir.graph.nodes if o.name == n.meta[M.REMAT])
            assert original in core, (n.name, n.target)


def test_the_fused_kernel_is_its_own_core():
    plan = planned(tiny("llama", LAYERS), "selective")
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in recomputed_targets(plan)


def test_each_policy_keeps_less_and_the_peak_is_as_predicted():
    """none > selective > full in predicted peak (written-out attention: the scores are what
    selective saves); "full" measured at its prediction on one device."""
    peaks = {p: max(planned(eager_gpt2(), p).memory_estimate().values())
             for p in ("none", "selective", "full")}
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    batches = token_batches(2, ROWS)
    plan = planned(eager_gpt2(), "full")
    runner = plan.runner(adamw)
    runner.step(*batches[0])
    (x,), (y,) = batches[1]
    measured = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y).total \
        - x.nbytes - y.nbytes
    assert abs(plan.memory_estimate()[0] - measured) <= 0.02 * measured, \
        (plan.memory_estimate()[0], measured)


@pytest.mark.parametrize("policy", ["selective", "full"])
@pytest.mark.parametrize("name", ["llama", "eager-gpt2"])
def test_each_policy_trains_equal_to_one_device(policy, name):
    model = tiny("llama", LAYERS) if name == "llama" else eager_gpt2()
    report = compare_training(model, token_batches(2, ROWS), lm_loss, recompute=policy)
    assert report.plan.remat is not None and report.plan.remat.recomputed


def _on_meshes() -> None:
    for mesh, policy, kw in (
            ({"dp": 2, "tp": 2}, "full", {"shard": "megatron", "zero": 1}),
            ({"pp": 2, "dp": 2}, "selective", {"microbatches": 2, "schedule": "1f1b"}),
            ({"pp": 2, "tp": 2}, "selective", {"microbatches": 2, "schedule": "zero-bubble",
                                               "shard": "megatron"})):
        report = compare_training(tiny("llama", LAYERS), token_batches(2, ROWS), lm_loss,
                                  mesh=mesh, recompute=policy, **kw)
        assert report.plan.remat is not None, (mesh, policy)


@pytest.mark.multiprocess
def test_each_policy_trains_equal_to_one_device_on_meshes():
    """tp (a block's recomputation, full, runs its all-reduce again), pp with 1F1B and zero
    bubble (selective: what a W part reads stays kept), dp with ZeRO-1."""
    shardfx.launch(_on_meshes, nprocs=4, timeout=300, deadline=1500)


def test_a_budget_a_named_policy_misses_says_what_would_fit():
    plan = planned(eager_gpt2(), "none")
    peak = max(plan.memory_estimate().values())
    with pytest.raises(MemoryBudgetError, match=r"with recompute='none' the plan's predicted "
                                                r"peak is \d+ bytes per device") as e:
        planned(eager_gpt2(), "none", memory_budget=int(0.9 * peak))
    assert 'recompute="auto"' in e.value.fix and 'recompute="full"' in e.value.fix
    fits = planned(eager_gpt2(), "full", memory_budget=int(0.9 * peak))
    assert max(fits.memory_estimate().values()) <= 0.9 * peak


def test_bad_recompute_requests_are_named():
    with pytest.raises(InputError, match="recompute must be one of 'auto', 'none', 'selective', "
                                         "'full', got 'some'"):
        planned(eager_gpt2(), "some")
    (x,), _ = token_batches(1, ROWS)[0]
    with pytest.raises(InputError, match="without a loss_fn: an inference plan has no backward"):
        shardfx.partition(eager_gpt2(), (x,), recompute="full")
