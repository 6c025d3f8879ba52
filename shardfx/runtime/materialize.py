"""Weights for a model on the meta device, one tensor at a time, the same on every mesh.

    model = shardfx.materialize(model, init_seed=0)   # the whole model, in place (one device)
    runner = plan.runner(optimizer, init_seed=0)      # a meta model: each rank its shards only

A runner planned from a model whose parameters (or buffers) are on meta makes only what its
rank holds. It allocates each such parameter's shard (tp, ZeRO rows, a pipeline stage's, its
experts) uninitialised, and on first use (``settle``: a step, ``forward``, ``state_dict``,
``parameters()``, a save) asks ``Initializer.value(fqn)`` for the whole tensor, on the CPU,
copies in the rectangles it holds and lets the whole one go: a rank holds its shards plus one
whole tensor at a time, never the model. A load that fills every tensor first (``load_hf``,
``load``, ``load_state_dict``) leaves nothing to make. Buffers are made with the runner.

The value of a tensor is what the model's own initialisation writes into it, applied as it
applies it, to that tensor alone:

- a model with ``_init_weights(module)`` (a Hugging Face ``PreTrainedModel``; its
  ``post_init`` applies it): that method, of the nearest such module at or above each module,
  called on the tensor's module and then on each of its ancestors (``Module.apply``'s order,
  children before parents, as Hugging Face's ``initialize_weights`` does; a tied weight gets
  the calls of every module that holds it, in that order). RoPE tables are buffers it writes;
- else, or where that leaves the tensor unset, the module's own ``reset_parameters()`` (every
  ``torch.nn`` layer's), as its constructor ran it, and then those calls again;
- or ``init=fn``: ``fn(module)`` in place of both, on the same modules in the same order.

Every other tensor stays on meta while these run (the calls write nothing there), so the
random stream a tensor draws from is its own: the CPU generator seeded from ``init_seed`` and
the tensor's name. Which tensors a rank holds, the mesh and the order they are made in change
nothing: every mesh gets the values ``materialize`` gives one device, bit for bit. (They are
not the values of the same model built on the CPU after ``torch.manual_seed``: that draws
every tensor from one stream, in construction order.) A tensor nothing writes, or writes only
in part, is an ``InputError`` naming it, before any step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from shardfx.errors import InputError
from shardfx.runtime.heap import give_back
from shardfx.runtime.nonfinite import kinds

InitFn = Callable[[torch.nn.Module], None]


def on_meta(model: torch.nn.Module) -> list[str]:
    """The FQNs of ``model``'s parameters and buffers on the meta device (tied ones once)."""
    return [fqn for fqn, t in _tensors(model).items() if t.is_meta]


class Initializer:
    """The whole value of any tensor of ``model``, made on demand (the module docstring)."""

    def __init__(self, model: torch.nn.Module, init_seed: int = 0, init: InitFn | None = None):
        if not isinstance(init_seed, int) or isinstance(init_seed, bool):
            raise InputError(f"init_seed={init_seed!r} is not a whole number",
                             where="plan.runner(..., init_seed=...)", fix="e.g. init_seed=0")
        if init is not None and not callable(init):
            raise InputError(f"init={init!r} is not callable", where="plan.runner(..., init=...)",
                             fix="a function of one module that initialises its own tensors "
                                 "in place, or None for the model's own initialisation")
        self.model, self.seed, self.init = model, init_seed, init
        self._order = list(_post_order(model))  # (name, module), children before parents
        # each FQN -> every (module name, attribute) holding its tensor: kept by name, as the
        # runner puts made tensors (tied ones still tied) where meta ones were
        self._places = {_join(*place): places for places in _names_of(model).values()
                        for place in places}

    def value(self, fqn: str) -> torch.Tensor:
        """The whole value of ``fqn`` (a parameter's or buffer's FQN, any of a tied tensor's
        names), a new CPU tensor of its dtype and shape; ``model`` is left as it was."""
        holder, attr = _split(self.model, fqn)
        tensor = _get(holder, attr)
        places = self._places[fqn]
        real = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if real.is_floating_point() or real.is_complex():
            real.fill_(float("nan"))  # what no call writes stays NaN: checked below
        swapped = real if not isinstance(tensor, torch.nn.Parameter) else \
            torch.nn.Parameter(real, requires_grad=tensor.requires_grad)
        # while the calls run, ``fqn`` is the one tensor with values: the others (any not on
        # meta, a model made in part) are on meta, so the calls neither draw for them nor
        # write them
        shadows = [(m, name, t) for m, name, t in _held(self.model) if not t.is_meta]
        for module, name, t in shadows:
            _put(module, name, _on_meta(t))
        for module_name, name in places:
            _put(self.model.get_submodule(module_name), name, swapped)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), torch.device("cpu"):
                torch.default_generator.manual_seed(_stream(self.seed, fqn))
                unset, reset = self._apply(places, real)
                if unset:  # NaN is left: never written, or written as NaN? Ask twice more.
                    unset = self._never_written(fqn, places, real, reset)
        finally:
            for module_name, name in places:
                _put(self.model.get_submodule(module_name), name, tensor)
            for module, name, t in shadows:
                _put(module, name, t)
        _check_written(fqn, unset, real, self.init)
        return real

    def _apply(self, places: list[tuple[str, str]], real: torch.Tensor,
               reset: bool | None = None) -> tuple[int, bool]:
        """The initialisation calls that reach a tensor held at ``places``, in the model's
        order. A tensor the model's ``_init_weights`` leaves unset gets what its constructor
        gave it first (``reset_parameters``), then those calls again, as eager order has it
        (``reset``: whether to, decided by a first run). Returns how many of ``real``'s values
        are NaN after the calls (``_unset``, counted once) and whether ``reset_parameters``
        ran."""
        owners = {module_name for module_name, _ in places}
        reach = {prefix for name in owners for prefix in _prefixes(name)}
        path = [(name, m) for name, m in self._order if name in reach]
        if self.init is not None:
            for _, module in path:
                self.init(module)
            return _unset(real), False
        hf = [(module, fn) for name, module in path
              if (fn := _nearest_init_weights(self.model, name)) is not None]
        for module, fn in hf:
            fn(module)
        if reset is None:  # a first run: reset_parameters where _init_weights leaves NaN
            reset = not hf or _unset(real) > 0
            if not reset:
                return 0, False
        elif not reset:
            return _unset(real), False
        for name, module in path:
            fn = getattr(module, "reset_parameters", None)
            if name in owners and callable(fn):
                fn()
        for module, fn in hf:
            fn(module)
        return _unset(real), True

    def _never_written(self, fqn: str, places: list[tuple[str, str]], real: torch.Tensor,
                       reset: bool) -> int:
        """How many of ``real``'s values the calls never write: they run again from 0 and
        from 1 (the same stream, so the same draws), and a value that comes out otherwise
        from the two was made from what was there (left as it was, or scaled); a NaN in both
        was written as NaN. ``real`` ends as the second run."""
        runs = []
        for fill in (0.0, 1.0):
            real.fill_(fill)
            torch.default_generator.manual_seed(_stream(self.seed, fqn))
            self._apply(places, real, reset)
            runs.append(real.clone())
        a, b = runs
        return int(((a != b) & ~(torch.isnan(a) & torch.isnan(b))).sum())


def materialize(model: torch.nn.Module, init_seed: int = 0, init: InitFn | None = None,
                device: torch.device | str = "cpu") -> torch.nn.Module:
    """Give every tensor of ``model`` on the meta device its value (the module docstring) on
    ``device``, in place, a tied one once and still tied; returns ``model``. Tensors not on meta
    are kept. The values are the ones every mesh's runner makes from the same ``init_seed``."""
    device = torch.device(device)
    maker = Initializer(model, init_seed, init)
    names = _names_of(model)
    values = {fqn: maker.value(fqn).to(device) for fqn in on_meta(model)}
    for fqn, value in values.items():
        tensor = _get(*_split(model, fqn))
        made = torch.nn.Parameter(value, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, torch.nn.Parameter) else value
        for module_name, name in names[id(tensor)]:
            _put(model.get_submodule(module_name), name, made)
    return model


def made_later(model: torch.nn.Module, maker: Initializer, device: torch.device) -> set[str]:
    """One device: each parameter of ``model`` on meta becomes an uninitialised one on
    ``device`` (a tied one once, still tied), to be made by ``settle`` or filled by a load;
    each buffer on meta is made now (they are small). Returns the parameters' FQNs."""
    names = _names_of(model)
    later = set()
    for fqn, tensor in _tensors(model).items():
        if not tensor.is_meta:
            continue
        if isinstance(tensor, torch.nn.Parameter):
            made = torch.nn.Parameter(torch.empty(tensor.shape, dtype=tensor.dtype,
                                                  device=device),
                                      requires_grad=tensor.requires_grad)
            later.add(fqn)
        else:
            made = maker.value(fqn).to(device)
        for module_name, name in names[id(tensor)]:
            _put(model.get_submodule(module_name), name, made)
    return later


class Unmade:
    """A runner's meta parameters it holds but has not made yet (``names``), and how to make
    them (``initializer``). A runner makes its weights on first use (``settle``), so a load
    that fills every tensor first (``load_hf``, ``load``, ``load_state_dict``: ``filled``)
    draws nothing."""

    def __init__(self, initializer: Initializer):
        self.initializer = initializer
        self.names: set[str] = set()

    def filled(self) -> None:
        """Every tensor the runner holds was filled by a load: nothing is left to make."""
        self.names.clear()


_TRIM_BYTES = 8 << 20  # a whole tensor this large is given back at once (runtime.heap)


def settle(runner) -> None:
    """Make the tensors ``runner`` holds but has not made yet (``runner.unmade``): each one's
    whole value, cut into the rectangles this rank holds (``holdings``), one whole tensor at
    a time; the memory of a large one is handed back to the system at once (``heap.give_back``):
    a rank's peak is its part and one whole tensor."""
    unmade = runner.unmade
    if not unmade.names:
        return
    held, _ = runner.holdings(made=False)
    shapes = runner.plan.state_shapes
    with torch.no_grad():
        for fqn in sorted(unmade.names):
            whole = unmade.initializer.value(fqn)
            for view, region in held[fqn].regions(shapes.get(fqn, tuple(whole.shape))):
                view.copy_(whole[region] if region else whole)
            large = whole.numel() * whole.element_size() >= _TRIM_BYTES
            del whole
            if large:
                give_back()
    unmade.filled()


# --- where tensors sit ---------------------------------------------------------------------

def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its first FQN (``named_parameters``' order, then buffers)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out[fqn] = t
    return out


def _names_of(model: torch.nn.Module) -> dict[int, list[tuple[str, str]]]:
    """id(tensor) -> every (module name, attribute name) that holds it."""
    out: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and (module_name, name) not in out.setdefault(id(t), []):
                    out[id(t)].append((module_name, name))
    return out


def _join(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _held(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, attribute, tensor) of every parameter and buffer slot of ``model``."""
    return [(module, name, t) for module in model.modules()
            for table in (module._parameters, module._buffers)
            for name, t in table.items() if t is not None]


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    """A stand-in for ``t`` with no values: its shape and dtype on meta, a Parameter if it is."""
    shadow = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return torch.nn.Parameter(shadow, requires_grad=t.requires_grad) \
        if isinstance(t, torch.nn.Parameter) else shadow


def _split(model: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    module_name, _, attr = fqn.rpartition(".")
    try:
        holder = model.get_submodule(module_name)
    except AttributeError:
        holder = None
    if holder is None or _get(holder, attr) is None:
        raise InputError(f"{fqn} is not a parameter or buffer of {type(model).__name__}",
                         where="Initializer.value", fix="one of model.state_dict()'s names")
    return holder, attr


def _get(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    return module._parameters.get(name, module._buffers.get(name))


def _put(module: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    table = module._parameters if name in module._parameters else module._buffers
    table[name] = t


def _prefixes(module_name: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``: the module and its ancestors."""
    parts = module_name.split(".") if module_name else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]


def _post_order(module: torch.nn.Module, prefix: str = ""):
    """(name, module) of every module, each after its children: ``Module.apply``'s order."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _nearest_init_weights(model: torch.nn.Module, module_name: str):
    """``_init_weights`` of the nearest module at or above ``module_name`` that has one (what
    Hugging Face's ``initialize_weights`` applies to it), or None."""
    for prefix in reversed(_prefixes(module_name)):
        fn = getattr(model.get_submodule(prefix), "_init_weights", None)
        if callable(fn):
            return fn
    return None


def _stream(seed: int, fqn: str) -> int:
    """The seed of ``fqn``'s own random stream: a hash of ``init_seed`` and the name."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_CHUNK = 1 << 22  # values per isnan: its temporaries stay a few MB, not a whole tensor's


def _unset(real: torch.Tensor) -> int:
    """How many of ``real``'s values no call wrote (they were NaN before the calls), counted a
    chunk at a time (``isnan(real).sum()`` made a bool and an int64 copy of it: 2.25x the
    tensor beside it, at the init's peak)."""
    if not (real.is_floating_point() or real.is_complex()):
        return 0
    return sum(int(torch.isnan(part).sum()) for part in real.reshape(-1).split(_CHUNK))


def _check_written(fqn: str, unset: int, real: torch.Tensor, init: InitFn | None) -> None:
    """Every value of ``real`` written (``unset`` were not), and finite."""
    how = "init=" if init is not None else "the model's initialisation " \
        "(_init_weights on it and its ancestors, else its module's reset_parameters())"
    if unset:
        raise InputError(
            f"{fqn} is on the meta device and {how} left {unset} of its {real.numel()} values "
            "unset: there is nothing to start training from",
            where=fqn, fix="pass plan.runner(..., init=fn), fn(module) filling the tensors "
                           "of that module, or materialize the model before plan.runner()")
    if found := kinds(real):
        raise InputError(
            f"{how} wrote {' and '.join(sorted(found))} into {fqn} (every value written, some "
            "not finite): training from it would give a NaN loss", where=fqn,
            fix="fix the initialisation of that tensor's module (a std or bound of 0/0, a log "
                "of 0), or pass plan.runner(..., init=fn) filling it")
