"""What the user asked of ``partition``, as every pass, solver and program pass sees it: one
frozen ``Options``, made by ``partition`` from its keyword arguments (each documented there)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from shardfx.mesh import MeshSpec
from shardfx.request.precision import Precision


RECOMPUTE = ("auto", "none", "selective", "full")  # the recompute policies (auto.recompute)


@dataclass(frozen=True)
class Options:
    """What the user asked of ``partition``, as the passes see it."""

    mesh: MeshSpec = MeshSpec()
    shard: Any = "auto"  # "auto" | "megatron" | "megatron-sp" | "replicate" | {glob: placements}
    module_types: dict[str, str] = field(default_factory=dict)  # module FQN -> class name
    microbatches: int = 1  # slices of the batch run one at a time (a pipeline's, or accumulated)
    schedule: str = "1f1b"  # gpipe | 1f1b | zero-bubble (pipeline schedule)
    debug: bool = field(default_factory=lambda: os.environ.get("SHARDFX_DEBUG", "") == "1")

    virtual_stages: int = 1  # stages per pp rank (interleaved schedules)
    memory_budget: int | None = None  # bytes per device
    recompute: str = "auto"  # RECOMPUTE: what the backward recomputes (auto.recompute)
    optimizer: str | None = "adamw"  # the optimizer's kind, for its state (shardfx.estimate.memory)
    follow_stages: dict[str, tuple[int, ...]] | None = None  # weight FQN -> stages (stage_cut)
    loss_reduction: str = "mean"  # how a pipeline combines its slices' losses: mean | sum
    precision: Precision = Precision()  # what ops compute in (passes.mixed_precision)
    kernels: str = "auto"  # auto | compiled (runtime.lowered) | triton (passes.fusion) | aten
    fused_loss: bool | str = True  # the LM head's matmul and cross-entropy in chunks
    # (passes.fused_loss); "auto" is decided by the compiler (compiler.compile.choose_fused_loss)
    zero: int | str = 0  # ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters;
    # "auto" until the plan chooses (auto.zero_stage), an int in every program pass
    optimizer_in_backward: bool = False  # step each block's parameters as their gradients are
    # final, in the backward (codegen.step_in_backward)
    offload_optimizer: bool = False  # what the optimizer steps, its state and its step in host
    # memory (runtime.offload; codegen.gradients_to_host)
    capacity_factor: float | None = None  # MoE experts' capacity (shardfx.experts); None: dropless
    device: torch.device = torch.device("cpu")  # where the programs run (kernels.device)
    device_model: Any = None  # a shardfx.cost.device_model.DeviceModel: the speeds time is traded at
    held_by: int = 1  # the stages a pipeline's IR, planned over its stage mesh, is cut into:
    # each device holds about 1/held_by of its parameters (auto.shard's memory)
    whole_mesh: MeshSpec | None = None  # a pipeline's whole mesh, where ``mesh`` is a stage's:
    # the dp axis the ZeRO stage divides over (auto.zero_stage)
    folded_from: MeshSpec | None = None  # the HSDP mesh asked for, where zero="auto" folded its
    # replicas into dp because no stage within dp fits memory_budget (api._plan)

    @property
    def slices(self) -> int:
        """Slices of the batch a step runs one at a time: microbatches, times the dp replicas of
        a pipeline (each its own rows); the program is traced on one."""
        return self.microbatches * (self.mesh.axis("dp") if self.mesh.axis("pp") > 1 else 1)

    @property
    def stages(self) -> int:
        """Pipeline stages: ``virtual_stages`` per rank of the pp axis."""
        return self.mesh.axis("pp") * (self.virtual_stages if self.mesh.axis("pp") > 1 else 1)
