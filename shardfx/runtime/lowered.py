"""Compiled programs: a per-device program lowered by Inductor, one compile per distinct region.

``partition(..., kernels="compiled")`` runs every per-device program (an SPMD program, a
pipeline stage's F, B and W parts, an inference program) through ``lowered(module)``: the same
program with each *region* of ATen ops replaced by one call of the code Inductor generated for
it (C++ on CPU, Triton on GPU). The program's order of regions, its Python program ops and the
values it frees are unchanged; inside a region Inductor fuses ops and reuses buffers.

A region is a run of consecutive ATen ops of one stamped block (``M.BLOCK``: the forward of
``model.layers.3``, its backward) or of the glue between blocks (the embedding, the head and
loss). A program op written in Python (ring attention's steps, the experts, the step in the
backward, a CPU wait that lets go of gloo's buffers: ``runtime.released``) ends a region and
runs as it is between two; so does an op that sums into a tensor it is given (``addmm_``,
``index_add_``: the accumulating variants' gradient sums, which BLAS does in place and Inductor
in a buffer copied back, 1.9x the time), and a ``_c10d_functional`` collective, issued and
waited where the program's passes put them (bucketing, ZeRO's prefetch). Inside a region
Inductor lowers a functional collective by copying its input into a buffer of its own, held with
the input: measured on CPU (each region's inputs then held to its end), the peak of a dp=2 x
tp=2 Llama step went 8.2% over the memory model's prediction with the collectives inside, 3.1%
with them between regions; ZeRO-3 22.4% and 8.1%. A region takes its inputs in a list it
empties, so an input it reads last is freed inside it, where Inductor's code last reads it: then
dp=2 x tp=2 is within 0.1%, pp and one device under a budget within 4.5%, ZeRO-3 0.6% under on
each of 6 runs (``runtime.measure.allocated_peak``, which sees Inductor's buffers and leaves out
gloo's scratch copies; the ATen programs are equal to the prediction within bytes but for a
gather input gloo's thread lets go of late: 2.7% over, once in 6). Region code is keyed by its
ops and their arguments, positions for values: the 80 forward blocks of an 80-layer plan are one
code, compiled once (for the shapes, strides and dtypes of its first call) and called 80 times —
torchtitan's per-block ``torch.compile``, found in the program rather than asked for by wrapping
modules. A region compiles under a tracing context with a shape env, as Dynamo's graphs do, so
AOTAutograd's and Inductor's on-disk caches (``TORCHINDUCTOR_CACHE_DIR``) answer for it: a
second run of the same plan skips tracing and code generation alike (a 58M Llama's five codes:
9.1 s of compiling cold, 3.0 s warm, 2.7 s of it Inductor's start). The processes of one machine
compile a given code one at a time, the others then reading it from the cache
(``_one_process_at_a_time``).

Regions made only of views (a reshape between two Python ops) run as they are: compiling them
buys nothing. A region is compiled at its first call, on the values it is called with, so a
step's first call pays the compile time, as ``torch.compile`` does; ``compiled_regions()``
says how many codes were compiled and how long that took (``shardfx run`` prints it).

The ranks of a mesh compile at their own pace: one may compile a region while its peers already
wait for it in a collective. A runner's call that may compile (``Compiling``) therefore holds
every collective's timeout to the compile timeout and ends with a barrier
(``runtime.mesh.while_compiling``): compile time never counts against a collective's timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import operator
import os
import time
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.ir import meta as M
from shardfx.ir.graph import is_getitem, tensor_val
from shardfx.runtime.mesh import while_compiling
from shardfx.runtime.released import released

log = logging.getLogger("shardfx.compile")

_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class Compiled:
    """What this process compiled so far: distinct region codes, the compiles they took (a code
    called with new shapes compiles again) and the seconds spent."""

    codes: int = 0
    compiles: int = 0
    seconds: float = 0.0
    calls: int = 0  # region calls, for the share each compile served


_totals = Compiled()
_codes: dict[tuple, "_Code"] = {}


def compiled_regions() -> Compiled:
    """This process's compile counts so far (a copy)."""
    return dataclasses.replace(_totals)


def lowered(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` with each region of ATen ops a call of its compiled code (made once per
    module; the codes are shared by every module of the process). Ensures: the same values,
    made in the same order of regions, Python ops and collectives."""
    if module not in _copies:
        _copies[module] = _lower(module)
    return _copies[module]


def regions(graph: fx.Graph) -> list[list[fx.Node]]:
    """The runs of ``graph``'s nodes that are compiled as one region each, in program order
    (module docstring): each a run of consecutive compilable ops of one block instance, or of
    glue, that computes more than views. Every value a region makes that is read after it is a
    tensor (a multi-output op whose parts are read elsewhere runs as it is)."""
    opaque: set[fx.Node] = set()
    while True:
        runs = _runs(graph, opaque)
        split = {n for run in runs for n in _outputs(run) if tensor_val(n) is None}
        if not split:
            return [run for run in runs if not all(_is_view(n) for n in run)]
        opaque |= split


# --- finding the regions -----------------------------------------------------------------


# Ops that add into a tensor they are given: an accumulating variant's gradient sums
# (``codegen.accumulate_into``). BLAS adds a matmul into its output in place; Inductor makes
# the sum in a buffer of its own and copies it back: an ``addmm_`` of a 64-token microbatch
# into a 1408 x 512 accumulator took 1.26 ms compiled against 0.66 ms as it is (one thread),
# an embedding's ``index_add_`` 0.03 against 0.008 ms. They run as they are, between regions.
_SUMS_INTO_INPUT = frozenset({torch.ops.aten.addmm_.default, torch.ops.aten.index_add_.default})


def _compilable(node: fx.Node, opaque: set[fx.Node]) -> bool:
    """An ATen op (or a part of one's result) a region may hold: not a Python op, not a
    collective, not a sum into a given tensor (module docstring, ``_SUMS_INTO_INPUT``)."""
    if node.op != "call_function" or node in opaque or node.target in _SUMS_INTO_INPUT:
        return False
    if is_getitem(node):
        src = node.args[0]
        return isinstance(src, fx.Node) and _compilable(src, opaque)
    return isinstance(node.target, torch._ops.OpOverload) and \
        node.target.namespace != "_c10d_functional"


def _instances(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Each stamped op's block instance: a new one starts where the list, the unit (forward,
    backward) changes or its place in the block does not grow."""
    out, last, instance = {}, None, -1
    for node in nodes:
        place = node.meta.get(M.BLOCK)
        if place is None:
            continue
        if last is None or (place.path, place.unit) != (last.path, last.unit) or \
                place.index <= last.index:
            instance += 1
        out[node], last = instance, place
    return out


def _labels(nodes: list[fx.Node]) -> list[Any]:
    """Per node, the block instance it belongs to, or ``None`` (glue): an unstamped op between
    two ops of the same instance (a collective codegen inserted, a cast) belongs to it."""
    instances = _instances(nodes)
    before, seen = [], None
    for node in nodes:
        seen = instances.get(node, seen)
        before.append(seen)
    after, seen = [None] * len(nodes), None
    for i in range(len(nodes) - 1, -1, -1):
        seen = instances.get(nodes[i], seen)
        after[i] = seen
    return [b if b is not None and b == a else None for b, a in zip(before, after)]


def _runs(graph: fx.Graph, opaque: set[fx.Node]) -> list[list[fx.Node]]:
    nodes = list(graph.nodes)
    runs: list[list[fx.Node]] = []
    current, label = [], object()
    for node, node_label in zip(nodes, _labels(nodes)):
        if not _compilable(node, opaque):
            current, label = [], object()
            continue
        if not current or node_label != label:
            current, label = [], node_label
            runs.append(current)
        current.append(node)
    return runs


def _outputs(run: list[fx.Node]) -> list[fx.Node]:
    """The values ``run`` makes that are read after it, in program order."""
    inside = set(run)
    return [n for n in run if any(u not in inside for u in n.users)]


def _inputs(run: list[fx.Node]) -> list[fx.Node]:
    """The values ``run`` reads from before it, in the order it first reads them."""
    inside, out = set(run), {}
    for node in run:
        for arg in node.all_input_nodes:
            if arg not in inside:
                out.setdefault(arg, None)
    return list(out)


def _is_view(node: fx.Node) -> bool:
    if is_getitem(node):
        return True
    return any(r.alias_info is not None for r in node.target._schema.returns)


# --- lowering ----------------------------------------------------------------------------


def _lower(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` whose regions are calls of ``_Region``s."""
    graph = module.graph
    first = {run[0]: run for run in regions(graph)}
    out = fx.Graph()
    out._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    skip: set[fx.Node] = set()
    for node in graph.nodes:
        if node in skip:
            continue
        run = first.get(node)
        if run is None:
            env[node] = out.node_copy(node, env.__getitem__)
            continue
        inputs, outputs = _inputs(run), _outputs(run)
        box = out.call_function(boxed, tuple(env[n] for n in inputs))
        call = out.call_function(_Region(_code(run, inputs, outputs)), (box,))
        for i, value in enumerate(outputs):
            env[value] = out.call_function(operator.getitem, (call, i))
            env[value].meta = dict(value.meta)
        skip.update(run)
    return fx.GraphModule(module, out, class_name=type(module).__name__)


def _code(run: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> "_Code":
    """The region's code, shared with every earlier region of the same ops and arguments."""
    place = {n: ("in", i) for i, n in enumerate(inputs)}
    place.update((n, ("op", i)) for i, n in enumerate(run))
    ops = tuple((str(n.target), _key(n.args, place), _key(n.kwargs, place)) for n in run)
    key = (ops, tuple(place[n] for n in outputs))
    if key not in _codes:
        _codes[key] = _Code(_graph_of(run, inputs, outputs), _describe(run))
        _totals.codes += 1
    return _codes[key]


def _key(value: Any, place: dict[fx.Node, tuple]) -> Any:
    if isinstance(value, fx.Node):
        return place[value]
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_key(v, place) for v in value))
    if isinstance(value, dict):
        return tuple((k, _key(v, place)) for k, v in value.items())
    return repr(value)


def _graph_of(run: list[fx.Node], inputs: list[fx.Node],
              outputs: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env = {n: graph.placeholder(f"in_{i}") for i, n in enumerate(inputs)}
    for node in run:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule({}, graph)


def _describe(run: list[fx.Node]) -> str:
    place = next((n.meta[M.BLOCK] for n in run if M.BLOCK in n.meta), None)
    where = f"{'forward' if place.unit == 'f' else 'backward'} block of {place.path}" \
        if place is not None else f"glue at {run[0].name}"
    return f"{where} ({len(run)} ops)"


class _Code:
    """One region code: its graph, compiled for each distinct set of input shapes, strides,
    dtypes and devices it is called with (once, in a plan: plans are static-shaped)."""

    def __init__(self, graph: fx.GraphModule, description: str):
        self.graph = graph
        self.description = description
        self._compiled: dict[tuple, Callable] = {}

    def __call__(self, box: list) -> Any:
        """The region's outputs on the values in ``box``, which it empties: an input whose last
        reader is this region is freed inside it, where Inductor's code last reads it, not
        when the region returns."""
        key = tuple((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                    else repr(a) for a in box)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._compile(box)
        _totals.calls += 1
        tensors = [a for a in box if isinstance(a, torch.Tensor)]
        box.clear()
        return fn(tensors)

    def _compile(self, args: list) -> Callable:
        """Inductor's code for ``args``, called with a list of their tensors, which it empties
        (Inductor frees each input after its last use); an input that is not a tensor (a
        rank's coordinate on a mesh axis) is a constant of it."""
        from torch._guards import TracingContext, tracing
        from torch._inductor.compile_fx import compile_fx  # imports Inductor: only when used
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        start = time.perf_counter()
        graph = _taking_a_list(self.graph, args)
        fake = FakeTensorMode(shape_env=ShapeEnv())
        example = [fake.from_tensor(a, static_shapes=True) for a in args
                   if isinstance(a, torch.Tensor)]
        with _one_process_at_a_time(graph, example), tracing(TracingContext(fake)):
            fn = compile_fx(graph, [example])  # the context's shape env: Inductor caches then
        seconds = time.perf_counter() - start
        _totals.compiles += 1
        _totals.seconds += seconds
        log.info("%s in %.1f s (%d compiled of %d region codes, %.1f s so far)",
                 self.description, seconds, _totals.compiles, _totals.codes, _totals.seconds)
        return fn


@contextlib.contextmanager
def _one_process_at_a_time(graph: fx.GraphModule, example: list) -> Iterator[None]:
    """Held while a region compiles: one process of this machine at a time compiles a given
    graph for given input shapes. The ranks whose programs share a region code (dp's
    replicas, most of tp's) reach it together; one compiles it and the others then read it
    from Inductor's on-disk cache instead of compiling it again beside it (on 2 cores, 4
    ranks compiling one code at once take twice one compile's time). A lock file per graph
    and shapes, in Inductor's cache directory; the OS lets go of it if its holder dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: each process compiles on its own
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = hashlib.sha256(repr((graph.code, [(tuple(t.shape), t.stride(), t.dtype, t.device)
                                            for t in example])).encode()).hexdigest()
    folder = os.path.join(cache_dir(), "shardfx-locks")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, key[:32]), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def boxed(*values: Any) -> list:
    """The list a region call takes its inputs in (``_Code.__call__`` empties it)."""
    return list(values)


def _taking_a_list(module: fx.GraphModule, args: list) -> fx.GraphModule:
    """``module`` taking one input, the list of the tensors in ``args``, which Inductor's
    code may empty (``steal_arg``); each input of ``args`` that is not a tensor is replaced
    by its value."""
    graph = fx.Graph()
    box = graph.placeholder("inputs")
    box.meta["steal_arg"] = True  # torch._dynamo.utils.flatten_graph_inputs clears it
    env: dict[fx.Node, Any] = {}
    tensors = 0
    for node in module.graph.nodes:
        if node.op == "placeholder":
            value = args[len(env)]
            if isinstance(value, torch.Tensor):
                env[node] = graph.call_function(operator.getitem, (box, tensors))
                tensors += 1
            else:
                env[node] = value
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule({}, graph)


class _Region:
    """The call a lowered program makes for one region: its code on the region's inputs, a
    tuple of the values read after it."""

    def __init__(self, code: _Code):
        self.code = code
        self.__name__ = "region"  # FX prints a call_function target by its name

    def __call__(self, box: list) -> tuple:
        return tuple(self.code(box))

    def __repr__(self) -> str:
        return f"region[{self.code.description}]"


def runnable(module: fx.GraphModule, device: torch.device, compiled: bool) -> fx.GraphModule:
    """The module a runner calls for a program on ``device``: ``released`` (on CPU, waits that
    let go of gloo's buffers), then, for a compiled plan, ``lowered``."""
    module = released(module, device)
    return lowered(module) if compiled and isinstance(module, fx.GraphModule) else module


class Compiling:
    """Which calls of a runner may compile, each held with ``runtime.mesh.while_compiling`` so
    no peer's collective times out while this rank compiles: a compiled plan's first call of a
    kind ("train", "accumulate": several batches run the accumulating variant too, "infer")
    with inputs of given shapes, strides and dtypes. Every rank passes the same global inputs,
    so every rank agrees on which calls those are. A plan for one device has no peers to hold
    (and may run on one rank of a larger world alone)."""

    def __init__(self, compiled: bool, devices: int):
        self.on = compiled and devices > 1
        self._ran: set[tuple] = set()

    @contextlib.contextmanager
    def __call__(self, kind: str, inputs: Any) -> Iterator[None]:
        key = (kind, tuple((tuple(t.shape), t.stride(), t.dtype) for t in
                           pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)))
        if not self.on or key in self._ran:
            yield
            return
        with while_compiling():
            yield
        self._ran.add(key)
