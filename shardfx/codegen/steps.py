"""A pipeline plan's split program, compiled for one rank: the steps the runner's loop takes.

``codegen.stages`` splits the program into parts named ``stage{s}_{F|B|W}``; a schedule orders
actions per rank. `StageProgram.steps` turns this rank's action list into `Step` records:
each action's parts with where every input comes from (a weight, a batch slice, a value an
earlier part on this rank left, a value another rank sends) and where every output goes (a
gradient, the loss, a model output, a later part here, other ranks); the receives the rank
posts before the action and waits for, and the values it drops after (their last reader
here). The loop then only looks things up. Built for the training program, and for the
forward-only program a pipeline plan runs inference with.

The messages (every tensor a part sends another rank, keyed by part, output and microbatch)
are posted as ``schedule.p2p`` orders them for an in-order transport: sends after the action
that makes them, in the order of its parts and outputs; receives before the first action on
the receiving rank that reads them, each after the messages its sender sent this rank
earlier. ``StageProgram.steps`` plays every rank's order (``check_p2p``) before any rank
runs, so an order that would hang under NCCL is a ``ScheduleError`` at ``plan.runner()``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from shardfx.codegen.accumulate_into import Accumulating, accumulating, summable
from shardfx.ir import meta as M
from shardfx.schedule import Action, Kind, Schedule
from shardfx.schedule.p2p import check_p2p


@dataclass
class Output:
    index: int  # which output of the part (a part returns a tuple, even of one)
    roles: tuple[M.OutputRole, ...]  # the program outputs it is (a gradient, the loss, ...)
    local: bool  # read by a later part on this rank
    sends: list[int]  # the pipeline ranks it is sent to


@dataclass
class Call:
    part: str
    module: Any
    inputs: list[tuple]  # ("input", placeholder, role) or ("value", part, output index)
    outputs: list[Output]


@dataclass
class Receive:
    key: tuple  # (part, output index, microbatch)
    src: int  # the pipeline rank it comes from
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Step:
    """One action of this rank: its parts, the receives it posts and waits for first (its
    inputs from other ranks, and earlier messages of the same senders: ``schedule.p2p``),
    what it drops after."""

    action: Action
    name: str
    calls: list[Call]
    receives: list[Receive] = field(default_factory=list)
    frees: list[tuple] = field(default_factory=list)


class StageProgram:
    @classmethod
    def of(cls, split: fx.GraphModule, ir: fx.GraphModule, schedule: Schedule) -> "StageProgram":
        """``split``'s parts run by ``schedule``; the IR it was split from gives the outputs'
        roles and the fake values (shapes to receive into)."""
        vals = {n.name: n.meta[M.VAL] for n in ir.graph.nodes if M.VAL in n.meta}
        return cls(split, ir.graph.output_node().meta[M.OUTPUTS], schedule, vals)

    def __init__(self, split: fx.GraphModule, outputs: tuple[M.OutputRole, ...],
                 schedule: Schedule, vals: dict[str, Any]):
        """``split``: the per-stage parts; ``outputs``: the roles of its outputs; ``vals``: fake
        values by node name, for shapes the parts' own graphs do not record. Ranks here are
        places on the pp axis."""
        self.module, self.schedule, self._vals = split, schedule, vals
        self.parts = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
        self._stage = {name: stage_of(name) for name in self.parts}
        self._rank = {name: schedule.rank_of(s) for name, s in self._stage.items()}
        placeholders = split.graph.find_nodes(op="placeholder")
        self.roles = {n.name: n.meta[M.ROLE] for n in placeholders}
        self._input_vals = {n.name: n.meta.get(M.VAL) for n in placeholders}
        self.constants = {n.name: n.meta[M.CONSTANT].value for n in placeholders
                          if M.CONSTANT in n.meta}  # by placeholder name
        self.placements = {n.meta[M.ROLE].name: n.meta.get(M.ANNOTATION, ())
                           for n in placeholders}  # by FQN for weights
        self.finals: dict[tuple, list[M.OutputRole]] = defaultdict(list)  # (part, index) -> roles
        for value, role in zip(split.graph.output_node().args[0], outputs):
            self.finals[source(value)].append(role)
        self._producers: dict[tuple, int] = {}  # (kind, name) -> the first part's rank
        for (part, _), roles in self.finals.items():
            for role in roles:
                self._producers.setdefault((role.kind, role.name), self.rank_of(part))
        self._calls = {name: self._call(name, self.rank_of(name)) for name in self.parts}
        self._first: dict[int, dict[tuple, Action]] = {}
        self._accumulating: dict[str, Accumulating | None] = {}
        self._batches = None  # every rank's messages in posting order, checked (schedule.p2p)
        self._messages: dict[Action, tuple[list, list]] = {}  # ``messages``, once an action

    def rank_of(self, part: str) -> int:
        return self._rank[part]

    def reads(self, rank: int) -> dict[str, M.InputRole]:
        """Placeholder name -> role of every program input a part on ``rank`` reads."""
        return {a.name: self.roles[a.name] for p, call in self.parts.items()
                if self.rank_of(p) == rank for a in call.args if a.op == "placeholder"}

    def readers(self, fqn: str) -> list[int]:
        """The ranks whose parts read the weight ``fqn``."""
        return sorted({self.rank_of(p) for p, c in self.parts.items() for a in c.args
                       if a.op == "placeholder" and self.roles[a.name].name == fqn})

    def input_val(self, placeholder: str):
        return self._input_vals[placeholder]

    def producer(self, kind: M.OutputKind, name: str) -> int | None:
        """The rank whose parts produce the output ``kind name`` (a parameter's gradient)."""
        return self._producers.get((kind, name))

    def parts_of(self, action: Action) -> list[str]:
        parts = [f"stage{action.stage}_{action.kind.value}"]
        if action.kind is Kind.B and not self.schedule.split_backward:
            parts.append(f"stage{action.stage}_W")  # B without W: the whole backward
        return [p for p in parts if p in self.parts]

    def steps(self, rank: int) -> list[Step]:
        """``rank``'s actions, compiled; raises ScheduleError when the messages of the
        schedule, posted in order, would not meet (``schedule.p2p``)."""
        steps = [Step(a, str(a), [self._calls[p] for p in self.parts_of(a)])
                 for a in self.schedule.actions[rank]]
        last = {}
        for i, step in enumerate(steps):
            for call in step.calls:
                for src in call.inputs:
                    if src[0] == "value":
                        last[(*src[1:], step.action.microbatch)] = i
        for key, i in last.items():
            steps[i].frees.append(key)
        for batch in self.p2p()[rank]:
            for op in batch.ops:
                if not op.send:  # a receive, posted before the action at batch.index
                    part, out, _ = op.message
                    val = self.out_val(part, out)
                    steps[batch.index].receives.append(
                        Receive(op.message, op.peer, tuple(val.shape), val.dtype))
        return steps

    def p2p(self) -> list[list]:
        """Every rank's messages, grouped in the order it posts them and checked to meet
        (``schedule.p2p.check_p2p``), found once."""
        if self._batches is None:
            self._batches = check_p2p(self.schedule, self.messages)
        return self._batches

    def messages(self, action: Action) -> tuple[list, list]:
        """What ``action`` sends other ranks and what it reads from them first on its rank,
        each ((part, output, microbatch), pipeline rank), in the order they are posted; found
        once an action (``schedule.p2p`` asks for each several times)."""
        if action not in self._messages:
            self._messages[action] = self._find_messages(action)
        return self._messages[action]

    def _find_messages(self, action: Action) -> tuple[list, list]:
        rank, mb = self.schedule.rank_of(action.stage), action.microbatch
        calls = [self._calls[p] for p in self.parts_of(action)]
        out = [((c.part, o.index, mb), dst) for c in calls for o in c.outputs for dst in o.sends]
        seen = self._first_reads(rank)
        ins = []
        for c in calls:
            for src in c.inputs:
                key = (*src[1:], mb) if src[0] == "value" else None
                if key and self.rank_of(key[0]) != rank and seen[key] is action \
                        and (key, self.rank_of(key[0])) not in ins:
                    ins.append((key, self.rank_of(key[0])))
        return out, ins

    def _first_reads(self, rank: int) -> dict[tuple, Action]:
        """(part, output, microbatch) -> the first action on ``rank`` that reads it."""
        if rank not in self._first:
            first: dict[tuple, Action] = {}
            for a in self.schedule.actions[rank]:
                for p in self.parts_of(a):
                    for src in self._calls[p].inputs:
                        if src[0] == "value":
                            first.setdefault((*src[1:], a.microbatch), a)
            self._first[rank] = first
        return self._first[rank]

    def _call(self, part: str, rank: int) -> Call:
        call = self.parts[part]
        inputs = [("input", a.name, self.roles[a.name]) if a.op == "placeholder"
                  else ("value", *source(a)) for a in call.args]
        consumers = _consumers(call)
        outputs = []
        for index in sorted(set(consumers) | {i for (p, i) in self.finals if p == part}):
            ranks = sorted({self.rank_of(c) for c in consumers.get(index, ())})
            outputs.append(Output(index, tuple(self.finals.get((part, index), ())),
                                  rank in ranks, [r for r in ranks if r != rank]))
        return Call(part, getattr(self.module, part), inputs, outputs)

    def accumulating(self, part: str) -> Accumulating | None:
        """``part``'s variant that sums gradients into their accumulators
        (``codegen.accumulate_into``), made once; None where it has none."""
        if part not in self._accumulating:
            call = self._calls[part]
            self._accumulating[part] = accumulating(getattr(self.module, part), call.outputs)
        return self._accumulating[part]

    def summable(self, part: str) -> dict[int, tuple[str, fx.Node]]:
        """The gradient outputs ``accumulating(part)`` sums in place, each with its parameter
        and the node of the part that makes it (``codegen.accumulate_into.summable``): no
        variant built."""
        return summable(getattr(self.module, part), self._calls[part].outputs)

    def out_val(self, part: str, index: int):
        """The fake value (shape, dtype) of a part's output, to receive it into."""
        node = getattr(self.module, part).graph.output_node().args[0][index]
        return node.meta.get(M.VAL, self._vals.get(node.name))


def stage_of(part: str) -> int:
    """The stage a part (``stage3_B``) computes."""
    return int(part[5:].split("_")[0])


def source(value: fx.Node) -> tuple[str, int]:
    """(part, output index) a value of the split graph comes from: ``getitem(part(...), i)``,
    as every part returns a tuple (``codegen.stages``)."""
    src, index = value.args
    return src.target, index


def _consumers(call: fx.Node) -> dict[int, list[str]]:
    """Output index -> the parts that read it."""
    out: dict[int, list[str]] = defaultdict(list)
    for user in call.users:  # getitem(call, i)
        out[user.args[1]] += [u.target for u in user.users if u.op == "call_module"]
    return out
