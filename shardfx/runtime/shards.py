"""Local shards on this rank: cutting full tensors by placements, and putting them back.

The program's inputs carry their placements (ANNOTATION). On a mesh this rank holds, for a
tensor ``Shard(d)`` on an axis of size n, the slice ``coord * size : (coord + 1) * size`` of
dim ``d`` (shard_propagate guarantees even sizes), and on ``cp`` its two chunks of the
sequence, a front and a back one (``cp_layout``), and for a strided split its slice of each
part (``strided``); ``Replicate`` keeps it whole. Full tensors come back with an all-gather per
sharded axis, the innermost first (a dim split over several axes is nested in mesh order),
cp's chunks and strided parts put back in order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardfx.ir import cp_layout

from shardfx.ir import strided
from shardfx.ir import meta as M
from shardfx.mesh import MeshSpec
from shardfx.runtime.mesh import coordinate, device_mesh


class Shards:
    def __init__(self, spec: MeshSpec, mesh=None):
        """Over ``spec``'s mesh; ``mesh``: an existing (sub-)DeviceMesh with those axes, as a
        pipeline stage's tp mesh."""
        self.spec = spec
        self.mesh = mesh if mesh is not None else device_mesh(spec)
        self.coord = coordinate(self.mesh)
        names = self.mesh.mesh_dim_names or ()
        self.groups = {axis: self.mesh.get_group(axis).group_name for axis in names}

    def local(self, full: torch.Tensor, placements: M.Placements) -> torch.Tensor:
        out = full
        for (axis, n), p in zip(self.spec.axes, placements):
            if cp_layout.chunked(p):
                out = cp_layout.take(cp_layout.call, out, tuple(out.shape), p.dim,
                                     self.coord[axis], n, cp_layout.split_factor(p))
            elif strided.factor(p) > 1:
                out = strided.take(cp_layout.call, out, tuple(out.shape), p.dim,
                                   self.coord[axis], n, strided.factor(p))
            elif isinstance(p, Shard):
                size = out.shape[p.dim] // n
                out = out.narrow(p.dim, self.coord[axis] * size, size)
        return out

    def full(self, local: torch.Tensor, placements: M.Placements) -> torch.Tensor:
        out = local.detach()
        for (axis, n), p in reversed(list(zip(self.spec.axes, placements))):
            if not isinstance(p, (Shard, _StridedShard)) or n == 1:
                continue
            front = out.movedim(p.dim, 0).contiguous()
            whole = front.new_empty((n * front.shape[0], *front.shape[1:]))
            dist.all_gather_single(whole, front, group=self.mesh.get_group(axis))
            if cp_layout.chunked(p):
                whole = cp_layout.unshuffle(cp_layout.call, whole, tuple(whole.shape), n,
                                            cp_layout.split_factor(p))
            elif strided.factor(p) > 1:
                whole = strided.unshuffle(cp_layout.call, whole, tuple(whole.shape), n,
                                          strided.factor(p))
            out = whole.movedim(0, p.dim)
        return out.contiguous()

    def mesh_input(self, role: M.InputRole):
        """The value of a MESH program input: ``group(tp)`` or ``coord(tp)``."""
        what, axis = role.name.rstrip(")").split("(")
        return self.groups[axis] if what == "group" else self.coord[axis]
