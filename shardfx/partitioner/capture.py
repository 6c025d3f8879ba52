"""Capture: a model and example inputs become one ATen-level graph, forward and backward together.

Two torch steps, then our naming:

1. ``torch.export.export(strict=False)`` traces the Python model (Hugging Face models included)
   into a functional graph, lifting parameters and buffers to inputs. Each custom
   ``autograd.Function`` call is one carrier node there (``functions``), so that its own
   backward, not its forward's derivative, is what the next step traces.
2. ``aot_export_joint_with_descriptors`` re-traces that graph at ATen level with autograd, giving
   the joint forward+backward graph. Every input and output carries a descriptor saying what it is
   (parameter FQN, user input index, gradient of which parameter, mutated buffer).
3. We turn the descriptors into ``ROLE`` / ``OUTPUTS`` meta, give placeholders readable names,
   drop the ``None`` outputs, make tensor constants inputs (``CONSTANT``): those torch builds
   from Python values and the tensors the code reads from outside the model, closed over by
   ``loss_fn`` or global (``constants``); write a class-weighted mean loss as its sum over its
   total weight (``weighted_mean``), merge tied parameters into one input whose gradient is
   the sum, and check that every trainable parameter the loss depends on has its gradient
   (``gradients``).

For training the traced callable is ``loss_fn(model(*args), *targets)``; for inference, the model.
A model on the meta device is traced as on its run device (``fake``). A list of repeated blocks
is traced cut after two of them and the others are stamped (``repeats``, ``stamp``), which
gives the full trace's graph at the cost of two blocks; ``Captured.path`` says which ran, and
repeated blocks that cannot be stamped say why there and in a ``NotStampedWarning``. Ops
are named in program order last (``rename_in_order``), so either way reads the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import traceback
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._functorch._aot_autograd import descriptors as d
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from shardfx.errors import CaptureError, InputError, LossError, ShardfxError, user_line
from shardfx.kernels.experts import capacity_while_tracing, name_layers
from shardfx.partitioner.experts_hf import traced_as_shardfx_experts
from shardfx.ir import meta as M
from shardfx.ir.graph import copy_ir, fake_mode_of, insert_op, placeholder_name
from shardfx.partitioner.constants import (UserConstant, describe, as_buffers, mutated_constant,
                                           user_constants)
from shardfx.partitioner.fake import on_meta, run_device, traced_as
from shardfx.partitioner.functions import routed_through_carrier
from shardfx.partitioner.gradients import check_gradients, no_silent_backward
from shardfx.partitioner.microbatching import output_of
from shardfx.partitioner.repeats import (FULL, Reads, Repeat, cut_to_traced, differing_reads,
                                         find_repeats, glue_between, refusal, refused,
                                         warn_not_stamped)
from shardfx.partitioner.stamp import NotRepeatable, NotStampable, rename_in_order, stamp
from shardfx.partitioner.weighted_mean import weighted_means_as_sums

log = logging.getLogger("shardfx.capture")


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one flattened input leaf, as captured (shapes are static)."""

    name: str  # args[i] / targets[i]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class Captured:
    """The IR and what is needed to call it with the user's own input structures."""

    gm: fx.GraphModule
    in_spec: pytree.TreeSpec  # of (args, targets)
    leaves: tuple[LeafSpec, ...]  # one per flattened leaf of (args, targets)
    out_spec: pytree.TreeSpec | None  # the model output's structure (inference)
    output: tuple | None = None  # training: the model output as traced (microbatching.output_of)
    path: str = FULL  # how: "full trace" (with why, for repeated blocks that were not
    # stamped: repeats.refusal), or which repeated blocks were stamped
    pair: tuple[fx.GraphModule, Repeat] | None = None  # one repeated list's traced pair, unstamped

    @property
    def depth(self) -> int:
        """Blocks in the stamped list (0 when nothing was stamped)."""
        return self.pair[1].count if self.pair else 0

    def at_depth(self, blocks: int) -> fx.GraphModule:
        """The IR of the same model with its stamped list cut to ``blocks`` blocks (at least
        the traced pair, at most ``depth``): what ``capture`` gives when the list is that long.
        A shallow copy planned like the whole one shows, block for block, what the whole one
        does (``shardfx.compiler.shallow``)."""
        gm, repeat = self.pair
        if not repeat.traced <= blocks <= repeat.count:
            raise ValueError(f"{repeat.path} has {repeat.count} blocks, {repeat.traced} traced: "
                             f"cannot cut it to {blocks}")
        grown = copy_ir(gm)
        if blocks > repeat.traced:
            stamp(grown, dataclasses.replace(repeat, count=blocks))
        rename_in_order(grown.graph)
        grown.recompile()
        return grown


def capture(
    model: torch.nn.Module,
    args: tuple,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: tuple = (),
    *,
    blocks: bool | None = None,
    capacity: float | None = None,
) -> Captured:
    """Trace ``model`` (and ``loss_fn``) into the IR. Raises ``CaptureError``/``LossError``/
    ``InputError`` naming the cause, the place, and what to do. ``blocks``: trace two blocks of
    each repeated list and stamp the rest (``stamp``), falling back to the full trace when they
    are not interchangeable; False: always the full trace; None: unless ``SHARDFX_BLOCKS=0``.
    Mixture-of-experts layers trace as ``shardfx::experts`` (``shardfx.experts``), with the
    ``capacity`` factor (None: dropless)."""
    _check_inputs(model, args, loss_fn, targets)
    mode = M.Mode.TRAIN if loss_fn is not None else M.Mode.INFER
    in_spec = pytree.tree_flatten((args, targets))[1]
    n_args = len(pytree.tree_leaves(args))
    leaves = capture_leaves(args, targets)

    traced: torch.nn.Module = model if mode is M.Mode.INFER else _LossOf(model, loss_fn)
    # Trace on fresh tensors: if two example leaves were one tensor (labels=input_ids), tracing
    # would fuse them into one graph input and a later step with different ones would be wrong.
    args, targets = pytree.tree_map_only(torch.Tensor, torch.empty_like, (args, targets))
    example = args if mode is M.Mode.INFER else (args, targets)
    if blocks is None:
        blocks = os.environ.get("SHARDFX_BLOCKS", "1") != "0"
    repeats, refusals, why_not = find_repeats(model) if blocks else ([], [], [])
    for reason in why_not:
        log.info("%s: not stamped, traced in full: %s", type(model).__name__, reason)
    gm, path, pair = None, refused(refusals[0]) if refusals else FULL, None
    if repeats and (why := _glue_between(model, args, repeats, mode is M.Mode.TRAIN)):
        path, repeats = refused(why), []
    while repeats:
        try:
            gm, reads, out_spec = _trace(model, traced, example, mode, n_args, repeats, capacity)
        except CaptureError as e:  # the model insists on all its blocks: trace them all
            gm, path = None, refused(f"the model cut after {repeats[0].traced} blocks of "
                                     f"{repeats[0].path} could not be traced: {e.cause}")
            break
        try:
            for r in repeats:
                if why := differing_reads(model, r, reads):
                    raise NotRepeatable(why)
            if len(repeats) == 1:  # kept to grow to any depth (Captured.at_depth)
                pair = (copy_ir(gm), repeats[0])
            for r in repeats:
                stamp(gm, r)
            path = "stamped " + ", ".join(map(str, repeats))
            break
        except NotStampable as e:
            gm, path, pair = None, refused(str(e)), None
            # a first block unlike the others (its input needs no gradient): try the next two
            later = [r.later() for r in repeats]
            repeats = later if all(later) and not isinstance(e, NotRepeatable) else []
    if gm is None:
        gm, _, out_spec = _trace(model, traced, example, mode, n_args, [], capacity)
    for why in filter(None, dict.fromkeys([*refusals, refusal(path)])):  # not only logged:
        warn_not_stamped(type(model).__name__, why)  # planning a deep model takes far longer
    log.info("%s: %s", type(model).__name__, path)
    rename_in_order(gm.graph)
    name_layers(gm.graph)  # each MoE layer's own name, stamped or traced
    gm.recompile()  # once, after all rewriting: Python codegen of a big graph is not free
    out_spec = out_spec if mode is M.Mode.INFER else None
    return Captured(gm, in_spec, leaves, out_spec, getattr(traced, "output", None), path, pair)


def _glue_between(model: torch.nn.Module, args: tuple, repeats: list[Repeat],
                  train: bool) -> str | None:
    """``repeats.glue_between`` on a run of the whole model on the meta device (no memory, no
    arithmetic, no trace)."""
    with _hf_cache_off(model), on_meta(model, args) as meta_args:
        return glue_between(model, repeats, meta_args, train)


def _trace(model: torch.nn.Module, traced: torch.nn.Module, example: tuple, mode: M.Mode,
           n_args: int, repeats: list[Repeat], capacity: float | None
           ) -> tuple[fx.GraphModule, Reads, Any]:
    """export, then the joint trace, then our IR: of the model with each of ``repeats`` cut to
    its first blocks (and the attributes they read), its experts as ``shardfx::experts``."""
    cut = cut_to_traced(model, repeats)
    with cut as reads, traced_as_shardfx_experts(model), capacity_while_tracing(capacity):
        device = run_device(model, example)  # on meta or a GPU: trace as on the CPU
        fakes = traced_as(model, example, device) if device else contextlib.nullcontext(example)
        with _hf_cache_off(model), fakes as fake_example, no_silent_backward(model), \
                routed_through_carrier():  # autograd.Functions keep their own backward
            ep = _export(traced, fake_example, model)
            _check_static(ep, model)
            prefix = "" if mode is M.Mode.INFER else _LossOf.PREFIX
            loss_fn = traced.loss_fn if isinstance(traced, _LossOf) else None
            constants = user_constants(ep, model, loss_fn, prefix)
            exported = ep.module()
            as_buffers(exported, constants)  # lifted by the joint trace, not met as real tensors
            with contextlib.ExitStack() as stack:
                grad_mode = torch.enable_grad() if mode is M.Mode.TRAIN else torch.no_grad()
                with grad_mode:
                    joint = aot_export_joint_with_descriptors(stack, exported, fake_example)
                gm = joint.graph_module
    _to_ir(gm, mode, model, prefix, n_args, constants)
    weighted_means_as_sums(gm.graph)  # a weighted mean loss split over dp is not a mean of means
    _merge_tied_parameters(gm, model)
    if mode is M.Mode.TRAIN:
        check_gradients(gm, ep, model, prefix, lambda: _eager_graded(traced, example, ep, prefix))
    return gm, reads, ep.call_spec.out_spec


def _eager_graded(traced: "_LossOf", example: tuple, ep: torch.export.ExportedProgram,
                  prefix: str) -> set[str]:
    """The parameters the traced program reads to which eager autograd gives a gradient:
    ``loss_fn(model(*args), *targets)`` and its backward run eagerly on fake tensors (shapes
    only, no memory), the user's own autograd Functions and checkpointing included."""
    model = traced.model
    wanted = {n.removeprefix(prefix) for n in ep.graph_signature.inputs_to_parameters.values()}
    with _hf_cache_off(model), traced_as(model, example, torch.device("cpu")) as fakes:
        args, targets = fakes
        params = [(n, p) for n, p in model.named_parameters() if n in wanted and p.requires_grad]
        mode = params[0][1].fake_mode if params else None
        if mode is None:
            return set()
        with mode, torch.enable_grad():
            loss = traced.loss_fn(model(*args), *targets)
            if not loss.requires_grad:
                return set()
            loss.backward()  # not autograd.grad: reentrant checkpointing refuses it
        return {n for n, p in params if p.grad is not None}  # the fakes' grads, dropped on exit


def capture_leaves(args: tuple, targets: tuple) -> tuple[LeafSpec, ...]:
    flat = pytree.tree_leaves((args, targets))
    n_args = len(pytree.tree_leaves(args))
    return tuple(LeafSpec(_leaf_name(i, n_args), tuple(t.shape), t.dtype) for i, t in enumerate(flat))


def microbatch(args: tuple, targets: tuple, n: int) -> tuple[tuple, tuple]:
    """The first of ``n`` equal slices of the batch (dim 0 of every input and target)."""
    if n == 1:
        return args, targets
    if not isinstance(n, int) or n < 1:
        raise InputError(f"microbatches must be a positive int, got {n!r}",
                         where="partition(..., microbatches=...)", fix="e.g. microbatches=4")
    n_args = len(pytree.tree_leaves(args))
    for i, t in enumerate(pytree.tree_leaves((args, targets))):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] % n:
            size = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else "no batch dim"
            raise InputError(
                f"{_leaf_name(i, n_args)} has batch size {size}, not divisible into "
                f"{n} microbatches", where=f"partition(..., microbatches={n})",
                fix=f"use a batch that is a multiple of {n}, or fewer microbatches")
    return pytree.tree_map_only(torch.Tensor, lambda t: t[: t.shape[0] // n], (args, targets))


# --- the traced callable -------------------------------------------------------------------


class _LossOf(torch.nn.Module):
    """``loss_fn(model(*args), *targets)`` as a module, so export lifts the model's parameters."""

    PREFIX = "model."

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        object.__setattr__(self, "loss_fn", loss_fn)  # not a submodule: its FQNs are not ours

    def forward(self, args: tuple, targets: tuple) -> torch.Tensor:
        out = self.model(*args)
        object.__setattr__(self, "output", output_of(out))  # for microbatching.loss_reduction
        try:
            loss = self.loss_fn(out, *targets)
        except ShardfxError:
            raise
        except Exception as e:
            raise LossError(
                f"loss_fn failed on the model's output and the targets: {type(e).__name__}: {e}",
                where=f"loss_fn({describe(out)}, {', '.join(describe(t) for t in targets)})",
                fix="make loss_fn accept what model(*example_args) returns (for Hugging Face "
                "models a ModelOutput: use out.logits) together with example_targets as given",
            ) from e
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise LossError(
                f"loss_fn must return a scalar tensor, got {describe(loss)}",
                where="the value returned by loss_fn",
                fix="reduce the loss to one number, e.g. return loss.mean() or use "
                "reduction='mean'",
            )
        if not loss.is_floating_point():
            raise LossError(
                f"loss_fn returned a {loss.dtype} tensor; a loss must be floating point",
                where="the value returned by loss_fn",
                fix="compute the loss in a floating dtype",
            )
        return loss.reshape(())


@contextlib.contextmanager
def _hf_cache_off(model: torch.nn.Module):
    """Hugging Face models return a KV cache (``DynamicCache``) unless ``use_cache=False``; a
    training step never reads it, and it is not a tensor the graph can return. Turn it off while
    tracing and restore the user's setting after."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        yield
        return
    log.info("%s: tracing with config.use_cache=False (the KV cache is for generation)",
             type(model).__name__)
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _export(traced: torch.nn.Module, example: tuple, model: torch.nn.Module):
    try:
        return torch.export.export(traced, example, strict=False)
    except ShardfxError:
        raise
    except Exception as e:
        where = _user_frame(e) or type(model).__name__
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CaptureError(
            f"{type(model).__name__} could not be traced: {type(e).__name__}: {first}",
            where=where,
            fix="make that line traceable: no Python branching on tensor values (use torch.where "
            "or torch.cond), no .item()/.tolist() in forward, no non-tensor outputs that "
            "depend on data; torch.export's non-strict mode is what shardfx traces with",
        ) from e


def _check_static(ep: torch.export.ExportedProgram, model: torch.nn.Module) -> None:
    """torch.export's non-strict mode records a value read from a tensor into Python (``.item()``,
    ``.tolist()``) or a shape that depends on the data (``nonzero``) as an unbacked symbol; the
    joint trace cannot follow it. Raise a CaptureError at the first such node's line."""
    for node in ep.graph.nodes:
        if "val" in node.meta and free_unbacked_symbols(node.meta["val"]):
            name = type(model).__name__
            raise CaptureError(
                f"{name} computes a value that depends on the data ({node.target}): a Python "
                "number read from a tensor, or a shape that depends on tensor values, which a "
                "static training graph cannot hold",
                where=user_line(node.meta.get("stack_trace")) or f"{name}, node {node.name}",
                fix="keep it a tensor: drop .item()/.tolist() and compute with the 0-dim tensor "
                "(it broadcasts like a number), choose with torch.where, and use a mask "
                "(torch.where(mask, x, 0)) instead of nonzero/masked_select")


def _user_frame(e: BaseException) -> str | None:
    """The innermost traceback frame outside torch itself, as 'file:line in fn: code'."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(torch_dir)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


# --- descriptors to IR ---------------------------------------------------------------------


def _to_ir(gm: fx.GraphModule, mode: M.Mode, model: torch.nn.Module, prefix: str, n_args: int,
           constants: dict[str, UserConstant]) -> None:
    """Replace aot's descriptors with our roles; flat calling convention; readable names.
    ``constants``: the buffers that stand for tensors read from outside the model, by FQN
    (``partitioner.constants``): CONSTANT inputs, after the others."""
    graph = gm.graph
    for node in graph.find_nodes(op="placeholder"):
        desc = node.meta["desc"]
        if isinstance(desc, d.BufferAOTInput) and desc.target in constants:
            const = constants[desc.target]
            node.meta[M.ROLE] = M.InputRole(M.InputKind.CONSTANT, const.name)
            node.meta[M.CONSTANT] = M.Constant(const.value)
            graph.find_nodes(op="placeholder")[-1].append(node)  # after the other inputs
        else:
            node.meta[M.ROLE] = _input_role(desc, prefix, n_args)
        node._rename(placeholder_name(node.meta[M.ROLE]))
    out_node = graph.output_node()
    values, roles = [], []
    for value, desc in zip(out_node.args[0], out_node.meta["desc"]):
        if isinstance(desc, d.InputMutationAOTOutput) and \
                getattr(desc.mutated_input, "target", None) in constants:
            raise mutated_constant(constants[desc.mutated_input.target], model)
        role = _output_role(desc, prefix, mode)
        if value is None or role is None:
            continue
        values.append(value)
        roles.append(role)
    out_node.args = (tuple(values),)
    out_node.meta[M.OUTPUTS] = tuple(roles)
    _lift_constants(gm)
    _drop_asserts(graph)
    if prefix:  # module paths as the user's model names them, like the parameters
        for node in graph.nodes:
            for key in ("nn_module_stack", "fwd_nn_module_stack"):
                if stack := node.meta.get(key):
                    node.meta[key] = {
                        k: (path.removeprefix(prefix) if path != prefix.rstrip(".") else "", cls)
                        for k, (path, cls) in stack.items()}
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs, a tuple out: no pytree specs
    gm.meta[M.GRAPH] = M.GraphInfo(mode=mode, model=type(model).__name__)


def _lift_constants(gm: fx.GraphModule) -> None:
    """Each tensor constant (``get_attr _tensor_constant0``: a tensor the model built from Python
    values, such as the index of ``h[:, [0, 1]]``) becomes a placeholder with a CONSTANT role and
    its value in ``CONSTANT``, after the other inputs. As an input it is planned (replicated),
    cut into pipeline stages and fed by the runner like any other; the attribute is dropped, so
    the value lives in one place. (Submodule attributes, the bodies of torch.cond and the like,
    stay as they are.)"""
    graph = gm.graph
    last = graph.find_nodes(op="placeholder")[-1]
    for node in graph.find_nodes(op="get_attr"):
        owner, _, attr = node.target.rpartition(".")
        value = getattr(gm.get_submodule(owner), attr)
        if not isinstance(value, torch.Tensor):
            continue
        role = M.InputRole(M.InputKind.CONSTANT, node.target)
        with graph.inserting_after(last):
            lifted = graph.placeholder(placeholder_name(role))
        lifted.meta.update(node.meta)
        lifted.meta[M.ROLE] = role
        lifted.meta[M.CONSTANT] = M.Constant(value.detach())
        if M.VAL not in lifted.meta:
            lifted.meta[M.VAL] = fake_mode_of(graph).from_tensor(value)
        node.replace_all_uses_with(lifted)
        graph.erase_node(node)
        delattr(gm.get_submodule(owner), attr)
        last = lifted


# Checks torch.export leaves in the graph; with static shapes they hold by construction.
_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default}


def _drop_asserts(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)


def _input_role(desc: d.AOTInput, prefix: str, n_args: int) -> M.InputRole:
    if isinstance(desc, d.ParamAOTInput):
        return M.InputRole(M.InputKind.PARAM, desc.target.removeprefix(prefix))
    if isinstance(desc, d.BufferAOTInput):
        return M.InputRole(M.InputKind.BUFFER, desc.target.removeprefix(prefix))
    if isinstance(desc, d.PlainAOTInput):
        i = desc.idx
        kind = M.InputKind.INPUT if i < n_args else M.InputKind.TARGET
        return M.InputRole(kind, _leaf_name(i, n_args), index=i)
    if isinstance(desc, d.TangentAOTInput):
        return M.InputRole(M.InputKind.TANGENT, "loss")
    raise CaptureError(
        f"the traced graph has an input shardfx does not know how to feed: {desc}",
        where="partitioner.capture",
        fix="report this model to shardfx; tensor subclasses and some exotic inputs are not "
        "supported yet",
    )


def _output_role(desc: d.AOTOutput | None, prefix: str, mode: M.Mode) -> M.OutputRole | None:
    if isinstance(desc, d.GradAOTOutput):
        target = desc.grad_of
        if isinstance(target, d.ParamAOTInput):
            return M.OutputRole(M.OutputKind.GRAD, target.target.removeprefix(prefix))
        return None  # gradients of user inputs are not used
    if isinstance(desc, d.InputMutationAOTOutput):
        src = desc.mutated_input
        if isinstance(src, d.BufferAOTInput):
            return M.OutputRole(M.OutputKind.BUFFER_UPDATE, src.target.removeprefix(prefix))
        raise CaptureError(
            f"the model mutates one of its inputs in place ({src})",
            where="the model's forward",
            fix="do not modify the example inputs in place inside forward; copy them first",
        )
    if isinstance(desc, d.PlainAOTOutput):
        if mode is M.Mode.TRAIN:  # the traced callable returns the loss alone
            return M.OutputRole(M.OutputKind.LOSS, "loss")
        return M.OutputRole(M.OutputKind.OUTPUT, f"out[{desc.idx}]", index=desc.idx)
    return None


def _leaf_name(i: int, n_args: int) -> str:
    return f"args[{i}]" if i < n_args else f"targets[{i - n_args}]"


# --- tied parameters -----------------------------------------------------------------------


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter and buffer FQN -> the first FQN its tensor is reachable by (a tied
    weight's other names map to the first)."""
    first: dict[int, str] = {}
    return {fqn: first.setdefault(id(t), fqn)
            for fqn, t in [*model.named_parameters(remove_duplicate=False),
                           *model.named_buffers(remove_duplicate=False)]}


def _merge_tied_parameters(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """One placeholder per distinct parameter tensor.

    torch.export lifts a tied weight once per FQN (GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight`` are one tensor). Keep the first FQN (as ``named_parameters``
    orders them), point the other placeholders' users at it, and sum their gradients: that is
    what autograd does for one leaf used twice.
    """
    alias_of = {fqn: first for fqn, first in canonical_names(model).items() if fqn != first}
    if not alias_of:
        return
    graph = gm.graph
    by_name = {n.meta[M.ROLE].name: n for n in graph.find_nodes(op="placeholder")}
    out = graph.output_node()
    values, roles = list(out.args[0]), list(out.meta[M.OUTPUTS])
    grad_at = {r.name: i for i, r in enumerate(roles) if r.kind is M.OutputKind.GRAD}
    aliases: dict[str, list[str]] = {}
    for alias, first in alias_of.items():
        if alias not in by_name or first not in by_name:
            continue
        aliases.setdefault(first, []).append(alias)
        by_name[alias].replace_all_uses_with(by_name[first])
        graph.erase_node(by_name[alias])
        if alias in grad_at:
            i = grad_at[alias]
            if first in grad_at:
                j = grad_at[first]
                with graph.inserting_before(out):
                    values[j] = insert_op(graph, torch.ops.aten.add.Tensor, values[j], values[i])
                values[i] = roles[i] = None
            else:
                roles[i] = M.OutputRole(M.OutputKind.GRAD, first)
                grad_at[first] = i
    for first, names in aliases.items():
        node = by_name[first]
        node.meta[M.ROLE] = M.InputRole(node.meta[M.ROLE].kind, first, aliases=tuple(names))
    out.args = (tuple(v for v in values if v is not None),)
    out.meta[M.OUTPUTS] = tuple(r for r in roles if r is not None)


def check_model(model: Any) -> None:
    """Raise an InputError naming what was given when ``model`` is not an ``nn.Module``."""
    if isinstance(model, torch.nn.Module):
        return
    given = type(model).__name__
    fix = "pass the torch.nn.Module itself: partition(model, example_args, ...)"
    if isinstance(model, dict):
        given = f"{given} of {len(model)} entries (a state dict?)"
        fix = "build the module and load the weights into it (model.load_state_dict(state)), " \
              "then pass the module"
    elif isinstance(model, str):
        given = f"the string {model!r}"
        fix = "build the model first (e.g. transformers.AutoModelForCausalLM.from_pretrained(" \
              "name) or your own nn.Module) and pass it"
    elif callable(model):
        given = f"{given} {getattr(model, '__qualname__', model)!r}"
        fix = "pass the torch.nn.Module (a function has no parameters to train); to plan a " \
              "function, wrap it in an nn.Module whose forward calls it"
    raise InputError(f"model must be a torch.nn.Module, got {given}",
                     where="partition(model, ...)", fix=fix)


def _check_inputs(model: Any, args: Any, loss_fn: Any, targets: Any) -> None:
    check_model(model)
    for what, value in (("example_args", args), ("example_targets", targets)):
        if not isinstance(value, tuple):
            raise InputError(
                f"{what} must be a tuple of inputs, got {describe(value)}",
                where=f"partition(..., {what}=...)",
                fix=f"wrap a single input in a tuple: ({what.split('_')[1][:-1]},)",
            )
        leaves = pytree.tree_leaves(value)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise InputError(
                    f"{what} may hold only tensors (in tuples, lists or dicts); leaf {i} is "
                    f"{type(leaf).__name__} {leaf!r}",
                    where=f"{what}, flattened leaf {i}",
                    fix="bind non-tensor options to the model instead (a wrapper module or "
                    "functools.partial in forward), or pass them as tensors",
                )
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(
            f"loss_fn must be callable, got {type(loss_fn).__name__}",
            where="partition(..., loss_fn=...)",
            fix="pass a function loss_fn(model_output, *targets) -> scalar tensor",
        )
    if loss_fn is None and targets:
        raise InputError(
            "example_targets were given without a loss_fn",
            where="partition(..., example_targets=...)",
            fix="pass loss_fn to train, or drop example_targets for inference",
        )
