"""The pipeline runner's training state on every rank (``runtime.pipeline.PipelineRunner``).

Each rank holds its stages' tensors (tp shards) and steps the parameters whose gradients it
makes (under ZeRO-1/2, its dp replica's rows of them). A checkpoint takes what each rank holds
as it holds it (``_holdings``, ``runtime.saving``); ``state_dict`` and ``grads`` give the full
tensors on every rank, each broadcast over pp by the rank that updates it (``_holder``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfx.ir import meta as M
from shardfx.runtime import saving
from shardfx.runtime.optimizer_step import check_kept
from shardfx.runtime.runner import load_state
from shardfx.runtime.saving import Held, offsets, parts, zero_held


class PipelineState:
    """The state methods of ``PipelineRunner`` (its ``_params``, ``_buffers``, ``_stepped``,
    ``_owned``, ``_program``, ``_plan``, ``_tp``, ``_zero``, ``_pp`` and ranks)."""

    def parameters(self):
        """This rank's parameters (its tp shards; under ZeRO, its rows of those it owns), those
        its optimizer steps and the others it reads (a tied weight another rank owns)."""
        return self._trained().values()

    def _trained(self) -> dict[str, torch.Tensor]:
        return {**self._params, **self._stepped}

    def save(self, path, **meta):
        """Write this runner's training state to the checkpoint ``path``, on every rank, all
        or nothing (``runtime.saving``); ``meta``: JSON entries of your own."""
        return saving.save(self, path, meta)

    def load(self, path) -> dict:
        """Load the checkpoint at ``path`` (saved on any mesh) into this runner, on every rank;
        returns its meta."""
        return saving.load(self, path)

    def _holdings(self) -> tuple[dict, dict]:
        """What this rank holds, for a checkpoint (``Runner._holdings``): its stages' tensors (tp
        shards), and the parameters it owns as its optimizer steps them."""
        axes = self._tp.spec.axes if self._tp is not None else ()
        coord = self._tp.coord if self._tp is not None else {}
        model, stepped = {}, {}
        for fqn, t in {**self._params, **self._buffers}.items():
            placements = self._program.placements.get(fqn, ())
            model[fqn] = Held(t, offsets(t.shape, placements, axes, coord),
                              parts=parts(t.shape, placements, axes, coord))
        for fqn in self._owned:
            if fqn in self._stepped:
                z = self._zero.layouts[fqn]
                stepped[fqn] = (self._stepped[fqn], zero_held(
                    self._stepped[fqn], z, self._dp_index, model[fqn].offsets, model[fqn].parts))
            else:
                stepped[fqn] = (self._params[fqn], model[fqn])
        return model, stepped

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's full gradients, on every rank (each sent by its owner): a runner
        made with ``keep_grads=True`` keeps them."""
        check_kept(self.keep_grads)
        mine, trained = {}, self._trained()
        for fqn in sorted(self._owned):  # ZeRO: every replica's rows; then every tp shard
            g = trained[fqn].grad
            if g is not None:
                mine[fqn] = self._full(fqn, self._zero.whole(fqn, g) if fqn in self._stepped
                                       else g)
        return self._gather(mine, self._grad_shapes())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors on every rank, each sent by the rank that trains it. (The runner
        updates the model's own tensors in place, so a rank's copy of what it owns is current.)"""
        model = self._plan.model
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        tensors |= {fqn: self._full(fqn, p) for fqn, p in self._params.items()}
        tensors |= self._buffers  # this rank's copies, on its device, updated by its steps
        mine = {fqn: t for fqn, t in tensors.items() if self._holder(fqn) == self.rank}
        full = self._gather(mine, self._state_shapes())
        return {fqn: full[self._plan.canonical(fqn)] for fqn in self._plan.state_names}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank takes its weights (its tp shards) from a full state dict, as
        ``state_dict`` gives it."""
        def local(fqn: str, t: torch.Tensor) -> torch.Tensor:
            placements = self._program.placements.get(fqn, ())
            return t if self._tp is None or fqn not in self._params else \
                self._tp.local(t, placements)

        load_state(self._plan, state, {**self._params, **self._buffers}, local)

    def _holder(self, fqn: str) -> int:
        """The rank that holds ``fqn`` for state_dict: the one that updates it (its gradient or
        its buffer update), else the first that reads it."""
        for kind in (M.OutputKind.GRAD, M.OutputKind.BUFFER_UPDATE):
            rank = self._program.producer(kind, fqn)
            if rank is not None:
                return rank
        return min(self._program.readers(fqn), default=0)

    def _state_shapes(self) -> dict[str, torch.Tensor]:
        model = self._plan.model
        return dict(model.named_parameters()) | dict(model.named_buffers())

    def _grad_shapes(self) -> dict[str, torch.Tensor]:
        model = dict(self._plan.model.named_parameters())
        return {fqn: t for fqn, t in model.items()
                if self._program.producer(M.OutputKind.GRAD, fqn) is not None}

    def _gather(self, mine: dict, shapes: dict) -> dict[str, torch.Tensor]:
        out = {}
        for fqn in sorted(shapes):
            owner = self._holder(fqn)
            val = shapes[fqn]
            t = mine[fqn].detach().to(self.device, copy=True) \
                if self.rank == owner and mine.get(fqn) is not None \
                else torch.empty(val.shape, dtype=val.dtype, device=self.device)
            dist.broadcast(t, src=self._ranks[owner], group=self._pp)
            out[fqn] = t
        return out
