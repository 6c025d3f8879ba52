"""The pipeline runner's gradient accumulators: a part's gradient output that nothing else holds
becomes the accumulator as it is (no copy); any other is copied, and training still matches
eager."""

from __future__ import annotations

import torch

import shardfx
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches


def parts_outputs(x, w):
    """Outputs of every kind ``memory_pipeline.exclusive_outputs`` tells apart (indices in comments)."""
    s = x.sum(0)
    return (torch.mm(x, w),  # 0: made here
            torch.mm(w, x).t(),  # 1: a transpose of a tensor made here, all of it
            x,  # 2: an input
            w.t(),  # 3: a view of an input
            s, s.view(1, -1),  # 4, 5: one storage, returned twice
            torch.mm(x, x)[:1],  # 6: a slice: the rest of its storage stays alive unseen
            x.sum().expand(4),  # 7: one element seen four times
            torch.nn.functional.layer_norm(x, (4,)),  # 8: an element of a multi-output op
            w.add_(1))  # 9: an input, updated in place


def test_exclusive_outputs_of_a_part():
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardfx.estimate.memory_pipeline import exclusive_outputs

    part = make_fx(parts_outputs, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    assert exclusive_outputs(part) == {0, 1, 8}


class SharedGradients(torch.nn.Module):
    """Linear, ReLU | Linear; ``p`` and ``q`` get one tensor as their gradient (the output of
    ``p + q`` passes it to both) and ``c`` an expanded scalar: none is the runner's alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.p, self.q, self.c = (torch.nn.Parameter(torch.randn(8)) for _ in range(3))

    def forward(self, x):
        h = shardfx.pipe_split(torch.relu(self.a(x)))
        return self.b(h + (self.p + self.q)) + self.c.sum()


def rows(n: int, batch: int = 8) -> list[tuple[tuple, tuple]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(batch, 8, generator=g),), (torch.randn(batch, 8, generator=g),))
            for _ in range(n)]


class Recorded:
    """A part that notes the data pointers of what its first call returns."""

    def __init__(self, module, first: list):
        self.module, self.first = module, first

    def __call__(self, *args):
        outs = self.module(*args)
        if not self.first:
            self.first.extend(t.data_ptr() for t in outs)
        return outs


def accumulators(model, batch, loss_fn, **kw) -> dict[str, bool]:
    """One step through a 2-stage pipeline; for each gradient this rank owns, whether its
    ``.grad`` (the accumulator) is the tensor the first microbatch's part returned."""
    from shardfx.ir import meta as M

    (x,), (y,) = batch
    plan = shardfx.partition(model, (x,), loss_fn, (y,), mesh={"pp": 2}, **kw)
    runner = plan.runner(keep_grads=True)
    first: dict[str, list] = {}
    calls = {id(c): c for step in runner._steps for c in step.calls}.values()
    for call in calls:
        call.module = Recorded(call.module, first.setdefault(call.part, []))
    runner.step((x,), (y,))
    params = dict(runner.params)
    out = {}
    for call in calls:
        for o in call.outputs:
            for role in o.roles:
                if role.kind is M.OutputKind.GRAD:
                    out[role.name] = params[role.name].grad.data_ptr() == first[call.part][o.index]
    return out


def kept_and_copied():
    """Every gradient of a tiny Llama is kept without a copy, under 1F1B and zero-bubble (a
    separate W); of ``SharedGradients``, those of ``p``, ``q``, ``c`` are copies, and it trains
    as eager does (one accumulator for ``p`` and ``q`` would count each microbatch twice; an
    ``expand`` cannot be added into)."""
    llama = [accumulators(tiny("llama"), token_batches(1, 4)[0], lm_loss, microbatches=4,
                          schedule=s) for s in ("1f1b", "zero-bubble")]
    shared = accumulators(SharedGradients(), rows(1)[0], torch.nn.functional.mse_loss,
                          microbatches=2)
    errors = [compare_training(SharedGradients(), rows(3), torch.nn.functional.mse_loss,
                               mesh={"pp": 2}, microbatches=m, schedule=s).max()
              for s, m in (("1f1b", 4), ("zero-bubble", 2))]
    return llama, shared, max(errors)


def test_gradients_are_kept_without_a_copy_where_nothing_else_holds_them():
    results = shardfx.launch(kept_and_copied, nprocs=2, timeout=120, deadline=600)
    for llama, _, err in results:
        for kept in llama:
            assert kept and all(kept.values()), kept
        assert err < 1e-5, err
    shared = {**results[0][1], **results[1][1]}
    assert shared == {"a.weight": True, "a.bias": True, "b.weight": True, "b.bias": True,
                      "p": False, "q": False, "c": False}, shared
