"""Every ``node.meta`` key that shardfx writes, and the frozen values stored under them.

The IR is a ``torch.fx.GraphModule`` at ATen level. torch itself owns ``meta["val"]`` (the
FakeTensor of each node); everything else a shardfx pass reads or writes is listed here, so a
reader can find in one place what a key means and which pass produces it.

    key               on                 value          written by
    ----------------  -----------------  -------------  ------------------------------
    VAL               every value node   FakeTensor     torch (capture)
    ROLE              placeholders       InputRole      partitioner.capture
    CONSTANT          constant inputs    Constant       partitioner.capture
    OUTPUTS           the output node    tuple[OutputRole, ...]  partitioner.capture
    PHASE             call_function      Phase          passes.assign_phase
    COST              call_function      NodeCost       passes.estimate_cost
    ANNOTATION        placeholders       Placements     passes.shard_annotate
    SHARDING          call_function      NodeSharding   passes.shard_propagate
    STAGE             ops, inputs        int            passes.stage_cut
    REMAT             recomputed copies  str (original) auto.remat
    OFFLOAD           offloaded values   str (the op it returns before) auto.remat
    ZERO              parameter inputs   ZeroShard      passes.zero (ZeRO-3: a dp shard)
    BLOCK             ops of a repeat    BlockPlace     partitioner.stamp
    CHOICE            call_function      Placements...  auto.shard (operand placements)

Graph-level facts live in ``gm.meta[GRAPH]`` as a ``GraphInfo``; what
``passes.mixed_precision`` did in ``gm.meta[PRECISION]`` as its ``PrecisionReport``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

VAL = "val"
ROLE = "shardfx.role"
CONSTANT = "shardfx.constant"
OUTPUTS = "shardfx.outputs"
PHASE = "shardfx.phase"
COST = "shardfx.cost"
ANNOTATION = "shardfx.annotation"
SHARDING = "shardfx.sharding"
STAGE = "shardfx.stage"
REMAT = "shardfx.remat"
OFFLOAD = "shardfx.offload"
ZERO = "shardfx.zero"
GRAPH = "shardfx.graph"
BLOCK = "shardfx.block"
CHOICE = "shardfx.choice"
AUTO = "shardfx.auto"  # gm.meta: the solver's AutoReport (``auto.shard``)
PRECISION = "shardfx.precision"  # gm.meta: passes.mixed_precision.PrecisionReport
RANDOM = "shardfx.random"  # gm.meta: passes.rng.RandomReport
MASK = "shardfx.mask"  # attention ops: passes.causal_mask's AttentionMask
REPLICAS = "shardfx.replicas"  # a pipeline's split module: stage -> codegen.replicas.Reduction


class Mode(str, enum.Enum):
    """What the captured program computes."""

    TRAIN = "train"  # forward + loss + backward: the joint graph
    INFER = "infer"  # forward only

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class AttentionMask:
    """What an attention op's dense mask is (``passes.causal_mask``): ``kind`` causal | full |
    window | input | other, and ``detail`` in words, for messages."""

    kind: str
    detail: str


@dataclass(frozen=True)
class GraphInfo:
    """Facts about the whole graph, in ``gm.meta[GRAPH]``."""

    mode: Mode
    model: str  # the user's model class name, for messages and dumps
    mesh: tuple[tuple[str, int], ...] = ()  # axis sizes, once the graph is planned for a mesh


class InputKind(str, enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"  # a leaf of example_args
    TARGET = "target"  # a leaf of example_targets
    TANGENT = "tangent"  # d(loss)/d(loss): 1.0, or the loss scale under fp16
    MESH = "mesh"  # per-rank facts of a per-device program: a process group name, a coordinate
    CONSTANT = "constant"  # a tensor the model makes from Python values (x[:, [0, 1]]'s index),
    # or reads from outside the model (a global, a tensor loss_fn closes over)
    RNG = "rng"  # i64[3] [seed, step, slice]: the random stream's state (passes.rng)
    GRAD = "grad"  # a gradient a pipeline stage made, into its dp reduction (codegen.replicas)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class InputRole:
    """What a placeholder stands for.

    ``name`` is the module FQN for parameters and buffers (``transformer.h.0.attn.c_attn.weight``),
    ``args[i]`` / ``targets[i]`` for the i-th flattened leaf of the user's inputs, ``loss`` for
    the tangent, the name torch gave a constant (``_tensor_constant0``) or, for a tensor read
    from outside the model, the user's name for it (``class_weights``; its value is in the
    placeholder's ``CONSTANT``). ``aliases`` lists other FQNs bound to the same tensor (tied
    weights, e.g. GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``).
    """

    kind: InputKind
    name: str
    index: int | None = None  # flat leaf index, for INPUT and TARGET
    aliases: tuple[str, ...] = ()

    def __str__(self) -> str:
        s = f"{self.kind} {self.name}"
        if self.aliases:
            s += " (= " + ", ".join(self.aliases) + ")"
        return s


@dataclass(frozen=True, eq=False)
class Constant:
    """The value of a CONSTANT input: a tensor the traced code built from Python values, such as
    the index of ``h[:, [0, 1]]``, or read from outside the model, such as a module-level global
    or class weights ``loss_fn`` closes over (``partitioner.constants``), as it was when the
    model was partitioned. torch leaves such tensors in the graph as module attributes; shardfx
    makes each an input like the others (torch.export lifts constants alike), so every program,
    on one device, sharded or cut into pipeline stages, takes it as an input the runner feeds.
    A constant is the same on every device: replicated on every mesh axis. Compared by identity
    (tensors have no single truth value)."""

    value: torch.Tensor

    def __str__(self) -> str:
        return f"constant {list(self.value.shape)} {self.value.dtype}"


class OutputKind(str, enum.Enum):
    LOSS = "loss"
    OUTPUT = "output"  # a flattened leaf of the model's output (inference)
    GRAD = "grad"  # gradient of the parameter named
    BUFFER_UPDATE = "buffer_update"  # new value of a buffer mutated in forward (BatchNorm stats)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class OutputRole:
    kind: OutputKind
    name: str  # FQN for GRAD / BUFFER_UPDATE, "loss", or "out[i]"
    index: int | None = None  # flat leaf index for OUTPUT

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


class Phase(str, enum.Enum):
    FORWARD = "fwd"
    BACKWARD = "bwd"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BlockPlace:
    """Where an op of a stamped list sits: the list (``model.layers``), forward or backward, and
    its place in the block's ops. Every block's op at the same place is the same op on values of
    the same shapes (``partitioner.stamp`` proved it), so what is decided for one holds for all
    (``auto.shard`` gives them one set of variables)."""

    path: str
    unit: str  # "f" (forward) or "b" (backward)
    index: int


@dataclass(frozen=True)
class NodeCost:
    """Estimated work of one node: FLOPs, and bytes of the tensors it produces."""

    flops: int
    out_bytes: int

    def __str__(self) -> str:
        return f"flops={self.flops} bytes={self.out_bytes}"


# One DTensor placement (Shard(d), Replicate(), Partial()) per mesh axis, in mesh axis order.
Placements = tuple  # tuple[torch.distributed.tensor.Placement, ...]


def placements_str(p: Placements | None) -> str:
    """Compact form for dumps: ``S(0)R`` for Shard(0) on the first axis, Replicate on the second
    (``S(1,3)``: a strided split of dim 1 in 3 parts, ``_StridedShard(1, split_factor=3)``;
    ``C(1)``: dim 1 in cp's balanced chunks, ``ir.cp_layout.Chunks``)."""
    if p is None:
        return "-"
    if p and isinstance(p[0], tuple):  # several outputs
        return "(" + ", ".join(placements_str(x) for x in p) + ")"
    return "".join(_placement_str(x) for x in p) or "R"


def _placement_str(x) -> str:
    name = type(x).__name__
    if name == "Shard":
        return f"S({x.dim})"
    if name == "Replicate":
        return "R"
    if name == "Partial":
        return "P" if x.reduce_op == "sum" else f"P({x.reduce_op})"
    if name == "_StridedShard":  # dim ``dim`` is k parts, each split (``shardfx.ir.strided``)
        return f"S({x.dim},{x.split_factor})"
    if name == "Chunks":  # cp's balanced chunks (``shardfx.ir.cp_layout``)
        return f"C({x.dim})"
    if name == "StridedChunks":
        return f"C({x.dim},{x.split_factor})"
    return str(x)


@dataclass(frozen=True)
class NodeSharding:
    """How one op runs on the mesh.

    ``out``: placements of its result (a tuple of them for multi-output ops). ``inputs``: the
    placements each tensor operand must have when the op runs, in operand order (the runtime
    redistributes an operand whose producer left it otherwise). ``local_args`` / ``local_kwargs``:
    the op's arguments with global shapes rewritten to per-device shapes (``view(x, [8, 32])``
    becomes ``view(x, [4, 32])``), or None when they are unchanged; ``local_op`` the overload to
    call with them when the rule chose another (``squeeze.dim`` -> ``squeeze.dims``). ``replicated``: no sharding
    rule applied, so the op runs on full tensors (correct, costlier; the dump lists these).
    """

    out: Placements
    inputs: tuple[Placements | None, ...] = ()
    local_args: tuple | None = None
    local_kwargs: dict | None = None
    local_op: object = None
    replicated: bool = False

    def __str__(self) -> str:
        s = placements_str(self.out)
        return s + " (no rule: replicated)" if self.replicated else s


@dataclass(frozen=True)
class ZeroShard:
    """How ZeRO holds a tensor over dp (a parameter, its gradient, its optimizer state): dp
    ranks each hold ``per_rank`` rows (dim 0) of the tensor the program computes with (its tp
    shard, of ``shape``), rank i rows ``i * per_rank`` on, the last ranks' padded with zeros
    (FSDP2's layout). A 0-d tensor counts as one row. The all-gather of the dp ranks' shards is
    the padded tensor, whose first ``rows`` rows are the tensor."""

    shape: tuple[int, ...]  # the tensor's shape on this rank without ZeRO (its tp shard)
    dp: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def per_rank(self) -> int:
        return -(-self.rows // self.dp)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.per_rank, *self.shape[1:])

    @property
    def row_numel(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    def held_rows(self, index: int) -> int:
        """Rows of the tensor (not padding) dp rank ``index`` holds."""
        return max(0, min(self.per_rank, self.rows - index * self.per_rank))

    def __str__(self) -> str:
        return f"zero {list(self.shard_shape)} of {list(self.shape)} over dp={self.dp}"
