"""Capture: what the IR looks like after tracing, checked as text and by running it."""

from __future__ import annotations

import torch

from shardfx.ir import meta as M
from shardfx.ir.text import ir_to_text
from shardfx.partitioner.capture import capture
from shardfx.testing import compare_training


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3, bias=False)

    def forward(self, x):
        return self.proj(x).relu()


def mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def test_training_graph_names_every_input_and_output():
    torch.manual_seed(0)
    gm = capture(Tiny(), (torch.randn(2, 4),), mse, (torch.randn(2, 3),)).gm
    text = ir_to_text(gm)
    lines = text.splitlines()
    assert lines[0] == "graph train Tiny"
    assert lines[1:4] == [
        "  proj_weight: f32[3, 4] = param proj.weight",
        "  args_0: f32[2, 4] = input args[0]",
        "  targets_0: f32[2, 3] = target targets[0]",
    ]
    assert lines[4] == "  tangent_loss: f32[] = tangent loss"
    outputs = [line for line in lines if line.startswith("  output")]
    assert [o.split(" = ")[0] for o in outputs] == ["  output loss loss", "  output grad proj.weight"]
    # the loss is computed from the input, the grad reads the tangent: run it to be sure
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    w = gm.graph.find_nodes(op="placeholder")[0]
    assert w.meta[M.ROLE] == M.InputRole(M.InputKind.PARAM, "proj.weight")
    weight = torch.randn(3, 4, requires_grad=True)
    loss, grad = gm(weight.detach(), x, y, torch.ones(()))
    expected = mse((x @ weight.T).relu(), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad, weight.grad, rtol=0, atol=0)


def test_inference_graph_has_no_backward():
    gm = capture(Tiny(), (torch.randn(2, 4),)).gm
    text = ir_to_text(gm)
    assert text.startswith("graph infer Tiny\n")
    assert "tangent" not in text and "output grad" not in text
    assert text.rstrip().splitlines()[-1].startswith("  output output out[0] = ")


def test_same_tensor_as_input_and_target_stays_two_inputs():
    """labels=input_ids: tracing must not fuse the two into one graph input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    gm = capture(model, (x,), mse, (x,)).gm
    kinds = [n.meta[M.ROLE].kind for n in gm.graph.find_nodes(op="placeholder")]
    assert kinds.count(M.InputKind.INPUT) == 1 and kinds.count(M.InputKind.TARGET) == 1
    later = [((torch.randn(2, 4),), (torch.randn(2, 4),)) for _ in range(2)]
    compare_training(model, [((x,), (x,)), *later], mse)


def test_frozen_parameter_gets_no_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    batches = [((torch.randn(3, 4),), (torch.randn(3, 2),)) for _ in range(3)]
    compare_training(model, batches, mse)
    (args, targets) = batches[0]
    roles = capture(model, args, mse, targets).gm.graph.output_node().meta[M.OUTPUTS]
    assert M.OutputRole(M.OutputKind.GRAD, "0.weight") not in roles
    assert M.OutputRole(M.OutputKind.GRAD, "0.bias") in roles


def test_nested_inputs_flatten_in_order():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 2)

        def forward(self, inputs):
            return self.a(inputs["x"]) * inputs["scale"]

    torch.manual_seed(0)
    model = Pair()
    batches = [(({"x": torch.randn(2, 4), "scale": torch.randn(2, 2)},), (torch.randn(2, 2),))
               for _ in range(3)]
    compare_training(model, batches, mse)
