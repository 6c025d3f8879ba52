"""Fuzzing: random small models through every mesh, each checked against one device.

Model ``k`` of a run with ``--seed S`` is ``random_spec(S * 1000 + k)`` of
``tests/fuzz_draw.py`` (Linear, activations, residuals, LayerNorm / RMSNorm, softmax,
transposes, reshapes, custom autograd.Functions, checkpointed regions, dropout and noise; 2-3
blocks, the cut points of a pipeline), the same on every machine. Every mesh gets the same
models; each is trained 3 AdamW steps eagerly and through shardfx and compared by
``shardfx.testing.compare_training``. Meshes: ``one`` (one device, this process),
``dp2``, ``tp2`` (Megatron's plan), ``tp2-globs`` (random placements per parameter), ``pp2``
(2 microbatches), and with four processes ``dp2-tp2``, ``pp2-tp2``, ``dp2-pp2``.

    python -m bench.fuzz [--models 40] [--seed 0] [--meshes one,dp2,tp2,tp2-globs,pp2]
                         [--reduce] [--no-append]
    python -m bench.fuzz --repro "x(4,24) seed 0: transpose linear(4,bias) transpose | ..." \\
                         --meshes pp2 [--reduce]

Prints, per mesh, how many models passed, differed from eager (mismatch), failed to plan and
failed to run (by exception type), hung or crashed; per op, how many models have it and how many
of those passed on each mesh; then each distinct failure (kind, exception,
message) with its count and first model, and with ``--reduce`` the smallest model found that
fails the same way (greedy: drop blocks, ops, shard entries; inline residuals and checkpoints;
simplify). Appends the table to bench/RESULTS.md with the machine and date unless
``--no-append`` or ``--repro``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("SHARDFX_DEBUG", "1")  # verify the IR after every pass, as the tests do
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # bench.common; the fuzz_* modules (the ranks' too)

import torch  # noqa: E402

from bench.common import append_results, machine  # noqa: E402
from fuzz_check import MESHES, Result, run  # noqa: E402
from fuzz_draw import random_spec  # noqa: E402
from fuzz_models import (DIMS, NESTED, SEQS, ModelSpec, Op, body_of, build,  # noqa: E402
                         out_shape)

DEFAULT_MESHES = "one,dp2,tp2,tp2-globs,pp2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=40, help="models per mesh")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meshes", default=DEFAULT_MESHES,
                        help=f"comma-separated, of {', '.join(MESHES)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repro", help="check this one model description instead")
    parser.add_argument("--reduce", action="store_true", help="reduce each distinct failure")
    parser.add_argument("--no-append", action="store_true")
    a = parser.parse_args()

    meshes = a.meshes.split(",")
    unknown = [m for m in meshes if m not in MESHES]
    if unknown:
        parser.error(f"unknown meshes {unknown}; known: {', '.join(MESHES)}")
    if a.repro:
        specs = [ModelSpec.parse(a.repro)]
    else:
        specs = [random_spec(a.seed * 1000 + k) for k in range(a.models)]
    results: dict[str, list[Result]] = {}
    seconds: dict[str, float] = {}
    for mesh in meshes:
        start = time.perf_counter()
        results[mesh] = run(specs, mesh, a.steps, log=_progress)
        seconds[mesh] = time.perf_counter() - start
    models = "1 model" if a.repro else f"{len(specs)} random models per mesh (seed {a.seed})"
    title = f"fuzz: {models}, {a.steps} AdamW steps each, compare_training against eager"
    table = "\n".join([title, "", *counts_table(results, seconds), "", *ops_table(results), "",
                       *failure_list(results)])
    print("\n" + table)
    if a.reduce:
        for mesh, key, first in distinct_failures(results):
            print(f"\nreducing {mesh}: {key}\n  {ModelSpec.parse(first.spec).size():3d}  "
                  f"{first.spec}", flush=True)
            small = reduce(ModelSpec.parse(first.spec), mesh, lambda r: r.key() == key,
                           a.steps, log=lambda s: print(s, flush=True))
            print(f"smallest: {small}")
    if not (a.no_append or a.repro):
        append_results("fuzz", table, f"{machine()}, {platform.platform()}")


def _progress(result: Result) -> None:
    print("." if result.ok else f"\n{result}", end="" if result.ok else "\n", flush=True)


def counts_table(results: dict[str, list[Result]], seconds: dict[str, float]) -> list[str]:
    rows = ["| mesh | models | passed | mismatch | plan errors | run errors | hang / crash "
            "| time (s) |", "|---|---:|---:|---:|---|---|---:|---:|"]
    for mesh, rs in results.items():
        kinds = Counter(r.kind for r in rs)
        rows.append(f"| {mesh} | {len(rs)} | {kinds['pass']} | {kinds['mismatch']} | "
                    f"{_by_type(rs, 'plan')} | {_by_type(rs, 'run')} | "
                    f"{kinds['hang'] + kinds['crash']} | {seconds[mesh]:.0f} |")
    return rows


def _by_type(results: list[Result], kind: str) -> str:
    types = Counter(r.error for r in results if r.kind == kind)
    if not types:
        return "0"
    return f"{sum(types.values())} (" + ", ".join(f"{t} {n}" for t, n in types.most_common()) + ")"


def ops_table(results: dict[str, list[Result]]) -> list[str]:
    """Per op (Linears by any name as one, activations as one, noise per kind; nested ones
    included): the models that have it, and how many of those passed on each mesh."""
    meshes = list(results)
    by_op: dict[str, set[str]] = {}
    for rs in results.values():
        for r in rs:
            for name in _op_names(ModelSpec.parse(r.spec).blocks):
                by_op.setdefault(name, set()).add(r.spec)
    passed = {m: {r.spec for r in rs if r.ok} for m, rs in results.items()}
    rows = ["| op | models | " + " | ".join(f"passed {m}" for m in meshes) + " |",
            "|---|---:|" + "---:|" * len(meshes)]
    for name, specs in sorted(by_op.items()):
        ran = [{r.spec for r in results[m]} & specs for m in meshes]
        rows.append(f"| {name} | {len(specs)} | " + " | ".join(
            f"{len(s & passed[m])}/{len(s)}" for m, s in zip(meshes, ran)) + " |")
    return rows


def _op_names(blocks) -> Iterator[str]:
    for ops in blocks:
        for op in ops:
            if op[0] in ("norm", "fn"):  # layernorm, rmsnorm; ste, clampste
                yield op[1]
            elif op[0] == "noise":
                yield f"noise({op[2]})"
            else:
                yield "activation" if op[0] == "act" else op[0]
            yield from _op_names([body_of(op)])


def distinct_failures(results: dict[str, list[Result]]) -> Iterator[tuple[str, str, Result]]:
    """(mesh, key, first result) for each distinct failure."""
    for mesh, rs in results.items():
        seen = set()
        for r in rs:
            if not r.ok and r.key() not in seen:
                seen.add(r.key())
                yield mesh, r.key(), r


def failure_list(results: dict[str, list[Result]]) -> list[str]:
    lines = []
    for mesh, key, first in distinct_failures(results):
        n = sum(r.key() == key for r in results[mesh])
        lines += [f"- {mesh}: {n} x {first.kind} {first.error}: "
                  f"{first.message.splitlines()[0] if first.message else ''}",
                  f"  first: `{first.spec}`"]
        if first.where:
            lines.append(f"  at {first.where}")
    return lines or ["no failures"]


# --- reducing a failure -------------------------------------------------------------------------


def reduce(spec: ModelSpec, mesh: str, fails: Callable[[Result], bool], steps: int = 3,
           log: Callable[[str], None] = lambda s: None) -> ModelSpec:
    """The smallest spec found, by greedy steps from ``spec``, whose result on ``mesh`` still
    ``fails``: each round checks the specs one step simpler (``_smaller``) until one fails the
    same way, and goes on from it; a round where none does ends the search."""
    while True:
        candidates = [c for c in _smaller(spec) if _valid(c)]
        found = [r for r in run(candidates, mesh, steps, stop=fails) if fails(r)]
        if not found:
            return spec
        spec = ModelSpec.parse(found[0].spec)
        log(f"  {spec.size():3d}  {spec}")


def _valid(spec: ModelSpec) -> bool:
    try:
        out_shape(spec)
    except ValueError:
        return False
    return bool(spec.blocks) and any(True for _ in _params(spec))


def _params(spec: ModelSpec):
    with torch.device("meta"):
        return dict(build(spec).named_parameters())


def _smaller(spec: ModelSpec) -> Iterator[ModelSpec]:
    """Specs one step simpler than ``spec``, the biggest steps first."""
    blocks = spec.blocks

    def with_blocks(bs) -> ModelSpec:
        return dataclasses.replace(spec, blocks=tuple(bs), shard=_keep(spec, tuple(bs)))

    for i in range(len(blocks)):
        yield with_blocks(blocks[:i] + blocks[i + 1:])
    for i in range(len(blocks) - 1):  # two blocks into one
        yield with_blocks(blocks[:i] + (blocks[i] + blocks[i + 1],) + blocks[i + 2:])
    for i, ops in enumerate(blocks):
        for smaller in _smaller_ops(ops):
            yield with_blocks(blocks[:i] + (smaller,) + blocks[i + 1:])
    for j, (name, p) in enumerate(spec.shard):
        yield dataclasses.replace(spec, shard=spec.shard[:j] + spec.shard[j + 1:])
        if p != "R":
            yield dataclasses.replace(spec, shard=spec.shard[:j] + ((name, "R"),)
                                      + spec.shard[j + 1:])
    if spec.seed:
        yield dataclasses.replace(spec, seed=0)
    yield from (dataclasses.replace(spec, seq=s) for s in SEQS if s < spec.seq)
    yield from (dataclasses.replace(spec, dim=d) for d in DIMS if d < spec.dim)


def _smaller_ops(ops: tuple[Op, ...]) -> Iterator[tuple[Op, ...]]:
    for i, op in enumerate(ops):
        yield ops[:i] + ops[i + 1:]
        if op[0] in NESTED:
            yield ops[:i] + op[1] + ops[i + 1:]
            for body in _smaller_ops(op[1]):
                if body:
                    yield ops[:i] + ((op[0], body),) + ops[i + 1:]
        for simpler in _simpler_op(op):
            yield ops[:i] + (simpler,) + ops[i + 1:]


def _simpler_op(op: Op) -> Iterator[Op]:
    kind = op[0]
    if kind == "linear":
        _, name, out, bias = op
        if bias:
            yield ("linear", name, out, False)
        if name != "linear":
            yield ("linear", "linear", out, bias)
        yield from (("linear", name, d, bias) for d in DIMS if d < out)
    elif kind == "norm" and op[2]:
        yield ("norm", op[1], False)
    elif kind == "act" and op[1] != "relu":
        yield ("act", "relu")
    elif kind == "noise" and op[2] != "normal":
        yield ("noise", op[1], "normal")
    elif kind == "ckpt":  # non-reentrant: no autograd.Function of torch's own
        yield ("ckptnr", op[1])


def _keep(spec: ModelSpec, blocks: tuple) -> tuple[tuple[str, str], ...]:
    """The shard entries that still name a parameter (with the dim they shard) of the model
    with ``blocks``."""
    try:
        params = _params(dataclasses.replace(spec, blocks=blocks))
    except ValueError:
        return spec.shard
    return tuple((n, p) for n, p in spec.shard
                 if n in params and (p == "R" or int(p[1:]) < params[n].dim()))


if __name__ == "__main__":
    main()
