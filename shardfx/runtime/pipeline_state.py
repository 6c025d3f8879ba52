"""The pipeline runner's training state on every rank (``runtime.pipeline.PipelineRunner``).

Each rank holds its stages' tensors (tp shards) and steps the parameters whose gradients it
makes (under ZeRO-1/2, its dp replica's rows of them). A checkpoint takes what each rank holds
as it holds it (``holdings``, ``runtime.saving``); ``state_dict`` and ``grads`` give the full
tensors on every rank, each broadcast over pp by the rank that updates it (``_holder``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfx.ir import meta as M
from shardfx.runtime import hf_load, hf_save, saving
from shardfx.runtime.materialize import settle
from shardfx.runtime.optimizer_step import check_kept
from shardfx.runtime.runner import load_state
from shardfx.runtime.saving import Held, offsets, parts, zero_held


class PipelineState:
    """The state methods of ``PipelineRunner`` (its ``_params``, ``_buffers``, ``_stepped``,
    ``_owned``, ``_program``, ``_plan``, ``_tp``, ``_zero``, ``_pp`` and ranks)."""

    def parameters(self):
        """This rank's parameters (its tp shards; under ZeRO, its rows of those it owns), those
        its optimizer steps and the others it reads (a tied weight another rank owns)."""
        settle(self)
        return self.trained().values()

    def device_parameters(self):
        """This rank's parameters on its device (``parameters()`` unless the optimizer is
        offloaded: then those it steps are the host's copies)."""
        settle(self)
        return self.device_trained().values()

    def trained(self) -> dict[str, torch.Tensor]:
        """What this rank's optimizer steps and the parameters it reads, by FQN; offloaded,
        those it steps are the host's copies (``runtime.offload``)."""
        if getattr(self, "offload", None) is None:  # (none yet while the runner is made)
            return self.device_trained()
        return self.device_trained() | self.offload.masters

    def device_trained(self) -> dict[str, torch.Tensor]:
        return {**self.params, **self.stepped}

    def _changed(self) -> None:
        """The device's tensors are changing other than by a step: offloaded, the host's
        copies are filled from them again before the next step."""
        if getattr(self, "offload", None) is not None:
            self.offload.stale = True

    def save(self, path, **meta):
        """Write this runner's training state to the checkpoint ``path``, on every rank, all
        or nothing (``runtime.saving``); ``meta``: JSON entries of your own."""
        return saving.save(self, path, meta)

    def load(self, path, allow_nonfinite: bool = False) -> dict:
        """Load the checkpoint at ``path`` (saved on any mesh) into this runner, on every rank;
        returns its meta. NaN or Inf is an error unless ``allow_nonfinite`` (``Runner.load``)."""
        self._changed()
        return saving.load(self, path, allow_nonfinite)

    def load_hf(self, path, allow_nonfinite: bool = False) -> None:
        """Fill this rank's stages' tensors from the Hugging Face checkpoint directory ``path``
        (``runtime.hf_load``); on every rank. NaN or Inf is an error unless
        ``allow_nonfinite``."""
        self._changed()
        hf_load.load_hf(self, path, allow_nonfinite)

    def save_hf(self, path, max_shard_bytes: int = hf_save.SHARD_BYTES):
        """Write the model as a Hugging Face checkpoint directory (``runtime.hf_save``); on
        every rank, all or nothing."""
        return hf_save.save_hf(self, path, max_shard_bytes)

    def whole(self, fqn: str) -> torch.Tensor:
        """The full tensor ``fqn`` on every rank: its stage's tp shards gathered, then sent by
        the rank that holds it (``state_dict``, one tensor)."""
        settle(self)
        name = self.plan.canonical(fqn)
        model = self.plan.model
        shape = t = (dict(model.named_parameters()) | dict(model.named_buffers()))[name]
        if name in self.params:
            t = self.full(name, self.params[name])
        elif name in self.buffers:
            t = self.buffers[name]
        mine = {name: self._whole(name, t)} if self._holder(name) == self.rank else {}
        return self._gather(mine, {name: shape})[name]

    def holdings(self, made: bool = True) -> tuple[dict, dict]:
        """What this rank holds, for a checkpoint (``Runner.holdings``): its stages' tensors (tp
        shards), and the parameters it owns as its optimizer steps them."""
        if made:
            settle(self)
        axes = self.tp.spec.axes if self.tp is not None else ()
        coord = self.tp.coord if self.tp is not None else {}
        model, stepped = {}, {}
        trained = self.trained()  # what the optimizer's state is kept for
        for fqn, t in {**self.params, **self.buffers}.items():
            placements = self.program.placements.get(fqn, ())
            model[fqn] = Held(t, offsets(t.shape, placements, axes, coord),
                              parts=parts(t.shape, placements, axes, coord))
        for fqn in self.owned:
            if fqn in self.stepped:
                z = self.zero.layouts[fqn]
                stepped[fqn] = (trained[fqn], zero_held(
                    self.stepped[fqn], z, self.dp_index, model[fqn].offsets, model[fqn].parts))
            else:
                stepped[fqn] = (trained[fqn], model[fqn])
        return model, stepped

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's full gradients, on every rank (each sent by its owner): a runner
        made with ``keep_grads=True`` keeps them."""
        check_kept(self.keep_grads)
        mine, trained = {}, self.trained()
        for fqn in sorted(self.owned):  # ZeRO: every replica's rows; then every tp shard
            g = trained[fqn].grad
            if g is not None:
                g = g.to(self.device)  # (offloaded: from the host)
                mine[fqn] = self.full(fqn, self.zero.whole(fqn, g) if fqn in self.stepped
                                       else g)
        return self._gather(mine, self._grad_shapes())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors on every rank, each sent by the rank that trains it. (The runner
        updates the model's own tensors in place, so a rank's copy of what it owns is current.)"""
        settle(self)
        model = self.plan.model
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        tensors |= {fqn: self.full(fqn, p) for fqn, p in self.params.items()}
        tensors |= self.buffers  # this rank's copies, on its device, updated by its steps
        mine = {fqn: self._whole(fqn, t) for fqn, t in tensors.items()
                if self._holder(fqn) == self.rank}  # one no stage reads: the model's, or made
        full = self._gather(mine, self._state_shapes())
        return {fqn: full[self.plan.canonical(fqn)] for fqn in self.plan.state_names}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every rank takes its weights (its tp shards) from a full state dict, as
        ``state_dict`` gives it."""
        def local(fqn: str, t: torch.Tensor) -> torch.Tensor:
            placements = self.program.placements.get(fqn, ())
            return t if self.tp is None or fqn not in self.params else \
                self.tp.local(t, placements)

        load_state(self.plan, state, {**self.params, **self.buffers}, local)
        self.unmade.filled()  # every tensor filled (load_state checks the names first)
        self._changed()

    def _holder(self, fqn: str) -> int:
        """The rank that holds ``fqn`` for state_dict: the one that updates it (its gradient or
        its buffer update), else the first that reads it."""
        for kind in (M.OutputKind.GRAD, M.OutputKind.BUFFER_UPDATE):
            rank = self.program.producer(kind, fqn)
            if rank is not None:
                return rank
        return min(self.program.readers(fqn), default=0)

    def _state_shapes(self) -> dict[str, torch.Tensor]:
        model = self.plan.model
        return dict(model.named_parameters()) | dict(model.named_buffers())

    def _grad_shapes(self) -> dict[str, torch.Tensor]:
        model = dict(self.plan.model.named_parameters())
        return {fqn: t for fqn, t in model.items()
                if self.program.producer(M.OutputKind.GRAD, fqn) is not None}

    def _gather(self, mine: dict, shapes: dict) -> dict[str, torch.Tensor]:
        out = {}
        for fqn in sorted(shapes):
            owner = self._holder(fqn)
            val = shapes[fqn]
            t = mine[fqn].detach().to(self.device, copy=True) \
                if self.rank == owner and mine.get(fqn) is not None \
                else torch.empty(val.shape, dtype=val.dtype, device=self.device)
            dist.broadcast(t, src=self.ranks[owner], group=self.pp)
            out[fqn] = t
        return out
