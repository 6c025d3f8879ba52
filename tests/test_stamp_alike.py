"""Blocks are interchangeable when what they read behaves alike, not when it is one object
(``partitioner/alike.py``); blocks that are not stamped say so, in a warning and in
``print(plan)``."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfx
from shardfx.ir.text import ir_to_text
from shardfx.partitioner.alike import Alike
from shardfx.partitioner.capture import capture
from shardfx.partitioner.repeats import NotStampedWarning


class Shift(nn.Module):
    """A kernel-function module as transformers 5.25 gives each attention module its own (in
    ``_kernel_funcs``): no parameters, not a submodule, made fresh for every block."""

    def __init__(self, owner: nn.Module, by: int = 1):
        super().__init__()
        self.by = by
        self.__dict__["owner"] = owner  # back to its block: a cycle, as a helper may hold

    def forward(self, x):
        return torch.roll(x, self.by, -1)


def gate(scale: float):
    return lambda x: scale * torch.sigmoid(x) * x  # a new function object per call


class Helped(nn.Module):
    """A block holding helpers made for it alone, each behaving as every other block's."""

    def __init__(self, by: int = 1, scale: float = 1.0, slope: float = 0.1):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.__dict__["_kernel_funcs"] = {"shift": Shift(self, by)}
        self.gate = gate(scale)
        self.act = functools.partial(F.leaky_relu, negative_slope=slope)
        self.norm = self.norm_of  # a bound method of its own, kept as an attribute

    def norm_of(self, x):  # reads the block's own bias: bound to another block, it reads its
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() + self.lin.bias

    def forward(self, x):
        return x + self.norm(self._kernel_funcs["shift"](self.gate(self.act(self.lin(x)))))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def traced(model) -> tuple[str, bool]:
    """The capture path, and whether the graph is the full trace's."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotStampedWarning)
        stamped = capture(model, (x,), F.mse_loss, (x,))
    full = capture(model, (x,), F.mse_loss, (x,), blocks=False)
    return stamped.path, ir_to_text(stamped.gm) == ir_to_text(full.gm)


def test_helpers_each_block_makes_for_itself_are_alike():
    """Per-block kernel-function dicts, lambdas, partials and bound methods: not one object
    between two blocks, all alike, so the blocks are stamped."""
    path, same = traced(Stack([Helped() for _ in range(4)]))
    assert path == "stamped layers: 2 of 4 blocks traced, 2 stamped" and same


@pytest.mark.parametrize("odd, why", [
    (dict(by=2), "layers.3._kernel_funcs['shift'].by is 2, layers.1's is 1"),
    (dict(scale=2.0), "layers.3.gate.<closure scale> is 2.0, layers.1's is 1.0"),
    (dict(slope=0.2), "layers.3.act.keywords['negative_slope'] is 0.2, layers.1's is 0.1"),
], ids=["kernel_funcs", "closure", "partial"])
def test_a_helper_that_differs_is_named_down_to_the_part(odd, why):
    path, same = traced(Stack([Helped(), Helped(), Helped(), Helped(**odd)]))
    assert path == f"full trace ({why})" and same


def test_a_bound_method_of_another_block_differs():
    blocks = [Helped() for _ in range(4)]
    blocks[3].norm = blocks[1].norm_of  # block 3 normalises with block 1 bound as self
    path, same = traced(Stack(blocks))
    assert path == "full trace (layers.3.norm.__self__ is the module layers.1, layers.1's is " \
                   "the module layers.1)" and same


@pytest.mark.parametrize("a, b, where", [
    (1, 1, None), (1, 1.0, ""), (float("nan"), float("nan"), None), ((1, [2, 3]), (1, [2, 4]), "[1][1]"),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}, ""), ({1, 2}, {2, 1}, None),
    (torch.zeros(1), torch.zeros(1), ""),  # a tensor: a constant of the graph, not compared
    (int, float, ""), (functools.partial(max, 1), functools.partial(max, 1), None),
    (functools.partial(max, 1), functools.partial(min, 1), ".func"),
])
def test_values_alike(a, b, where):
    found = Alike(nn.Module(), nn.Module()).difference(a, b)
    assert (found and found[0]) == where


# --- saying so -------------------------------------------------------------------------------


class Scaled(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return x + self.scale * torch.tanh(self.lin(x))


def test_blocks_not_stamped_warn_and_say_so_in_the_plan():
    model = Stack([Scaled(), Scaled(), Scaled(), Scaled(2.0)])
    x = torch.randn(4, 8)
    with pytest.warns(NotStampedWarning, match=r"Stack: repeated blocks not stamped, every one "
                      r"traced: layers\.3\.scale is 2\.0, layers\.1's is 1\.0"):
        plan = shardfx.partition(model, (x,), F.mse_loss, (x,))
    text = str(plan)
    assert "Traced: full trace (layers.3.scale is 2.0, layers.1's is 1.0)" in text
    assert "Repeated blocks not stamped (why above)" in text


def test_stamped_blocks_do_not_warn():
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotStampedWarning)
        plan = shardfx.partition(Stack([Scaled() for _ in range(4)]), (x,), F.mse_loss, (x,))
    assert plan.capture_path.startswith("stamped ")
    assert "not stamped" not in str(plan)
