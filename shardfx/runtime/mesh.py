"""The ``torch.distributed`` DeviceMesh for a ``MeshSpec``, and this rank's place on it.

    mesh = device_mesh(MeshSpec.parse("dp=2,tp=2"))   # on each of 4 ranks
    coordinate(mesh)                                   # {"dp": 1, "tp": 0} on rank 2

The mesh's dimensions are the spec's axes, in the spec's order (dp, pp, tp, ep) and with its
names, so ``mesh["tp"]`` is this rank's tensor-parallel group. Ranks are laid out row-major:
the last axis varies fastest, as in ``torch.arange(world).view(sizes)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardfx.errors import MeshError
from shardfx.mesh import MeshSpec


def device_mesh(spec: MeshSpec | dict[str, int] | str) -> DeviceMesh:
    """Build the DeviceMesh of ``spec`` over the current (default) process group.

    Raises MeshError when torch.distributed is not initialized or its world size is not the
    number of devices the spec asks for.
    """
    spec = MeshSpec.parse(spec)
    run_with = (f"launch with torchrun --nproc-per-node {spec.size} "
                f"or shardfx.launch(..., nprocs={spec.size})")
    if not (dist.is_available() and dist.is_initialized()):
        raise MeshError(f"mesh {spec} needs torch.distributed, which is not initialized in "
                        "this process", where="shardfx.runtime.mesh.device_mesh", fix=run_with)
    world = dist.get_world_size()
    if world != spec.size:
        raise MeshError(f"mesh {spec} needs {spec.size} processes, this run has {world}",
                        where="shardfx.runtime.mesh.device_mesh", fix=run_with)
    # A one-device spec has no axes, but a DeviceMesh needs one dimension: give it dp=1.
    names, sizes = zip(*(spec.axes or (("dp", 1),)))
    return init_device_mesh(_device_type(), sizes, mesh_dim_names=names)


def coordinate(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's index along each named axis of ``mesh``, e.g. ``{"dp": 1, "tp": 0}``."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise MeshError(f"rank {dist.get_rank()} is not in {mesh}",
                        where="shardfx.runtime.mesh.coordinate",
                        fix="ask for the coordinate on a rank that the mesh contains")
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return dict(zip(names, coord))


def _device_type() -> str:
    """"cuda" when the process group can talk CUDA (NCCL) and a GPU is there, else "cpu"."""
    backend = str(dist.get_backend())
    return "cuda" if torch.cuda.is_available() and "nccl" in backend else "cpu"
