"""A pipeline rank's gradients combined over its dp replicas, while the step runs.

    buckets = ReplicaBuckets(reductions, group_name, device)   # this rank's stages'
    buckets.final(fqn, grads)   # after the action that made fqn's last contribution on this rank
    ...
    reduced = buckets.finish()  # after the last action: FQN -> the sum over dp (ZeRO-2: rows)

The reductions are the compiler's (``passes.program.replica_reductions``: each stage's
gradients through the same bucketing and ZeRO passes as an SPMD program's, cut into a part
per bucket and a finish part by ``codegen.replicas``). A gradient is final on a pipeline
rank after the last action that adds to it (its stage's last microbatch's backward:
``final_gradients``). Once every gradient of a bucket is, ``final`` runs the bucket's issue
part: its collective starts (on NCCL on the process group's own stream, on gloo on its
thread) and the rank goes on with the backward of earlier microbatches and stages, as DDP
overlaps its buckets (Li et al. 2020). ``finish`` runs each stage's finish part: the waits,
then the buckets split back into gradients. Every replica of a pipeline rank runs the same
actions, so their buckets start in the same order.
"""

from __future__ import annotations

import torch

from shardfx.codegen.replicas import Reduction
from shardfx.kernels.device import place
from shardfx.runtime.released import released


class ReplicaBuckets:
    def __init__(self, reductions: dict[int, Reduction], group_name: str, device: torch.device):
        """``reductions``: stage -> its ``Reduction``, for the stages this rank runs."""
        self.reductions, self.group_name, self.device = reductions, group_name, device
        self._bucket: dict[str, tuple[int, int]] = {}  # FQN -> (stage, bucket)
        for stage, r in reductions.items():
            for i, b in enumerate(r.buckets):
                place(b.issue, device)
                self._bucket.update({fqn: (stage, i) for fqn in b.names})
            place(r.finish, device)
        self._missing: dict[tuple[int, int], set[str]] = {}
        self._started: dict[tuple[int, int], torch.Tensor] = {}

    def start(self) -> None:
        """A new step: every bucket waits for all of its gradients."""
        self._missing = {(s, i): set(b.names) for s, r in self.reductions.items()
                         for i, b in enumerate(r.buckets)}
        self._started = {}

    def final(self, fqn: str, grads: dict[str, torch.Tensor]) -> None:
        """``fqn``'s gradient (in ``grads``) is final on this rank: start its bucket's
        collective once the bucket's last gradient is."""
        key = self._bucket[fqn]
        missing = self._missing[key]
        missing.discard(fqn)
        if not missing:
            stage, i = key
            bucket = self.reductions[stage].buckets[i]
            issue = released(bucket.issue, self.device)
            self._started[key] = issue(*[grads[n] for n in bucket.names], self.group_name)[0]

    def finish(self) -> dict[str, torch.Tensor]:
        """Wait for every bucket; FQN -> its gradient summed over dp (ZeRO-2: this replica's
        rows of it)."""
        out = {}
        for stage, r in sorted(self.reductions.items()):
            started = [self._started.pop((stage, i)) for i in range(len(r.buckets))]
            values = released(r.finish, self.device)(*started)
            out.update({role.name: v for role, v in zip(r.outputs, values)})
        return out

    @property
    def collectives(self) -> int:
        """Collectives a step issues."""
        return sum(len(r.buckets) for r in self.reductions.values())
