"""Local shards on this rank: cutting full tensors by placements, and putting them back.

The program's inputs carry their placements (ANNOTATION). On a mesh this rank holds, for a
tensor ``Shard(d)`` on an axis of size n, the slice ``coord * size : (coord + 1) * size`` of
dim ``d`` (shard_propagate guarantees even sizes); ``Replicate`` keeps it whole. Full tensors
come back with DTensor's ``full_tensor`` (an all-gather per sharded axis).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

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
            if isinstance(p, Shard):
                size = out.shape[p.dim] // n
                out = out.narrow(p.dim, self.coord[axis] * size, size)
        return out

    def full(self, local: torch.Tensor, placements: M.Placements) -> torch.Tensor:
        if not any(isinstance(p, Shard) for p in placements):
            return local
        return DTensor.from_local(local, self.mesh, placements, run_check=False).full_tensor()

    def mesh_input(self, role: M.InputRole):
        """The value of a MESH program input: ``group(tp)`` or ``coord(tp)``."""
        what, axis = role.name.rstrip(")").split("(")
        return self.groups[axis] if what == "group" else self.coord[axis]
