"""Held-out Hugging Face families: each trained through shardfx on one device and on meshes, and
checked against eager PyTorch by ``shardfx.testing.compare_training``.

The suite's tests train a few Hugging Face models (tests/models.py), each on a few meshes; this
sweep crosses the families ``transformers`` ships that people train with every mesh, most of them
never seen by a test: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Phi-3, PhiMoE (Gumbel
routing through a custom ``autograd.Function``, input jitter), StableLM, Cohere, OLMo, OLMo 2,
OLMoE, GraniteMoE, GLM-4, GLM-4-MoE, DeepSeek-V3, Gemma, Gemma 2, Gemma 3, GPT-J, GPT-2,
GPT-NeoX, StarCoder2, BERT (masked LM), Mixtral, Llama with Hugging Face's gradient
checkpointing on (reentrant and not); and since, Falcon, Bloom, OPT, GPT-BigCode, Phi-2,
Granite, Nemotron, Helium, Exaone 4, SmolLM3, OLMo 3 (sliding windows of 3 beside global
layers), ERNIE 4.5 and its MoE, Hunyuan dense and MoE, Apertus, Arcee, Seed-OSS, JetMoE, Llama 4
(chunks of 3, MoE), GPT-OSS, dots.llm1, RoBERTa, T5 and BART (encoder-decoders), ViT and ConvNeXt
(image classifiers). How each is built, its inputs and its loss: ``bench/heldout_families.py``
(tiny configs with seeded random weights, no download: hidden 32, ``--layers`` 2, 4 heads,
vocabulary 64; dropout as the config has it: ``compare_training`` replays shardfx's random
stream in eager). Batches: ``--steps`` 3 of 4 x 8 tokens (images, source and target tokens for
the others), AdamW lr 1e-3.

Meshes (``--meshes``; each run a ``shardfx.launch`` of its ranks, one on one device in this
process): ``one``; ``dp2``; ``tp2`` (``shard="megatron"``); ``ep2`` (MoE families only);
``dp2-tp2-z3`` (megatron, ``zero=3``: four processes); ``cp2`` (token sequences: not the image
classifiers); ``pp2`` (2 microbatches). Per (family, mesh) the result is one of

- ``pass``, with the worst error-to-bound ratio of any check (below 1 is within the bound);
- ``FAIL``: ``compare_training``'s assertion, the step and the tensors beyond their bound: a
  bug in shardfx (this script loosens nothing);
- ``refused``: a named shardfx error (``ShardfxError``: ``InputError``, ``CaptureError``, ...)
  with its first line: shardfx says it cannot do this, which is a result, not a failure;
- ``ERROR``: any other exception (its type, first line and innermost shardfx frames), or a
  ``PassError`` / ``VerifyError`` (shardfx's own words for a bug of its own: a pass that
  raised or broke the IR), ``hang`` or ``crash``: bugs too;
- ``skipped``: the mesh does not apply (no experts for ep, images for cp) or the family
  does not build or train eagerly in this ``transformers`` (the reason recorded);

and the run's wall time. ``--quick`` is the subset tests/test_heldout.py runs (a dense, a MoE
and a random-routing family; one device, dp and tp, ep).

    python -m bench.heldout [--families llama,phimoe | --added] [--meshes one,tp2] [--quick]
                            [--layers 2] [--steps 3] [--no-append] [--list]

(``--added``: the families added since the first sweep, ``heldout_families.ADDED``.)

Prints the table (families by meshes) and every result other than a pass, and appends both to
bench/RESULTS.md with the machine, the load average and the date unless ``--no-append``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("SHARDFX_DEBUG", "1")  # verify the IR after every pass, as the tests do
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # bench.common; tests/models.py (the ranks' too)

import torch  # noqa: E402

from bench.common import append_results, machine  # noqa: E402
from bench.heldout_families import ADDED, FAMILIES, Family  # noqa: E402
from models import HIDDEN, SEQ, VOCAB  # noqa: E402

BATCH = 4  # divides dp=2 x 2 microbatches
TIMEOUT = 120.0  # seconds a collective may wait: a rank that failed alone ends its peers' wait
DEADLINE = 600.0  # seconds a whole run may take, start-up included

# --- the meshes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """``partition`` keyword arguments, and which families the mesh applies to."""

    kwargs: dict = field(default_factory=dict)
    needs: str = ""  # "moe" | "sequence" | "" (every family)

    @property
    def nprocs(self) -> int:
        n = 1
        for size in self.kwargs.get("mesh", {}).values():
            n *= size
        return n

    def skip(self, family: Family) -> str | None:
        if self.needs == "moe" and not family.moe:
            return "no experts"
        if self.needs == "sequence" and not family.sequence:
            return "images, not a token sequence"
        return None


MESHES: dict[str, Mesh] = {
    "one": Mesh(),
    "dp2": Mesh(dict(mesh={"dp": 2})),
    "tp2": Mesh(dict(mesh={"tp": 2}, shard="megatron")),
    "ep2": Mesh(dict(mesh={"ep": 2}), needs="moe"),
    "dp2-tp2-z3": Mesh(dict(mesh={"dp": 2, "tp": 2}, shard="megatron", zero=3)),
    "cp2": Mesh(dict(mesh={"cp": 2}), needs="sequence"),
    "pp2": Mesh(dict(mesh={"pp": 2}, microbatches=2)),
}

QUICK_FAMILIES = "llama,mixtral,phimoe"
QUICK_MESHES = "one,dp2,tp2,ep2"

# --- one run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """How one family fared on one mesh.

    kind: "pass" | "FAIL" (numbers beyond compare_training's bound) | "refused" (a named shardfx
    error) | "ERROR" (another exception) | "hang" | "crash" (a rank died or never answered) |
    "skipped".
    """

    family: str
    mesh: str
    kind: str
    error: str = ""  # exception type
    message: str = ""  # first lines of the message
    where: str = ""  # innermost frames, shardfx's own where it has any
    worst: float = 0.0  # a pass: the largest error-to-bound ratio of its checks
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """A pass, a refusal by name or a skip: what tests/test_heldout.py requires."""
        return self.kind in ("pass", "refused", "skipped")

    def headline(self) -> str:
        """The first line of the message; for a FAIL, also the tensors beyond their bound."""
        lines = self.message.splitlines()
        head = lines[0] if lines else ""
        if self.kind == "FAIL":
            bad = [line.split()[-1] for line in lines[1:] if " FAIL " in line]
            head += f" {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else ""
        return f"{self.error}: {head}" if self.error else head

    def cell(self) -> str:
        if self.kind == "skipped":
            return "skipped"
        if self.kind == "pass":
            return f"pass {self.worst:.2f} ({self.seconds:.0f} s)"
        what = self.kind if self.kind == "refused" else f"**{self.kind}**"  # a bug: bold
        return f"{what} ({self.seconds:.0f} s)"


def check(family: str, mesh: str, layers: int, steps: int) -> Result:
    """Train ``family`` on ``mesh`` through ``compare_training`` (this process must be one of the
    mesh's ranks) and say how it went."""
    from shardfx.errors import PassError, ShardfxError, VerifyError
    from shardfx.testing import compare_training

    start, f = time.perf_counter(), FAMILIES[family]
    model = f.build(layers)
    try:
        report = compare_training(model, f.batches(steps, BATCH), f.loss, **MESHES[mesh].kwargs)
    except Exception as e:  # noqa: BLE001 - every way of failing is a result here
        if isinstance(e, AssertionError) and _raised_in_testing(e):
            kind = "FAIL"
        else:
            named = isinstance(e, ShardfxError) and not isinstance(e, (PassError, VerifyError))
            kind = "refused" if named else "ERROR"
        return _failure(family, mesh, kind, e, time.perf_counter() - start)
    worst = max((c.shardfx / c.bound for c in report.checks), default=0.0)
    return Result(family, mesh, "pass", worst=worst, seconds=time.perf_counter() - start)


def probe(family: str, layers: int) -> tuple[str | None, str]:
    """Whether ``family`` builds and trains one eager step on a batch: (None, the module of its
    model class), or (why not: the error's first line, "")."""
    try:
        f = FAMILIES[family]
        model = f.build(layers)
        (args, targets), = f.batches(1, BATCH)
        f.loss(model(*args), *targets).backward()
    except Exception as e:  # noqa: BLE001
        return (f"does not build or train eagerly: {type(e).__name__}: "
                + (str(e).splitlines() or [""])[0][:200]), ""
    return None, type(getattr(model, "model", model)).__module__  # Seq2Seq's too


def _raised_in_testing(e: BaseException) -> bool:
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(os.path.join("shardfx", "testing.py"))


def _failure(family: str, mesh: str, kind: str, e: BaseException, seconds: float) -> Result:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if os.sep + "shardfx" + os.sep in f.filename] or frames
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
    message = "\n".join(str(e).splitlines()[:14])[:3000]
    return Result(family, mesh, kind, type(e).__name__, message, where, seconds=seconds)


def run(family: str, mesh: str, layers: int, steps: int) -> Result:
    """``check`` on one device here, or on every rank of a ``shardfx.launch``; the result of the
    rank that explains the outcome."""
    import shardfx

    if MESHES[mesh].nprocs == 1:
        return check(family, mesh, layers, steps)
    n, start = MESHES[mesh].nprocs, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardfx-heldout-") as out:
        error = None
        try:
            shardfx.launch(_rank_main, family, mesh, layers, steps, out, nprocs=n,
                           timeout=TIMEOUT, deadline=DEADLINE)
        except shardfx.LaunchError as e:
            error = e
        results = [Result(**json.loads(p.read_text())) for p in sorted(Path(out).glob("rank*"))]
    seconds = time.perf_counter() - start
    failed = [r for r in results if r.kind != "pass"]
    own = [r for r in failed if not _secondary(r.message)]  # not "peer closed the connection"
    if own or failed:
        return _with_seconds((own or failed)[0], seconds)
    if len(results) < n or error is not None:
        cause = str(error).splitlines()[0] if error else "a rank did not answer"
        kind = "hang" if error and "deadline" in cause.lower() else "crash"
        return Result(family, mesh, kind, "LaunchError", cause, seconds=seconds)
    worst = max(r.worst for r in results)
    return Result(family, mesh, "pass", worst=worst, seconds=seconds)


def _secondary(message: str) -> bool:
    """An error a rank gets because another rank failed first."""
    text = message.lower()
    return any(s in text for s in ("connection reset", "connection closed", "timed out",
                                   "timeout", "broken pipe", "peer"))


def _with_seconds(result: Result, seconds: float) -> Result:
    return Result(**{**asdict(result), "seconds": seconds})


def _rank_main(family: str, mesh: str, layers: int, steps: int, out: str) -> None:
    """On every rank: check, write the result; a rank that did not pass raises, so the launcher
    stops the others at once instead of leaving them waiting in a collective."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # tiny models: the ranks share the machine's cores
    result = check(family, mesh, layers, steps)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(asdict(result)))
    if result.kind != "pass":
        raise _Failed(f"{family} on {mesh}: {result.kind} on rank {dist.get_rank()}")


class _Failed(Exception):
    """Ends a rank after a run that did not pass (the result is in its file)."""


# --- the sweep ----------------------------------------------------------------------------------


def sweep(families: list[str], meshes: list[str], layers: int = 2, steps: int = 3,
          log: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Every family on every mesh that applies to it; skips recorded."""
    probes = {f: probe(f, layers) for f in families}
    skips = {f: why for f, (why, _) in probes.items()}
    # The ranks fork from a server that imports the models' code once, not in every rank.
    modules = sorted({module for _, module in probes.values() if module})
    os.environ.setdefault("SHARDFX_PRELOAD", ",".join(modules))
    results = []
    for f in families:
        for m in meshes:
            why = skips[f] or MESHES[m].skip(FAMILIES[f])
            result = Result(f, m, "skipped", message=why) if why else run(f, m, layers, steps)
            log(result)
            results.append(result)
    return results


def table(results: list[Result], meshes: list[str]) -> list[str]:
    families = list(dict.fromkeys(r.family for r in results))
    cell = {(r.family, r.mesh): r.cell() for r in results}
    rows = ["| family | " + " | ".join(meshes) + " |", "|---|" + "---|" * len(meshes)]
    rows += [f"| {f} | " + " | ".join(cell.get((f, m), "") for m in meshes) + " |"
             for f in families]
    return rows


def notes(results: list[Result]) -> list[str]:
    """Every result other than a pass, with its reason; skips for a whole family once."""
    lines, family_skips = [], set()
    for r in results:
        if r.kind == "pass" or r.kind == "skipped" and r.family in family_skips:
            continue
        if r.kind == "skipped" and r.message.startswith("does not build"):
            family_skips.add(r.family)
            lines.append(f"- {r.family}: skipped, {r.message}")
        elif r.kind == "skipped":
            continue  # the mesh does not apply: said once under the table
        else:
            lines.append(f"- {r.family} x {r.mesh}: {r.kind}, {r.headline()}"
                         + (f" (at {r.where})" if r.kind in ("ERROR", "FAIL") and r.where else ""))
    return lines or ["every run passed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--added", action="store_true",
                        help=f"the families added since the first sweep: {', '.join(ADDED)}")
    parser.add_argument("--meshes", help=f"comma-separated, of {', '.join(MESHES)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"families {QUICK_FAMILIES} on meshes {QUICK_MESHES}")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--list", action="store_true", help="list families and meshes")
    a = parser.parse_args()
    if a.list:
        print("families:", ", ".join(FAMILIES), "\nmeshes:", ", ".join(MESHES))
        return
    families = (a.families or (QUICK_FAMILIES if a.quick else ",".join(
        ADDED if a.added else FAMILIES))).split(",")
    meshes = (a.meshes or (QUICK_MESHES if a.quick else ",".join(MESHES))).split(",")
    for what, names, known in (("families", families, FAMILIES), ("meshes", meshes, MESHES)):
        if unknown := [n for n in names if n not in known]:
            parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")

    load, start = os.getloadavg()[0], time.perf_counter()
    results = sweep(families, meshes, a.layers, a.steps,
                    log=lambda r: print(f"{r.family:>22} {r.mesh:<11} {r.cell():<22} "
                                        f"{'' if r.kind == 'pass' else r.headline()[:120]}",
                                        flush=True))
    elapsed, load = time.perf_counter() - start, (load, os.getloadavg()[0])
    head = (f"heldout: {len(families)} Hugging Face families x {len(meshes)} meshes, hidden "
            f"{HIDDEN}, {a.layers} layers, 4 heads, vocab {VOCAB}, {BATCH} x {SEQ} tokens (images, "
            f"or source and target tokens: bench/heldout_families.py), "
            f"{a.steps} AdamW steps, compare_training against eager; cell: result (pass: the "
            f"worst error / bound ratio) and wall time; {elapsed:.0f} s in all, load average "
            f"(1 min) {load[0]:.2f} at the start, {load[1]:.2f} at the end")
    only = {"moe": "MoE families only", "sequence": "token sequences, not images"}
    applies = "; ".join(f"{m}: {only[MESHES[m].needs]}" for m in meshes if MESHES[m].needs)
    text = "\n".join([head, "", *table(results, meshes), "", *[applies + "."] * bool(applies),
                      "", *notes(results)])
    print("\n" + text)
    if not a.no_append:
        append_results("heldout (bench/heldout.py)", text, f"{machine()}, {platform.platform()}")


if __name__ == "__main__":
    main()
