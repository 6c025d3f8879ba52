"""How fast a device computes, reads memory and talks to its peers: the time model behind
every decision that trades time (``stage_cut``'s balance, ``remat``'s recompute cost, the
budget's schedule search, the ILP of ``auto_shard``) and behind ``plan.predicted_step``.

A ``DeviceModel`` holds a peak FLOP/s per dtype, a memory bandwidth, and two links: ``intra``
between devices of one node (NVLink), ``inter`` one device's port between nodes (InfiniBand).
Beside the device's memory it holds the host's, a second tier (``Host``): how much of it a
rank may fill and the link a tensor crosses each way (PCIe, or NVLink-C2C on a Grace Hopper),
for what offloading costs. An op takes

    max(flops / rate, bytes read and written / memory bandwidth)

(the roofline: a matmul is compute-bound, a pointwise op memory-bound). ``rate`` is the
dtype's peak, unless the model says what its kernels reach (``Throughput``, the GPU presets):
then a matmul runs at the fraction of peak the vendor library sustains on large shapes, less
what its shape wastes (partial tiles, a last partial wave of tiles over the SMs, a short K),
and a fused attention kernel at its published speed for the sequence, forward and backward.

A collective of ``n`` ranks takes NCCL's ring time on its axis's link (``collective_seconds``:
a fixed latency, one per step, and 2(n-1)/n or (n-1)/n of the buffer at the link's bus
bandwidth). Which link (``link_of``, the span rule): an axis whose ranks all sit in one node
uses NVLink; one that spans nodes crosses InfiniBand, each node's share of the group through
as many ports as the group has ranks in that node (NCCL's rings run one channel per port).
The figures of each preset and their sources: docs/device-models.md.

Which model a plan uses (``device_model``): ``partition(..., device_model=)`` names a preset
(``PRESETS``), a JSON file, or a ``DeviceModel``; by default, the calibrated file of this
machine's device if ``shardfx calibrate`` wrote one (``cache_path``), else on CUDA the preset
of the GPU (H100, H200, A100), else the ``cpu`` preset.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from shardfx.errors import InputError
from shardfx.cost.node import attention_work, matmul_shape, node_work

log = logging.getLogger("shardfx.cost.device_model")

DTYPES = ("float64", "float32", "bfloat16", "float16")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
GRAPH_KEY = "shardfx.device_model"  # gm.meta: the model the IR's time estimates are for


@dataclass(frozen=True)
class Link:
    """One kind of connection between two devices."""

    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds per message (per hop of a ring)

    def __post_init__(self) -> None:
        for field_, ok, want in (("bandwidth", lambda v: v > 0, "a positive number of bytes/s"),
                                 ("latency", lambda v: v >= 0, "a number of seconds >= 0")):
            v = getattr(self, field_)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and ok(v)):
                raise InputError(
                    f"a device model's link has {field_} {v!r}; it must be {want}",
                    where=f"Link(bandwidth={self.bandwidth!r}, latency={self.latency!r})",
                    fix="give the link's real speed (e.g. Link(53e9, 10e-6): PCIe 5 to pinned "
                        "host memory); a device model with no host tier to offload to has "
                        "host=None, not a link of bandwidth 0")


@dataclass(frozen=True)
class Host:
    """The host's memory as a tier beside the device's: how much of it one rank may keep
    tensors in, and the link each way. A device-to-host and a host-to-device copy run at once
    (a copy engine each), so each direction has a link of its own."""

    memory: float  # bytes one rank may keep there (its share of the node's; 0: unknown)
    d2h: Link  # device -> host
    h2d: Link  # host -> device

    def __post_init__(self) -> None:
        if not (isinstance(self.memory, (int, float)) and math.isfinite(self.memory)
                and self.memory >= 0):
            raise InputError(f"a device model's host memory is {self.memory!r}; it must be a "
                             "number of bytes >= 0", where=f"Host(memory={self.memory!r}, ...)",
                             fix="bytes one rank may keep in host memory, e.g. 250e9 (0: "
                                 "unknown)")
        for way in ("d2h", "h2d"):
            if not isinstance(getattr(self, way), Link):
                raise InputError(f"a device model's host {way} is "
                                 f"{type(getattr(self, way)).__name__}, not a Link",
                                 where=f"Host(..., {way}=...)", fix="e.g. Link(53e9, 10e-6)")

    def copy_seconds(self, nbytes: float, direction: str) -> float:
        """Seconds to copy ``nbytes`` one way: "d2h" (offload) or "h2d" (bring back)."""
        if direction not in ("d2h", "h2d"):
            raise InputError(f"unknown copy direction {direction!r}", where="copy_seconds",
                             fix='"d2h" (device to host) or "h2d" (host to device)')
        link = self.d2h if direction == "d2h" else self.h2d
        return link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class Attention:
    """A fused (flash) attention kernel's speed: FLOP/s at long sequences, forward and backward
    (FLOPs counted as the FlashAttention papers count them: 4·b·h·d per query-key pair
    computed forward, 2.5 times that backward), reaching half of it at ``half_seq`` keys."""

    forward: float
    backward: float
    half_seq: int
    kernel: str = ""  # which kernel the figures are of, for describe()

    def rate(self, keys: int, backward: bool) -> float:
        top = self.backward if backward else self.forward
        return top * keys / (keys + self.half_seq)


@dataclass(frozen=True)
class Throughput:
    """What a device's kernels sustain, below its data sheet's peaks.

    A GEMM of ``batch`` x (m, n, k) computes output tiles, one per SM at a time: ``matmul``
    is the fraction of peak the vendor library reaches on its best large shape (whose K is
    ``matmul_k``); a shape loses what it wastes of the tiles it computes (partial tiles at
    its edges and a last wave that leaves SMs idle, the best of ``tiles``), and a K shorter
    than ``matmul_k`` pays each tile's fixed prologue and epilogue, ``k_overhead`` columns'
    worth, more often. ``attention``: the fused attention kernel the program runs;
    ``vendor_attention``: the vendor's, which other frameworks call."""

    matmul: float  # of peak_flops, on the best large shape (measured, vendor library)
    matmul_k: int  # the K of that shape
    sms: int  # streaming multiprocessors: tiles computed at once
    tiles: tuple[tuple[int, int], ...]  # the output tile shapes the library picks among
    k_overhead: int  # a tile's fixed cost, in columns of K
    attention: Attention | None = None
    vendor_attention: Attention | None = None  # cuDNN's, where published: what TE calls

    def matmul_efficiency(self, batch: int, m: int, n: int, k: int) -> float:
        """Fraction of peak a GEMM of ``batch`` x (m, n) outputs and depth ``k`` reaches."""
        if min(batch, m, n, k) <= 0:
            return self.matmul
        waves = max(_wave_efficiency(batch, m, n, tm, tn, self.sms) for tm, tn in self.tiles)
        depth = min(1.0, (k / (k + self.k_overhead))
                    / (self.matmul_k / (self.matmul_k + self.k_overhead)))
        return self.matmul * waves * depth


def _group_offsets(axes: tuple[tuple[str, int], ...], group: tuple[str, ...]) -> list[int]:
    """The ranks of the group of mesh axes ``group`` that holds rank 0, as offsets from it,
    ranks row-major over ``axes`` (axes not in the mesh: left out)."""
    offsets = [0]
    for at, (name, size) in enumerate(axes):
        if name in group:
            stride = math.prod(n for _, n in axes[at + 1:])
            offsets = [o + c * stride for o in offsets for c in range(size)]
    return offsets


def _wave_efficiency(batch: int, m: int, n: int, tm: int, tn: int, sms: int) -> float:
    """Useful over computed tile area: tiles = batch·⌈m/tm⌉·⌈n/tn⌉ run ⌈tiles/sms⌉ waves
    of ``sms`` tiles each."""
    tiles = batch * -(-m // tm) * -(-n // tn)
    waves = -(-tiles // sms)
    return batch * m * n / (waves * sms * tm * tn)


@dataclass(frozen=True)
class DeviceModel:
    """One device's speeds (see the module docstring)."""

    name: str
    peak_flops: dict[str, float]  # dtype name (DTYPES) -> FLOP/s, dense
    memory_bandwidth: float  # bytes/s
    links: dict[str, Link]  # "intra" (inside a node), "inter" (between nodes)
    devices_per_node: int = 8  # mesh axes that fit in this many ranks use the intra link
    memory: float = 0.0  # bytes of device memory (0: unknown): when memory matters to a choice
    measured: tuple[str, ...] = field(default=(), compare=False)  # by ``shardfx calibrate``
    host: Host | None = None  # the host tier (None: no offloading can be priced)
    throughput: Throughput | None = None  # what its kernels reach (None: the peaks, a roofline)
    collective_latency: float = 0.0  # seconds each collective pays once, beside its steps'

    # --- ops --------------------------------------------------------------------------------

    def peak(self, dtype: torch.dtype | str) -> float:
        """FLOP/s in ``dtype`` (float32's for a dtype without its own entry: ints, fp8)."""
        key = str(dtype).removeprefix("torch.")
        return self.peak_flops.get(key, self.peak_flops["float32"])

    def op_seconds(self, flops: float, bytes_moved: float,
                   dtype: torch.dtype | str = "float32") -> float:
        """The roofline: the slower of computing ``flops`` and moving ``bytes_moved``."""
        return max(flops / self.peak(dtype), bytes_moved / self.memory_bandwidth)

    def node_seconds(self, node: fx.Node) -> float:
        """Seconds of one op of the IR or of a program (see ``node_work``); 0 for a view, a
        collective (``collective_seconds``) and anything not a call. With ``throughput``, a
        matmul at its shape's achievable rate and a fused attention at its kernel's."""
        flops, moved, dtype = node_work(node)
        if not (flops or moved):
            return 0.0
        if self.throughput is not None:
            rate = self._rate(node, flops, dtype)
            if rate is not None:
                return max(flops / rate if flops else 0.0, moved / self.memory_bandwidth)
        return self.op_seconds(flops, moved, dtype)

    def _rate(self, node: fx.Node, flops: int, dtype: torch.dtype) -> float | None:
        """FLOP/s of a matmul or an attention ``node`` computing ``flops`` (None: neither)."""
        shape = matmul_shape(node)
        if shape is not None:
            return self.peak(dtype) * self.throughput.matmul_efficiency(*shape)
        work = attention_work(node)
        if work is None or self.throughput.attention is None:
            return None
        pairs_flops, keys, backward = work  # the kernel's FLOPs, as the papers count them
        kernel = self.throughput.attention.rate(keys, backward)
        return kernel * flops / pairs_flops if pairs_flops else None

    def core_attention_seconds(self, heads: int, queries: int, keys: int, dim: int,
                               backward: bool, dtype: torch.dtype | str = "float16") -> float:
        """Seconds of an attention computed unfused, as Megatron's core attention was before
        FlashAttention (``CORE_ATTENTION_BYTES``): ``heads`` (batch x heads) score matrices of
        queries x keys, all of them (a causal mask hides half, computes none less), made and
        used by batched matmuls at their shapes' rate (forward S = QK^T and O = PV; backward
        dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q), and read and written in memory by
        the softmax and dropout kernels between them."""
        if backward:
            gemms = [(heads, queries, keys, dim), (heads, keys, dim, queries),
                     (heads, queries, dim, keys), (heads, keys, dim, queries)]
        else:
            gemms = [(heads, queries, keys, dim), (heads, queries, dim, keys)]
        rate = self.peak(dtype)
        seconds = sum(2 * b * m * n * k / (rate * (self.throughput.matmul_efficiency(b, m, n, k)
                                                   if self.throughput else 1.0))
                      for b, m, n, k in gemms)
        moved = heads * queries * keys * CORE_ATTENTION_BYTES["backward" if backward else
                                                              "forward"]
        return seconds + moved / self.memory_bandwidth

    # --- communication ----------------------------------------------------------------------

    def collective_seconds(self, kind: str, nbytes: float, group_size: int,
                           link: Link | str = "intra") -> float:
        """Seconds of a ring collective over ``group_size`` ranks on ``link`` (a ``Link``, or
        "intra"/"inter"). ``nbytes`` is the whole buffer: the tensor all-reduced, the
        all-gather's output, the reduce-scatter's input, the all-to-all's input, the message
        sent. Each rank moves 2(n-1)/n of it for an all-reduce (reduce-scatter then
        all-gather), (n-1)/n for the other three, all of it for a send; each of the 2(n-1),
        n-1 or 1 steps pays the latency (an all-to-all: one exchange with each other rank)."""
        if kind not in KINDS:
            raise InputError(f"unknown collective {kind!r}", where="collective_seconds",
                             fix=f"one of {', '.join(KINDS)}")
        n = group_size
        if kind != "send" and n <= 1:
            return 0.0
        link = self.links[link] if isinstance(link, str) else link
        share, steps = {"all_reduce": (2 * (n - 1) / n, 2 * (n - 1)),
                        "all_gather": ((n - 1) / n, n - 1),
                        "reduce_scatter": ((n - 1) / n, n - 1),
                        "all_to_all": ((n - 1) / n, n - 1),
                        "send": (1.0, 1)}[kind]
        return self.collective_latency + steps * link.latency + share * nbytes / link.bandwidth

    def link_of(self, axes: tuple[tuple[str, int], ...], axis: str | tuple[str, ...],
                p2p: bool = False) -> Link:
        """The link a collective over mesh axis ``axis`` (or over the group of several axes'
        ranks, a tuple: Megatron's dp x cp) runs at (the span rule). Ranks are laid out
        row-major over ``axes`` (the last fastest, ``runtime.mesh``): an axis's ranks lie
        ``stride`` apart (the product of the sizes after it). A group whose ranks all lie
        within ``devices_per_node`` ranks is one node: ``intra``. Across nodes, each node's
        ranks of the group, ``per_node`` of them, send through a port each (``inter`` is one
        port), at most the intra link's speed; a send between two ranks (``p2p``) goes
        through one port."""
        offsets = _group_offsets(axes, (axis,) if isinstance(axis, str) else tuple(axis))
        if max(offsets) < self.devices_per_node:
            return self.links["intra"]
        per_node = 1 if p2p else sum(1 for o in offsets if o < self.devices_per_node)
        inter, intra = self.links["inter"], self.links["intra"]
        if per_node == 1:
            return inter
        return Link(min(intra.bandwidth, per_node * inter.bandwidth), inter.latency)

    # --- files ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["measured"] = list(self.measured)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "a device model") -> "DeviceModel":
        """A model from ``to_json``'s dict; an ``InputError`` names a missing or bad field."""
        fix = ('write {"name": ..., "peak_flops": {"float32": ...}, "memory_bandwidth": ..., '
               '"links": {"intra": {"bandwidth": ..., "latency": ...}, "inter": {...}}} '
               "(shardfx calibrate writes one)")
        try:
            peaks = {str(k): _positive(v, f"peak_flops.{k}") for k, v in data["peak_flops"].items()}
            if "float32" not in peaks:
                raise ValueError("peak_flops has no float32 entry")
            links = {k: Link(_positive(data["links"][k]["bandwidth"], f"links.{k}.bandwidth"),
                             _nonnegative(data["links"][k]["latency"], f"links.{k}.latency"))
                     for k in ("intra", "inter")}
            return cls(str(data["name"]), peaks,
                       _positive(data["memory_bandwidth"], "memory_bandwidth"), links,
                       int(data.get("devices_per_node", 8)),
                       _nonnegative(data.get("memory", 0.0), "memory"),
                       tuple(data.get("measured", ())), _host_of(data.get("host")),
                       _throughput_of(data.get("throughput")),
                       _nonnegative(data.get("collective_latency", 0.0), "collective_latency"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise InputError(f"cannot read the device model: {what}", where=where,
                             fix=fix) from None

    def describe(self) -> str:
        """One line per number, for ``shardfx calibrate`` and error messages."""
        lines = [f"device model {self.name}"]
        for dtype in DTYPES:
            if dtype in self.peak_flops:
                lines.append(f"  matmul {dtype:<9} {self.peak_flops[dtype] / 1e9:12.1f} GFLOP/s"
                             + _mark(self, f"peak_flops.{dtype}"))
        lines.append(f"  memory           {self.memory_bandwidth / 1e9:12.2f} GB/s"
                     + _mark(self, "memory_bandwidth"))
        if self.memory:
            lines.append(f"  memory size      {self.memory / 2**30:12.1f} GiB"
                         + _mark(self, "memory"))
        for kind, link in self.links.items():
            lines.append(f"  link {kind:<11} {link.bandwidth / 1e9:12.2f} GB/s, "
                         f"{link.latency * 1e6:.1f} us latency" + _mark(self, f"links.{kind}"))
        if self.collective_latency:
            lines.append(f"  collective       {self.collective_latency * 1e6:12.1f} us latency, "
                         "once each")
        if self.throughput is not None:
            t = self.throughput
            lines.append(f"  matmul reaches   {t.matmul:12.0%} of peak on large shapes "
                         f"(K >= {t.matmul_k}; {t.sms} SMs, tiles "
                         + ", ".join(f"{m}x{n}" for m, n in t.tiles) + ")")
            if t.attention is not None:
                a = t.attention
                lines.append(f"  attention        {a.forward / 1e12:12.0f} / {a.backward / 1e12:.0f} "
                             f"TFLOP/s forward / backward, half at {a.half_seq} keys"
                             + (f" ({a.kernel})" if a.kernel else ""))
        if self.host is not None:
            if self.host.memory:
                lines.append(f"  host memory      {self.host.memory / 2**30:12.1f} GiB"
                             + _mark(self, "host.memory"))
            for way in ("d2h", "h2d"):
                link = getattr(self.host, way)
                lines.append(f"  host {way:<11} {link.bandwidth / 1e9:12.2f} GB/s, "
                             f"{link.latency * 1e6:.1f} us latency" + _mark(self, f"host.{way}"))
        return "\n".join(lines)


def _host_of(data: Any) -> Host | None:
    """``to_json``'s ``host`` back (None where the file has none)."""
    if data is None:
        return None
    return Host(_nonnegative(data.get("memory", 0.0), "host.memory"),
                *(Link(_positive(data[way]["bandwidth"], f"host.{way}.bandwidth"),
                       _nonnegative(data[way]["latency"], f"host.{way}.latency"))
                  for way in ("d2h", "h2d")))


def _throughput_of(data: Any) -> Throughput | None:
    """``to_json``'s ``throughput`` back (None where the file has none)."""
    if data is None:
        return None
    return Throughput(_positive(data["matmul"], "throughput.matmul"),
                      int(_positive(data["matmul_k"], "throughput.matmul_k")),
                      int(_positive(data["sms"], "throughput.sms")),
                      tuple((int(m), int(n)) for m, n in data["tiles"]),
                      int(_nonnegative(data["k_overhead"], "throughput.k_overhead")),
                      _attention_of(data.get("attention"), "attention"),
                      _attention_of(data.get("vendor_attention"), "vendor_attention"))


def _attention_of(att: Any, name: str) -> Attention | None:
    if att is None:
        return None
    return Attention(_positive(att["forward"], f"throughput.{name}.forward"),
                     _positive(att["backward"], f"throughput.{name}.backward"),
                     int(_nonnegative(att["half_seq"], f"throughput.{name}.half_seq")),
                     str(att.get("kernel", "")))


def _mark(model: DeviceModel, key: str) -> str:
    if not model.measured:
        return ""
    return "  (measured)" if key in model.measured else "  (preset)"


def _positive(value: Any, name: str) -> float:
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return v


def _nonnegative(value: Any, name: str) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return v


# --- presets ---------------------------------------------------------------------------------
# Every figure's source: docs/device-models.md.

# Megatron's core attention before FlashAttention (megatron/model/transformer.py, 2021-22:
# baddbmm, FusedScaleMaskSoftmax, attention dropout, bmm), fp16/bf16 scores (2 bytes) and a
# 1-byte dropout mask: bytes read and written per score element. Forward: the scores written
# (2), the fused scale-mask-softmax reading them and writing the probabilities (4), dropout
# reading them and writing its output and mask (5), the PV matmul reading that (2). Backward:
# dP written (2), dropout's backward reading it and the mask and writing its gradient (5),
# softmax's backward reading that and the probabilities and writing dS (6), dV's matmul
# reading the dropped-out probabilities (2), dQ's and dK's reading dS (4). Korthikanti et al.
# 2022 (sec. 4.1) count the same tensors kept for the backward: 5 bytes a score element.
CORE_ATTENTION_BYTES = {"forward": 13, "backward": 19}

# NCCL's own cost model (src/graph/tuning.cc): a ring collective of the Simple protocol (the
# one large messages take) pays 8.4 us once and 3.4 us per step over NVLink, 9.6 us per step
# over the network.
NCCL_LATENCY = 8.4e-6
# NVLink 4: 450 GB/s a direction; NCCL's rings reach ~80% of a link (8 x A100: 230-250 of 300
# GB/s), 360 GB/s. One 400 Gb/s NDR port per GPU: 50 GB/s, ~90% of it reached.
NVLINK = Link(360e9, 3.4e-6)
NDR_IB = Link(45e9, 9.6e-6)
# NVLink 3: 300 GB/s a direction; NCCL caps an A100's bus bandwidth at 235 GB/s. One 200 Gb/s
# HDR port per GPU: 25 GB/s, ~90% of it.
NVLINK3 = Link(235e9, 3.4e-6)
HDR_IB = Link(22.5e9, 9.6e-6)
# PCIe Gen5 x16 between an HGX GPU and its host: 64 GB/s a direction on paper, about 53 GB/s
# to and from pinned memory; an HGX node's 2 TB of host memory shared by its 8 GPUs.
PCIE5 = Host(250e9, Link(53e9, 10e-6), Link(53e9, 10e-6))
# PCIe Gen4 x16 beside an A100: 32 GB/s a direction on paper, about 25 GB/s reached; a DGX
# A100's 2 TB of host memory over 8 GPUs.
PCIE4 = Host(250e9, Link(25e9, 10e-6), Link(25e9, 10e-6))
# Grace Hopper: NVLink-C2C to the Grace CPU's LPDDR5X, 450 GB/s a direction (900 both), 480 GB.
C2C = Host(480e9, Link(450e9, 2e-6), Link(450e9, 2e-6))

# The fused attention PyTorch's flash backend runs (FlashAttention-2), head dim 128, as the
# FlashAttention-3 paper measured it on an H100 SXM5 (causal forward, backward) and the
# FlashAttention-2 paper on an A100 (73% and 63% of peak at best); half speed at ~400 keys.
FA2_H100 = Attention(335e12, 322e12, 400, "FlashAttention-2")
FA2_A100 = Attention(0.73 * 312e12, 0.63 * 312e12, 400, "FlashAttention-2")
# cuDNN's fused attention in the same figures (causal forward, backward at 16k keys).
CUDNN_H100 = Attention(539e12, 516e12, 400, "cuDNN")
# Hopper GEMM tiles (CUTLASS/cuBLAS warp-specialized kernels), the best large bf16 matmul
# measured: 792.1 of 989 TFLOP/s at 6144x17920x2816 (ml-engineering's MAMF table). A
# tile's prologue and epilogue: two 64-deep stages of its main loop.
H100_KERNELS = Throughput(792.1 / 989, 2816, 132, ((128, 256), (256, 128), (128, 128)), 128,
                          FA2_H100, CUDNN_H100)
# GH200: 821.0 of 989 at 11264x19712x1536 (the same table); the H100's tiles and attention.
GH200_KERNELS = replace(H100_KERNELS, matmul=821.0 / 989, matmul_k=1536)
# A100: 267.9 of 312 TFLOP/s at 6912x16384x2048 (the same table), 108 SMs.
A100_KERNELS = Throughput(267.9 / 312, 2048, 108, ((256, 128), (128, 256), (128, 128)), 128,
                          FA2_A100)

_HOPPER = {"float64": 67e12, "float32": 67e12, "bfloat16": 989e12, "float16": 989e12}

PRESETS: dict[str, DeviceModel] = {
    # H100 SXM in a DGX H100 (8 per node, NVLink 4 through NVSwitch, 8 x 400 Gb/s NDR), dense
    # (no sparsity). fp32 is the CUDA cores' 67 TFLOP/s: torch runs fp32 matmuls in full fp32
    # by default (torch.backends.cuda.matmul.allow_tf32 is False), not in TF32 on the tensor
    # cores. fp64 on the tensor cores, 67 TFLOP/s too.
    "h100": DeviceModel("h100", _HOPPER, 3.35e12, {"intra": NVLINK, "inter": NDR_IB},
                        memory=80e9, host=PCIE5, throughput=H100_KERNELS,
                        collective_latency=NCCL_LATENCY),
    # H200: the H100's compute with faster, larger HBM3e.
    "h200": DeviceModel("h200", _HOPPER, 4.8e12, {"intra": NVLINK, "inter": NDR_IB},
                        memory=141e9, host=PCIE5, throughput=H100_KERNELS,
                        collective_latency=NCCL_LATENCY),
    # GH200 (96 GB HBM3): the H100's compute, 4 TB/s, and the Grace CPU's memory over C2C.
    "gh200": DeviceModel("gh200", _HOPPER, 4.0e12, {"intra": NVLINK, "inter": NDR_IB},
                         memory=96e9, host=C2C, throughput=GH200_KERNELS,
                         collective_latency=NCCL_LATENCY),
    # A100 SXM 80GB in a DGX A100 (8 per node, NVLink 3 through NVSwitch, 8 x 200 Gb/s HDR):
    # 312 TFLOP/s bf16/fp16 dense, fp32 on the CUDA cores 19.5 (no TF32, as above), fp64 on
    # the tensor cores 19.5; 2.039 TB/s HBM2e.
    "a100": DeviceModel("a100", {"float64": 19.5e12, "float32": 19.5e12, "bfloat16": 312e12,
                                 "float16": 312e12}, 2.039e12,
                        {"intra": NVLINK3, "inter": HDR_IB}, memory=80e9, host=PCIE4,
                        throughput=A100_KERNELS, collective_latency=NCCL_LATENCY),
    # Any CPU, when nothing is calibrated: a few cores' worth of AVX2 (bf16/fp16 matmuls are
    # slower than fp32 on CPUs without AMX), dual-channel DRAM, gloo over loopback inside a
    # machine and 10 Gb Ethernet between machines. Ranks of a CPU mesh are usually processes
    # of one machine (shardfx.launch): every axis up to 64 of them is "intra".
    "cpu": DeviceModel("cpu", {"float64": 50e9, "float32": 100e9, "bfloat16": 50e9,
                               "float16": 20e9}, 10e9,
                       {"intra": Link(2e9, 50e-6), "inter": Link(1.2e9, 100e-6)},
                       devices_per_node=64,  # its memory: unknown (a machine's RAM is shared)
                       # "host" is the same DRAM: a copy there reads and writes each byte
                       host=Host(0.0, Link(5e9, 1e-6), Link(5e9, 1e-6))),
}


def default_model(options) -> DeviceModel:
    """The model planning uses: ``options.device_model``, else the ``cpu`` preset (passes run
    on ``Options()`` of their own in tests)."""
    return getattr(options, "device_model", None) or PRESETS["cpu"]


def model_of(gm: fx.GraphModule) -> DeviceModel:
    """The model the IR's costs were estimated for (``estimate_cost`` records it)."""
    return gm.meta.get(GRAPH_KEY) or PRESETS["cpu"]


# --- choosing ---------------------------------------------------------------------------------

def device_model(spec: "DeviceModel | str | os.PathLike | None" = None,
                 device: torch.device | str | None = None) -> DeviceModel:
    """The model for ``spec``: a ``DeviceModel``; a preset name (``PRESETS``); a path to a JSON
    file (``DeviceModel.to_json``, as ``shardfx calibrate`` writes); or None: this machine's
    calibrated file for ``device`` if there is one, else on CUDA the preset of the GPU's name,
    else the ``cpu`` preset."""
    where = "partition(..., device_model=...)"
    if isinstance(spec, DeviceModel):
        return spec
    if spec is None:
        return _default(torch.device(device or "cpu"))
    if not isinstance(spec, (str, os.PathLike)):
        raise InputError(f"device_model must be a preset name, a JSON file or a DeviceModel, "
                         f"got {type(spec).__name__}", where=where,
                         fix=f"one of {', '.join(PRESETS)}, a path to a .json file, or None")
    text = os.fspath(spec)
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    path = Path(text).expanduser()
    if path.suffix == ".json" or os.sep in text or path.exists():
        return load(path)
    raise InputError(f"unknown device model {text!r}", where=where,
                     fix=f"a preset ({', '.join(PRESETS)}), a path to a .json file "
                         "(shardfx calibrate writes one), or None for this machine's")


def load(path: Path) -> DeviceModel:
    where = str(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"no device model file {str(path)!r}", where=where,
                         fix="give an existing .json file, a preset name "
                             f"({', '.join(PRESETS)}), or run shardfx calibrate") from None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read device model file {str(path)!r}: {e}", where=where,
                         fix="write it as shardfx calibrate does (JSON)") from None
    return DeviceModel.from_json(data, where)


def _default(device: torch.device) -> DeviceModel:
    cached = cache_path(device)
    if cached.is_file():
        return load(cached)
    if device.type != "cuda":
        return PRESETS["cpu"]
    gpu = device_name(device)
    preset = gpu_preset(gpu)
    if preset is not None:
        return preset
    log.warning("no device model for GPU %r: planning with the h100 preset; run `shardfx "
                "calibrate` on it, or pass partition(..., device_model=...)", gpu)
    return replace(PRESETS["h100"], name=f"h100 (for {gpu})")


def gpu_preset(gpu: str) -> DeviceModel | None:
    """The preset of a GPU named ``gpu`` (``torch.cuda.get_device_name``), or None: a GH200
    before an H200 (its name holds "h200" too), then an H100, then an A100 (the 80 GB one's
    figures)."""
    for key in ("gh200", "h200", "h100", "a100"):
        if key in gpu.lower():
            return PRESETS[key]
    return None


def device_name(device: torch.device | str | None = None) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or this machine's CPU model."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def cache_dir() -> Path:
    """``$SHARDFX_CACHE``, else ``$XDG_CACHE_HOME/shardfx``, else ``~/.cache/shardfx``."""
    if os.environ.get("SHARDFX_CACHE"):
        return Path(os.environ["SHARDFX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardfx"


def cache_path(device: torch.device | str | None = None) -> Path:
    """Where ``shardfx calibrate`` keeps the model of ``device``: named after the device
    (``device-cpu-amd-epyc-7763-64-core-processor.json``, ``device-cuda-nvidia-h100-80gb-hbm3.json``)."""
    device = torch.device(device or "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "unknown"
    return cache_dir() / f"device-{device.type}-{slug}.json"
