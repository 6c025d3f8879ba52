"""Repeated blocks traced once and stamped: the same IR and programs as the full trace, and the
full trace whenever the blocks are not interchangeable."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfx
from shardfx.ir import meta as M
from shardfx.ir.text import ir_to_text
from shardfx.partitioner.capture import capture
from shardfx.partitioner.repeats import NotStampedWarning
from shardfx.testing import compare_training

from fuzz_draw import RandomPicker, random_body
from fuzz_models import DIMS, SEQS, ModelSpec, batches, build
from models import hf, lm_loss, tiny, token_batches

LAYERS = 4  # blocks 2 and 3 are stamped


def both(model, args, loss_fn=None, targets=()):
    """The stamped capture and the full trace of ``model``."""
    return (capture(model, args, loss_fn, targets),
            capture(model, args, loss_fn, targets, blocks=False))


def pairing(gm) -> dict[str, str]:
    """Each backward op -> the forward op it differentiates (by torch's seq_nr, as stage_cut
    pairs them), by name."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    forward = {}
    for n in ops:
        if not n.meta.get("autograd_backward") and "seq_nr" in n.meta:
            forward.setdefault(n.meta["seq_nr"], n.name)
    return {n.name: forward.get(n.meta.get("seq_nr")) for n in ops
            if n.meta.get("autograd_backward")}


def modules(gm) -> dict[str, str]:
    """Each op -> the innermost module it was traced in."""
    def inner(n):
        stack = n.meta.get("fwd_nn_module_stack" if n.meta.get("autograd_backward")
                           else "nn_module_stack")
        return list(stack.values())[-1][0] if stack else ""
    return {n.name: inner(n) for n in gm.graph.nodes if n.op == "call_function"}


MODELS = ["llama", "gpt2", "mixtral", "nanogpt", "qwen3_moe", "gemma3", "olmo2", "gpt_neox",
          "bert", "deepseek_v3"]


@pytest.mark.parametrize("name", MODELS)
def test_stamped_training_graph_is_the_full_trace(name):
    model = tiny(name, LAYERS) if name in ("llama", "gpt2", "mixtral", "nanogpt") else \
        hf(name, LAYERS)
    (x,), (y,) = token_batches(1)[0]
    stamped, full = both(model, (x,), lm_loss, (y,))
    # DeepSeek-V3's first layer is dense, the others mixtures of experts: 1, 2 are the pair
    traced = 3 if name == "deepseek_v3" else 2
    assert stamped.path.endswith(f": {traced} of 4 blocks traced, {4 - traced} stamped"), \
        stamped.path
    assert full.path == "full trace"
    assert ir_to_text(stamped.gm) == ir_to_text(full.gm)
    assert pairing(stamped.gm) == pairing(full.gm)  # each copy's backward pairs with its forward
    assert modules(stamped.gm) == modules(full.gm)  # and is named for its own block


STOCK = {  # each as its users make it: the stock class and config, shrunk to 4 layers
    "llama": lambda T: T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=LAYERS)),
    "gpt2": lambda T: T.GPT2LMHeadModel(T.GPT2Config(n_layer=LAYERS)),
    "mixtral": lambda T: T.MixtralForCausalLM(T.MixtralConfig(num_hidden_layers=LAYERS)),
}


@pytest.mark.parametrize("name", STOCK)
def test_stock_hugging_face_models_stamp(name):
    """A release of transformers that keeps its stock models from stamping (each block
    holding something that differs, such as 5.25's per-module ``_kernel_funcs``) makes every
    deep plan trace all its blocks: 3.3-3.5x torch.export at 80 layers instead of 0.4-0.5x
    (bench/RESULTS.md, plan, 2026-12-07)."""
    import transformers as T

    with torch.device("meta"):
        model = STOCK[name](T)
    ids = torch.randint(0, 1000, (2, 16), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotStampedWarning)
        captured = capture(model, (ids,), lm_loss, (ids,))
    assert captured.path.startswith("stamped ") and captured.path.endswith(
        f": 2 of {LAYERS} blocks traced, {LAYERS - 2} stamped"), captured.path


def test_stamped_inference_graph_is_the_full_trace():
    (x,), _ = token_batches(1)[0]
    stamped, full = both(tiny("llama", LAYERS), (x,))
    assert stamped.path.startswith("stamped ")
    assert ir_to_text(stamped.gm) == ir_to_text(full.gm)


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}])
def test_plans_from_the_stamped_graph_are_the_full_traces(mesh, monkeypatch):
    (x,), (y,) = token_batches(1)[0]
    kw = dict(mesh=mesh, shard="megatron", microbatches=2 if "pp" in mesh else 1)
    stamped = shardfx.partition(tiny("llama", LAYERS), (x,), lm_loss, (y,), **kw)
    monkeypatch.setenv("SHARDFX_BLOCKS", "0")
    full = shardfx.partition(tiny("llama", LAYERS), (x,), lm_loss, (y,), **kw)
    assert stamped.capture_path.startswith("stamped ") and full.capture_path == "full trace"
    assert f"Traced: {stamped.capture_path}" in str(stamped)
    if stamped.program is not None:
        assert stamped.program.module.code == full.program.module.code
    else:
        assert [(n, p.code) for n, p in stamped.stage_program.named_children()] == \
            [(n, p.code) for n, p in full.stage_program.named_children()]


def test_a_stamped_plan_trains_as_eager():
    compare_training(tiny("llama", LAYERS), token_batches(2), lm_loss)


# --- when the blocks are not interchangeable -------------------------------------------------


class Block(nn.Module):
    def __init__(self, scale: float = 1.0, tag: int = 0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale, self.tag = scale, tag  # forward reads scale, never tag

    def forward(self, x):
        return x + self.scale * torch.tanh(self.lin(x))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], embed: bool = True, skip: bool = False,
                 split_at: int | None = None):
        super().__init__()
        self.embed = nn.Linear(8, 8) if embed else nn.Identity()  # the blocks' input needs grad
        self.layers = nn.ModuleList(blocks)
        self.skip, self.split_at = skip, split_at

    def forward(self, x):
        outs = [self.embed(x)]
        for i, layer in enumerate(self.layers):
            h = shardfx.pipe_split(outs[-1]) if i == self.split_at else outs[-1]
            outs.append(layer(h))
        return outs[-1] + outs[-2] if self.skip else outs[-1]  # skip: reads the last two blocks


def paths(model) -> tuple[str, bool]:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    stamped, full = both(model, (x,), F.mse_loss, (x,))
    return stamped.path, ir_to_text(stamped.gm) == ir_to_text(full.gm)


def test_a_first_block_unlike_the_others_is_traced_as_it_is():
    """Block 0 reads the input, which needs no gradient: its backward has fewer ops than the
    others'. Blocks 1 and 2 are the pair then."""
    path, same = paths(Stack([Block() for _ in range(5)], embed=False))
    assert path == "stamped layers: 3 of 5 blocks traced, 2 stamped" and same


def test_an_attribute_forward_never_reads_may_differ():
    path, same = paths(Stack([Block(tag=i) for i in range(4)]))
    assert path == "stamped layers: 2 of 4 blocks traced, 2 stamped" and same


def test_an_attribute_forward_reads_that_differs_is_traced_in_full():
    path, same = paths(Stack([Block(), Block(), Block(), Block(scale=2.0)]))
    assert path == "full trace (layers.3.scale is 2.0, layers.1's is 1.0)" and same


def test_glue_reading_a_block_before_the_last_is_traced_in_full():
    path, same = paths(Stack([Block() for _ in range(4)], skip=True))
    assert path.startswith("full trace (") and "depends on how many blocks" in path and same


def test_code_between_untraced_blocks_is_traced_in_full():
    """A pipeline marker before block 3: the model cut after two blocks never reaches it, the
    run on fake tensors does."""
    path, same = paths(Stack([Block() for _ in range(5)], split_at=3))
    assert path == "full trace (shardfx.pipe_split.default runs between layers[2] and [3]: " \
                   "code around the blocks does something between some of them)" and same


class Pool(nn.Module):
    """Halves the rows it gets, with the same parameters whatever it gets."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)[::2]  # the same slice arguments whatever the rows


def test_blocks_that_change_the_shape_are_traced_in_full():
    """Each block maps rows n to n/2: in inference the same ops with the same arguments, but
    block 2 gets other shapes than block 1, so block 1 is no template for it."""
    torch.manual_seed(0)
    stamped, full = both(Stack([Pool() for _ in range(4)]), (torch.randn(32, 8),))
    assert stamped.path.startswith("full trace (") and "is (" in stamped.path, stamped.path
    assert ir_to_text(stamped.gm) == ir_to_text(full.gm)


def test_a_list_that_is_not_a_repeat_is_traced_in_full(caplog):
    model = Stack([Block(), Block(), nn.Sequential(nn.Linear(8, 8)), Block()])
    with caplog.at_level("INFO", logger="shardfx.capture"):
        path, same = paths(model)
    assert path == "full trace" and same
    assert "[2] is a Sequential, [3] a Block" in caplog.text


def test_one_block_listed_four_times_is_refused():
    path, same = paths(Stack([Block()] * 4))
    assert path == "full trace (layers: [1] shares a parameter or buffer with an earlier " \
                   "block)" and same


def test_hooks_keep_blocks_from_being_stamped():
    model = Stack([Block() for _ in range(4)])
    model.layers[2].register_forward_hook(lambda m, i, o: o * 2)
    path, same = paths(model)
    assert path == "full trace (layers: [2] has hooks)" and same


class Counted(Stack):
    def forward(self, x):
        if len(self.layers) != 4:  # a model that insists on all its blocks
            raise ValueError("expected 4 layers")
        return super().forward(x)


def test_a_model_that_cannot_be_cut_is_traced_in_full():
    path, same = paths(Counted([Block() for _ in range(4)]))
    assert path.startswith("full trace (the model cut after 2 blocks of layers could not be "
                           "traced: Counted could not be traced: ValueError: expected 4 layers")
    assert same


@pytest.mark.parametrize("seed", range(12))
def test_random_repeated_blocks_stamp_to_the_full_trace(seed):
    """Five copies of one random residual block (random ops, own weights), stamped from a pair
    (blocks 1 and 2 when block 0's backward is shorter: its input needs no gradient) to the
    graph the full trace gives."""
    pick = RandomPicker(seed)
    seq, dim = pick.choice(SEQS), pick.choice(DIMS)
    block = (("res", random_body(pick, (seq, dim))),)
    spec = ModelSpec(seq, dim, seed, (block,) * 5)
    (args, targets), = batches(spec, 1)
    stamped, full = both(build(spec), args, F.mse_loss, targets)
    assert stamped.path.startswith("stamped layers: "), (spec, stamped.path)
    assert ir_to_text(stamped.gm) == ir_to_text(full.gm), spec
    assert pairing(stamped.gm) == pairing(full.gm), spec
