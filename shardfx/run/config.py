"""The configuration of a ``shardfx run``: one dataclass tree, read from TOML, overridden by flags.

    shardfx run --config examples/shakespeare.toml              # the file
    shardfx run --config examples/shakespeare.toml --steps 20   # the file, one field overridden

Every field is one TOML key in its section and one command-line flag (``--`` and the field's
name with dashes: ``[training] clip_grad_norm`` is ``--clip-grad-norm``); a flag given wins
over the file, the file over the default. The tree, section by section:

    [run]         spec (MODULE:FACTORY), seed
    [parallel]    mesh, shard, zero, precision, kernels, microbatches, schedule,
                  virtual_stages, capacity_factor, offload_optimizer, recompute
    [optimizer]   lr, weight_decay, beta1, beta2, eps            (AdamW)
    [lr_schedule] warmup, decay (constant | cosine | linear), final_lr   (a fraction of lr)
    [training]    steps, accumulate, clip_grad_norm
    [data]        tokens (a .bin of uint16 token ids or a .npy)
    [checkpoint]  save, every, keep, resume, init_from, export_hf, allow_nonfinite
    [metrics]     jsonl, tensorboard, peak_tflops, gpu, trace

Nothing here imports torch: ``shardfx --help`` reads this module alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shardfx.errors import InputError
from shardfx.mesh import MeshSpec
from shardfx.request.option_docs import summary


def _f(default: Any, help: str, kind: type = None, choices: tuple = (),
       parse: Any = None) -> Any:
    """A config field: its default, its help, the type its flag and TOML value take (``parse``:
    how a flag's text becomes one, where not ``kind(text)``)."""
    return field(default=default, metadata={"help": help, "kind": kind or type(default),
                                            "choices": choices, "parse": parse or kind or type(default)})


def boolean(text: str) -> bool:
    """A true-or-false flag's value: ``true`` or ``false``."""
    if text.lower() not in ("true", "false"):
        raise ValueError(f"{text!r} is not true or false")
    return text.lower() == "true"


def zero_stage(text: str) -> int | str:
    """A ``--zero`` flag's value: a stage 0-3, or "auto"."""
    return text if text == "auto" else int(text)


@dataclass
class Run:
    spec: str = _f("", "MODULE:FACTORY: a dotted module or a .py file and the factory in it", str)
    seed: int = _f(0, "seeds the factory's weights, the batch order and synthetic batches")
    devices: int | None = _f(None, 'with mesh = "auto": the devices to plan for; shardfx.search '
                             "chooses the mesh, micro-batch, schedule, ZeRO stage and "
                             "recomputation, and the run takes its first choice", int)


@dataclass
class Parallel:  # partition()'s options: their help is theirs (request/option_docs.py)
    mesh: str = _f("", summary("mesh"))
    shard: str = _f("auto", summary("shard"),
                    choices=("auto", "megatron", "megatron-sp", "replicate"))
    zero: int | str = _f("auto", summary("zero"), object, (0, 1, 2, 3, "auto"), zero_stage)
    precision: str = _f("fp32", summary("precision"), choices=("fp32", "bf16", "fp16"))
    kernels: str = _f("auto", summary("kernels"), choices=("auto", "compiled", "triton", "aten"))
    microbatches: int | None = _f(None, summary("microbatches"), int)
    schedule: str | None = _f(None, summary("schedule"), str)
    virtual_stages: int | None = _f(None, summary("virtual_stages"), int)
    capacity_factor: float | None = _f(None, summary("capacity_factor"), float)
    offload_optimizer: bool = _f(False, summary("offload_optimizer"), bool, parse=boolean)
    recompute: str = _f("auto", summary("recompute"),
                        choices=("auto", "none", "selective", "full"))


@dataclass
class Optimizer:
    lr: float = _f(3e-4, "AdamW's peak learning rate")
    weight_decay: float = _f(0.0, "AdamW's decoupled weight decay")
    beta1: float = _f(0.9, "AdamW's beta1")
    beta2: float = _f(0.999, "AdamW's beta2")
    eps: float = _f(1e-8, "AdamW's eps")


@dataclass
class LR:
    warmup: int = _f(0, "steps of linear warmup to lr")
    decay: str = _f("constant", "after warmup, to final_lr by the last step",
                    choices=("constant", "cosine", "linear"))
    final_lr: float = _f(0.0, "the learning rate at the last step, as a fraction of lr")


@dataclass
class Training:
    steps: int = _f(10, "optimizer steps in all")
    accumulate: int = _f(1, "batches per optimizer step (gradient accumulation)")
    clip_grad_norm: float | None = _f(None, "clip the global gradient norm to this", float)


@dataclass
class Data:
    tokens: str | None = _f(None, "a file of token ids (uint16 .bin, or .npy) to train a "
                                  "language model on; default: the factory's batches, else "
                                  "synthetic ones", str)


@dataclass
class Checkpoint:
    save: str | None = _f(None, "directory of checkpoints (step-N/ in it)", str)
    every: int = _f(0, "save every N steps (0: after the last step only)")
    keep: int = _f(0, "keep the last K checkpoints (0: all)")
    resume: str | None = _f(None, "continue from this checkpoint, or the latest in this "
                                  "directory", str)
    init_from: str | None = _f(None, "start from the weights of this Hugging Face checkpoint "
                                     "directory (save_pretrained's safetensors)", str)
    export_hf: str | None = _f(None, "after the last step, write the model here as a Hugging "
                                     "Face checkpoint (from_pretrained loads it)", str)
    allow_nonfinite: bool = _f(False, "load weights holding NaN or Inf (resume, init_from) on "
                                      "purpose, to look at a run that diverged", bool,
                               parse=boolean)


@dataclass
class Metrics:
    jsonl: str | None = _f(None, "append one JSON line per step (and events) to this file", str)
    tensorboard: str | None = _f(None, "write TensorBoard scalars to this directory", str)
    peak_tflops: float | None = _f(None, "one device's peak TFLOP/s, for MFU", float)
    gpu: str | None = _f(None, "a GPU whose peak to use for MFU: h100 | h200 | a100 | l4", str)
    trace: str | None = _f(None, "profile the last step: a Chrome trace to this file, and "
                                 "per rank its compute, communication and idle time", str)


@dataclass
class RunConfig:
    run: Run = field(default_factory=Run)
    parallel: Parallel = field(default_factory=Parallel)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_schedule: LR = field(default_factory=LR)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)

    @classmethod
    def of(cls, spec: str, mesh: str = "", **flat: Any) -> "RunConfig":
        """A config from flat field names, as the flags name them: ``RunConfig.of(spec,
        "dp=2", steps=4, save="ck")``."""
        config = cls()
        set_fields(config, {"spec": spec, "mesh": mesh, **flat}, "RunConfig.of")
        return config

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved config as TOML text (unset optional fields left out)."""
        lines = []
        for name, section in self.to_dict().items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {_toml(v)}" for k, v in section.items() if v is not None]
            lines.append("")
        return "\n".join(lines)

    # the fields every rank reads, by their flat names
    def __getattr__(self, name: str) -> Any:
        section = SECTION_OF.get(name)
        if section is None:
            raise AttributeError(name)
        return getattr(getattr(self, section), name)


def _toml(v: Any) -> str:
    """A TOML value: JSON's string escapes are TOML's basic string's."""
    return str(v).lower() if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) \
        else str(v)


SECTIONS = {f.name: f.default_factory for f in fields(RunConfig)}
SECTION_OF = {f.name: section for section, kind in SECTIONS.items() for f in fields(kind)}


def config_fields():
    """(section, field) of every config field, in order: the flags and the TOML keys."""
    for section, kind in SECTIONS.items():
        for f in fields(kind):
            yield section, f


def load_toml(path: str) -> RunConfig:
    """The config in a TOML file, checked: unknown sections and keys, and values of the wrong
    type, are errors naming the key and the fix."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no config file {path!r}", where=f"--config {path}",
                         fix="give the path of a TOML file (see examples/shakespeare.toml)")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path} is not valid TOML: {e}", where=f"--config {path}",
                         fix="fix the line the message names") from None
    config = RunConfig()
    for section, values in data.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise InputError(f"unknown section [{section}]{_close(section, SECTIONS)}",
                             where=f"{path}", fix=f"sections are {', '.join(SECTIONS)}")
        known = {f.name for f in fields(SECTIONS[section])}
        for key, value in values.items():
            if key not in known:
                raise _unknown_key(key, section, known, path)
        set_fields(config, values, f"{path}, [{section}]", only=section)
    return config


def _unknown_key(key: str, section: str, known: set[str], path: str) -> InputError:
    """A key [section] does not take: a key of another section (``init_from`` under
    [training] is [checkpoint]'s) or a near miss of one is said with its section."""
    where = f"{path}, [{section}]"
    near = difflib.get_close_matches(key, sorted(known), n=1)
    elsewhere = [key] if key in SECTION_OF else \
        [] if near else difflib.get_close_matches(key, list(SECTION_OF), n=1)
    if elsewhere:
        name, home = elsewhere[0], SECTION_OF[elsewhere[0]]
        return InputError(f"unknown key {key!r} in [{section}] (did you mean [{home}] {name}? "
                          f"{name} is a key of [{home}], not of [{section}])", where=where,
                          fix=f"move it under [{home}]: [{home}] {name} = ...")
    return InputError(f"unknown key {key!r} in [{section}]{_close(key, known)}", where=where,
                      fix=f"[{section}] takes {', '.join(sorted(known))}")


def set_fields(config: RunConfig, values: dict[str, Any], where: str,
               only: str | None = None) -> None:
    """Set fields by name (flat, or within section ``only``), each value checked."""
    for name, value in values.items():
        section = only or SECTION_OF.get(name)
        if section is None:
            raise InputError(f"unknown config field {name!r}{_close(name, SECTION_OF)}",
                             where=where, fix=f"fields are {', '.join(SECTION_OF)}")
        f = next(f for f in fields(SECTIONS[section]) if f.name == name)
        setattr(getattr(config, section), name, _checked(f, value, f"{where}: {name}"))


def _checked(f: dataclasses.Field, value: Any, where: str) -> Any:
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    if value is None and f.default is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise InputError(f"{f.name} is {value!r}, not {'an' if kind is int else 'a'} "
                         f"{kind.__name__}", where=where, fix=f"{f.name}: {f.metadata['help']}")
    if choices and value not in choices:
        raise InputError(f"{f.name} is {value!r}", where=where,
                         fix=f"one of {', '.join(map(str, choices))}")
    return value


def check_fields(config: "RunConfig") -> None:
    """Every field's value alone and against the mesh (no torch, no model): an InputError in
    the command line's terms. ``shardfx run`` calls it before importing torch. With
    ``mesh = "auto"`` what depends on the mesh is checked once the search has chosen it."""
    auto = config.mesh == "auto"
    mesh = MeshSpec.parse(None if auto else config.mesh)

    def need(ok: bool, what: str, where: str, fix: str) -> None:
        if not ok:
            raise InputError(what, where=where, fix=fix)

    if not config.spec:
        raise InputError("no model factory to train", where="shardfx run",
                         fix="give MODULE:FACTORY on the command line, or [run] spec in --config")
    for name in ("steps", "accumulate"):
        need(getattr(config, name) >= 1, f"{name} is {getattr(config, name)}",
             f"--{name}", "a positive integer")
    for name in ("every", "keep", "warmup"):
        need(getattr(config, name) >= 0, f"{name} is {getattr(config, name)}",
             f"--{name}", "zero or a positive integer")
    need(config.warmup < config.steps or config.warmup == 0,
         f"warmup is {config.warmup} steps of a {config.steps}-step run", "--warmup",
         "fewer warmup steps than steps")
    need(0 <= config.final_lr <= 1, f"final_lr is {config.final_lr}", "--final-lr",
         "a fraction of lr between 0 and 1")
    need(config.lr > 0, f"lr is {config.lr}", "--lr", "a positive learning rate")
    for name in ("beta1", "beta2"):
        need(0 <= getattr(config, name) < 1, f"{name} is {getattr(config, name)}",
             f"--{name}", "a decay rate in [0, 1), e.g. 0.9 (beta1) or 0.999 (beta2)")
    need(config.eps > 0, f"eps is {config.eps}", "--eps", "a small positive number, e.g. 1e-8")
    need(config.weight_decay >= 0, f"weight_decay is {config.weight_decay}", "--weight-decay",
         "zero or a positive decay")
    need(config.clip_grad_norm is None or config.clip_grad_norm > 0,
         f"clip_grad_norm is {config.clip_grad_norm}", "--clip-grad-norm",
         "a positive norm, or leave it out")
    need(not auto or (config.devices or 0) >= 1, 'mesh = "auto" without devices',
         "--mesh auto", "give the devices to plan for: --devices N ([parallel] devices)")
    need(auto or config.devices is None, f"devices = {config.devices} with the mesh "
         f"{config.mesh or '(one device)'}: devices is what mesh = \"auto\" plans for",
         "--devices", 'drop --devices, or use --mesh auto to have shardfx choose the mesh')
    if not auto:  # else checked once the search has chosen the mesh (run.choose)
        check_mesh(config, mesh)
    need(config.every == 0 or config.save is not None, f"every is {config.every}, with no save "
         "directory", "--every", "give --save DIR, where the checkpoints go")
    need(not (config.init_from and config.resume), "--init-from and --resume both given: a "
         "resumed run takes its weights from its checkpoint", "--init-from",
         "drop --init-from when resuming")


def check_mesh(config: "RunConfig", mesh: MeshSpec) -> None:
    """The options that need an axis of the mesh have it (``check_axes``; megatron-sp, tp)."""
    given = [n for n in ("schedule", "virtual_stages")  # (microbatches: accumulation there)
             if getattr(config.parallel, n) is not None]
    check_axes(given, config.zero, mesh, config.mesh)
    if config.shard == "megatron-sp" and mesh.axis("tp") <= 1:
        raise InputError(f"--shard megatron-sp splits the sequence over tp, and the mesh {mesh} "
                         "has no tp axis", where=f"--mesh {config.mesh or '(one device)'}",
                         fix="add a tp axis (--mesh tp=2,...) or use --shard megatron or auto")


def check_axes(pipeline: list[str], zero: int | str, mesh, mesh_text: str) -> None:
    """Options the mesh has no axis for: ``pipeline`` options given (field names) without a
    pp axis (microbatches is not one: without pp it accumulates), a ZeRO stage without dp;
    ZeRO-3 with pp."""
    where = f"--mesh {mesh_text or '(one device)'}"
    flags = " and ".join(f"--{n.replace('_', '-')}" for n in pipeline)
    if pipeline and mesh.axis("pp") <= 1:
        raise InputError(f"{flags} given, but the mesh {mesh} has no pp axis: only a pipeline "
                         "runs a schedule over stages", where=where,
                         fix=f"add a pp axis (--mesh pp=2,...) or drop {flags}")
    if zero and zero != "auto" and mesh.axis("dp") <= 1:
        raise InputError(f"--zero {zero} shards the training state over dp, and the mesh {mesh} "
                         "has no dp axis", where=where,
                         fix="add a dp axis (--mesh dp=2,...) or drop --zero")
    if zero == 3 and mesh.axis("pp") > 1:
        raise InputError(f"--zero 3 inside a pipeline is not supported (mesh {mesh}): each "
                         "stage would gather its parameters once per microbatch", where=where,
                         fix="use --zero 1 or --zero 2 with pp, or drop the pp axis for --zero 3")


def _close(word: str, known) -> str:
    match = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
