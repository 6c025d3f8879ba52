"""auto_shard alone (the solver's pass), on IR text: under ``shard="auto"`` it rewrites the
parameters' and inputs' ANNOTATION to the placements it chose, writes CHOICE (the operand
placements ``shard_propagate`` will ask each op's rule with) on every op, and leaves its
report in ``gm.meta[AUTO]``.

Which plan is cheapest on a tiny MLP is the device model's call and not asserted; the tests
check what holds for any choice: every input printed with one placement per mesh axis that the
report agrees with, a CHOICE for every operand of every op, a plan priced no worse than the
named ones, a parameter the user placed kept, and no solver on a mesh with no axis to decide.
"""

from __future__ import annotations

import re
import textwrap

from torch.distributed.tensor import Shard

from shardfx.auto.shard import AUTO, AutoReport, auto_shard
from shardfx.ir import meta as M
from shardfx.ir.graph import op_nodes, operands
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.request.options import Options

# A two-linear MLP without biases and its backward, as shard_annotate leaves it under "auto":
# every input replicated until the solver decides.
MLP = textwrap.dedent("""\
    graph train MLP mesh {mesh}
      fc1_weight: f32[8, 4] = param fc1.weight  # {r}
      fc2_weight: f32[4, 8] = param fc2.weight  # {r}
      args_0: f32[4, 4] = input args[0]  # {x}
      tangent_loss: f32[] = tangent loss  # {r}
      t: f32[4, 8] = aten.t.default(fc1_weight)  # fwd
      mm: f32[4, 8] = aten.mm.default(args_0, t)  # fwd
      relu: f32[4, 8] = aten.relu.default(mm)  # fwd
      t_1: f32[8, 4] = aten.t.default(fc2_weight)  # fwd
      mm_1: f32[4, 4] = aten.mm.default(relu, t_1)  # fwd
      sum_1: f32[] = aten.sum.default(mm_1)  # fwd
      expand: f32[4, 4] = aten.expand.default(tangent_loss, [4, 4])  # bwd
      mm_2: f32[4, 8] = aten.mm.default(expand, fc2_weight)  # bwd
      t_2: f32[4, 4] = aten.t.default(expand)  # bwd
      mm_3: f32[4, 8] = aten.mm.default(t_2, relu)  # bwd
      threshold_backward: f32[4, 8] = aten.threshold_backward.default(mm_2, relu, 0)  # bwd
      t_3: f32[8, 4] = aten.t.default(threshold_backward)  # bwd
      mm_4: f32[8, 4] = aten.mm.default(t_3, args_0)  # bwd
      output loss loss = sum_1
      output grad fc1.weight = mm_4
      output grad fc2.weight = mm_3
    """)
TP = MLP.format(mesh="tp=2", r="R", x="R")
INPUTS = ("fc1_weight", "fc2_weight", "args_0", "tangent_loss")


def solve(text: str, shard, mesh: str = "tp=2"):
    options = Options(mesh=MeshSpec.parse(mesh), shard=shard)
    return auto_shard(estimate_cost(text_to_ir(text), options), options)


def printed(text: str) -> dict[str, str]:
    """Each input line's name -> its printed placements."""
    return {m[1]: m[2] for m in re.finditer(r"^  (\w+): .* = \w+ .*# (\S+)$", text, flags=re.M)
            if m[1] in INPUTS}


def test_every_input_is_placed_and_every_op_given_a_choice():
    gm = solve(TP, "auto")
    text = ir_to_text(gm, people=False)
    placed = printed(text)
    assert set(placed) == set(INPUTS)
    assert all(re.fullmatch(r"R|S\([01]\)", p) for p in placed.values()), placed  # one per axis
    assert text.split("\n", 5)[5] == TP.split("\n", 5)[5]  # ops keep their lines: no SHARDING
    for node in op_nodes(gm.graph):
        choice = node.meta.get(M.CHOICE)
        assert choice is not None and len(choice) == len(operands(node)), node.name
        assert all(len(p) == 1 for p in choice), (node.name, choice)  # tp's placement

    report = gm.meta[AUTO]
    assert isinstance(report, AutoReport)
    assert report.axes == ("tp",) and report.mesh_axes == ("tp",)
    assert {fqn: M.placements_str(p) for fqn, p in report.params.items()} == \
        {"fc1.weight": placed["fc1_weight"], "fc2.weight": placed["fc2_weight"]}
    assert {k: M.placements_str(p) for k, p in report.inputs.items()} == \
        {"args[0]": placed["args_0"]}
    assert set(report.named) == {"replicate", "megatron"}
    # the named plans are among those it chose from: it prices its choice no worse
    assert report.seconds <= min(s for s, _ in report.named.values()) * (1 + 1e-6)
    assert report.gap == 0.0


def test_a_parameter_the_user_placed_keeps_its_placement():
    gm = solve(TP, {"fc1.weight": [Shard(0)], "*": "auto"})
    assert printed(ir_to_text(gm))["fc1_weight"] == "S(0)"
    assert gm.meta[AUTO].params["fc1.weight"] == (Shard(0),)
    (t,) = [n for n in op_nodes(gm.graph) if n.name == "t"]
    assert t.meta[M.CHOICE] == ((Shard(0),),)  # its reader priced with it as placed


def test_no_solver_on_a_mesh_without_an_axis_to_decide():
    """dp splits the batch as named: nothing for the solver, the graph is left as it was."""
    text = MLP.format(mesh="dp=2", r="R", x="S(0)")
    gm = solve(text, "auto", mesh="dp=2")
    assert ir_to_text(gm, people=False) == text
    assert AUTO not in gm.meta
    assert not any(M.CHOICE in n.meta for n in gm.graph.nodes)
