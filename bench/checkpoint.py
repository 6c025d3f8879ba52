"""What verifying a checkpoint costs: ``shardfx.runtime.checkpoint``'s save and load with the
save's id and every file's checksum (as shipped) against the same code with the checksums patched
out, interleaved.

The state is the training state of bench/zero.py's model, a Hugging Face Llama (9 layers, hidden
768, 12 heads, 4 KV heads, intermediate 2048, vocab 32000, untied head: 105,789,696 parameters),
with AdamW's two moments (random values): 1.27 GB in fp32. Two layouts:

- one process: ``save`` then ``load`` of every tensor whole;
- 4 gloo processes (``shardfx.launch``): saved as dp=2 x tp=2 boxes (rows over dp, columns over
  tp; 1-d tensors in 4 row blocks), loaded as dp=4 rows (ZeRO-3's layout): each rank reads parts
  of two ranks' files. Times are rank 0's, barrier to barrier (the slowest rank's).

"off" is the same code with ``Digest.update`` (the checksum computed while a file is written)
counting bytes only and ``verify_contents`` (the data files read for their checksums during a
load) a no-op: the save id, the trailers and the record are still written and checked, which
costs nothing measurable. Each round runs save and load with verification on and off, in alternating order;
``--warmup`` untimed rounds, then ``--runs`` timed ones; wall time min and median and the ratio
of medians (goal: <= 1.1x for save and for load), and process CPU time (every thread of the
process, rank 0's on 4): the checking thread runs beside DCP's reading, so where the machine has
no idle core (4 ranks on 2 cores, or other work) the CPU ratio is the one wall time approaches.
A save ends with fsync, so it is bound by the disk; a load reads files just written, from the
page cache, the case where the checksums weigh most. ``check`` (every file read and checked,
what ``shardfx run --resume`` does before it spawns the ranks) is timed alone on the
one-process checkpoint. Last, the checksums' speed on 256 MiB in memory, one
core: CRC-32 (zlib), Adler-32, BLAKE2b and shardfx's ``Digest``.

    PYTHONPATH=. python -m bench.checkpoint [--runs 7] [--warmup 1] [--layers 9] [--no-append]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import shardfx
from bench.common import append_results, count, machine
from shardfx.runtime import checkpoint
from shardfx.runtime.checkpoint import Box
from shardfx.runtime.checkpoint_digest import Digest

SIZE = dict(hidden=768, inter=2048, heads=12, kv=4, vocab=32000)
N = 4  # processes of the distributed layout


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """The Llama's parameters and two AdamW moments each: checkpoint key -> shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=layers, hidden_size=SIZE["hidden"],
            intermediate_size=SIZE["inter"], num_attention_heads=SIZE["heads"],
            num_key_value_heads=SIZE["kv"], vocab_size=SIZE["vocab"], use_cache=False))
    out = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = tuple(p.shape)
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"optim/{name}/{moment}"] = tuple(p.shape)
    return out


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    return n * i // parts, n * (i + 1) // parts


def boxes(keys: dict, rows_of, cols_of, fill) -> dict[str, Box]:
    """A Box per key: rows ``rows_of(shape)``, columns ``cols_of(shape)`` (2-d), values
    ``fill(size)``."""
    out = {}
    for k, shape in keys.items():
        spans = [rows_of(shape)] + ([cols_of(shape)] if len(shape) == 2 else [])
        size = [b - a for a, b in spans]
        out[k] = Box.of(fill(size), shape, [a for a, _ in spans])
    return out


def saved_boxes(keys: dict, r: int) -> dict[str, Box]:
    """Rank ``r``'s dp=2 x tp=2 boxes: 2-d rows over dp, columns over tp; 1-d in 4 blocks."""
    dp, tp = divmod(r, 2)
    return boxes(keys, lambda s: split(s[0], 2, dp) if len(s) == 2 else split(s[0], N, r),
                 lambda s: split(s[1], 2, tp), torch.randn)


def loaded_boxes(keys: dict, r: int) -> dict[str, Box]:
    """Rank ``r``'s dp=4 rows (ZeRO-3's layout), zeros to load into."""
    return boxes(keys, lambda s: split(s[0], N, r), lambda s: (0, s[1]), torch.zeros)


@contextlib.contextmanager
def verification(on: bool):
    """As shipped (``on``), or without the checksums of the data files' contents."""
    if on:
        yield
        return
    update, verify = Digest.update, checkpoint.verify_contents
    Digest.update = _count_only
    checkpoint.verify_contents = lambda *args: None
    try:
        yield
    finally:
        Digest.update, checkpoint.verify_contents = update, verify


def _count_only(self: Digest, data) -> None:
    self.size += memoryview(data).nbytes


def race(save, load, runs: int, warmup: int, barrier=lambda: None) -> dict[str, list]:
    """Rounds of save and load, verification on and off in alternating order: the timed ones'
    (wall, CPU) seconds by "save on", "save off", "load on", "load off". CPU: this process's,
    every thread (the checking thread's too), from one barrier to the next."""
    times: dict[str, list] = {f"{what} {mode}": [] for what in ("save", "load")
                              for mode in ("on", "off")}
    for i in range(warmup + runs):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            mode = "on" if on else "off"
            for what, fn in (("save", save), ("load", load)):
                with verification(on):
                    barrier()
                    start, cpu = time.perf_counter(), time.process_time()
                    fn(mode)
                    barrier()
                if i >= warmup:
                    times[f"{what} {mode}"].append((time.perf_counter() - start,
                                                    time.process_time() - cpu))
    return times


def one_process(keys: dict, folder: Path, runs: int, warmup: int,
                ) -> tuple[dict, list[float]]:
    whole = boxes(keys, lambda s: (0, s[0]), lambda s: (0, s[1]), torch.randn)
    into = boxes(keys, lambda s: (0, s[0]), lambda s: (0, s[1]), torch.zeros)

    def load(mode: str) -> None:
        checkpoint.load(folder / mode, into)

    times = race(lambda mode: checkpoint.save(folder / mode, whole), load, runs, warmup)
    assert all(torch.equal(into[k], v) for k, v in whole.items()), "the load is not the save"
    checks = []
    for _ in range(runs):
        start = time.perf_counter()
        checkpoint.check(folder / "on")
        checks.append(time.perf_counter() - start)
    return times, checks


def four_processes(keys: dict, folder: str, runs: int, warmup: int) -> dict:
    """On every rank of 4: the dp=2 x tp=2 save and the dp=4 load, raced."""
    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    r = dist.get_rank()
    mine, into = saved_boxes(keys, r), loaded_boxes(keys, r)

    def load(mode: str) -> None:
        checkpoint.load(Path(folder) / mode, into)

    times = race(lambda mode: checkpoint.save(Path(folder) / mode, mine), load, runs, warmup,
                 dist.barrier)
    return times


def throughput() -> list[tuple[str, float]]:
    """GB/s of each checksum over 256 MiB in memory, best of 3."""
    data = memoryview(bytearray(os.urandom(1 << 20) * 256))
    chunk = 1 << 24

    def crc32():
        c = 0
        for i in range(0, len(data), chunk):
            c = zlib.crc32(data[i:i + chunk], c)

    def adler32():
        c = 1
        for i in range(0, len(data), chunk):
            c = zlib.adler32(data[i:i + chunk], c)

    def blake2b():
        h = hashlib.blake2b()
        for i in range(0, len(data), chunk):
            h.update(data[i:i + chunk])

    def digest():
        d = Digest()
        for i in range(0, len(data), chunk):
            d.update(data[i:i + chunk])
        d.hexdigest()

    out = []
    for name, fn in (("zlib.crc32", crc32), ("zlib.adler32", adler32),
                     ("hashlib.blake2b", blake2b), ("shardfx Digest", digest)):
        best = min(_seconds(fn) for _ in range(3))
        out.append((name, len(data) / best / 1e9))
    return out


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rows(layout: str, times: dict[str, list]) -> list[str]:
    out = []
    for what in ("save", "load"):
        (on, on_cpu), (off, off_cpu) = (zip(*times[f"{what} {mode}"]) for mode in ("on", "off"))
        med = statistics.median
        out.append(f"| {layout} | {what} | {min(on):.3f} | {med(on):.3f} | {min(off):.3f} | "
                   f"{med(off):.3f} | **{med(on) / med(off):.2f}x** | {med(on_cpu):.3f} | "
                   f"{med(off_cpu):.3f} | {med(on_cpu) / med(off_cpu):.2f}x |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--no-append", action="store_true", help="print, do not record")
    a = parser.parse_args()
    keys = shapes(a.layers)
    params = sum(math.prod(s) for k, s in keys.items() if k.startswith("model/"))
    size = 4 * sum(math.prod(s) for s in keys.values())
    folder = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    load_start = os.getloadavg()[0]
    try:
        single, checks = one_process(keys, folder / "one", a.runs, a.warmup)
        four = shardfx.launch(four_processes, keys, str(folder / "four"), a.runs, a.warmup,
                              nprocs=N, timeout=1800)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    head = ["| layout | | on: min (s) | on: median | off: min | off: median | on / off | "
            "CPU on: median | CPU off: median | CPU on / off |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table = [f"Llama {count(params)} params + AdamW moments: {size / 1e9:.2f} GB fp32; "
             f"{a.runs} timed rounds after {a.warmup}, verification on and off alternating; "
             f"load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end",
             "", *head]
    table += rows("one process", single) + rows("dp=2×tp=2 saves, dp=4 loads", four)
    table += ["", f"`check` (every file read and checked), one-process checkpoint: "
              f"min {min(checks):.3f} s, median {statistics.median(checks):.3f} s "
              f"({size / statistics.median(checks) / 1e9:.2f} GB/s)", "",
              "| checksum, 256 MiB in memory, one core | GB/s |", "|---|---:|"]
    table += [f"| {name} | {rate:.2f} |" for name, rate in throughput()]
    text = "\n".join(table)
    print(text)
    if not a.no_append:
        append_results("checkpoint", text, machine())


if __name__ == "__main__":
    main()
