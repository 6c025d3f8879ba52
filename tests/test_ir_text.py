"""The IR's text form: ``text_to_ir`` reads back what ``ir_to_text`` prints, and tests can be
written in it.

Captured graphs (a tiny MLP, a one-layer GPT-2) go text -> IR -> text unchanged, with the same
nodes and roles, and the parsed graph computes the same numbers as the captured one and as eager
PyTorch. Hand-written text parses and runs; bad lines fail naming their line number.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from torch.distributed.tensor import Replicate, Shard

from shardfx.errors import ParseError, VerifyError
from shardfx.ir import meta as M
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify
from shardfx.partitioner.capture import capture
from shardfx.passes.assign_phase import assign_phase
from shardfx.request.options import Options


def _mlp():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return model, (torch.randn(2, 4),), F.mse_loss, (torch.randn(2, 4),)


def _gpt2():
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = GPT2LMHeadModel(config)

    def loss_fn(out, targets):
        return F.cross_entropy(out.logits.reshape(-1, 32), targets.reshape(-1))

    return model, (torch.randint(0, 32, (2, 8)),), loss_fn, (torch.randint(0, 32, (2, 8)),)


@pytest.fixture(scope="module", params=[_mlp, _gpt2], ids=["mlp", "gpt2"])
def captured(request):
    torch.manual_seed(0)
    model, args, loss_fn, targets = request.param()
    return model, args, loss_fn, targets, capture(model, args, loss_fn, targets).gm


def _structure(gm: fx.GraphModule) -> list[tuple]:
    """Each node's name, op, target, operands (by name) and our meta."""
    names = lambda a: fx.map_arg(a, lambda n: n.name)  # noqa: E731
    return [(n.name, n.op, n.target if n.op == "call_function" else None, names(n.args),
             names(n.kwargs), *(n.meta.get(k) for k in (M.ROLE, M.OUTPUTS, M.PHASE)))
            for n in gm.graph.nodes]


def _inputs(gm: fx.GraphModule, model: torch.nn.Module, args: tuple, targets: tuple) -> list:
    """Real tensors for the graph's placeholders, found from their roles."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    leaves = [*args, *targets]
    feed = {M.InputKind.TANGENT: lambda r: torch.ones(()),
            M.InputKind.INPUT: lambda r: leaves[r.index],
            M.InputKind.TARGET: lambda r: leaves[r.index],
            M.InputKind.PARAM: lambda r: state[r.name].detach(),
            M.InputKind.BUFFER: lambda r: state[r.name]}
    roles = [n.meta[M.ROLE] for n in gm.graph.find_nodes(op="placeholder")]
    return [feed[r.kind](r) for r in roles]


def test_captured_graph_round_trips(captured):
    *_, gm = captured
    text = ir_to_text(gm, people=False)
    parsed = text_to_ir(ir_to_text(gm))  # the cost and origin after | are for people only
    verify(parsed)
    assert ir_to_text(parsed) == text
    assert _structure(parsed) == _structure(gm)
    assert parsed.meta[M.GRAPH] == gm.meta[M.GRAPH]

    # A pass runs on the parsed graph, and its annotations (here PHASE) round trip too.
    phased = assign_phase(parsed, Options())
    text = ir_to_text(phased, people=False)
    assert "  # fwd" in text and "  # bwd" in text
    again = text_to_ir(text)
    assert ir_to_text(again) == text
    assert _structure(again) == _structure(phased)


def test_parsed_graph_computes_what_captured_and_eager_do(captured):
    model, args, loss_fn, targets, gm = captured
    parsed = text_to_ir(ir_to_text(gm))
    inputs = _inputs(gm, model, args, targets)
    got, want = parsed(*inputs), gm(*inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    params = dict(model.named_parameters())
    loss = loss_fn(model(*args), *targets)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    eager = {"loss": loss, **grads}
    for role, value in zip(parsed.graph.output_node().meta[M.OUTPUTS], got):
        torch.testing.assert_close(value, eager[role.name].reshape(value.shape))


TINY = """\
graph train Tiny
  w: f32[4, 3] = param w
  x: f32[2, 4] = input args[0]
  y: f32[2, 3] = target targets[0]
  tangent_loss: f32[] = tangent loss
  mm: f32[2, 3] = aten.mm.default(x, w)  # fwd
  sub: f32[2, 3] = aten.sub.Tensor(mm, y)  # fwd
  pow_1: f32[2, 3] = aten.pow.Tensor_Scalar(sub, 2)  # fwd
  loss: f32[] = aten.sum.default(pow_1)  # fwd
  mul: f32[2, 3] = aten.mul.Tensor(sub, 2.0)  # bwd
  grad_mm: f32[2, 3] = aten.mul.Tensor(mul, tangent_loss)  # bwd
  t: f32[4, 2] = aten.t.default(x)  # bwd
  grad_w: f32[4, 3] = aten.mm.default(t, grad_mm)  # bwd
  output loss loss = loss
  output grad w = grad_w
"""


def test_hand_written_training_graph():
    gm = text_to_ir(TINY)
    assert ir_to_text(gm) == TINY
    roles = [n.meta[M.ROLE] for n in gm.graph.find_nodes(op="placeholder")]
    assert roles == [M.InputRole(M.InputKind.PARAM, "w"),
                     M.InputRole(M.InputKind.INPUT, "args[0]", index=0),
                     M.InputRole(M.InputKind.TARGET, "targets[0]", index=1),
                     M.InputRole(M.InputKind.TANGENT, "loss")]
    phases = {n.name: n.meta[M.PHASE] for n in gm.graph.nodes if n.op == "call_function"}
    assert phases["loss"] is M.Phase.FORWARD and phases["grad_w"] is M.Phase.BACKWARD

    w = torch.randn(4, 3, requires_grad=True)
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    loss, grad_w = gm(w.detach(), x, y, torch.ones(()))
    want = ((x @ w - y) ** 2).sum()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad_w, torch.autograd.grad(want, w)[0])


LITERALS = """\
graph infer Literals
  x: f32[2, 4] = input args[0]
  c: f32[2, 4] = aten.clone.default(x, memory_format=torch.contiguous_format)
  amax: f32[2, 1] = aten.amax.default(c, [-1], True)
  full: f32[2, 1] = aten.full.default([2, 1], float('-inf'), dtype=torch.float32, \
layout=torch.strided, device=torch.device('cpu'), pin_memory=False)
  maximum: f32[2, 1] = aten.maximum.default(amax, full)
  split: (f32[2, 2], f32[2, 2]) = aten.split.Tensor(c, 2, 1)
  getitem: f32[2, 2] = operator.getitem(split, 1)
  _to_copy: i64[2, 2] = aten._to_copy.default(getitem, dtype=torch.int64)
  output output out[0] = maximum
  output output out[1] = _to_copy
"""


def test_hand_written_literals_and_multi_output_ops():
    gm = text_to_ir(LITERALS)
    assert ir_to_text(gm) == LITERALS
    assert [r.index for r in gm.graph.output_node().meta[M.OUTPUTS]] == [0, 1]
    x = torch.randn(2, 4) * 10
    top, tail = gm(x)
    assert torch.equal(top, x.amax(-1, keepdim=True))
    assert torch.equal(tail, x[:, 2:].long())


def test_marked_dump_parses():
    gm = text_to_ir(TINY)
    marked = ir_to_text(gm, mark=next(n for n in gm.graph.nodes if n.name == "sub"))
    assert ">> sub:" in marked
    assert ir_to_text(text_to_ir(marked)) == TINY


@pytest.mark.parametrize("bad, error, says", [
    ("sub: f32[3, 2] = aten.sub.Tensor(mm, y)  # fwd", VerifyError,
     "sub is declared f32[3, 2] but aten.sub.Tensor gives f32[2, 3]"),
    ("sub: f32[2, 3] = aten.mm.default(mm, y)  # fwd", VerifyError, "sub: aten.mm.default fails"),
    ("sub: f32[2, 3] = aten.nope.default(mm, y)  # fwd", ParseError,
     "unknown op 'aten.nope.default'"),
    ("sub: f32[2, 3] = aten.sub.Tensor(mm, z)  # fwd", ParseError, "unknown name 'z'"),
    ("sub: f32[2, 3] = aten.sub.Tensor(mm, y, alpha=x.T)  # fwd", ParseError,
     "cannot read operand 'x.T'"),
    ("sub: f32[2, 3] = aten.sub.Tensor(mm, y  # fwd", ParseError, "cannot parse"),
    ("sub: f32[2, 3] = aten.sub.Tensor(mm, y)  # fwd stage0", ParseError, "without a mesh"),
    ("sub: f32[2, 3] = constant _tensor_constant0", ParseError, "constants cannot be rebuilt"),
    ("sub = aten.sub.Tensor(mm, y)", ParseError, "expected 'NAME: TYPE = ...'"),
])
def test_bad_line_fails_naming_it(bad, error, says):
    lines = TINY.splitlines()
    lineno = next(i for i, line in enumerate(lines, 1) if line.startswith("  sub:"))
    lines[lineno - 1] = "  " + bad
    with pytest.raises(error) as e:
        text_to_ir("\n".join(lines))
    message = str(e.value)
    assert f"line {lineno}: " in message and says in message
    assert f">> {lineno:4d} |   {bad}" in message  # the bad line, shown in context


def test_sharded_ir_round_trips_and_placements_are_checked():
    """A graph planned for a mesh prints its placements; reading it back re-derives them by
    propagation and rejects a line that declares other ones."""
    import shardfx

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    plan = shardfx.partition(model, (x,), torch.nn.functional.mse_loss, (y,),
                             mesh={"dp": 2, "tp": 2}, shard={"0.weight": [Replicate(), Shard(0)]})
    text = ir_to_text(plan.ir, people=False)
    assert text.splitlines()[0] == "graph train Sequential mesh dp=2,tp=2"
    assert "  args_0: f32[4, 4] = input args[0]  # S(0)R" in text
    assert ir_to_text(text_to_ir(text)) == text
    relu = next(line for line in text.splitlines() if " = aten.relu.default(" in line)
    wrong = relu.rsplit(" ", 1)[0] + " RR"
    with pytest.raises(VerifyError, match="propagation gives"):
        text_to_ir(text.replace(relu, wrong))


def test_dump_says_where_each_op_comes_from_and_what_each_pass_did(tmp_path):
    """A person reads a dump: each op names its module and source line (a backward op, the
    module whose forward it differentiates; a stamped layer, its own index), and each per-pass
    file begins with what that pass changed, so two files whose ops read alike still differ."""
    import shardfx
    from models import SEQ, VOCAB, lm_loss, tiny

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    plan = shardfx.partition(tiny("llama", layers=4), (ids,), lm_loss, (ids,), mesh="tp=2",
                             shard="megatron")
    assert "stamped" in plan.capture_path  # layers 1..3 are copies of a traced block
    out = plan.dump(tmp_path)
    text = (out / "06-shard_propagate.txt").read_text()
    for layer in range(4):
        down = [line for line in text.splitlines() if " = aten.mm.default(" in line
                and line.endswith(f"| model.layers.{layer}.mlp.down_proj modeling_llama.py:164")]
        phases = sorted(d.split("  # ")[1].split()[0] for d in down)
        assert phases == ["bwd", "bwd", "fwd"], down  # the matmul, its input and weight grads
    assert "| (loss)" in text  # the loss function's own ops (its cross-entropy)

    headers = {f.name: [line for line in f.read_text().splitlines() if line.startswith("#")]
               for f in sorted(out.glob("0*.txt"))}
    assert headers["00-capture.txt"] == []
    ops = sum(1 for n in plan.ir.graph.nodes if n.op == "call_function")
    assert headers["02-assign_phase.txt"][1] == f"#   wrote phase on {ops} nodes"
    cost = headers["04-estimate_cost.txt"]
    assert cost[0] == "# after estimate_cost: 0 nodes added, 0 removed"
    assert cost[1].startswith("#   wrote cost on ") and ": fwd " in cost[1] and "FLOP" in cost[1]
    assert headers["01-rng_stream.txt"][1] == "#   the IR is unchanged"  # nothing random in it
    assert "without a rule run replicated" in headers["06-shard_propagate.txt"][1]
    # the IR under the header parses back: the header and the text after | are for people
    assert len(text_to_ir(text).graph.nodes) == len(plan.ir.graph.nodes)
