"""The nanoGPT example (examples/nanogpt.py) through shardfx: three AdamW steps and inference
match eager PyTorch, and the tied token-embedding / LM-head weight is one input of the plan."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import shardfx
from shardfx.ir import meta as M
from shardfx.testing import compare_inference, compare_training

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanogpt.py"


@pytest.fixture(scope="module")
def nanogpt():
    """examples/ is not a package: load the example file as a module."""
    spec = importlib.util.spec_from_file_location("nanogpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _tiny(nanogpt, batches: int = 1):
    """A 2-layer GPT and ``batches`` (args, targets) pairs of shape (B=2, T=8)."""
    cfg = nanogpt.GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    model = nanogpt.GPT(cfg)
    text = nanogpt.make_text(cfg, length=256)
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(batches):
        idx, targets = nanogpt.get_batch(text, 2, 8, gen)  # (2, 8), (2, 8)
        data.append(((idx,), (targets,)))
    return model, data


def test_training_matches_eager(nanogpt):
    model, batches = _tiny(nanogpt, batches=3)
    report = compare_training(
        model, batches, nanogpt.loss_fn,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), rtol=1e-5)
    assert len(report.loss) == 3, report


def test_inference_matches_eager(nanogpt):
    model, [(args, _)] = _tiny(nanogpt)
    assert compare_inference(model, args) < 1e-5


def test_tied_weight_is_one_input(nanogpt):
    model, [(args, targets)] = _tiny(nanogpt)
    assert model.lm_head.weight is model.transformer.wte.weight
    plan = shardfx.partition(model, args, nanogpt.loss_fn, targets)
    roles = [n.meta[M.ROLE] for n in plan.ir.graph.find_nodes(op="placeholder")]
    params = [r for r in roles if r.kind is M.InputKind.PARAM]
    names = [r.name for r in params]

    # One placeholder for the shared (V, C) tensor, under its first name, the other as an alias.
    tied = [r for r in params if r.aliases]
    assert [(r.name, r.aliases) for r in tied] == [("transformer.wte.weight", ("lm_head.weight",))]
    assert "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(list(model.parameters()))

    # Its gradient is one output: the sum of the embedding's and the LM head's contributions.
    grads = [r.name for r in plan.ir.graph.output_node().meta[M.OUTPUTS]
             if r.kind is M.OutputKind.GRAD]
    assert grads.count("transformer.wte.weight") == 1 and "lm_head.weight" not in grads


def test_workload_factory(nanogpt):
    w = nanogpt.workload(n_layer=1)
    (idx,), (targets,) = w["args"], w["targets"]
    assert idx.shape == targets.shape == (8, w["model"].cfg.block_size)
    assert len(w["model"].transformer.h) == 1
    logits = w["model"](idx)  # (B, T, V)
    assert logits.shape == (*idx.shape, w["model"].cfg.vocab_size)
    assert torch.isfinite(w["loss_fn"](logits, targets))
