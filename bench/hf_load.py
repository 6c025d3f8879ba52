"""Loading a 1.1 B-parameter Hugging Face Llama into 4 ranks' shards (``runner.load_hf``): each
rank's peak resident memory and the time, against loading the whole model and against
``torch.distributed.checkpoint``'s Hugging Face reader.

The checkpoint: TinyLlama-1.1B's shape (22 layers, hidden 2048, intermediate 5632, 32 heads,
4 KV heads, vocab 32000, untied head: 1,100,048,384 parameters), random bf16 weights written by
transformers' own ``save_pretrained`` in 1 GB files with their index (made once, kept in
``--dir``). Every contestant ends with the weights in fp32 (the training dtype), each rank
holding its part:

- shardfx, dp=4 ZeRO-3: a meta model planned on dp=4 with ``zero=3``, then ``plan.runner()``
  and ``runner.load_hf(dir)``: each rank reads the rows it holds of every tensor;
- shardfx, dp=2 x tp=2: the same, ``shard="megatron"``: each rank reads its tp slices (half
  the model: dp replicates);
- DCP's Hugging Face reader, dp=4 rows: a state dict of DTensors, every tensor ``Shard(0)``
  over the 4 ranks (ZeRO-3's and FSDP2's layout), fp32, filled by ``dcp.load`` through
  ``HuggingFaceStorageReader``;
- the whole model, today's path without a meta model: ``from_pretrained(dir, dtype=float32)``
  in one process, as every rank would before cutting its shards. It runs once, alone (four of
  them at once would not fit this machine's memory); per rank it is at least this.

Peak resident memory is each rank's ``VmHWM`` above its resident size before the load (reset
through ``/proc/self/clear_refs``), the maximum over the ranks; it is compared with what the
rank holds afterwards plus the largest tensor (the bound: at most 1.2x that). The load's time
is wall, barrier to barrier, and the process CPU time, max over ranks (2 cores for 4 ranks:
read CPU). Planning is not timed. Rounds alternate the distributed contestants; the checkpoint
is read from the page cache after the first round.

A second table makes the same model from a seed instead (``plan.runner(init_seed=0)`` on the
meta model, the model's own ``_init_weights``): each rank makes one whole tensor at a time and
keeps its part, so its peak is bounded by its part plus the largest tensor; against the whole
model made in one process (``LlamaForCausalLM(config)`` in fp32, today's path before cutting).

    PYTHONPATH=. python -m bench.hf_load [--runs 3] [--layers 22] [--dir DIR] [--no-append]
                                         [--no-init]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardfx
from bench.common import append_results, count, machine

SIZE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000)
N = 4


def config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, use_cache=False, **SIZE)


def make_checkpoint(path: Path, layers: int) -> None:
    """Random bf16 weights, written by save_pretrained (1 GB files and their index)."""
    from transformers import LlamaForCausalLM

    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return
    with torch.device("meta"):
        model = LlamaForCausalLM(config(layers)).to(torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    model.save_pretrained(path, max_shard_size="1GB")


def rss() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes since the last reset)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak() -> int:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return rss()[0]


def _timed(load) -> tuple[float, float, int, object]:
    """(wall, CPU seconds, peak RSS above the start, what ``load`` returned), barrier to barrier."""
    base = reset_peak()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    out = load()
    dist.barrier()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, rss()[1] - base, out


def _meta_plan(layers: int, mesh: dict, kw: dict):
    """(a meta Llama of ``layers`` layers, its plan on ``mesh``)."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = LlamaForCausalLM(config(layers))
    ids = torch.zeros(N, 16, dtype=torch.long)
    loss = lambda out, t: torch.nn.functional.cross_entropy(  # noqa: E731
        out.logits.flatten(0, 1), t.flatten())
    return model, shardfx.partition(model, (ids,), loss, (ids,), mesh=mesh, **kw)


def _shardfx(path: str | None, layers: int, mesh: dict, kw: dict) -> dict:
    """Each rank's part filled from ``path`` (``load_hf``), or, with no path, made from seed 0
    by the model's own ``_init_weights`` (``plan.runner(init_seed=0)``, made on first use:
    ``runner.whole`` of one tensor makes them all)."""
    model, plan = _meta_plan(layers, mesh, kw)
    held = {}

    def load():
        runner = plan.runner(init_seed=0)
        if path is None:
            runner.whole("model.norm.weight")
        else:
            runner.load_hf(path)
        held["bytes"] = sum(h.tensor.untyped_storage().nbytes()
                            for h in runner.holdings()[0].values())
        return runner

    wall, cpu, peak, runner = _timed(load)
    largest = max(p.numel() * 4 for p in model.parameters())
    check = runner.holdings()[0]["model.norm.weight"].tensor.float().sum().item()
    return dict(wall=wall, cpu=cpu, peak=peak, held=held["bytes"], largest=largest, check=check)


def _dcp(path: str, layers: int) -> dict:
    """DCP's Hugging Face reader into Shard(0) DTensors over the 4 ranks, fp32."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (N,))
    shapes = {}
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    r = dist.get_rank()

    def load():
        state = {}
        for k, shape in shapes.items():
            rows = -(-shape[0] // N)
            mine = max(0, min(rows, shape[0] - r * rows))
            local = torch.empty((mine, *shape[1:]), dtype=torch.float32)
            state[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size(shape),
                                          stride=torch.empty(shape, device="meta").stride())
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
        return state

    largest = max(torch.Size(s).numel() * 4 for s in shapes.values())
    wall, cpu, peak, state = _timed(load)
    held = sum(t.to_local().untyped_storage().nbytes() for t in state.values())
    return dict(wall=wall, cpu=cpu, peak=peak, held=held, largest=largest, check=0.0)


def _whole(make) -> dict:
    """Time, peak RSS and size of the whole model ``make()`` returns, in this process, fp32."""
    base = reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    model = make()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    held = sum(p.numel() * 4 for p in model.parameters())
    out = dict(wall=wall, cpu=cpu, peak=rss()[1] - base, held=held,
               largest=max(p.numel() * 4 for p in model.parameters()))
    del model
    return out


def whole_init(layers: int) -> dict:
    """today's path for a model from a seed, in this process: the whole model made in fp32."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return _whole(lambda: LlamaForCausalLM(config(layers)))


def whole_model(path: Path) -> dict:
    """today's path, in this process: the whole model from_pretrained, in fp32."""
    from transformers import AutoModelForCausalLM

    return _whole(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--dir", default="/tmp/shardfx-bench-hf")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--no-init", action="store_true", help="skip the init-from-seed table")
    a = parser.parse_args()
    path = Path(a.dir) / f"llama-{a.layers}"
    start = time.perf_counter()
    make_checkpoint(path, a.layers)
    made = time.perf_counter() - start
    params = sum(torch.Size(s).numel() for s in _shapes(path).values())
    contestants = {
        "shardfx dp=4 ZeRO-3": lambda: shardfx.launch(_shardfx, str(path), a.layers, {"dp": N},
                                                      {"zero": 3}, nprocs=N, timeout=900),
        "shardfx dp=2 x tp=2": lambda: shardfx.launch(
            _shardfx, str(path), a.layers, {"dp": 2, "tp": 2}, {"shard": "megatron"}, nprocs=N,
            timeout=900),
        "DCP HF reader, dp=4 rows": lambda: shardfx.launch(_dcp, str(path), a.layers, nprocs=N,
                                                           timeout=900),
    }
    runs: dict[str, list[dict]] = {name: [] for name in contestants}
    for i in range(a.runs):
        order = list(contestants) if i % 2 == 0 else list(reversed(contestants))
        for name in order:
            ranks = contestants[name]()
            runs[name].append({k: max(r[k] for r in ranks) for k in ranks[0]})
            print(f"round {i + 1} {name}: {runs[name][-1]}", flush=True)
    whole = whole_model(path)
    print(f"whole model: {whole}", flush=True)
    table = _table(runs, whole)
    if not a.no_init:
        table += "\n\n" + _init_table(a.runs, a.layers)
    load = os.getloadavg()
    where = (f"{machine()}; {count(params)} parameters ({_gb(params * 2)} bf16 on disk, "
             f"{_gb(params * 4)} in fp32), {a.runs} rounds, checkpoint made in {made:.0f} s; "
             f"load average {load[0]:.1f}")
    print(where)
    print(table)
    if not a.no_append:
        append_results("hf_load", table, where)


def _init_table(rounds: int, layers: int) -> str:
    """The same model made from a seed on meta, each rank making only its part (one whole
    tensor at a time: the bound is its part + the largest tensor), against the whole model
    made in one process."""
    meshes = {"dp=4 ZeRO-3": ({"dp": N}, {"zero": 3}),
              "dp=2 x tp=2": ({"dp": 2, "tp": 2}, {"shard": "megatron"})}
    runs: dict[str, list[dict]] = {name: [] for name in meshes}
    for i in range(rounds):
        for name in (meshes if i % 2 == 0 else reversed(meshes)):
            mesh, kw = meshes[name]
            ranks = shardfx.launch(_shardfx, None, layers, mesh, kw, nprocs=N, timeout=900)
            runs[name].append({k: max(r[k] for r in ranks) for k in ranks[0]})
            print(f"init round {i + 1} {name}: {runs[name][-1]}", flush=True)
    whole = whole_init(layers)
    print(f"whole model made: {whole}", flush=True)
    lines = ["| made from seed 0 (meta model) | peak RSS per rank (max) | held after | held + "
             "largest | peak / (held + largest) | wall min / median | CPU median (max rank) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in runs.items():
        peak, held, largest = max(r["peak"] for r in rows), rows[0]["held"], rows[0]["largest"]
        walls = [r["wall"] for r in rows]
        lines.append(f"| shardfx {name}, `plan.runner(init_seed=0)` | {_gb(peak)} | {_gb(held)} "
                     f"| {_gb(held + largest)} | {peak / (held + largest):.2f}x | "
                     f"{min(walls):.2f} / {statistics.median(walls):.2f} s | "
                     f"{statistics.median(r['cpu'] for r in rows):.2f} s |")
    lines.append(f"| whole model made in one process (`LlamaForCausalLM(config)`, fp32) | "
                 f"{_gb(whole['peak'])} | {_gb(whole['held'])} | - | - | {whole['wall']:.2f} s | "
                 f"{whole['cpu']:.2f} s |")
    return "\n".join(lines)


def _shapes(path: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _table(runs: dict, whole: dict) -> str:
    ref = statistics.median(r["wall"] for r in runs["DCP HF reader, dp=4 rows"])
    ref_cpu = statistics.median(r["cpu"] for r in runs["DCP HF reader, dp=4 rows"])
    lines = ["| contestant | peak RSS per rank (max) | held after | held + largest | peak / "
             "(held + largest) | wall min / median | vs DCP | CPU median (max rank) | vs DCP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in runs.items():
        peak = max(r["peak"] for r in rows)
        held, largest = rows[0]["held"], rows[0]["largest"]
        walls = [r["wall"] for r in rows]
        cpu = statistics.median(r["cpu"] for r in rows)
        lines.append(f"| {name} | {_gb(peak)} | {_gb(held)} | {_gb(held + largest)} | "
                     f"{peak / (held + largest):.2f}x | {min(walls):.2f} / "
                     f"{statistics.median(walls):.2f} s | {statistics.median(walls) / ref:.2f}x "
                     f"| {cpu:.2f} s | {cpu / ref_cpu:.2f}x |")
    lines.append(f"| whole model (from_pretrained, one process, fp32) | {_gb(whole['peak'])} | "
                 f"{_gb(whole['held'])} | - | - | {whole['wall']:.2f} s | - | "
                 f"{whole['cpu']:.2f} s | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
