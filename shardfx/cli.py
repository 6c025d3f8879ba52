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
``run`` trains it (``shardfx.train``); its dict may add ``"batches"``, an iterable of
``(args, targets)`` to train on instead of synthetic batches. ``calibrate`` measures this
machine (matmul FLOP/s per dtype, memory bandwidth, the link between two local processes) and
writes the ``DeviceModel`` plans then use by default (``shardfx.calibrate``).

Exit codes: 0 planned; 1 shardfx rejected the model (a ``ShardfxError``, message printed);
2 the command line is wrong (bad MODULE:FACTORY, bad ``--mesh``, unknown option). Errors print
one paragraph, never a traceback; an exception raised by the user's own module or factory
propagates with its traceback, since that is where the fix is.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Sequence

from shardfx.config import zero_stage
from shardfx.errors import InputError, MeshError, ShardfxError
from shardfx.mesh import MeshSpec

if TYPE_CHECKING:
    import torch

FACTORY_KEYS = ("model", "args", "loss_fn", "targets", "batches")
FACTORY_SHAPE = ('return {"model": module, "args": (x,), "loss_fn": fn, "targets": (y,)} '
                 "or (module, (x,), fn, (y,)); loss_fn and targets are optional")
_MISSING = object()


class SpecError(ShardfxError):
    """MODULE:FACTORY on the command line does not name a usable factory (exit code 2)."""


@dataclass(frozen=True)
class Job:
    """What a factory returned, checked: the arguments of ``shardfx.partition``."""

    model: torch.nn.Module
    args: tuple
    loss_fn: Callable[..., Any] | None = None
    targets: tuple = ()
    batches: Any = None  # for run: an iterable of (args, targets)


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
            from shardfx.runtime.launch import record_for_torchrun

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
                        "h100, h200, cpu or a JSON file (default: this machine's calibration, "
                        "else the GPU's preset, else cpu)")
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
    """One flag per field of the run configuration (``shardfx.config``), given or not."""
    from shardfx.config import config_fields

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
    """``--mesh`` of run, checked, in its canonical text ("" for one device)."""
    return ",".join(f"{axis}={n}" for axis, n in _mesh(text).axes)


def _mesh(text: str) -> MeshSpec:
    try:
        return MeshSpec.parse(text)
    except MeshError as e:  # argparse prints it under the usage line and exits 2
        raise argparse.ArgumentTypeError(str(e)) from None


def inspect_command(ns: argparse.Namespace) -> int:
    import shardfx
    from shardfx.config import check_axes

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


def calibrate_command(ns: argparse.Namespace) -> int:
    import torch

    from shardfx.calibrate import calibrate, write

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = calibrate(device, quick=ns.quick, links=ns.links,
                      log=lambda what: print(f"measuring {what} ...", file=sys.stderr))
    print(model.describe())
    path = write(model, ns.out, device)
    print(f"wrote {path}")
    return 0


def run_command(ns: argparse.Namespace) -> int:
    from shardfx.config import RunConfig, check_fields, load_toml, set_fields

    config = load_toml(ns.config) if ns.config else RunConfig()
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "name", "config")}
    set_fields(config, given, "the command line")
    check_fields(config)  # a mistake in the file or the flags is said before torch loads

    from shardfx.train import run  # imports torch

    run(config)
    return 0


def pipeline_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The pipeline options given on the command line (``partition`` checks them, and says
    when one is given without a pp axis)."""
    given = {"microbatches": ns.microbatches, "schedule": ns.schedule,
             "virtual_stages": ns.virtual_stages}
    return {k: v for k, v in given.items() if v is not None}


# --- MODULE:FACTORY -> Job ------------------------------------------------------------------


def load_job(spec: str) -> Job:
    """Import the module ``spec`` names, call its factory, and check what it returned."""
    module_name, colon, attr = spec.rpartition(":")
    if not colon or not module_name or not attr:
        raise SpecError(f"{spec!r} does not name a factory", where=spec,
                        fix="write MODULE:FACTORY, e.g. mypkg.models:make or "
                        "examples/nanogpt.py:make")
    module = _import(module_name)
    factory = getattr(module, attr, _MISSING)
    if factory is _MISSING:
        defined = [name for name, v in vars(module).items() if _defined_function(v, module)]
        listed = ", ".join(defined[:12]) + (", ..." if len(defined) > 12 else "")
        raise SpecError(f"module {module_name!r} has no attribute {attr!r}", where=spec,
                        fix=f"name one of its functions ({listed or 'it defines none'})")
    if not callable(factory):
        raise SpecError(f"{attr!r} in {module_name!r} is {_a(factory)}, not a callable",
                        where=spec, fix=f"name a function that takes no arguments and will "
                        f"{FACTORY_SHAPE}")
    _check_no_required_args(factory, spec)
    try:
        made = factory()
    except OSError as e:  # a data file not made yet (examples/prepare_text.py), unreadable
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise InputError(f"the factory could not read what it needs: {type(e).__name__}: {e}",
                        where=f"{spec} ({frame.filename}:{frame.lineno} in {frame.name})",
                        fix="make or point to the file it reads (its message above says how), "
                            "then run again") from None
    return _job(made, spec)


def _import(name: str) -> ModuleType:
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(Path(name))
    # Like `python -m`: modules and packages in the current directory are importable.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # the module exists; something it imports does not: the user's traceback
        raise SpecError(f"no module named {name!r} (looked for {e.name!r} on the import path)",
                        where=f"{name} (from {os.getcwd()})",
                        fix="check the spelling, run from the directory that contains the "
                        "package, or give the path to the .py file instead "
                        f"(e.g. {name.replace('.', '/')}.py:FACTORY)") from None


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise SpecError(f"no file {str(path)!r}", where=f"{path.resolve()}",
                        fix="give the path of a .py file, relative to the current directory or "
                        "absolute, or a dotted module name (mypkg.models:FACTORY)")
    # Named after the file, as `import` would, unless that would replace an unrelated module
    # (the file's own `if __name__ == "__main__":` block does not run).
    name = path.stem
    other = sys.modules.get(name)
    if other is not None and getattr(other, "__file__", None) != str(path.resolve()):
        name = f"_shardfx_cli_.{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path.resolve())
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"cannot import {str(path)!r} as a Python module", where=str(path),
                        fix="give the path of a .py file")
    module = importlib.util.module_from_spec(module_spec)
    # Like `python path/to/file.py`: its directory is on the path, for its sibling imports.
    if str(path.resolve().parent) not in sys.path:
        sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _a(value: Any) -> str:
    """``a Tensor``, ``an int``: the type of ``value`` for a message."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _defined_function(value: Any, module: ModuleType) -> bool:
    return inspect.isfunction(value) and value.__module__ == module.__name__ \
        and not value.__name__.startswith("_")


def _check_no_required_args(factory: Callable, spec: str) -> None:
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise SpecError(f"the factory {spec.rpartition(':')[2]}{inspect.signature(factory)} "
                        "has required parameters; the command line calls it with none",
                        where=spec,
                        fix="give its parameters defaults, or add a function without parameters "
                        "that calls it") from None
    except ValueError:  # no signature to read (a builtin): let the call decide
        pass


def _job(value: Any, spec: str) -> Job:
    """A Job from a factory's dict or tuple, naming the wrong part if there is one."""
    import torch

    if isinstance(value, dict):
        unknown = [k for k in value if k not in FACTORY_KEYS]
        missing = [k for k in ("model", "args") if k not in value]
        if unknown or missing:
            problem = "; ".join(filter(None, [
                unknown and f"unknown keys {', '.join(map(repr, unknown))}",
                missing and f"missing keys {', '.join(map(repr, missing))}"]))
            raise SpecError(f"the factory returned a dict with {problem}", where=spec,
                            fix=f"use the keys {', '.join(FACTORY_KEYS)}: {FACTORY_SHAPE}")
        parts = dict(value)
    elif isinstance(value, (tuple, list)) and 2 <= len(value) <= 4:
        parts = dict(zip(FACTORY_KEYS, value))
    else:
        what = f"a {len(value)}-tuple" if isinstance(value, (tuple, list)) else _a(value)
        raise SpecError(f"the factory returned {what}, not a dict or a 2- to 4-tuple",
                        where=spec, fix=f"make it {FACTORY_SHAPE}")

    def wrong(key: str, want: str, fix: str) -> SpecError:
        return SpecError(f"the factory's {key} is {_a(parts[key])}, not {want}", where=spec,
                         fix=fix)

    if not isinstance(parts["model"], torch.nn.Module):
        raise wrong("model", "a torch.nn.Module", "return the module itself")
    for key in ("args", "targets"):
        if isinstance(parts.get(key), list):
            parts[key] = tuple(parts[key])
        if key in parts and not isinstance(parts[key], tuple):
            raise wrong(key, "a tuple", "wrap a single tensor in a tuple: (x,)")
    if parts.get("loss_fn") is not None and not callable(parts["loss_fn"]):
        raise wrong("loss_fn", "a callable", "return loss_fn(output, *targets) -> scalar, or None")
    return Job(**parts)
