"""codegen: the IR becomes the program a device runs.

On one device the program is the IR itself, stripped of analysis metadata, compiled by torch.fx to
Python that calls ATen ops in order. Later stages of the compiler add here: local shapes
and explicit collectives (spmd; a pipeline's sends and receives are the runner's), and Triton
kernels for fused groups. The runner only
knows ``Program``: a callable with a list of input roles and a list of output roles.

Layouts. The strides in the IR (``meta["val"]``) are FakeTensor's prediction, and a real kernel
may lay out its result otherwise: CPU ``mse_loss_backward`` returns a contiguous gradient for a
transposed input where the fake one keeps the input's strides; the runner's inputs (a batch
slice, a tensor received from another stage) and codegen's collectives have layouts of their
own. Nearly every op computes the same values from any layout; two kinds do not, and
``layout_free`` rewrites both in every generated program (as Inductor lowers them):

- views that fail when the strides do not allow them (``view``, ``_unsafe_view``) become
  ``reshape``: the same values, a view where the layout allows and a copy where not;
- ops that address their operand's memory (``as_strided``, ``view.dtype``, ...) get their operand
  laid out as the IR recorded (``restride``: the operand itself when it already is, a copy
  otherwise), so they read what the trace meant.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module

from shardfx.codegen.redistribute import Collective
from shardfx.request.hints import strip_hints
from shardfx.ir import meta as M
from shardfx.errors import VerifyError
from shardfx.ir.contract import holds
from shardfx.kernels.triton import FusedKernel

aten = torch.ops.aten

# Ops that fail unless their operand's strides allow them -> the op computing the same values
# from any layout.
RESHAPES = {aten.view.default: aten.reshape.default,
            aten._unsafe_view.default: aten.reshape.default}

# Ops whose values depend on their first operand's strides and storage offset.
ADDRESSING = frozenset({aten.as_strided.default, aten.as_strided_copy.default,
                        aten.as_strided_scatter.default, aten.view.dtype,
                        aten.view_as_complex.default})


@dataclass(frozen=True)
class Program:
    """A runnable per-device program and its calling convention."""

    module: fx.GraphModule  # call as module(*inputs) -> tuple of outputs
    inputs: tuple[M.InputRole, ...]
    outputs: tuple[M.OutputRole, ...]
    collectives: tuple[Collective, ...] = ()  # what it issues, with bytes and why (print(plan))

    @property
    def source(self) -> str:
        """Readable Python: a header naming what each input and output is, then the code."""
        lines = ["# shardfx program", "# inputs:"]
        lines += [f"#   {name}: {role}" for name, role in zip(self.input_names, self.inputs)]
        lines += ["# outputs (in order):"] + [f"#   {role}" for role in self.outputs]
        return "\n".join(lines) + "\n" + self.module.code

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.module.graph.find_nodes(op="placeholder"))


def generate(gm: fx.GraphModule) -> Program:
    """Requires: ROLE on placeholders, OUTPUTS on the output node. Leaves ``gm`` untouched.
    Ensures: the program's values do not depend on the layouts its kernels give (``layout_free``);
    ops keep their PHASE and STAGE (a pipeline is cut from this graph)."""
    graph = copy.deepcopy(gm.graph)
    strip_hints(graph)
    layout_free(graph)
    module = _make_graph_module(gm, graph, class_name="ShardfxProgram")
    inputs = tuple(n.meta[M.ROLE] for n in graph.find_nodes(op="placeholder"))
    outputs = tuple(graph.output_node().meta[M.OUTPUTS])
    return Program(module, inputs, outputs)


def layout_free(graph: fx.Graph) -> None:
    """Rewrite the ops whose result depends on their operand's layout (see the module docstring)
    so the program computes what the IR means whatever layouts its values have at run time.
    A ``restride`` takes the PHASE and STAGE of the op it serves."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in RESHAPES:
            node.target = RESHAPES[node.target]
        elif node.target in ADDRESSING and isinstance(node.args[0], fx.Node):
            x = node.args[0]
            val = x.meta[M.VAL]
            with graph.inserting_before(node):
                guard = graph.call_function(restride, (x, tuple(val.stride()),
                                                       val.storage_offset()))
            guard.meta[M.VAL] = val
            guard.meta.update({k: node.meta[k] for k in (M.PHASE, M.STAGE) if k in node.meta})
            node.update_arg(0, guard)


def restride(x: torch.Tensor, stride: tuple[int, ...], offset: int) -> torch.Tensor:
    """``x`` with the strides and storage offset the program was traced with: ``x`` itself when
    it has them, else a copy laid out so (in a buffer just large enough). A broadcast dim
    (stride 0) holds one value, written once."""
    if x.stride() == stride and x.storage_offset() == offset:
        return x
    extent = offset + (1 + sum((n - 1) * s for n, s in zip(x.shape, stride)) if x.numel() else 0)
    out = x.new_empty(extent).as_strided(x.shape, stride, offset)
    src, dst = x, out
    for dim, (n, s) in enumerate(zip(x.shape, stride)):
        if s == 0 and n > 1:
            src, dst = src.narrow(dim, 0, 1), dst.narrow(dim, 0, 1)
    dst.copy_(src)
    return out


def graphs(program: Program) -> list[tuple[str, fx.GraphModule]]:
    """The modules a program runs: itself, or a pipeline's parts (``stage0_F``, ...)."""
    parts = [(name, m) for name, m in program.module.named_children()
             if isinstance(m, fx.GraphModule)]
    return parts or [("program", program.module)]


def verify_program(program) -> None:
    """The invariants of a generated program (``codegen.program.Program``), after every program
    pass in tests and debug runs: each module it runs lints and every op there has a ``VAL``;
    one input role per placeholder and one output role per returned value; a training program
    returns one loss; every collective record names an axis the program has a group for."""
    for name, module in graphs(program):
        try:
            module.graph.lint()
        except Exception as e:
            raise VerifyError(f"{name} does not lint: {e}", where="torch.fx lint") from e
        for node in module.graph.nodes:
            if node.op == "call_function" and M.VAL not in node.meta:
                raise VerifyError(f"{name}: node has no meta['val']", where=node.format_node(),
                                  fix="a program pass that inserts nodes must fill in their "
                                      "values (shardfx.ir.graph.insert_op does)")
    graph = program.module.graph
    placeholders = graph.find_nodes(op="placeholder")
    if len(placeholders) != len(program.inputs):
        raise VerifyError(f"the program takes {len(placeholders)} inputs but has "
                          f"{len(program.inputs)} input roles", where="program inputs")
    values = graph.output_node().args[0]
    if len(values) != len(program.outputs):
        raise VerifyError(f"the program returns {len(values)} values but has "
                          f"{len(program.outputs)} output roles", where="program outputs")
    if program.outputs and any(r.kind is M.OutputKind.GRAD for r in program.outputs):
        losses = sum(r.kind is M.OutputKind.LOSS for r in program.outputs)
        if losses != 1:
            raise VerifyError(f"a training program returns {losses} losses", where="outputs")
    groups = {r.name for r in program.inputs if r.kind is M.InputKind.MESH}
    for c in program.collectives:
        if f"group({c.axis})" not in groups:
            raise VerifyError(f"collective on {c.axis}, which the program has no group for",
                              where=c.reason)


# --- what program passes require and ensure (``ir.contract``) ---------------------------

def first_kernel(program: Program) -> str | None:
    """The first fused Triton kernel the program calls, if any."""
    node = next((n for _, m in graphs(program) for n in m.graph.nodes
                 if n.op == "call_function" and isinstance(n.target, FusedKernel)), None)
    return None if node is None else node.format_node()


def first_bucket(program: Program) -> str | None:
    """The first gradient bucket's collective, if any."""
    node = next((n for _, m in graphs(program) for n in m.graph.nodes
                 if n.op == "call_function" and n.name.startswith("bucket")), None)
    return None if node is None else node.format_node()


def lone_gradient_reduce(program: Program) -> str | None:
    """A returned gradient all-reduced on its own (``wait(all_reduce(grad))``), not in a bucket."""
    returned = {v for v in program.module.graph.output_node().args[0] if isinstance(v, fx.Node)}
    for node in program.module.graph.find_nodes(op="call_function", target=_ALL_REDUCE):
        if not node.name.startswith("bucket") and any(u in returned for u in node.users):
            return node.format_node()
    return None


def returned_gradient(program: Program) -> str | None:
    """A gradient the program still returns."""
    values = program.module.graph.output_node().args[0]
    for value, role in zip(values, program.outputs):
        if role.kind is M.OutputKind.GRAD and value is not None:
            return f"output grad {role.name}"
    return None


def no_parts(program: Program) -> str | None:
    parts = [name for name, _ in program.module.named_children() if name.endswith("_F")]
    return None if parts else "the program's module calls no stage{s}_F part"


_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
NO_KERNEL = holds("no fused Triton kernel yet (the ATen ops it replaces all there)",
                  "Triton kernel", first_kernel)
NO_BUCKET = holds("no gradient bucket yet", "bucket", first_bucket)
BUCKETED = holds("every returned gradient's all-reduce in a bucket", "bucket",
                 lone_gradient_reduce)
