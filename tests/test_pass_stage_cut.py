"""stage_cut alone, on IR text: a pipeline STAGE (``@0``, ``@1``) on every op and on every
input an op reads.

The forward is cut into ``pp`` stages of about equal estimated time (``estimate_cost`` runs
first: the cut is priced by each op's COST), at places where few bytes cross, or right after
``shardfx.pipe_split`` markers; a backward op runs in the stage of the forward op it
differentiates, or earlier where it reads a gradient made in an earlier stage; an input gets
the first stage that reads it. The tests compare the printed stages.

The text form does not carry torch's ``seq_nr``, by which the joint trace pairs a backward op
with its forward op (nor ``nn_module_stack``, by which cuts fall between numbered blocks): the
tests that need the pairing set ``seq_nr`` on the parsed graph (``paired``).
"""

from __future__ import annotations

import re
import textwrap

import pytest

from shardfx.errors import PipelineError
from shardfx.ir.parse import text_to_ir
from shardfx.ir.text import ir_to_text
from shardfx.mesh import MeshSpec
from shardfx.passes.estimate_cost import estimate_cost
from shardfx.passes.stage_cut import stage_cut
from shardfx.request.options import Options


def unstaged(text: str) -> str:
    """``text`` without its stages: what the pass starts from."""
    return re.sub(r" @\d+", "", re.sub(r"  # @\d+$", "", text, flags=re.M))


def paired(gm, seq_nr: dict[str, int]):
    """``gm`` with torch's ``seq_nr`` on the ops named (what capture records and text lacks)."""
    for node in gm.graph.nodes:
        if node.name in seq_nr:
            node.meta["seq_nr"] = seq_nr[node.name]
    return gm


def cut(gm, pp: int):
    options = Options(mesh=MeshSpec.parse(f"pp={pp}"))
    return ir_to_text(stage_cut(estimate_cost(gm, options), options), people=False)


def stages(text: str) -> dict[str, int]:
    """Each line's name -> its printed stage (inputs no op reads have none)."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^  (\w+): .*# .*@(\d+)", text, flags=re.M)}


# A two-layer MLP with a sum loss, forward and backward as a joint trace writes them.
JOINT = textwrap.dedent("""\
    graph train MLP
      w1: f32[8, 8] = param w1  # @0
      w2: f32[8, 8] = param w2  # @1
      args_0: f32[4, 8] = input args[0]  # @0
      tangent_loss: f32[] = tangent loss  # @1
      mm: f32[4, 8] = aten.mm.default(args_0, w1)  # fwd @0
      relu: f32[4, 8] = aten.relu.default(mm)  # fwd @0
      mm_1: f32[4, 8] = aten.mm.default(relu, w2)  # fwd @1
      sum_1: f32[] = aten.sum.default(mm_1)  # fwd @1
      expand: f32[4, 8] = aten.expand.default(tangent_loss, [4, 8])  # bwd @1
      t: f32[8, 8] = aten.t.default(w2)  # bwd @1
      mm_2: f32[4, 8] = aten.mm.default(expand, t)  # bwd @1
      t_1: f32[8, 4] = aten.t.default(relu)  # bwd @1
      mm_3: f32[8, 8] = aten.mm.default(t_1, expand)  # bwd @1
      threshold_backward: f32[4, 8] = aten.threshold_backward.default(mm_2, relu, 0)  # bwd @0
      t_2: f32[8, 4] = aten.t.default(args_0)  # bwd @0
      mm_4: f32[8, 8] = aten.mm.default(t_2, threshold_backward)  # bwd @0
      output loss loss = sum_1
      output grad w1 = mm_4
      output grad w2 = mm_3
    """)
# torch's pairing: each backward op has the seq_nr of the forward op it differentiates
SEQ_NR = {"mm": 1, "relu": 2, "mm_1": 3, "sum_1": 4, "expand": 4, "t": 3, "mm_2": 3, "t_1": 3,
          "mm_3": 3, "threshold_backward": 2, "t_2": 1, "mm_4": 1}


def test_each_backward_op_runs_in_its_forward_ops_stage():
    """One layer a stage; w1's gradient is made in stage 0, which holds w1."""
    assert cut(paired(text_to_ir(unstaged(JOINT)), SEQ_NR), pp=2) == JOINT


def test_an_unpaired_backward_op_goes_where_what_it_reads_is_made_or_read():
    """Without a seq_nr, ``mm_4`` reads the gradient ``threshold_backward`` made in stage 0, so
    runs there: in the backward values flow from later stages to earlier ones only. ``t_2``
    reads an input alone (w1's transpose): it runs where its reader ``mm_4`` runs, beside the
    weight, not in the last stage with its result sent back."""
    seq_nr = {k: v for k, v in SEQ_NR.items() if k not in ("t_2", "mm_4")}
    got = stages(cut(paired(text_to_ir(unstaged(JOINT)), seq_nr), pp=2))
    assert (got["threshold_backward"], got["t_2"], got["mm_4"]) == (0, 0, 0)
    assert got["args_0"] == 0  # read by stage 0's mm: the first stage reading it


def chain(first: int) -> str:
    """Four linears with ReLUs, each activation (64, 8): the first's input has ``first``
    features, the others 8; the loss their sum. Forward only: the cut is the forward's."""
    lines = ["graph train Chain", f"  args_0: f32[64, {first}] = input args[0]",
             f"  w0: f32[{first}, 8] = param w0", "  tangent_loss: f32[] = tangent loss"]
    lines += [f"  w{i}: f32[8, 8] = param w{i}" for i in (1, 2, 3)]
    prev = "args_0"
    for i in range(4):
        lines += [f"  mm_{i}: f32[64, 8] = aten.mm.default({prev}, w{i})  # fwd",
                  f"  relu_{i}: f32[64, 8] = aten.relu.default(mm_{i})  # fwd"]
        prev = f"relu_{i}"
    lines += [f"  sum_1: f32[] = aten.sum.default({prev})  # fwd", "  output loss loss = sum_1"]
    return "\n".join(lines) + "\n"


FORWARD = ["mm_0", "relu_0", "mm_1", "relu_1", "mm_2", "relu_2", "mm_3", "relu_3", "sum_1"]


@pytest.mark.parametrize("first,pp,expected", [
    (8, 2, [0, 0, 0, 0, 1, 1, 1, 1, 1]),  # equal layers: two each
    (8, 4, [0, 0, 1, 1, 2, 2, 3, 3, 3]),
    (8, 3, [0, 0, 0, 1, 1, 1, 2, 2, 2]),
    (64, 2, [0, 0, 1, 1, 1, 1, 1, 1, 1]),  # the first layer 8x the others' FLOPs
    (512, 2, [0, 1, 1, 1, 1, 1, 1, 1, 1]),  # the first matmul alone outweighs the rest
])
def test_the_forward_is_cut_into_stages_of_balanced_cost(first, pp, expected):
    got = stages(cut(text_to_ir(chain(first)), pp))
    assert [got[name] for name in FORWARD] == expected
    assert got["w0"] == 0 and got["w3"] == pp - 1  # each weight in the stage reading it
    assert "tangent_loss" not in got  # no op reads it: no stage


def test_pipe_split_markers_decide_the_cut():
    """A marker after the first layer cuts there, not where costs balance (after the
    second)."""
    text = chain(8).replace("aten.mm.default(relu_0, w1)", "aten.mm.default(pipe_split, w1)")
    text = text.replace("  mm_1:", "  pipe_split: f32[64, 8] = shardfx.pipe_split.default("
                                   "relu_0)  # fwd\n  mm_1:")
    got = stages(cut(text_to_ir(text), pp=2))
    assert [got[n] for n in ("relu_0", "pipe_split", "mm_1", "sum_1")] == [0, 0, 1, 1]
    with pytest.raises(PipelineError, match="1 pipe_split markers but the plan needs 2 cuts"):
        cut(text_to_ir(text), pp=3)


def test_more_stages_than_places_to_cut_is_refused():
    with pytest.raises(PipelineError, match="cannot cut the model into 5 stages") as info:
        cut(text_to_ir(unstaged(JOINT)), pp=5)
    assert "at most 4 pipeline stages" in info.value.fix
