"""The memory model of a pipeline rank: its peak running its action list.

Requires: a ``codegen.steps.StageProgram`` (the parts' graphs with ``meta["val"]``, the
          rank's steps and what each part reads and makes).
Ensures:  ``pipeline_memory`` returns the rank's fullest moment as a ``memory.DeviceMemory``;
          ``owned_gradients`` says which outputs the pipeline runner keeps as accumulators,
          as the model counts them.

The walk follows ``runtime.pipeline``'s order: every receive of a step posted an action ahead
into its own buffer (communication); each part's outputs that a later part on the rank reads
stay until their last reader (saved: a forward's activations, per microbatch in flight; a saved
output that is a view of a value the part read, a received one or an earlier part's, holds that
value's storage once it is let go, until the view's own last reader); what it
sends stays until the step ends on gloo (a gloo send's buffer is released when the step waits
for it); on NCCL (``transport``) until the runner finds it completed, after the first of the
rank's later actions that ends once the receiver has posted its receive (``send_release``:
when, on the schedule's timeline);
a parameter's gradient is accumulated from its first microbatch on, in that microbatch's output
itself where nothing else holds its storage (``owned_gradients``), else in a copy; later
microbatches run the part's accumulating variant where it has one
(``codegen.accumulate_into``); inside a part, its own liveness peak (``memory.walk``). An
offloaded activation (``codegen.activation_offload``) waits from its forward to its backward
in host memory instead, counted in ``host``. Then the optimizer's step, and under ZeRO-1/2
the gather of the updated rows.

With techniques assumed (``sizing``: ``cost.techniques.Sizing``) values, messages, parameters
and optimizer rows count as the published system held them; with embedding-grad-once the last
stage accumulates its contribution to a tied weight's gradient in its own copy instead of
sending it each microbatch.
"""

from __future__ import annotations

import bisect
from collections import Counter
import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from shardfx.ir import meta as M
from shardfx.cost.optimizer import OptimizerModel, optimizer_temporaries
from shardfx.cost.techniques import Sizing
from shardfx.cost.values import bases, tensor_bytes, writes_input, value_bytes
from shardfx.estimate.memory import DeviceMemory, kind_of, walk, zero_gather_peak
from shardfx.schedule import simulate


@dataclass
class _Part:
    """What running one part allocates: its peak above its inputs, by kind, and each output's
    bytes."""

    peak: dict[str, int]
    outputs: dict[int, int] = field(default_factory=dict)  # storage the part allocated
    host: dict[int, int] = field(default_factory=dict)  # ... in host memory (an offloaded
    #                                                     activation, to_host's)
    values: dict[int, int] = field(default_factory=dict)  # each output's own bytes (a clone's)
    views: dict[int, int] = field(default_factory=dict)  # output -> the input it is a view of


def _part(part: fx.GraphModule, summed: frozenset = frozenset(),
          sizing: Sizing = Sizing()) -> _Part:
    """``summed``: nodes whose tensor the part's accumulating variant does not make (it adds
    into a gradient's accumulator instead: ``codegen.accumulate_into.summable``). ``sizing``:
    each value's bytes (``cost.techniques``)."""
    graph = part.graph
    kind = kind_of(graph)
    peak, _, _ = walk(graph, lambda n: kind(n) if kind(n) in ("communication", "host")
                      else "transient", lambda n: 0 if n in summed else sizing.value(n))
    outs = graph.output_node().args[0]
    base = bases(graph)
    position = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    sizes, values, views, owners, host = {}, {}, {}, set(), {}
    for i, v in enumerate(outs if isinstance(outs, (tuple, list)) else (outs,)):
        owner = base.get(v, v) if isinstance(v, fx.Node) else None
        sizes[i] = 0 if owner is None or owner in owners or owner in summed \
            else sizing.value(owner)
        if owner is not None and kind(owner) == "host":
            host[i], sizes[i] = sizes[i], 0
        values[i] = sizing.bytes(v.meta.get(M.VAL)) if isinstance(v, fx.Node) else 0
        if owner in position:
            views[i] = position[owner]
        owners.add(owner)  # outputs sharing a storage: counted once
    return _Part(peak, sizes, host, values, views)


def exclusive_outputs(part: fx.GraphModule) -> frozenset[int]:
    """The indices of ``part``'s outputs whose tensor is the only one left holding its storage
    once the part returns: storage an op of the part made (not an input's, a constant's, or an
    input an op updated in place), returned at this index alone, and covered by the tensor
    (a ``t`` of a fresh ``mm``, a ``reshape`` of a fresh ``sum``; not a slice or an
    ``expand``, which would keep bytes alive that it does not show, or show some twice).
    Anything else may be read or written through another tensor. See ``owned_gradients``."""
    graph = part.graph
    outs = graph.output_node().args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    base = bases(graph)
    owners = Counter(base.get(v, v) for v in outs if isinstance(v, fx.Node))
    return frozenset(i for i, v in enumerate(outs) if isinstance(v, fx.Node)
                     and owners[base.get(v, v)] == 1 and _covers(v, base.get(v, v)))


def _covers(value: fx.Node, owner: fx.Node) -> bool:
    """Is ``owner`` storage the part allocated, and ``value`` (``owner`` or a view of it) all
    of it, each element once?"""
    val = value.meta.get(M.VAL)
    if owner.op != "call_function" or writes_input(owner) or not isinstance(val, torch.Tensor):
        return False
    return value_bytes(owner) == tensor_bytes(val) and _dense(val)


def _dense(t: torch.Tensor) -> bool:
    """Does ``t`` reach each element of a block of ``t.numel()`` elements once (some order of
    its dimensions is contiguous: a transpose's is, an ``expand``'s or a slice's is not)?"""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def owned_gradients(part: fx.GraphModule, outputs) -> frozenset[int]:
    """The outputs of ``part`` the pipeline runner keeps as a gradient's accumulator as they
    are, instead of a copy, on the first microbatch that makes the gradient (later ones add
    into it in place): of ``exclusive_outputs(part)``, those that are one parameter's gradient
    and nothing else, neither read by a later part on the rank nor sent to another (they
    would see the sum change under them). ``outputs``: the part's ``codegen.steps.Output``
    records. The memory model counts such a gradient once, where a copy is a second tensor."""
    exclusive = exclusive_outputs(part)
    return frozenset(o.index for o in outputs
                     if o.index in exclusive and not o.local and not o.sends
                     and [r.kind for r in o.roles] == [M.OutputKind.GRAD])


def pipeline_memory(program, rank: int, train: bool, optimizer: OptimizerModel,
                    dp: int = 1, device: torch.device = torch.device("cpu"),
                    zero: int = 0, offload: bool = False, transport: str | None = None,
                    sizing: Sizing = Sizing()) -> DeviceMemory:
    """The peak of pipeline rank ``rank`` running its action list (``program``: the
    ``codegen.steps.StageProgram`` the pipeline runner runs). Under ZeRO-1/2 (``zero``) the
    optimizer steps this dp replica's rows of each parameter the rank owns: its state and, at
    its step, the gradients are those rows; then the updated rows are gathered. ``offload``:
    the optimizer's state, what it steps and, after the schedule, the gradients are the host's
    (``DeviceMemory.host``: its peak, at the step). ``transport``: ``"gloo"`` or ``"nccl"``,
    how long a send holds its buffer (module docstring); None: NCCL on CUDA, else gloo.
    ``sizing``: the bytes of values, parameters and optimizer rows with the techniques assumed
    (``cost.techniques``; with low-precision-weights an fp32 main copy of the rows)."""
    reads = program.reads(rank)
    params = [sizing.weight(program.input_val(n)) for n, r in reads.items()
              if r.kind is M.InputKind.PARAM]
    buffers = sum(tensor_bytes(program.input_val(n)) for n, r in reads.items()
                  if r.kind is M.InputKind.BUFFER)
    whole = {r.name: program.input_val(n) for n, r in reads.items()
             if r.kind is M.InputKind.PARAM and program.producer(M.OutputKind.GRAD, r.name) == rank}
    steps = program.steps(rank)
    tied = _tied(program, steps) if sizing.tied_copy else {}  # (part, output) -> weight
    whole |= {fqn: _weights(program, rank)[fqn] for fqn in tied.values()}  # their copies
    rows = [sizing.tensor(v) for v in whole.values()]  # the parameters this rank steps
    if zero:  # each replica's rows (runtime.zero)
        rows = [torch.empty(M.ZeroShard(sizing.shape(v.shape), dp).shard_shape,
                            dtype=v.dtype, device="meta") for v in whole.values()]
    opt_state = sizing.optimizer(rows, optimizer) if train else 0
    offload = offload and train
    host = 0
    if offload:  # the host's copies and the state; the device's state without them
        host, opt_state = opt_state + sum(map(tensor_bytes, rows)), 0
    state = dict(parameters=sum(map(tensor_bytes, params)), buffers=buffers, optimizer=opt_state)
    _low_precision(program, sizing)
    parts: dict[str, _Part] = {}  # the parts this rank runs, each walked once
    comm: dict[tuple, int] = {}  # receive buffers: posted an action ahead, freed after use
    saved: dict[tuple, int] = {}
    holders: dict[tuple, list[tuple]] = {}  # a value -> the saved outputs that view it
    grads: dict[str, int] = {}
    owned: dict[str, frozenset[int]] = {}  # part -> the outputs kept as accumulators
    summing: dict = {}  # part -> (gradients its accumulating variant sums, what it makes)
    best = DeviceMemory(**state)

    def consider(transient: int, communication: int, when: str) -> None:
        nonlocal best
        now = DeviceMemory(**state, gradients=sum(grads.values()), saved=sum(saved.values()),
                           transient=transient, communication=sum(comm.values()) + communication,
                           when=when)
        if now.total > best.total:
            best = now

    host_saved: dict[tuple, int] = {}  # offloaded activations waiting for their backward
    offloaded = 0  # the most bytes of them the host held at once
    sending = 0  # sends' buffers: gloo frees one only when the step's end waits for it
    sent: set[tuple] = set()  # saved values also sent
    nccl = (transport or ("nccl" if device.type == "cuda" else "gloo")) == "nccl"
    release = send_release(program, rank) if nccl else {}
    letgo: Counter = Counter()  # step index -> send bytes the runner lets go after it
    reducing = 0  # dp buckets started (counted to the step's end: an upper bound)
    final = final_gradients(steps)
    reductions = _reductions(program, rank) if dp > 1 and train else {}
    missing = {key: set(b.names) for key, b in reductions.items()}
    bucket_of = {fqn: key for key, b in reductions.items() for fqn in b.names}
    for index, step in enumerate(steps):
        mb = step.action.microbatch
        for posted in steps[index:index + 2]:  # the runner posts the next one's receives now
            comm |= {r.key: sizing.output(getattr(program.module, r.key[0]).graph, r.key[1])
                     for r in posted.receives if not (sizing.tied_copy and _contribution(
                         program, r.src, *r.key[:2]))}
        for call in step.calls:
            if call.part not in parts:
                parts[call.part] = _part(getattr(program.module, call.part), sizing=sizing)
            info = parts[call.part]
            if call.part not in summing:  # its accumulating variant: what it makes
                made = program.summable(call.part)
                summing[call.part] = made and (
                    [name for name, _ in made.values()],
                    _part(getattr(program.module, call.part),
                          frozenset(node for _, node in made.values()), sizing))
            if summing[call.part] and all(name in grads for name in summing[call.part][0]):
                info = summing[call.part][1]  # it runs: the summed gradients are not made
            consider(info.peak["transient"] + info.peak["gradients"] + info.peak["saved"],
                     info.peak["communication"] + sending + reducing,
                     f"{step.name} ({call.part})")
            offloaded = max(offloaded, sum(host_saved.values()) + info.peak["host"])
            out_bytes = sum(info.outputs.values())  # all live until the call's outputs go
            if call.part not in owned:
                owned[call.part] = owned_gradients(getattr(program.module, call.part),
                                                   call.outputs)
            for o in call.outputs:
                nbytes = info.outputs.get(o.index, 0)
                for role in o.roles:
                    if role.kind is M.OutputKind.GRAD and role.name not in grads:
                        # the accumulator: the output itself where the runner keeps it (its
                        # bytes now a gradient's, no longer the part's), else a copy of its
                        # own bytes, even where the part returns a view of its input
                        grads[role.name] = info.values.get(o.index, 0)
                        if o.index in owned[call.part]:
                            out_bytes -= nbytes
                        consider(out_bytes, sending + reducing,
                                 f"{step.name} ({call.part}, gradients)")
                if o.local and o.index in info.host:  # waits in host memory
                    host_saved[(call.part, o.index, mb)] = info.host[o.index]
                    offloaded = max(offloaded, sum(host_saved.values()))
                elif o.local:
                    saved[(call.part, o.index, mb)] = nbytes
                    source = call.inputs[info.views[o.index]] if o.index in info.views else None
                    if source is not None and source[0] == "value":  # a view of an input
                        holders.setdefault((*source[1:], mb), []).append(
                            (call.part, o.index, mb))
                    if o.sends:  # once freed here, its send holds it (to its release)
                        sent.add((call.part, o.index, mb))
                elif (call.part, o.index) in tied:  # accumulated in the copy's gradient
                    fqn = tied[(call.part, o.index)]
                    grads.setdefault(f"{fqn} (copy)", sizing.bytes(whole[fqn]))
                elif o.sends:
                    sending += nbytes
                    if (call.part, o.index, mb) in release:
                        letgo[release[(call.part, o.index, mb)]] += nbytes
        for key in step.frees:
            host_saved.pop(key, None)
            freed = saved.pop(key, 0)
            if key in sent and release.get(key, len(steps)) > index:  # its send still holds it
                sending += freed
                if key in release:
                    letgo[release[key]] += freed
            freed += comm.pop(key, 0)
            held = [h for h in holders.pop(key, ()) if h in saved]
            if held:  # a saved view keeps the value's storage: counted with it from now
                saved[held[0]] += freed
                holders[held[0]] = held[1:] + holders.get(held[0], [])
        for fqn in final[index] if reductions else ():  # final here: its bucket issued
            key = bucket_of[fqn]  # once its last gradient is (``runtime.buckets``)
            missing[key].discard(fqn)
            if not missing[key]:
                peak, started = _issue(reductions[key].issue)
                consider(0, peak + sending + reducing, f"{step.name} (dp bucket {key[1]} of "
                         f"stage {key[0]})")
                reducing += started
        sending -= letgo.pop(index, 0)  # completed sends: the runner drops them now
    if reducing:  # waited for after the sends (``runtime.pipeline`` lets them go then)
        finish = max(_issue(r.finish)[0] for r in _stage_reductions(program, rank).values())
        consider(0, finish + reducing, "dp all-reduce")
    comm.clear()
    sending = reducing = 0
    if zero:  # the whole gradients go; the optimizer steps this replica's rows
        grads = {"rows": sum(map(tensor_bytes, rows))}
    schedule_host = host + offloaded  # the host during the schedule
    if offload:  # the gradients went to the host, where the optimizer steps
        grads = {}
        host += sum(map(tensor_bytes, rows)) + optimizer_temporaries(rows, optimizer,
                                                                     torch.device("cpu"))
    elif train and optimizer.name != "none":
        consider(optimizer_temporaries(rows, optimizer, device), 0, "optimizer step")
    if train and zero:  # every replica's updated rows, gathered a bucket at a time
        gathers = [g for r in _stage_reductions(program, rank).values() for g in r.gathers]
        consider(zero_gather_peak(gathers), 0, "ZeRO gather")
    return dataclasses.replace(best, host=max(host, schedule_host))


def _low_precision(program, sizing: Sizing) -> None:
    """With the weights in the compute dtype (``sizing.weights``), each part's
    ``techniques.low_precision``, found in the split graph's order: a part's input is in the
    compute dtype where it is a weight or an earlier part's output found so; its parameters'
    gradients stay fp32."""
    if sizing.weights is None:
        return
    for call in program.module.graph.find_nodes(op="call_module"):
        graph = getattr(program.module, call.target).graph
        args = dict(zip(graph.find_nodes(op="placeholder"), call.args))
        outs = graph.output_node().args[0]
        keep = frozenset(outs[i] for (part, i), roles in program.finals.items()
                         if part == call.target and any(r.kind is M.OutputKind.GRAD
                                                        for r in roles))
        sizing.lows(graph, lambda node, args=args: _low_input(program, sizing, args[node]),
                    keep)


def _low_input(program, sizing: Sizing, arg: fx.Node) -> bool:
    """Is a part's argument ``arg`` (a program input, or an earlier part's output) in the
    compute dtype with the weights in it?"""
    if arg.op == "placeholder":
        return program.roles[arg.name].kind is M.InputKind.PARAM
    part, index = arg.args[0].target, arg.args[1]  # getitem(part(...), index)
    graph = getattr(program.module, part).graph
    node = graph.output_node().args[0][index]
    low, _ = sizing.lows(graph)
    return node in low or node.meta[M.VAL].dtype == sizing.weights


def _tied(program, steps: list) -> dict[tuple[str, int], str]:
    """(part, output) of the rank's parts that each microbatch sends another rank as its
    contribution to a weight's gradient (``_contribution``), with the weight's FQN."""
    calls = {call.part: call for step in steps for call in step.calls}
    return {(part, o.index): fqn for part, call in calls.items() for o in call.outputs
            if o.sends and not o.roles
            and (fqn := _contribution(program, program.rank_of(part), part, o.index))}


def _contribution(program, rank: int, part: str, index: int) -> str | None:
    """The weight whose gradient output ``index`` of ``part`` (run on ``rank``) is a
    contribution to, where another rank makes that gradient: a backward part's output of the
    shape of a weight ``rank`` reads (or of its transpose) whose gradient it does not make (a
    tied embedding, read again as the LM head). None otherwise."""
    if part.endswith("_F"):
        return None
    return _foreign(program)[rank].get(tuple(program.out_val(part, index).shape))


@functools.lru_cache(maxsize=1)  # every rank of one program asks (one program kept)
def _foreign(program) -> list[dict[tuple, str]]:
    """Per rank, the shapes (and their transposes) of the weights it reads whose gradient
    another rank makes, with their FQNs."""
    out = []
    for rank in range(len(program.schedule.actions)):
        shapes = {}
        for fqn, val in _weights(program, rank).items():
            if program.producer(M.OutputKind.GRAD, fqn) != rank:
                shapes[tuple(val.shape)] = shapes[tuple(reversed(val.shape))] = fqn
        out.append(shapes)
    return out


def _weights(program, rank: int) -> dict[str, torch.Tensor]:
    """The weights ``rank``'s parts read, by FQN."""
    return {r.name: program.input_val(n) for n, r in program.reads(rank).items()
            if r.kind is M.InputKind.PARAM}


def send_release(program, rank: int) -> dict[tuple, int]:
    """On NCCL, each of ``rank``'s sends ((part, output, microbatch)) -> the step after which
    the runner lets it go (``runtime.pipeline`` drops completed sends after each action): the
    first of its later steps that ends once every receiver has posted the receive. A receiver
    posts it at the start of the action before the one it is received for (``schedule.p2p``'s
    groups); times are the schedule's timeline under ``schedule.Costs``' proportions
    (``simulate``). A send no later step outlives is let go at the step's end, as on gloo."""
    spans, posted = _timeline(program)
    steps = program.schedule.actions[rank]
    ends = [spans[(rank, j)].end for j in range(len(steps))]  # nondecreasing
    out = {}
    for i, action in enumerate(steps):
        for message, _ in program.messages(action)[0]:
            done = max(ends[i], posted.get((message, rank), 0.0))
            j = bisect.bisect_left(ends, done, lo=i + 1)
            if j < len(steps):
                out[message] = j
    return out


@functools.lru_cache(maxsize=1)  # every rank of one program asks (one program kept)
def _timeline(program) -> tuple[dict, dict]:
    """The schedule's spans by (rank, index), and when the last receiver of each (message,
    sender) posts its receive."""
    spans = {(s.rank, s.index): s for s in simulate(program.schedule).spans}
    posted: dict[tuple, float] = {}
    for dst, groups in enumerate(program.p2p()):
        for batch in groups:
            at = spans[(dst, max(batch.index - 1, 0))].start if (dst, 0) in spans else 0.0
            for op in batch.ops:
                if not op.send:
                    key = (op.message, op.peer)
                    posted[key] = max(posted.get(key, at), at)
    return spans, posted


def _stage_reductions(program, rank: int) -> dict:
    """Stage -> its ``codegen.replicas.Reduction``, for the stages ``rank`` runs."""
    return {s: r for s, r in program.module.meta.get(M.REPLICAS, {}).items()
            if program.schedule.rank_of(s) == rank}


def _reductions(program, rank: int) -> dict:
    """(stage, bucket) -> its ``codegen.replicas.Bucket``, for the stages ``rank`` runs."""
    return {(s, i): b for s, r in _stage_reductions(program, rank).items()
            for i, b in enumerate(r.buckets)}


def _issue(module: fx.GraphModule) -> tuple[int, int]:
    """A reduction part's peak above its inputs, and the bytes of what it returns (a started
    collective's buffer, which lives until the finish part waits for it)."""
    peak, _, _ = walk(module.graph, lambda n: "communication")
    out = module.graph.output_node().args[0]
    return sum(peak.values()), sum(value_bytes(v) for v in out if isinstance(v, fx.Node))


def final_gradients(steps: list) -> list[list[str]]:
    """Per step, the gradients whose last contribution on this rank it makes, in the order
    its parts return them: they can be reduced across replicas from then on."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for call in step.calls:
            for o in call.outputs:
                for role in o.roles:
                    if role.kind is M.OutputKind.GRAD:
                        last.pop(role.name, None)
                        last[role.name] = i
    out: list[list[str]] = [[] for _ in steps]
    for fqn, i in last.items():
        out[i].append(fqn)
    return out
