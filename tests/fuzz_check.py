"""Checking ``ModelSpec`` models (``fuzz_models``) through a mesh against one device.

``check(spec, mesh)`` trains a model eagerly and through shardfx
(``shardfx.testing.compare_training``) and classifies the outcome; ``run`` checks many specs on
one mesh with one ``shardfx.launch`` for all of them (a launch costs seconds), launching again
after a failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fuzz_models import ModelSpec, batches, build


@dataclass(frozen=True)
class Mesh:
    """A mesh to check models on: ``partition`` keyword arguments and the processes it needs."""

    mesh: dict
    shard: str = "auto"  # "globs": the spec's own placements
    microbatches: int = 1

    @property
    def nprocs(self) -> int:
        n = 1
        for size in self.mesh.values():
            n *= size
        return n

    def partition_kwargs(self, spec: ModelSpec) -> dict[str, Any]:
        shard: Any = self.shard
        if shard == "globs":
            shard = _globs(spec, list(self.mesh))
        return dict(mesh=self.mesh, shard=shard, microbatches=self.microbatches)


MESHES = {
    "one": Mesh({}),
    "dp2": Mesh({"dp": 2}),
    "tp2": Mesh({"tp": 2}, "megatron"),
    "tp2-globs": Mesh({"tp": 2}, "globs"),
    "pp2": Mesh({"pp": 2}, microbatches=2),
    # four processes: slower, benchmarks only
    "dp2-tp2": Mesh({"dp": 2, "tp": 2}, "megatron"),
    "pp2-tp2": Mesh({"pp": 2, "tp": 2}, "megatron", microbatches=2),
    "dp2-pp2": Mesh({"dp": 2, "pp": 2}, microbatches=2),
}


def _globs(spec: ModelSpec, axes: list[str]) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for name, p in spec.shard:
        placement = Replicate() if p == "R" else Shard(int(p[1:]))
        out[name] = [placement if a == "tp" else Replicate() for a in axes]
    return out


@dataclass(frozen=True)
class Result:
    """How one model fared on one mesh.

    kind: "pass" | "mismatch" (numbers differ from eager) | "plan" (``partition`` raised) |
    "run" (a training step raised) | "hang" (no answer in time) | "crash" (a rank died) |
    "invalid" (the spec itself does not build or train eagerly: a generator bug).
    """

    spec: str
    mesh: str
    kind: str
    error: str = ""  # exception type ("AssertionError", "RuntimeError", ...)
    message: str = ""  # first lines of the message
    where: str = ""  # the innermost frames, "file:line func" (shardfx's own, when it has any)
    worst: float = 0.0  # passes: the largest error over its bound (see ``_worst``)
    rank: int = 0

    @property
    def ok(self) -> bool:
        return self.kind == "pass"

    def key(self) -> str:
        """What makes two failures the same bug: kind, exception type and the message's start
        without numbers and node names."""
        head = re.sub(r"\d+|'[^']*'|\[[^\]]*\]", "#", self.message.splitlines()[0] if
                      self.message else "")[:60]
        return f"{self.kind} {self.error} {head}".strip()

    def __str__(self) -> str:
        if self.ok:
            return f"{self.mesh}: pass ({self.worst:.1e})  {self.spec}"
        lines = [f"{self.mesh}: {self.kind} {self.error}  {self.spec}",
                 *self.message.splitlines(), *[f"at {self.where}"] * bool(self.where)]
        return "\n    ".join(lines)


def check(spec: ModelSpec, mesh: str, steps: int = 3) -> Result:
    """Train ``spec``'s model for ``steps`` AdamW steps eagerly and through shardfx on ``mesh``
    (this process must be one of the mesh's ranks) and say how it went."""
    from shardfx.testing import adamw, compare_training

    try:  # the model must train eagerly
        model, data = build(spec), batches(spec, steps)
        F.mse_loss(model(*data[0][0]), *data[0][1]).backward()
        adamw(list(model.parameters()))
        model.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        return _failure(spec, mesh, "invalid", e)
    try:
        report = compare_training(model, data, F.mse_loss, **MESHES[mesh].partition_kwargs(spec))
    except Exception as e:  # noqa: BLE001 - every way of failing is a result here
        return _failure(spec, mesh, _stage_of(e), e)
    return Result(str(spec), mesh, "pass", worst=_worst(report), rank=_rank())


def _worst(report) -> float:
    """The largest error over its bound (below 1: within it) of a ``compare_training``
    report."""
    checks = getattr(report, "checks", None)
    if checks is None:  # a report without per-tensor bounds: its own summary
        return report.max()
    return max((c.shardfx / c.bound for c in checks), default=0.0)


def _stage_of(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, AssertionError) and frames and frames[-1].filename.endswith(
            os.path.join("shardfx", "testing.py")):
        return "mismatch"
    planning = any(f.name == "partition" and f.filename.endswith(os.path.join("shardfx", "api.py"))
                   for f in frames)
    return "plan" if planning else "run"


def _failure(spec: ModelSpec, mesh: str, kind: str, e: BaseException) -> Result:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if os.sep + "shardfx" + os.sep in f.filename] or frames
    where = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
    message = "\n".join(str(e).splitlines()[:12])[:2000]
    return Result(str(spec), mesh, kind, type(e).__name__, message, where, rank=_rank())


def _short(path: str) -> str:
    parts = Path(path).parts
    for root in ("shardfx", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return Path(path).name


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# --- checking many models on one mesh ---------------------------------------------------------


def run(specs: Sequence[ModelSpec], mesh: str, steps: int = 3, *, model_s: float = 120.0,
        stop: Callable[[Result], bool] | None = None,
        log: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """``check`` each spec on ``mesh``, in order; returns their results.

    One device runs here. A mesh of N devices runs every spec in one ``shardfx.launch`` of N
    ranks; after a model fails the ranks stop (a failed step can leave messages in flight that
    a later model would receive) and the rest run in a new launch. A model that takes longer
    than ``model_s`` seconds is a "hang". With ``stop``, the first result it accepts ends the
    run. ``log`` sees each result as it comes.
    """
    results: list[Result] = []
    todo = list(specs)
    while todo:
        if MESHES[mesh].nprocs == 1:
            got = [check(todo[0], mesh, steps)]
        else:
            got = _launch(todo, mesh, steps, model_s)
        for result in got:
            log(result)
        results += got
        todo = todo[len(got):]
        if stop and any(stop(r) for r in got):
            break
    return results


def _launch(specs: list[ModelSpec], mesh: str, steps: int, model_s: float) -> list[Result]:
    """Results of the specs one launch got through: up to and including the first failure."""
    import shardfx

    n = MESHES[mesh].nprocs
    with tempfile.TemporaryDirectory(prefix="shardfx-fuzz-") as out:
        error = None
        try:
            shardfx.launch(_rank_main, [str(s) for s in specs], mesh, steps, out, model_s,
                           nprocs=n, timeout=model_s, deadline=30 + model_s * len(specs))
        except shardfx.LaunchError as e:
            error = e
        records = [_read(Path(out, f"rank{r}.jsonl")) for r in range(n)]
    results = []
    for i, spec in enumerate(specs):
        mine = [rec[i] for rec in records if i in rec]
        if not mine:
            cause = str(error).splitlines()[0] if error else "no rank answered"
            results.append(Result(str(spec), mesh, "crash", "LaunchError", cause))
            break
        result = _primary(mine)
        if result.ok and len(mine) < n:  # a rank passed, another never answered
            cause = str(error).splitlines()[0] if error else "a rank did not answer"
            result = Result(str(spec), mesh, "crash", "LaunchError", cause)
        results.append(result)
        if not result.ok:
            break
    return results


def _read(path: Path) -> dict[int, Result]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row.pop("index"): Result(**row) for row in rows}


# Errors a rank gets because another rank failed first.
_SECONDARY = re.compile(r"Connection (reset|closed)|timed? ?out|Broken pipe|peer", re.I)


def _primary(results: list[Result]) -> Result:
    """The result that explains the ranks' outcomes: a failure rather than a pass, a rank's own
    failure rather than the one it met waiting for that rank."""
    failed = [r for r in results if not r.ok]
    own = [r for r in failed if r.kind != "hang" and not _SECONDARY.search(r.message)]
    return (own or failed or results)[0]


def _rank_main(specs: list[str], mesh: str, steps: int, out: str, model_s: float) -> None:
    """On every rank: check each spec, writing each result as it comes. A rank whose model
    fails raises, so the launcher stops the others at once (instead of them waiting out a
    collective's timeout); one running a model past ``model_s`` writes a hang and exits."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # tiny models: the ranks share the machine's cores
    path = Path(out, f"rank{dist.get_rank()}.jsonl")
    for i, text in enumerate(specs):
        spec = ModelSpec.parse(text)
        watchdog = threading.Timer(model_s, _hung, (path, i, spec, mesh, model_s))
        watchdog.daemon = True
        watchdog.start()
        result = check(spec, mesh, steps)
        watchdog.cancel()
        _write(path, i, result)
        if not result.ok:
            raise _Failed(f"model {i} failed on rank {dist.get_rank()}: {result.kind}")
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, result.ok)  # in step: no rank starts the next model early


class _Failed(Exception):
    """Ends a rank after a failed model (the result is in its file)."""


def _write(path: Path, index: int, result: Result) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"index": index, **dataclasses.asdict(result)}) + "\n")


def _hung(path: Path, index: int, spec: ModelSpec, mesh: str, model_s: float) -> None:
    _write(path, index, Result(str(spec), mesh, "hang", message=f"no result after {model_s:g} s",
                               rank=_rank()))
    os._exit(3)
