"""``shardfx calibrate``: measure this machine's device and write its ``DeviceModel``.

What is measured (each the best of a few timed runs, so a busy moment of a shared machine
counts less):

- **matmul FLOP/s per dtype** (float64, float32, bfloat16, float16): ``torch.mm`` of square
  matrices, the size doubled from 64 until one takes a measurable time (CPUs without native
  bf16/fp16 matmuls stop small); CUDA timed between synchronizations.
- **memory bandwidth**: a copy of a large buffer (bytes read plus bytes written per second).
- **the host link, each way**: a large copy from the device to (pinned) host memory and one
  back, their latency from a 4 KiB copy; on a GPU, the host memory a rank may fill (the
  machine's RAM over its GPUs). On a CPU "host" and device are one memory: the copy is
  between two buffers of it.
- **the link between two ranks** (unless ``links=False``): two processes spawned by
  ``shardfx.launch`` (gloo on CPU, NCCL on two GPUs): the latency from many 4 KiB
  all-reduces (``SMALL_BYTES``: gloo takes a faster path for a few bytes, 0.44 ms a 4-byte
  all-reduce against 1.75 ms for 4 KiB or 256 KiB on 2 ranks of the CI machine, and the
  collectives a plan adds carry activations, never that few bytes) and a large one: the ring
  model's line (``DeviceModel.collective_seconds``) through both. This is the ``intra`` link;
  the ``inter`` link (between machines) cannot be measured from one machine and keeps the
  preset's numbers.

The rest (the ``inter`` link, ``devices_per_node``) comes from the preset the device would get
without calibration (``device_model``); ``DeviceModel.measured`` names what was measured.
The file goes to ``cache_path(device)``, where ``device_model(None, device)`` finds it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from shardfx.cost.device_model import (DTYPES, PRESETS, DeviceModel, Host, Link, cache_path,
                                       device_name, gpu_preset)
from shardfx.errors import InputError
from shardfx.runtime.launch import launch

QUICK = dict(seconds=0.02, copy_bytes=32 << 20, max_n=512, tiny_reps=20, big_bytes=4 << 20,
             big_reps=2)
FULL = dict(seconds=0.2, copy_bytes=256 << 20, max_n=2048, tiny_reps=200, big_bytes=64 << 20,
            big_reps=5)
TRIES = 3  # timed runs of each measurement; the fastest counts
SMALL_BYTES = 4096  # the all-reduce the link's latency is read from (module docstring)


def calibrate(device: torch.device | str = "cpu", quick: bool = False, links: bool = True,
              log: Callable[[str], None] = lambda line: None) -> DeviceModel:
    """This machine's ``DeviceModel`` for ``device`` (module docstring); ``log`` is told what
    is being measured as it goes."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("CUDA was asked for and torch sees no GPU", where="shardfx calibrate",
                         fix="calibrate --device cpu, or run it on a machine with a GPU")
    sizes = QUICK if quick else FULL
    base = _base(device)
    measured = []
    peaks = dict(base.peak_flops)
    for dtype in DTYPES:
        log(f"matmul {dtype}")
        peaks[dtype] = matmul_flops(getattr(torch, dtype), device, sizes["seconds"],
                                    sizes["max_n"] if device.type == "cpu" else 8192)
        measured.append(f"peak_flops.{dtype}")
    log("memory bandwidth")
    bandwidth = copy_bandwidth(device, sizes["copy_bytes"] * (4 if device.type == "cuda" else 1))
    measured.append("memory_bandwidth")
    log("host link, each way")
    host = host_tier(device, base.host, sizes["copy_bytes"])
    measured += ["host.d2h", "host.h2d"] + (["host.memory"] if device.type == "cuda" else [])
    link_models = dict(base.links)
    if links:
        log("link between 2 processes")
        intra = measure_link(device, sizes["tiny_reps"], sizes["big_bytes"], sizes["big_reps"])
        if intra is not None:
            link_models["intra"] = intra
            measured.append("links.intra")
    name = f"calibrated {device_name(device)}"
    memory = base.memory
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        measured.append("memory")
    return replace(base, name=name, peak_flops=peaks, memory_bandwidth=bandwidth,
                   links=link_models, memory=memory, measured=tuple(measured), host=host)


def _base(device: torch.device) -> DeviceModel:
    """The preset this device gets without calibration: what calibration does not measure."""
    if device.type != "cuda":
        return PRESETS["cpu"]
    return gpu_preset(device_name(device)) or PRESETS["h100"]


def write(model: DeviceModel, path: Path | None = None,
          device: torch.device | str = "cpu") -> Path:
    """Write ``model`` as JSON to ``path`` (default ``cache_path(device)``); returns the path."""
    path = Path(path) if path is not None else cache_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(model.to_json(), indent=2) + "\n")
    tmp.replace(path)  # a reader sees the old file or the new one
    return path


# --- measurements -----------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, reps: int = 1,
                 tries: int = TRIES) -> float:
    """The fastest of ``tries`` timings of ``reps`` calls of ``fn``, per call (after one
    untimed call: allocation, kernel selection, first-touch of pages)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def matmul_flops(dtype: torch.dtype, device: torch.device, seconds: float, max_n: int) -> float:
    """The best FLOP/s of an ``n x n`` matmul in ``dtype``: ``n`` doubled from 64 until one
    takes ``seconds / 4`` (or ``n`` reaches ``max_n``), the last size then timed over about
    ``seconds``. The best rate of any size counts: on a loaded machine a small matmul can wait
    as long as a large one for its threads."""
    n, rate = 64, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        one = best_seconds(lambda: torch.mm(a, b, out=c), device)
        rate = max(rate, 2 * n**3 / one)
        if one * 4 >= seconds or n >= max_n:
            break
        n *= 2
    reps = max(1, round(seconds / max(one, 1e-9)))
    return max(rate, 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=c), device, reps))


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a large copy reads and writes (2 x its size)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device)


def host_tier(device: torch.device, preset: Host | None, nbytes: int) -> Host:
    """The host link each way (module docstring) and, on a GPU, a rank's share of the
    machine's RAM (else the preset's)."""
    pinned = device.type == "cuda"

    def pair(n: int, way: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) of ``n`` floats for a copy ``way``."""
        on_device, on_host = torch.empty(n, device=device), torch.empty(n, pin_memory=pinned)
        return (on_device, on_host) if way == "d2h" else (on_host, on_device)

    links = []
    for way in ("d2h", "h2d"):
        src, dst = pair(nbytes // 4, way)
        small_src, small_dst = pair(SMALL_BYTES // 4, way)
        tiny = best_seconds(lambda: small_dst.copy_(small_src, non_blocking=pinned), device,
                            reps=20)
        big = best_seconds(lambda: dst.copy_(src, non_blocking=pinned), device)
        links.append(Link(nbytes / max(big - tiny, big / 2), tiny))
    memory = preset.memory if preset is not None else 0.0
    if device.type == "cuda":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = float(ram // max(1, torch.cuda.device_count()))
    return Host(memory, *links)


def measure_link(device: torch.device, tiny_reps: int, big_bytes: int, big_reps: int
                 ) -> Link | None:
    """The link between two ranks on this machine, or None when two ranks cannot run here
    (CUDA with one GPU)."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    results = launch(link_worker, device.type, tiny_reps, big_bytes, big_reps, nprocs=2,
                     backend=backend, timeout=60, deadline=120)
    latency, bandwidth = results[0]
    return Link(bandwidth, latency)


def link_worker(device_type: str, tiny_reps: int, big_bytes: int, big_reps: int
                ) -> tuple[float, float]:
    """On each of 2 ranks: (latency, bandwidth) of the link, from all-reduces timed between
    barriers. A 2-rank ring all-reduce takes 2 steps and sends the whole buffer once
    (``DeviceModel.collective_seconds``): time = 2 latency + bytes / bandwidth, fitted through
    the small and the big all-reduce's times."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    n = dist.get_world_size()
    steps, share = 2 * (n - 1), 2 * (n - 1) / n

    def timed(t: torch.Tensor, reps: int) -> float:
        dist.all_reduce(t)  # connections, buffers
        best = float("inf")
        for _ in range(TRIES):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(t)
            _sync(device)
            best = min(best, (time.perf_counter() - start) / reps)
        return best

    small = timed(torch.zeros(SMALL_BYTES // 4, device=device), tiny_reps)
    big = timed(torch.zeros(big_bytes // 4, device=device), big_reps)
    bandwidth = share * big_bytes / big  # a bound, where no slope shows (a busy moment)
    if big > small:  # the line through both: its slope the bandwidth, the rest latency
        bandwidth = share * (big_bytes - SMALL_BYTES) / (big - small)
    rest = small - share * SMALL_BYTES / bandwidth
    return (rest if rest > 0 else small) / steps, bandwidth
