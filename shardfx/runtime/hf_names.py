"""Which tensors of a Hugging Face checkpoint make which tensor of the model, and back.

A checkpoint ``save_pretrained`` wrote names its tensors as the model's ``state_dict`` does,
except where transformers converts them as it loads: Mixtral's experts are stored one tensor
per expert and projection (``block_sparse_moe.experts.3.w1.weight``) and the model holds them
stacked and fused (``mlp.experts.gate_up_proj``); checkpoints of a base model lack (or have)
the task model's prefix (``transformer.``). ``sources`` reads that mapping from transformers
itself (``conversion_mapping``, ``core_model_loading``), so shardfx converts what
``from_pretrained`` converts and nothing else; ``checkpoint_tensors`` applies it backwards, as
``save_pretrained`` does. A model that is not a transformers model maps names as they are.

    Source(keys=("model.layers.0.self_attn.q_proj.weight",), converter=None)   # read as it is
    Source(keys=(...w1.weight for each expert, ...w3.weight ...), converter=WeightConverter(...),
           targets=("model.layers.0.mlp.experts.gate_up_proj",))   # read, then converted
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Source:
    """The checkpoint tensors one model tensor (or a converter's group of them) is made from."""

    keys: list[str] = field(default_factory=list)
    patterns: list[str | None] = field(default_factory=list)  # each key's converter pattern
    converter: Any = None  # transformers' WeightConverter; None: keys[0] is the tensor itself
    targets: tuple[str, ...] = ()  # the model tensors a converter makes (first: the group's)

    def realize(self, read: Callable[[str], torch.Tensor], model: torch.nn.Module
                ) -> dict[str, torch.Tensor]:
        """The whole value of each of ``targets``, from the keys' tensors (``read(key)``)."""
        if self.converter is None:
            return {self.targets[0]: read(self.keys[0])}
        converter = copy.deepcopy(self.converter)
        for key, pattern in zip(self.keys, self.patterns):
            converter.add_tensor(self.targets[0], key, pattern, lambda key=key: read(key))
        made = converter.convert(self.targets[0], model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value
                for name, value in made.items()}


def _transformers_model(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def sources(model: torch.nn.Module, keys: list[str]
            ) -> tuple[dict[str, Source], list[str], list[str]]:
    """For checkpoint ``keys``: model FQN -> its Source (a converter's targets share one);
    the keys no model tensor takes; the FQNs more than one key fills, as they would load."""
    state = model.state_dict(keep_vars=True)
    out: dict[str, Source] = {}
    unexpected: list[str] = []
    twice: list[str] = []
    if not _transformers_model(model):
        for key in keys:
            (out.setdefault(key, Source(targets=(key,))).keys.append(key) if key in state
             else unexpected.append(key))
        twice = [fqn for fqn, s in out.items() if len(s.keys) > 1]
        return out, unexpected, twice
    direct = _as_named(model, keys, state)
    if direct is not None:  # no conversion at all (most models): transformers' mapping unread
        return direct, [], []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 dot_natural_key, rename_source_key)

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    for key in sorted(keys, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if name not in state and key in state:  # a name that needed no renaming
            name, pattern = rename_source_key(key, [], [], prefix, state)
        if name not in state:
            unexpected.append(key)
            continue
        if pattern is None:
            if name in out:
                twice.append(name)
            out[name] = Source([key], [None], None, (name,))
            continue
        converter = by_pattern[pattern]
        group = out.get(name)
        if group is None:
            first = converter.target_patterns[0]
            targets = tuple(name.replace(first, t) for t in converter.target_patterns)
            group = Source([], [], converter, targets)
            for target in targets:
                out[target] = group
        group.keys.append(key)
        group.patterns.append(pattern)
    return out, unexpected, sorted(set(twice))


def _as_named(model: torch.nn.Module, keys: list[str], state: dict
               ) -> dict[str, Source] | None:
    """The sources when every key is a state-dict name, or one with the base model's prefix
    added or dropped (how ``from_pretrained`` reads a base model's checkpoint into a task
    model), each name once; None when any key needs more (transformers' mapping then).
    Building transformers' mapping of every architecture takes about a second; this does not."""
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None
    out: dict[str, Source] = {}
    for key in keys:
        name = key if key in state else None
        if name is None and prefix is not None:
            name = next((n for n in (prefix + key, key.removeprefix(prefix)) if n in state),
                        None)
        if name is None or name in out:
            return None
        out[name] = Source([key], [None], None, (name,))
    return out


def ignored(model: torch.nn.Module, key: str) -> bool:
    """Whether the model says a checkpoint may carry ``key`` and loading skips it
    (``_keys_to_ignore_on_load_unexpected``: old checkpoints' rotary tables, ...)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, key) for p in patterns)


def checkpoint_tensors(model: torch.nn.Module, fqn: str, tensor: torch.Tensor
                       ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors ``save_pretrained`` writes for the model's tensor ``fqn``: the
    tensor under its own name, or what transformers' conversion makes of it backwards (one
    tensor per expert and projection for a fused experts' tensor)."""
    if not _transformers_model(model):
        return {fqn: tensor}
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {fqn: tensor})
