"""Accumulating variants (``codegen.accumulate_into``): from a pipeline's second microbatch on
(and a one-device runner's second batch of an accumulated step), a matmul's and an embedding's
weight gradient are added into their accumulators where they are made, instead of made anew
and added by the runner; both train as eager does, padding rows included."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import shardfx
from shardfx.codegen.accumulate_into import accumulating
from shardfx.ir import meta as M
from shardfx.codegen.steps import Output
from shardfx.testing import compare_training

aten = torch.ops.aten
VOCAB, HIDDEN = 16, 8


def gradients(g, x, rows, ids):
    """Gradient outputs of every kind the variant tells apart (indices in comments)."""
    w = torch.mm(g.t(), x)
    return (w.t().t(),  # 0: a matmul through transposes: summed
            torch.mm(x.t(), g).t(),  # 1: a transposed matmul: summed (into acc.t())
            aten.embedding_dense_backward(rows, ids, VOCAB, 0, False),  # 2: summed, padding 0
            aten.embedding_dense_backward(rows, ids, VOCAB, -1, True),  # 3: scaled by counts
            torch.mm(g.t(), x) * 2,  # 4: not a matmul's own output
            w.sum(0))  # 5: a matmul another op reads: the first output's, now read twice


def _part():
    g, x = torch.randn(6, 4), torch.randn(6, 5)
    rows, ids = torch.randn(2, 3, HIDDEN), torch.tensor([[0, 3, 3], [5, 0, 15]])
    part = make_fx(gradients, tracing_mode="fake")(g, x, rows, ids)
    for node in part.graph.nodes:  # the runtime's parts carry their fake values as M.VAL
        if "val" in node.meta:
            node.meta[M.VAL] = node.meta["val"]
    grads = [Output(i, (M.OutputRole(M.OutputKind.GRAD, f"w{i}"),), False, []) for i in range(6)]
    return part, grads, (g, x, rows, ids)


def test_matmuls_and_embeddings_are_summed_in_place():
    part, outputs, inputs = _part()
    variant = accumulating(part, outputs)
    assert variant.indices == (1, 2)  # output 0 shares its matmul with output 5
    targets = [str(n.target) for n in variant.module.graph.nodes]
    assert "aten.index_add_.default" in targets and "aten.embedding_dense_backward.default" in \
        targets  # the scaled one stays
    expected = part(*inputs)
    acc = torch.randn(VOCAB, HIDDEN)
    before = acc.clone()
    got = variant.module(*inputs, torch.randn(5, 4).t(), acc)
    assert got[2] is acc or got[2].data_ptr() == acc.data_ptr()
    torch.testing.assert_close(acc, before + expected[2])
    assert acc[0].equal(before[0])  # the padding row: nothing added
    for i in (0, 3, 4, 5):
        torch.testing.assert_close(got[i], expected[i])


def test_a_transposed_matmul_is_summed_into_the_transpose_of_its_accumulator():
    part, outputs, inputs = _part()
    variant = accumulating(part, [o for o in outputs if o.index in (1, 4)])
    assert variant.indices == (1,)
    acc = torch.randn(4, 5).t().contiguous().t()  # the layout the first microbatch returned
    before = acc.clone()
    variant.module(*inputs, acc)
    torch.testing.assert_close(acc, before + part(*inputs)[1])


def test_gradients_read_elsewhere_are_not_summed():
    part, outputs, _ = _part()
    sent = [Output(o.index, o.roles, o.index == 2, [1] if o.index == 1 else []) for o in outputs]
    assert accumulating(part, sent) is None  # 1 is sent, 2 read by a later part here


class PaddedLM(torch.nn.Module):
    """Embedding with a padding row | Linear, ReLU, Linear over the vocabulary."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        self.a, self.b = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = shardfx.pipe_split(torch.relu(self.a(self.embed(ids))))
        return self.b(h)


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tokens(n: int):
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (8, 5), generator=g)
        ids[:, 0] = 0  # every microbatch reads the padding row
        out.append(((ids,), (torch.randint(0, VOCAB, (8, 5), generator=g),)))
    return out


def _trained() -> tuple[list[float], int]:
    from shardfx.runtime import pipeline

    ran = []
    original = pipeline.PipelineRunner._summing

    def summing(self, program, call):
        module, summed = original(self, program, call)
        ran.append(len(summed))
        return module, summed

    pipeline.PipelineRunner._summing = summing
    try:
        errors = [compare_training(PaddedLM(), _tokens(3), _lm_loss, mesh={"pp": 2},
                                   microbatches=4, schedule=s).max()
                  for s in ("1f1b", "zero-bubble", "gpipe")]
    finally:
        pipeline.PipelineRunner._summing = original
    return errors, max(ran)


def test_pipelines_with_summed_gradients_train_as_eager_does():
    (errors, first), (_, last) = shardfx.launch(_trained, nprocs=2, timeout=120, deadline=600)
    assert (first, last) == (2, 1)  # stage 0 sums the embedding's and a's, stage 1 b's
    assert max(errors) < 1e-5, errors


def test_gradient_accumulation_on_one_device_sums_in_place(monkeypatch):
    from shardfx.runtime.runner import Runner

    summed = []
    original = Runner._accumulators

    def accumulators(self, trained):
        into = original(self, trained)
        summed.append(sorted(into))
        return into

    monkeypatch.setattr(Runner, "_accumulators", accumulators)
    report = compare_training(PaddedLM(), _tokens(6), _lm_loss, accumulate=3)
    assert report.max() < 1e-5
    assert summed == [["a.weight", "b.weight", "embed.weight"]] * 4, summed  # 2 steps x 2
