"""The ``torch.distributed`` DeviceMesh for a ``MeshSpec``, and this rank's place on it.

    mesh = device_mesh(MeshSpec.parse("dp=2,tp=2"))   # on each of 4 ranks
    coordinate(mesh)                                   # {"dp": 1, "tp": 0} on rank 2

The mesh's dimensions are the spec's axes, in the spec's order (dp_replicate, dp, pp, cp, tp, ep) and with its
names, so ``mesh["tp"]`` is this rank's tensor-parallel group. Ranks are laid out row-major:
the last axis varies fastest, as in ``torch.arange(world).view(sizes)``.

Across nodes: torchrun numbers ranks node by node (node n holds ranks n*G .. n*G + G-1 for G
processes per node), and the last axis varies fastest, so with ``tp`` no larger than G, and
dividing it, every tp group lies inside one node, on NVLink; pp neighbours come next, dp
outside them, and HSDP's dp_replicate outermost, across nodes. That is the order of their traffic: tp all-reduces activations twice
per layer, forward and backward, on the critical path; pp sends one activation (or its
gradient) per microbatch and cut, point to point; dp all-reduces the gradients once per step,
overlapped with the backward. A tp axis that a node cannot hold is a warning naming the fix.

Every group of the mesh waits as long as the default group: its timeout, set by
``init_process_group(timeout=...)`` (``shardfx.launch(timeout=...)`` passes it there), is
read back from the default group and given to each group the mesh creates. A rank that
stops before a tp all-reduce then fails its peers after that timeout, not torch's default
30 minutes for new groups.

A compile never counts against that timeout (``while_compiling``): a runner's call that may
compile (``kernels="compiled"``: its first with given inputs) runs with every group of the
process waiting up to the compile timeout instead (``shardfx.launch(compile_timeout=...)``,
30 minutes unless told), and ends with a barrier of every rank under it; only then do the
groups wait their own timeouts again. So a rank that compiles a region for a minute holds up
its peers' collectives without failing them, while a rank that dies ends the job as before
(the launcher or torchrun sees its exit; gloo's peers see its connections close), and one
that hangs fails its peers after the compile timeout, never later: torchtitan's
``init_timeout_seconds`` for its first step, per call that compiles.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardfx.errors import MeshError
from shardfx.mesh import MeshSpec

COMPILE_TIMEOUT_S = 1800.0  # torch's own default for a gloo group: a first compile takes minutes
_compile_timeout = timedelta(seconds=COMPILE_TIMEOUT_S)


def device_mesh(spec: MeshSpec | dict[str, int] | str) -> DeviceMesh:
    """Build the DeviceMesh of ``spec`` over the current (default) process group.

    Every rank must call it (each creates every group of the mesh, in the same order).
    Raises MeshError when torch.distributed is not initialized or its world size is not the
    number of devices the spec asks for.
    Ensures: each axis's group has the default group's timeout (``collective_timeout``).
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
                        where=f"plan.runner() of a plan for mesh {spec} (partition(..., "
                              f"mesh=...)), in a run of {world} processes",
                        fix=f"{run_with}, or plan for a mesh of {world} devices")
    _check_nodes(spec)
    # A one-device spec has no axes, but a DeviceMesh needs one dimension: give it dp=1.
    names, sizes = zip(*(spec.axes or (("dp", 1),)))
    grid = torch.arange(world).view(sizes)
    timeout = collective_timeout()
    groups = [_axis_group(grid, dim, name, timeout) for dim, name in enumerate(names)]
    return DeviceMesh.from_group(groups, _device_type(), grid, mesh_dim_names=names)


def _check_nodes(spec: MeshSpec) -> None:
    """Warn when tp groups would span nodes (``LOCAL_WORLD_SIZE``: processes per node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    inner = spec.axis("tp") * spec.axis("ep")
    if local and spec.size > local and inner > 1 and local % inner:
        warnings.warn(
            f"mesh {spec}: tp x ep = {inner} does not divide the {local} processes per node, "
            "so some tp groups span two nodes and their per-layer all-reduces cross the "
            "network; choose tp (x ep) dividing the GPUs per node, and scale across nodes "
            "with dp or pp", stacklevel=3)


def collective_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """How long a collective of ``group`` (default: the default process group) may wait
    (None: the backend has no timeout to read back, and new groups get torch's default)."""
    try:
        group = dist.group.WORLD if group is None else group
        backend = group._get_backend(torch.device(_device_type()))
    except RuntimeError:  # a process group with no backend of its own for this device
        return None
    return getattr(getattr(backend, "options", None), "_timeout", None)


def set_compile_timeout(seconds: float) -> None:
    """How long a collective may wait in a call that compiles (``while_compiling``);
    ``shardfx.launch(compile_timeout=...)`` sets it on every rank."""
    global _compile_timeout
    _compile_timeout = timedelta(seconds=seconds)


@contextmanager
def while_compiling() -> Iterator[None]:
    """Around a call that every rank makes and that may compile (module docstring): every
    group of this process waits up to the compile timeout (or its own timeout, if longer);
    the call ends with a barrier of every rank, under it, and then each group waits its own
    timeout again. Nothing to hold in a world of one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    own = {group: collective_timeout(group) for group in list(_world.pg_map)}
    own = {group: t for group, t in own.items() if t is not None}
    for group, t in own.items():
        _set_pg_timeout(max(t, _compile_timeout), group)
    try:
        yield
        dist.barrier()  # every rank has compiled what this call ran: no peer compiles now
    finally:
        for group, t in own.items():
            _set_pg_timeout(t, group)


def _axis_group(grid: torch.Tensor, dim: int, name: str,
                timeout: timedelta | None) -> dist.ProcessGroup:
    """This rank's group along ``dim`` of the rank ``grid``, created with ``timeout``.

    ``new_group`` must be called by every rank for every group, in the same order: each rank
    creates all the groups of the axis and keeps the one it belongs to. An axis spanning the
    whole world is the default group itself.
    """
    if grid.size(dim) == grid.numel():
        return dist.group.WORLD
    mine = None
    for ranks in grid.movedim(dim, -1).reshape(-1, grid.size(dim)).tolist():
        group = dist.new_group(ranks, timeout=timeout, group_desc=f"mesh_{name}")
        if dist.get_rank() in ranks:
            mine = group
    return mine


def channels(mesh: DeviceMesh, axis: str) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A process group of two ranks for each ordered pair (i, j) of this rank's places on
    ``axis``, which i sends to j on and nothing else: one direction per NCCL communicator, so
    a send its receiver has not reached yet delays no other message (``schedule.p2p``).

    Every rank must call it: each creates every pair group of every line of the axis, in the
    same order. Ensures: the groups wait as long as the default group (``collective_timeout``).
    """
    names = list(mesh.mesh_dim_names)
    dim = names.index(axis)
    size = mesh.mesh.size(dim)
    me, timeout, out = dist.get_rank(), collective_timeout(), {}
    for line in mesh.mesh.movedim(dim, -1).reshape(-1, size).tolist():
        for i in range(size):
            for j in range(size):
                if i == j:
                    continue
                group = dist.new_group([line[i], line[j]], timeout=timeout,
                                       group_desc=f"{axis}_{i}_to_{j}")
                if me in (line[i], line[j]):
                    out[(i, j)] = group
    return out


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
