"""A rank's ZeRO rows over dp, as the runner keeps them (``passes.zero``; layout: ``ZeroShard``).

    zero=1, 2   the program reads whole (tp-local) parameters. Each lives in a buffer of
                ``dp * per_rank`` rows; the program reads its first ``rows`` rows, and the
                optimizer steps this rank's ``per_rank`` rows of it, a view: an update writes
                the buffer itself, and ``gather`` (the plan's gather program: one all-gather per
                bucket) brings every rank's updated rows in after the step. The gradient comes
                whole (zero=1: this rank's rows are cut from it) or as this rank's rows (zero=2).
    zero=3      the program reads this rank's rows and gathers the rest itself; the optimizer
                steps those rows; the gradient comes as them.

So the optimizer's state, kept per stepped tensor, is 1/dp of plain data parallelism's at
every stage; padding rows hold zeros, get zero gradients, and stay zero under SGD, Adam and
AdamW (their updates of a zero element with a zero gradient are zero).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfx.ir import meta as M
from shardfx.runtime.released import released


def padded(whole: torch.Tensor | None, z: M.ZeroShard, like: torch.Tensor) -> torch.Tensor:
    """``whole`` (a tp-local tensor of layout ``z``) in a new ``(dp * per_rank, ...)`` tensor,
    padded with zero rows: rank i's rows are rows ``i * per_rank`` on. ``whole=None``: the
    rows left unset, to be filled (a meta model's, ``runtime.materialize``)."""
    out = torch.empty((z.dp * z.per_rank, *z.shape[1:]), dtype=like.dtype, device=like.device)
    out[z.rows:].zero_()
    if whole is not None:
        out[:z.rows].copy_(whole.reshape(z.rows, *z.shape[1:]))
    return out


class ZeroRows:
    def __init__(self, layouts: dict[str, M.ZeroShard], stage: int, index: int,
                 group: dist.ProcessGroup, gather: list | None = None):
        """``layouts``: FQN -> layout of each parameter ZeRO holds; ``index``: this rank's place
        on dp; ``gather``: the gather programs, one per bucket (zero=1, 2)."""
        self.layouts, self.stage, self.index, self.group = layouts, stage, index, group
        self._gather = gather or []
        self._padded: dict[str, torch.Tensor] = {}  # zero=1, 2: each parameter's dp rows

    def rows(self, fqn: str, whole: torch.Tensor, unset: bool = False) -> torch.Tensor:
        """This rank's rows of ``whole`` (a tp-local tensor), zero-padded: a new tensor.
        ``unset``: the rows ``whole`` would give left unset (to be filled), the padding zero."""
        z = self.layouts[fqn]  # only this rank's rows are made, not the whole padded tensor
        out = whole.new_empty(z.shard_shape)
        held, start = z.held_rows(self.index), self.index * z.per_rank
        out[held:].zero_()
        if held and not unset:
            out[:held].copy_(whole.reshape(z.rows, *z.shape[1:])[start:start + held])
        return out

    def hold(self, fqn: str, whole: torch.Tensor, unset: bool = False
             ) -> tuple[torch.Tensor, torch.nn.Parameter]:
        """What the program reads and what the optimizer steps for a parameter whose tp-local
        value is ``whole``: (whole, a view of its rows) under zero=1, 2; (rows, rows) under 3.
        ``unset``: ``whole`` has no values yet (a meta model's): only its shape and dtype count,
        nothing is copied, and the tensors are filled later."""
        z = self.layouts[fqn]
        if self.stage == 3:
            rows = torch.nn.Parameter(self.rows(fqn, whole, unset))
            return rows, rows
        buffer = self._padded[fqn] = padded(None if unset else whole, z, whole)
        read = buffer[:z.rows].reshape(z.shape)
        mine = buffer[self.index * z.per_rank:(self.index + 1) * z.per_rank]
        return read, torch.nn.Parameter(mine)

    def grad(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """The gradient the optimizer steps this rank's rows with, from the program's output."""
        return self.rows(fqn, value) if self.stage == 1 else value

    def after_step(self, stepped: dict[str, torch.Tensor], group_name: str) -> None:
        """zero=1, 2: every rank's updated rows into the parameters the program reads (each
        rank's rows copied into their place in the parameter's padded storage), a bucket at a
        time: one bucket's gathered buffer exists at once."""
        with torch.no_grad():
            for program in self._gather:
                self._gather_bucket(program, stepped, group_name)

    def _gather_bucket(self, program, stepped: dict[str, torch.Tensor], group_name: str) -> None:
        """One bucket, in a call of its own: its gathered buffer is gone before the next one's
        is made (a loop variable would hold a view of it)."""
        inputs = [stepped[role.name].detach() for role in program.inputs
                  if role.kind is M.InputKind.PARAM]
        gather = released(program.module, inputs[0].device)
        for role, rows in zip(program.outputs, gather(*inputs, group_name)):
            z = self.layouts[role.name]
            self._padded[role.name].view(z.dp, -1).copy_(rows)

    def whole(self, fqn: str, rows: torch.Tensor) -> torch.Tensor:
        """The tp-local tensor from every rank's ``rows`` of it (an all-gather over dp)."""
        z = self.layouts[fqn]
        out = rows.new_empty((z.dp * z.per_rank, *z.shape[1:]))
        dist.all_gather_single(out, rows.contiguous(), group=self.group)
        return out[:z.rows].reshape(z.shape)
