"""Gradient buckets across data-parallel replicas of a pipeline, reduced while the step runs.

    buckets = GradBuckets(group, size=2, mean=True)
    buckets.add(g)      # after the action that made g's last contribution on this rank
    ...
    buckets.finish()    # after the last action: wait, then every g holds the replicas' mean

A gradient is final on a pipeline rank after the last action that adds to it (its stage's last
microbatch's backward: ``final_gradients``). ``add`` packs final gradients, in the order they become final, into
buckets of one dtype and at most ``BUCKET_BYTES`` (a larger one alone), and starts a bucket's
all-reduce (``async_op``) as soon as it is full: the reduction of the last stages' gradients
runs while the rank computes the backward of earlier microbatches and stages, as DDP overlaps
its buckets with the backward (Li et al. 2020). On NCCL the all-reduce runs on the process
group's own CUDA stream, and the default stream waits for it only in ``finish``; on gloo it
runs on gloo's thread. A bucket whose all-reduce has completed is written back between actions
(``retire``), so its buffer goes early. Every replica of a pipeline rank runs the same actions, so their buckets
are the same gradients in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.runtime.zero import padded


class GradBuckets:
    def __init__(self, group: dist.ProcessGroup, size: int, mean: bool,
                 reduce_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
                 rows: dict | None = None):
        """``mean``: average over the ``size`` replicas (as DDP), else sum; ``reduce_dtype``:
        a narrower dtype to sum in (``Precision.reduce``). ``rows`` (ZeRO-2: FQN ->
        ``ZeroShard``): reduce-scatter instead, each replica getting its rows of each gradient
        in ``self.rows`` (by FQN); the gradients themselves are left as they were."""
        self.group, self.size, self.mean = group, size, mean
        self.reduce_dtype, self.bucket_bytes = reduce_dtype, bucket_bytes
        self.layouts = rows
        self.rows: dict[str, torch.Tensor] = {}
        self._open: list[tuple[torch.Tensor, str | None]] = []
        self._bytes = 0
        self._flying: list[tuple[list, torch.Tensor, object, list]] = []  # in order
        self._done = 0  # buckets written back before finish

    def add(self, grad: torch.Tensor, fqn: str | None = None) -> None:
        """``grad`` (of parameter ``fqn``) is final on this rank: bucket it, and start the
        bucket once full."""
        nbytes = grad.numel() * grad.element_size()
        if self._open and (self._open[0][0].dtype != grad.dtype
                           or self._bytes + nbytes > self.bucket_bytes):
            self._start()
        self._open.append((grad, fqn))
        self._bytes += nbytes
        if self._bytes >= self.bucket_bytes:
            self._start()

    def _start(self) -> None:
        bucket, self._open, self._bytes = self._open, [], 0
        if self.layouts is None:
            flat = torch.cat([g.reshape(-1) for g, _ in bucket])
        else:  # rank-major: each replica's rows of every gradient together (codegen.zero)
            flat = torch.cat([padded(g, self.layouts[fqn]).reshape(self.size, -1)
                              for g, fqn in bucket], dim=1).reshape(-1)
        if self.reduce_dtype is not None and flat.is_floating_point():
            flat = flat.to(self.reduce_dtype)  # summed narrower, widened back in finish
        if self.layouts is None:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._flying.append((bucket, flat, work, [flat]))
            return
        out = flat.new_empty(flat.numel() // self.size)
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        self._flying.append((bucket, out, work, [out]))  # gloo copies the input

    def retire(self) -> None:
        """Write back the buckets whose all-reduce has completed (without waiting), so their
        buffers go before the step ends."""
        while self._flying and self._flying[0][2].is_completed():
            self._write_back(*self._flying.pop(0))
            self._done += 1

    def finish(self) -> int:
        """Start the last bucket, wait for every one, and write the results back into the
        gradients. Returns how many all-reduces the step took."""
        if self._open:
            self._start()
        for flying in self._flying:
            self._write_back(*flying)
        done, self._done, self._flying = self._done + len(self._flying), 0, []
        return done

    def _write_back(self, bucket: list, result: torch.Tensor, work, scratch: list) -> None:
        """Wait for ``work``, then its ``result`` into the gradients (ZeRO-2: into
        ``self.rows``). The ``scratch`` buffers (the all-reduced bucket; the reduce-scatter's
        output unless the rows view it) are freed here: the process group's own thread (gloo's worker, NCCL's watchdog) holds the
        work and its tensors a while after the wait, so dropping them would free the memory at
        a moment that differs from step to step."""
        work.wait()
        wide = result.to(bucket[0][0].dtype)
        if self.mean:
            wide /= self.size
        if self.layouts is not None:  # ZeRO-2: this replica's rows of each
            shapes = [self.layouts[fqn].shard_shape for _, fqn in bucket]
            sizes = [torch.Size(s).numel() for s in shapes]
            for (_, fqn), part, shape in zip(bucket, wide.split(sizes), shapes):
                self.rows[fqn] = part.view(shape)
        else:
            for (g, _), part in zip(bucket, wide.split([g.numel() for g, _ in bucket])):
                g.copy_(part.view_as(g))
        kept = wide.data_ptr() if self.layouts is not None else None  # the rows view it
        for t in scratch:
            if t.data_ptr() != kept:
                t.untyped_storage().resize_(0)
