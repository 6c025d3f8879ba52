"""A plan: what shardfx decided for a model and mesh, ready to print, dump, and run.

``partition`` captures the model and hands it to the compiler (``compiler.compile``); a
``Plan`` is the compiler's result (``compiler.compiled.Compiled``: the IR, the programs, the
schedule, the history, and what the cost model predicts of them) with the methods users call:
``runner()``, ``print(plan)``, ``dump()``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from shardfx.codegen.program import Program
from shardfx.compiler.compiled import Compiled
from shardfx.compiler.driver import compile_ir, deferred_codegen
from shardfx.ir import meta as M
from shardfx.partitioner.capture import canonical_names, capture, microbatch
from shardfx.passes.stage_cut import weight_stages
from shardfx.report.dump import write_dump
from shardfx.report.experts import expert_layers
from shardfx.report.text import plan_text
from shardfx.runtime.loss_scale import LossScaling
from shardfx.errors import InputError
from shardfx.runtime.materialize import InitFn, on_meta
from shardfx.runtime.pipeline import PipelineRunner
from shardfx.runtime.runner import OptimizerFactory, Runner


class Plan(Compiled):
    def __init__(self, model: torch.nn.Module, example_args: tuple, compiled: Compiled):
        vars(self).update(vars(compiled))  # the compiler's result, as it left it
        self.model = model
        self._example_args = example_args
        # (scope, {layer: kernels.expert_load.Routed}) of the last step a runner took
        self.routing: tuple[str, dict] | None = None
        state = model.state_dict()
        self.state_names = tuple(state)
        self.state_shapes = {fqn: tuple(t.shape) for fqn, t in state.items()}  # full, unsharded
        self._canonical = canonical_names(model)
        self._inference: tuple[Program, pytree.TreeSpec] | None = None
        self._inference_stages: tuple | None = None
        if self.mode is M.Mode.INFER:
            self._inference = (self.program, self.captured.out_spec)

    # --- running ----------------------------------------------------------------------------

    def runner(self, optimizer: OptimizerFactory | None = None,
               loss_scaling: "LossScaling | bool | None" = None,
               clip_grad_norm: float | None = None, keep_grads: bool = False,
               init_seed: int | None = None, init: InitFn | None = None) -> Runner:
        """A runner for this plan; ``optimizer`` maps the parameters to a torch optimizer.
        ``loss_scaling``: dynamic loss scaling (``runtime.loss_scale``); None scales fp16
        plans only, False never, True or a ``LossScaling`` always. ``clip_grad_norm``: clip
        the global gradient norm to it before each optimizer step, as
        ``torch.nn.utils.clip_grad_norm_`` on one device (``runtime.optimizer_step``; the norm
        before clipping is ``runner.grad_norm``). Each step's gradients are freed after its
        optimizer step, as ``zero_grad(set_to_none=True)``; ``keep_grads=True`` keeps them in
        each parameter's ``.grad`` until the next step (and for ``runner.grads()``).

        A model on the meta device (built under ``torch.device("meta")``) is made by the runner,
        on first use (a load that fills it draws nothing): each
        rank only its own shards, one whole tensor at a time, by the model's own initialisation
        (Hugging Face's ``_init_weights``, else ``reset_parameters``) or ``init(module)``, each
        tensor from its own stream seeded by ``init_seed`` (``runtime.materialize``): every
        mesh starts from the weights ``shardfx.materialize(model, init_seed)`` gives one
        device (``init_seed`` 0 unless given). Either one for a model with no tensor on meta,
        whose weights are already made, is an error: it would change nothing."""
        if (init_seed is not None or init is not None) and not on_meta(self.model):
            given = "init_seed" if init is None else "init"
            raise InputError(
                f"plan.runner(..., {given}=...) has nothing to make: the model's weights are "
                "already made (none is on the meta device), and the runner trains them as they "
                "are", where=f"plan.runner(..., {given}=...)",
                fix="build the model under torch.device('meta') for the runner to make its "
                    f"weights with {given}=, or leave {given} out to train the weights it has")
        kw = dict(init_seed=0 if init_seed is None else init_seed, init=init)
        if self.stage_program is not None:
            return PipelineRunner(self, optimizer, loss_scaling, clip_grad_norm, keep_grads, **kw)
        return Runner(self, optimizer, loss_scaling, clip_grad_norm, keep_grads, **kw)

    def inference_program(self) -> tuple[Program, pytree.TreeSpec]:
        """The forward-only program (captured on first use for a training plan)."""
        if self._inference is None:
            with deferred_codegen():
                captured = capture(self.model, self._example_args,
                                   capacity=self.options.capacity_factor)
                _, program, _, _ = compile_ir(captured.gm, self.options)
            self._inference = (program, captured.out_spec)
        return self._inference

    def inference_stages(self) -> tuple[fx.GraphModule, fx.GraphModule, pytree.TreeSpec]:
        """A pipeline plan's forward-only per-stage program, the IR it was split from and the
        model output's structure. For a training plan it is captured on first use and cut where the
        training plan keeps each weight (``Options.follow_stages``), so every rank runs it on
        the parameters it trains."""
        if self._inference_stages is None:
            if self.mode is M.Mode.INFER:
                split, ir, spec = self.stage_program, self.ir, self.captured.out_spec
            else:
                options = dataclasses.replace(self.options, follow_stages=weight_stages(self.ir))
                with deferred_codegen():
                    captured = capture(self.model, microbatch(self._example_args, (),
                                                              self.options.slices)[0],
                                       capacity=self.options.capacity_factor)
                    ir, split, _, _ = compile_ir(captured.gm, options)
                spec = captured.out_spec
            self._inference_stages = (split, ir, spec)
        return self._inference_stages

    @property
    def input_names(self) -> tuple[str, ...]:
        """A step's flat inputs by name: ``args[0]``, ..., ``targets[0]``, ..."""
        return tuple(s.name for s in self.captured.leaves)

    # --- inspecting -------------------------------------------------------------------------

    @property
    def capture_path(self) -> str:
        """How the model was traced: ``"full trace"`` (with why, when repeated blocks were
        found but could not be stamped), or ``"stamped model.layers: 2 of 80 blocks traced, 78
        stamped"``: the others copied from the second (``partitioner.stamp``)."""
        return self.captured.path

    def __str__(self) -> str:
        return plan_text(self)

    @property
    def expert_layers(self) -> list:
        """Each mixture-of-experts layer: its name, experts, the ranks they are spread over
        and its capacity factor (``report.experts.ExpertLayer``)."""
        return expert_layers(self)

    @property
    def precision(self):
        """What ops compute in: a ``PrecisionReport`` (how many ops really compute in the low
        dtype, how many stay in their own (fp32; fp64 values are not cast), the casts, ops kept
        in fp32 for want of a kernel), or the fp32 ``Precision``."""
        return self.ir.meta.get(M.PRECISION, self.options.precision)

    def replicated_ops(self) -> list[str]:
        """Ops no sharding rule covered: they run on full tensors (correct, costlier)."""
        return [n.name for n in self.ir.graph.nodes
                if M.SHARDING in n.meta and n.meta[M.SHARDING].replicated]

    def __repr__(self) -> str:
        return f"<shardfx.Plan {self.summary.model} {self.mode} mesh={self.mesh}>"

    def dump(self, directory: str | os.PathLike) -> Path:
        """Write the IR after every pass (each file headed by what that pass changed; each op
        with its cost, module path and source line), the generated program (for a pipeline
        plan: each stage's F, B and W parts and the schedule), the summary (``plan.txt``) and
        ``plan.html``: one self-contained page with the layers and their placements, the
        stages, the memory, the collectives and the schedule (``report.dump``)."""
        return write_dump(self, directory)

    def canonical(self, fqn: str) -> str:
        return self._canonical.get(fqn, fqn)
