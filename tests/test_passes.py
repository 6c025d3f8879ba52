"""The passes on the smallest graph that shows them: a 2-layer MLP with an MSE loss.

    x (2, 4) -> Linear(4, 8) -> ReLU -> Linear(8, 3) -> mse_loss(., y (2, 3))

Each test asserts what a pass wrote (structural) and that the numbers agree with eager PyTorch
(numeric): the program trains like eager, FLOPs equal torch's FlopCounterMode on the eager step.
Then the pass machinery itself: ``verify`` rejects broken IR, a failing pass is a ``PassError``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import shardfx
from shardfx.errors import PassError, VerifyError
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.partitioner.capture import capture
from shardfx.passes.assign_phase import assign_phase
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.compiler.manager import PassRecord, run_passes
from shardfx.request.options import Options
from shardfx.testing import compare_training

B, IN, HID, OUT = 2, 4, 8, 3
aten = torch.ops.aten


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, OUT))


def data(seed: int = 0) -> tuple[tuple, tuple]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, IN, generator=g),), (torch.randn(B, OUT, generator=g),)


@pytest.fixture
def plan():
    args, targets = data()
    return shardfx.partition(mlp(), args, F.mse_loss, targets)


def outputs(gm: fx.GraphModule) -> list[tuple[fx.Node, M.OutputRole]]:
    out = gm.graph.output_node()
    return list(zip(out.args[0], out.meta[M.OUTPUTS]))


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def test_program_trains_like_eager():
    """Numeric check for the pipeline as a whole: the passes leave the program computing the
    model's loss, gradients and AdamW updates."""
    compare_training(mlp(), [data(0), data(1)], F.mse_loss)


# --- assign_phase ------------------------------------------------------------------------------


def test_assign_phase(plan):
    ir = plan.ir
    ops = op_nodes(ir.graph)
    assert ops and all(isinstance(n.meta.get(M.PHASE), M.Phase) for n in ops), ir_to_text(ir)

    (loss, _), = [(v, r) for v, r in outputs(ir) if r.kind is M.OutputKind.LOSS]
    loss_ops = [n for n in ancestors(loss) if n.op == "call_function"]
    assert {n.target for n in loss_ops} >= {aten.addmm.default, aten.relu.default,
                                            aten.mse_loss.default}
    wrong = [n.format_node() for n in loss_ops if n.meta[M.PHASE] is not M.Phase.FORWARD]
    assert not wrong, "ops the loss needs are not forward:\n" + "\n".join(wrong)

    grads = {r.name: v for v, r in outputs(ir) if r.kind is M.OutputKind.GRAD}
    assert set(grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, node in grads.items():
        assert node.meta[M.PHASE] is M.Phase.BACKWARD, f"grad of {name}: {node.format_node()}"

    (tangent,) = [n for n in ir.graph.find_nodes(op="placeholder")
                  if n.meta[M.ROLE].kind is M.InputKind.TANGENT]
    assert all(u.meta[M.PHASE] is M.Phase.BACKWARD for u in tangent.users)
    # forward ops: exactly the loss's ancestors
    assert {n for n in ops if n.meta[M.PHASE] is M.Phase.FORWARD} == set(loss_ops)


# --- estimate_cost -----------------------------------------------------------------------------


def test_estimate_cost_matmul_flops(plan):
    ir = plan.ir
    fwd_mm = [n for n in op_nodes(ir.graph) if n.meta[M.PHASE] is M.Phase.FORWARD
              and n.target in (aten.mm.default, aten.addmm.default)]
    assert len(fwd_mm) == 2, ir_to_text(ir)
    for node in fwd_mm:
        m, n = node.meta[M.VAL].shape
        k = node.args[-1].meta[M.VAL].shape[0]  # addmm(bias, a (m, k), b (k, n))
        assert node.meta[M.COST].flops == 2 * m * n * k, node.format_node()
    fwd = 2 * B * IN * HID + 2 * B * HID * OUT
    assert sorted(n.meta[M.COST].flops for n in fwd_mm) == sorted([2 * B * IN * HID,
                                                                    2 * B * HID * OUT])
    # Backward: each layer's weight gradient costs its forward matmul again, and so does each
    # input gradient but the first layer's (x does not require grad). With that layer too it
    # would be exactly 2x forward.
    bwd = 2 * fwd - 2 * B * IN * HID
    s = plan.summary
    assert (s.flops_fwd, s.flops_bwd) == (fwd, bwd)
    # only matmuls count FLOPs
    for node in op_nodes(ir.graph):
        if node.target not in (aten.mm.default, aten.addmm.default):
            assert node.meta[M.COST].flops == 0, node.format_node()


def test_estimate_cost_flops_equal_eager_flop_counter(plan):
    model, ((x,), (y,)) = mlp(), data()
    with FlopCounterMode(display=False) as forward:
        loss = F.mse_loss(model(x), y)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    s = plan.summary
    assert s.flops_fwd == forward.get_total_flops()
    assert s.flops_bwd == backward.get_total_flops()


def test_estimate_cost_counts_cpu_attention():
    """torch has no FLOP formula for CPU flash attention; shardfx counts its SDPA formulas,
    forward and backward, as FlopCounterMode does given the same mapping."""
    from shardfx.cost.node import CPU_ATTENTION_FLOPS

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 8)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as count:
        model(x).sum().backward()
    plan = shardfx.partition(model, (x,), lambda out: out.sum())
    attention = [n for n in op_nodes(plan.ir.graph) if "flash_attention_for_cpu" in str(n.target)]
    assert len(attention) == 2 and all(n.meta[M.COST].flops > 0 for n in attention)
    assert plan.summary.flops_fwd + plan.summary.flops_bwd == count.get_total_flops() > 0


def test_estimate_cost_bytes_and_saved_activations(plan):
    ir, s = plan.ir, plan.summary
    fwd_ops = [n for n in op_nodes(ir.graph) if n.meta[M.PHASE] is M.Phase.FORWARD]
    for node in op_nodes(ir.graph):
        val = node.meta[M.VAL]
        want = 0 if node.target in (aten.t.default, aten.view.default, aten.detach.default) \
            else val.numel() * val.element_size()
        assert node.meta[M.COST].out_bytes == want, node.format_node()
    fwd_bytes = sum(n.meta[M.COST].out_bytes for n in fwd_ops)
    assert 0 < s.saved_bytes <= fwd_bytes
    # what the backward reads of the forward: the ReLU output (for the weight grad and the ReLU
    # mask) and the second Linear's output (for mse_loss_backward); not the loss, not views
    assert s.saved_bytes == 4 * (B * HID + B * OUT)


# --- verify and the pass manager ---------------------------------------------------------------


def test_verify_rejects_placeholder_without_role(plan):
    ir = plan.ir
    verify(ir)
    node = ir.graph.find_nodes(op="placeholder")[2]
    del node.meta[M.ROLE]
    with pytest.raises(VerifyError) as info:
        verify(ir)
    assert "no ROLE" in info.value.cause and node.name in info.value.where


def test_verify_rejects_node_without_val(plan):
    ir = plan.ir
    node = next(n for n in op_nodes(ir.graph) if n.target is aten.relu.default)
    del node.meta[M.VAL]
    with pytest.raises(VerifyError) as info:
        verify(ir)
    assert "meta['val']" in info.value.cause and node.name in info.value.where
    assert info.value.fix


def _captured() -> tuple[fx.GraphModule, list[PassRecord]]:
    args, targets = data()
    gm = capture(mlp(), args, F.mse_loss, targets).gm
    return gm, [PassRecord("capture", ir_to_text(gm))]


def explode(gm, options):
    raise RuntimeError("boom")


def lose_a_role(gm, options):
    del gm.graph.find_nodes(op="placeholder")[0].meta[M.ROLE]
    return gm


def test_failing_pass_is_pass_error_naming_it():
    gm, history = _captured()
    with pytest.raises(PassError) as info:
        run_passes(gm, [assign_phase, explode], Options(debug=True), history)
    e = info.value
    assert "RuntimeError: boom" in e.cause
    assert "pass explode (after capture, assign_phase)" in e.where
    assert "report" in e.fix
    assert isinstance(e.__cause__, RuntimeError)
    assert [r.name for r in history] == ["capture", "assign_phase"]


def test_pass_breaking_the_ir_is_caught_by_verify():
    gm, history = _captured()
    with pytest.raises(PassError) as info:
        run_passes(gm, [lose_a_role, assign_phase], Options(debug=True), history)
    e = info.value
    assert "VerifyError" in e.cause and "no ROLE" in e.cause
    assert e.where.startswith("pass lose_a_role (after capture)")
    assert isinstance(e.__cause__, VerifyError)


def test_each_pass_is_recorded_as_it_left_the_ir_and_rendered_when_read(monkeypatch):
    """The history keeps the IR after each pass without rendering it (most plans are never
    dumped); read later, each record is the IR as that pass left it, not as later passes
    rewrote the same nodes."""
    import shardfx.compiler.manager as manager

    rendered = []
    render = manager.ir_to_text
    monkeypatch.setattr(manager, "ir_to_text", lambda gm: rendered.append(gm) or render(gm))
    gm, history = _captured()
    run_passes(gm, [assign_phase, estimate_cost], Options(debug=True), history)
    assert rendered == []  # nothing rendered while planning
    phase, cost = (r.text for r in history[1:])
    assert len(rendered) == 2
    assert phase.startswith("# after assign_phase:") and "wrote phase on" in phase
    assert "FLOP" not in phase  # the costs estimate_cost wrote later are not in it
    assert "wrote cost on" in cost and "FLOP" in cost
    assert cost.endswith(ir_to_text(gm))  # the IR as it is now
    assert history[2].text is cost and len(rendered) == 2  # rendered once


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_pauses_the_cyclic_gc_and_restores_it(enabled):
    """The garbage collector does not run while a plan is made (``pipeline.paused_gc``: full
    collections walked every graph planning holds, a third of a deep model's plan), and is
    left as the caller had it."""
    seen = []

    def loss(out, y):
        seen.append(gc.isenabled())  # called while capture traces
        return F.mse_loss(out, y)

    (x,), (y,) = data()
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        shardfx.partition(mlp(), (x,), loss, (y,))
        assert seen and not any(seen)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
