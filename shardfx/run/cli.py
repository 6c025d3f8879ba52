"""The ``shardfx`` command line.

    shardfx inspect MODULE:FACTORY [--mesh dp=1,tp=1] [--microbatches M] [--schedule NAME]
                                   [--virtual-stages V] [--infer] [--precision P]
                                   [--zero K] [--budget SIZE] [--dump DIR]
    shardfx run MODULE:FACTORY [--mesh ...] [--steps N] [--lr LR] [--seed S] [--precision P]
                               [--zero K] [pipeline options] [--save DIR] [--resume DIR]
                               [--trace FILE]
    shardfx calibrate [--device cpu|cuda] [--quick] [--no-links] [--out FILE]
    shardfx --version

``inspect`` imports MODULE (a dotted module such as ``mypkg.models``, or a path to a .py file
such as ``examples/nanogpt.py``), calls FACTORY() with no arguments, plans what it returns with
``shardfx.partition`` and prints the plan (with a pp axis, the schedule's grid too); nothing
runs. FACTORY returns either

    {"model": nn.Module, "args": tuple, "loss_fn": callable or None, "targets": tuple}

(``loss_fn`` and ``targets`` optional) or the tuple ``(model, args[, loss_fn[, targets]])``.
``run`` trains it (``shardfx.run.train``); its dict may add ``"batches"``, an iterable of
``(args, targets)`` to train on instead of synthetic batches. ``calibrate`` measures this
machine (matmul FLOP/s per dtype, memory bandwidth, the link between two local processes) and
writes the ``DeviceModel`` plans then use by default (``shardfx.run.calibrate``).

Exit codes: 0 planned; 1 shardfx rejected the model (a ``ShardfxError``, message printed);
2 the command line is wrong (bad MODULE:FACTORY, bad ``--mesh``, unknown option). Errors print
one paragraph, never a traceback; an exception raised by the user's own module or factory
propagates with its traceback, since that is where the fix is.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

import shardfx
from shardfx.errors import MeshError, ShardfxError
from shardfx.mesh import MeshSpec
from shardfx.run.config import (RunConfig, check_axes, check_fields, config_fields, load_toml,
                                set_fields, zero_stage)
from shardfx.run.job import FACTORY_SHAPE, SpecError, load_job


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # --help (0), or a usage error argparse has already printed (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return ns.command(ns)
    except SpecError as e:
        print(f"shardfx {ns.name}: error: {e}", file=sys.stderr)
        return 2
    except ShardfxError as e:
        print(f"shardfx {ns.name}: error: {e}", file=sys.stderr)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under torchrun (not importing torch)
            from shardfx.runtime.launch import record_for_torchrun  # lazy: it imports torch

            record_for_torchrun(e)  # torchrun's summary shows it, not "To enable traceback see"
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardfx", description="A compiler for distributed training of PyTorch models.")
    parser.add_argument("--version", action="version", version=f"shardfx {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "inspect", help="plan a model and print the plan, without running it",
        description="Import MODULE, call FACTORY(), plan what it returns and print the plan. "
        f"FACTORY must {FACTORY_SHAPE}.")
    p.add_argument("spec", metavar="MODULE:FACTORY",
                   help="a dotted module (mypkg.models:make) or a .py file "
                   "(examples/nanogpt.py:make) and the factory function in it")
    p.add_argument("--mesh", type=_mesh, default=MeshSpec(), metavar="AXIS=N,...",
                   help="device mesh, e.g. dp=2,tp=2 (default: one device)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="with a pp axis: slices of the batch the pipeline runs (default 1)")
    p.add_argument("--schedule", metavar="NAME",
                   help="with a pp axis: gpipe | 1f1b | interleaved-1f1b | zero-bubble "
                   "(default 1f1b)")
    p.add_argument("--virtual-stages", type=int, metavar="V",
                   help="with a pp axis: stages per rank (interleaved-1f1b: default 2)")
    p.add_argument("--infer", action="store_true",
                   help="plan inference only: ignore the factory's loss_fn and targets")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="what matmuls and attention compute in; softmax, norms and the loss "
                   "stay fp32 (default: fp32)")
    p.add_argument("--shard", choices=["auto", "megatron", "megatron-sp", "replicate"],
                   default="auto", help="how weights split over tp: auto (a solver picks by "
                   "the device model), megatron, megatron-sp (and the sequence over tp), "
                   "replicate (default auto)")
    p.add_argument("--zero", type=zero_stage, choices=[0, 1, 2, 3, "auto"], default="auto",
                   help="shard the training state over dp (ZeRO): 1 the optimizer state, 2 "
                   "and the gradients, 3 and the parameters; auto: the cheapest stage that "
                   "fits the memory (default auto)")
    p.add_argument("--budget", metavar="SIZE",
                   help="memory per device, e.g. 8GiB: recompute activations until it fits")
    p.add_argument("--dump", metavar="DIR",
                   help="also write the IR after every pass, the program, plan.txt and "
                        "plan.html (the plan as a page) to DIR")
    p.add_argument("--device-model", metavar="NAME|FILE",
                   help="the device speeds the plan trades time at and predicts its step on: "
                        "h100, h200, gh200, cpu or a JSON file (default: this machine's "
                        "calibration, else the GPU's preset, else cpu)")
    p.set_defaults(command=inspect_command, name="inspect")

    c = commands.add_parser(
        "calibrate", help="measure this machine's speeds for the time model plans use",
        description="Measure matmul FLOP/s per dtype (float64, float32, bfloat16, float16), "
        "memory bandwidth (a large copy) and the link between two processes spawned here "
        "(gloo, or NCCL on two GPUs: latency from tiny all-reduces, bandwidth from a large "
        "one); print them and write them as JSON to $SHARDFX_CACHE, else "
        "$XDG_CACHE_HOME/shardfx, else ~/.cache/shardfx, in a file named after the device. "
        "partition() then uses that file by default (device_model=None). The link between "
        "machines cannot be measured here and keeps the preset's numbers.")
    c.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="what to measure (default: cuda if torch sees a GPU, else cpu)")
    c.add_argument("--quick", action="store_true",
                   help="small sizes and few repetitions: seconds, rougher numbers")
    c.add_argument("--no-links", dest="links", action="store_false",
                   help="skip the two-process link measurement (keep the preset's link)")
    c.add_argument("--out", metavar="FILE", help="write the JSON here instead of the cache")
    c.set_defaults(command=calibrate_command, name="calibrate")

    s = commands.add_parser(
        "plan", help="choose the mesh, batch split, schedule, ZeRO stage and recomputation "
        "for N devices",
        description="Import MODULE, call FACTORY() (or read [run] spec and [parallel] precision "
        "from a run's TOML file) and search every way to run one optimizer step of its example "
        "batch (one global batch) on --devices devices: meshes, micro-batch sizes, schedules, "
        "ZeRO stages and recompute policies, each priced on the device model; the fastest are "
        "planned in full. Prints the candidates ranked and why the first wins.")
    s.add_argument("spec", metavar="MODULE:FACTORY|FILE.toml",
                   help="as for inspect, or a run's TOML config (its [run] spec)")
    s.add_argument("--devices", type=int, required=True, metavar="N", help="devices to plan for")
    s.add_argument("--device-model", metavar="NAME|FILE",
                   help="h100, a100, gh200, cpu or a JSON file (as for inspect)")
    s.add_argument("--mesh", type=_mesh, default=MeshSpec(), metavar="AXIS=N,...",
                   help="axes to keep as given, e.g. tp=8 (default: none fixed)")
    s.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="what matmuls and attention compute in (default: the TOML's, else fp32)")
    s.add_argument("--budget", metavar="SIZE",
                   help="memory per device, e.g. 80GB (default: the device model's memory)")
    s.set_defaults(command=plan_command, name="plan")

    r = commands.add_parser(
        "run", help="train a model factory on a mesh, as flags and a TOML config say",
        description="Import MODULE, call FACTORY() on every rank, plan it and train it with "
        "AdamW, printing a line per step; spawns the mesh's processes unless run under torchrun. "
        f"FACTORY must {FACTORY_SHAPE}; it may add \"batches\": an iterable of (args, targets) "
        "(else a token file, or synthetic batches shaped like the example). Every option is "
        "also a key of --config's TOML file (its [section] in brackets below); a flag given "
        "wins over the file.")
    r.add_argument("spec", metavar="MODULE:FACTORY", nargs="?", default=argparse.SUPPRESS,
                   help="as for inspect ([run] spec)")
    r.add_argument("--config", metavar="FILE.toml", help="read the run's configuration from it")
    _config_flags(r)
    r.set_defaults(command=run_command, name="run")
    return parser


def _config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of the run configuration (``shardfx.run.config``), given or not."""
    for section, f in config_fields():
        if f.name == "spec":
            continue
        kind, choices = f.metadata["kind"], f.metadata["choices"]
        default = "" if f.default in (None, "") else f" (default {f.default})"
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
            type=_mesh_text if f.name == "mesh" else f.metadata["parse"], choices=choices or None,
            metavar=None if choices else f.name.upper().replace("_", "-"),
            help=f"[{section}] {f.metadata['help']}{default}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardfx")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _mesh_text(text: str) -> str:
    """``--mesh`` of run, checked, in its canonical text ("" for one device; "auto": the
    mesh ``shardfx.search`` chooses for ``--devices``)."""
    if text.strip() == "auto":
        return "auto"
    return ",".join(f"{axis}={n}" for axis, n in _mesh(text).axes)


def _mesh(text: str) -> MeshSpec:
    try:
        return MeshSpec.parse(text)
    except MeshError as e:  # argparse prints it under the usage line and exits 2
        raise argparse.ArgumentTypeError(str(e)) from None


def inspect_command(ns: argparse.Namespace) -> int:
    check_axes(list(pipeline_kwargs(ns)), ns.zero, ns.mesh, str(ns.mesh))
    job = load_job(ns.spec)
    plan = shardfx.partition(
        job.model, job.args,
        loss_fn=None if ns.infer else job.loss_fn,
        example_targets=() if ns.infer else job.targets,
        mesh=dict(ns.mesh.axes), shard=ns.shard, precision=ns.precision,
        memory_budget=ns.budget,
        zero=ns.zero, device_model=ns.device_model, **pipeline_kwargs(ns))
    print(str(plan).rstrip("\n"))
    if plan.schedule is not None:
        print(f"\nSchedule ({plan.schedule.ranks} ranks, {plan.schedule.microbatches} "
              f"microbatches):\n{plan.schedule}")
    if ns.dump:
        out = plan.dump(ns.dump)
        print(f"dumped the IR after every pass, the program and plan.txt to {out}/; "
              f"open {out / 'plan.html'} in a browser to look at the plan")
    return 0


def plan_command(ns: argparse.Namespace) -> int:
    spec, precision = ns.spec, ns.precision
    if spec.endswith(".toml"):
        config = load_toml(spec)
        spec, precision = config.spec, precision or config.precision
    job = load_job(spec)
    found = shardfx.search(job.model, job.args, job.loss_fn, job.targets, devices=ns.devices,
                           mesh=dict(ns.mesh.axes) or None, device_model=ns.device_model,
                           memory_budget=ns.budget, precision=precision or "fp32")
    print(found)
    return 0


def calibrate_command(ns: argparse.Namespace) -> int:
    import torch

    from shardfx.run.calibrate import calibrate, write  # lazy: --help stays fast without torch

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = calibrate(device, quick=ns.quick, links=ns.links,
                      log=lambda what: print(f"measuring {what} ...", file=sys.stderr))
    print(model.describe())
    path = write(model, ns.out, device)
    print(f"wrote {path}")
    return 0


def run_command(ns: argparse.Namespace) -> int:
    config = load_toml(ns.config) if ns.config else RunConfig()
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "name", "config")}
    set_fields(config, given, "the command line")
    check_fields(config)  # a mistake in the file or the flags is said before torch loads
    from shardfx.run.train import run  # lazy: imports torch, after the checks above

    run(config)
    return 0


def pipeline_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The pipeline options given on the command line (``partition`` checks them, and says
    when one is given without a pp axis)."""
    given = {"microbatches": ns.microbatches, "schedule": ns.schedule,
             "virtual_stages": ns.virtual_stages}
    return {k: v for k, v in given.items() if v is not None}


# --- MODULE:FACTORY -> Job ------------------------------------------------------------------


