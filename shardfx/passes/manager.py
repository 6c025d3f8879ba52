"""Running passes: one at a time, verified, with the IR text kept after each for ``plan.dump``.

A pass is a function ``(gm, options) -> gm``; its docstring has ``Requires:`` and ``Ensures:``
lines naming the meta keys it reads and writes. When a pass fails or breaks the IR, the
``PassError`` names the pass, the passes that ran before it, and the cause; a ``ShardfxError``
about the user's request (a dimension not divisible by its mesh axis) passes through as is. ``verify`` runs after each pass when
``options.debug`` is set or ``SHARDFX_DEBUG=1`` (the test suite sets it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from shardfx.errors import PassError, ShardfxError, VerifyError
from shardfx.mesh import MeshSpec
from shardfx.ir.text import ir_to_text
from shardfx.ir.verify import verify

log = logging.getLogger("shardfx.passes")

Pass = Callable[[fx.GraphModule, "Options"], fx.GraphModule]


@dataclass(frozen=True)
class Options:
    """What the user asked of ``partition``, as the passes see it."""

    mesh: MeshSpec = MeshSpec()
    shard: Any = "auto"  # "auto" | "megatron" | "replicate" | {param glob: placements}
    module_types: dict[str, str] = field(default_factory=dict)  # module FQN -> class name
    microbatches: int = 1  # slices of the batch a pipeline runs one at a time
    schedule: str = "1f1b"  # gpipe | 1f1b | zero-bubble (pipeline schedule)
    debug: bool = field(default_factory=lambda: os.environ.get("SHARDFX_DEBUG", "") == "1")

    virtual_stages: int = 1  # stages per pp rank (interleaved schedules)
    memory_budget: int | None = None  # bytes per device
    follow_stages: dict[str, tuple[int, ...]] | None = None  # weight FQN -> stages (stage_cut)
    loss_reduction: str = "mean"  # how a pipeline combines its slices' losses: mean | sum

    @property
    def slices(self) -> int:
        """Slices of the batch a step runs one at a time: microbatches, times the dp replicas of
        a pipeline (each its own rows); the program is traced on one."""
        return self.microbatches * (self.mesh.axis("dp") if self.mesh.axis("pp") > 1 else 1)

    @property
    def stages(self) -> int:
        """Pipeline stages: ``virtual_stages`` per rank of the pp axis."""
        return self.mesh.axis("pp") * (self.virtual_stages if self.mesh.axis("pp") > 1 else 1)


@dataclass
class PassRecord:
    name: str
    text: str  # the IR after the pass


def run_passes(gm: fx.GraphModule, passes: list[Pass], options: Options,
               history: list[PassRecord]) -> fx.GraphModule:
    """Apply ``passes`` in order; append the IR text after each one to ``history``."""
    if options.debug:
        verify(gm)
    for p in passes:
        name = p.__name__
        before = [r.name for r in history]
        try:
            gm = p(gm, options)
            if options.debug:
                verify(gm)
        except (PassError, VerifyError) as e:  # a pass broke the IR: shardfx's fault
            if isinstance(e, PassError):
                raise
            raise PassError(f"{type(e).__name__}: {e.cause}", where=_where(name, before, e.where),
                            fix=e.fix) from e
        except ShardfxError:  # the user's request cannot be met: its own message says why
            raise
        except Exception as e:
            raise PassError(f"{type(e).__name__}: {e}", where=_where(name, before, None),
                            fix="this is a shardfx bug; please report it with the IR dump "
                            "(SHARDFX_DUMP=dir)") from e
        history.append(PassRecord(name, ir_to_text(gm)))
        log.debug("ran %s", name)
    return gm


def _where(name: str, before: list[str], inner: str | None) -> str:
    s = f"pass {name} (after {', '.join(before) or 'capture'})"
    return f"{s}; {inner}" if inner else s
