"""The device mesh a user asks for: named axes and their sizes.

``dp`` splits the batch over replicas of the model; ZeRO (``partition(..., zero=k)``) shards
their training state over it. ``dp_replicate`` splits the batch too, over replicas of a whole
dp group: HSDP, with ZeRO sharding within each dp group and the groups holding the same shards,
their gradients' rows all-reduced across groups. Outermost in the mesh, it spans nodes while
each dp group stays inside fewer of them: ``{"dp_replicate": 2, "dp": 8}`` on two nodes of 8
GPUs shards within a node and all-reduces 1/8 of the gradients across the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardfx.errors import MeshError

AXES = ("dp_replicate", "dp", "pp", "cp", "tp", "ep")
DATA_AXES = ("dp_replicate", "dp")  # the batch is split over both; ZeRO shards over dp only
STAGE_AXES = ("cp", "tp", "ep")  # a pipeline stage's program is split over these


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes in the canonical order dp_replicate, dp, pp, cp, tp, ep; axes of size 1 are
    kept as given."""

    axes: tuple[tuple[str, int], ...] = ()

    def only(self, *names: str) -> "MeshSpec":
        """The sub-mesh of the axes named (those the mesh has)."""
        return MeshSpec(tuple((a, n) for a, n in self.axes if a in names))

    def stage(self) -> "MeshSpec":
        """What each pipeline stage is sharded over (dp is the pipeline runner's: replicas of
        the whole pipeline)."""
        return self.only(*STAGE_AXES)

    def folded(self) -> "MeshSpec":
        """The mesh with HSDP's replicas folded into dp: ``dp_replicate=R, dp=D`` as ``dp=R*D``,
        the same ranks in the same places (dp_replicate is the outer of the two, rank-major) and
        the same batch split, with ZeRO sharding over all of them."""
        n = self.axis("dp_replicate") * self.axis("dp")
        return MeshSpec(tuple(("dp", n) if a == "dp" else (a, k) for a, k in
                              (self.axes if "dp" in dict(self.axes) else (("dp", 1), *self.axes))
                              if a != "dp_replicate"))

    def axis(self, name: str) -> int:
        """The size of axis ``name`` (1 when the mesh does not have it)."""
        return dict(self.axes).get(name, 1)

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.axes)

    def __str__(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.axes) or "1 device"

    @classmethod
    def parse(cls, mesh: "MeshSpec | dict[str, int] | str | None") -> "MeshSpec":
        """From ``{"dp": 2, "tp": 2}``, ``"dp=2,tp=2"``, ``None`` or ``{}`` (one device)."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if mesh is None:
            return cls()
        if isinstance(mesh, str):
            mesh = _parse_text(mesh)
        if not isinstance(mesh, dict):
            raise MeshError(f"mesh must be a dict of axis sizes, got {type(mesh).__name__}",
                            where="partition(..., mesh=...)", fix='e.g. mesh={"dp": 2, "tp": 2}')
        for axis, n in mesh.items():
            if axis not in AXES:
                raise MeshError(f"unknown mesh axis {axis!r}", where=f"mesh[{axis!r}]",
                                fix=f"use axes from {', '.join(AXES)}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise MeshError(f"mesh axis {axis} must be a positive int, got {n!r}",
                                where=f"mesh[{axis!r}]", fix="give each axis a size >= 1")
        return cls(tuple((a, mesh[a]) for a in AXES if a in mesh))


def _parse_text(text: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, eq, n = part.partition("=")
        if not eq or not n.strip().isdigit():
            raise MeshError(f"cannot read mesh {text!r}", where=f"part {part!r}",
                            fix="write it as axis=size pairs, e.g. dp=2,tp=2")
        out[axis.strip()] = int(n)
    return out
