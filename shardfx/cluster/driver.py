"""``shardfx.search``: the plan for N devices, chosen among every candidate of ``space``.

1. The space: every candidate ``space.candidates`` gives for the model's ``Shape`` (its
   blocks, heads, key-value heads, experts; the batch and sequence of ``example_args``; the
   device model's devices per node), the axes the user fixed taken as given.
2. The prices: each candidate composed (``compose.price``) from the pass of its tp x cp x ep
   mesh, micro-batch and recompute policy (``blocks.Line``, two shallow plans per distinct
   pass, shared by every candidate with that pass).
3. The finalists: the fastest of each of the first ``finalists`` families (mesh, ZeRO
   stage, schedule) that fit the budget are planned in full (``partition`` with
   ``Candidate.options()``) and take their plans' own predicted step and peak; the rest keep
   their price. All are ranked by these figures, and while the first is one not planned it
   is planned too: the first choice is always a plan's own figure.

Requires: what ``partition`` requires of the model and its example batch (one global batch).
Ensures:  a ``report.Searched`` of the candidates that fit, fastest first, or a named error:
          ``SearchError`` where no candidate exists for the device count (with the nearest
          counts that have some), ``MemoryBudgetError`` where none fits (with the candidate of
          least memory and what it needs).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.utils._pytree as pytree

from shardfx.api import parse_bytes, partition, request
from shardfx.errors import InputError, MemoryBudgetError, SearchError, ShardfxError
from shardfx.mesh import AXES
from shardfx.cluster.blocks import Blocks
from shardfx.cluster.compose import price
from shardfx.cluster.report import Ranked, Searched
from shardfx.cluster.space import RECOMPUTE, Candidate, Shape, candidates

FINALISTS = 5  # candidates planned in full: the fastest of as many families
MAX_MBS = 16  # rows of a microbatch tried, at most (Megatron's largest published: 16)
NEAREST = 64  # device counts looked at either side for the nearest that has candidates


def search(model: torch.nn.Module, example_args: tuple, loss_fn: Callable | None = None,
           example_targets: tuple = (), *, devices: int, mesh: dict[str, int] | None = None,
           device_model=None, memory_budget=None, precision="fp32", optimizer="adamw",
           recompute: tuple[str, ...] = RECOMPUTE, finalists: int = FINALISTS,
           max_mbs: int = MAX_MBS) -> Searched:
    """The candidates for ``devices`` devices that fit ``memory_budget`` (None: the device
    model's memory), fastest first (module docstring). ``mesh``: axes fixed, e.g.
    ``{"tp": 8}``; ``recompute``: the policies tried."""
    start = time.process_time()
    fixed = _fixed(mesh, devices)
    _, options = request(model, example_args, loss_fn, None, shard="megatron",
                         precision=precision, optimizer=optimizer, device_model=device_model)
    dm = options.device_model
    budget = parse_bytes(memory_budget) or dm.memory or float("inf")
    blocks = Blocks(model, example_args, loss_fn, example_targets, options)
    shape = shape_of(model, example_args, blocks.layers, dm.devices_per_node)
    space = [c for c in candidates(devices, shape, fixed)
             if c.mbs <= max_mbs and c.recompute in recompute]
    if not space:
        raise _no_candidate(devices, shape, fixed)
    tokens = shape.batch * shape.seq
    peak = dm.peak(options.precision.dtype) / flops_per_token(model, shape)

    def make(c: Candidate):
        return partition(model, example_args, loss_fn, example_targets, precision=precision,
                         optimizer=optimizer, device_model=dm, **c.options())

    priced, bounded = _priced(space, blocks, dm, budget,
                              lambda c, p: Ranked(c, p, devices, tokens, peak, make))
    fits = sorted((r for r in priced if r.price.memory <= budget), key=lambda r: r.price.step)
    if not fits:
        raise _over_budget(priced, budget, devices)
    refused = _plan_finalists(fits, finalists)
    ranked = _ranked(fits, budget)
    while ranked and ranked[0].planned is None:  # the first is always one planned in full
        refused |= _plan_finalists(ranked, 1)
        ranked = _ranked(fits, budget)
    return Searched(ranked, devices, budget, len(priced), len(priced) - len(ranked),
                    blocks.plans, time.process_time() - start, refused, bounded)


def _priced(space: list[Candidate], blocks: Blocks, dm, budget: float,
            ranked: Callable) -> tuple[list[Ranked], int]:
    """Each candidate priced, and how many were left unpriced. Candidates that differ only in
    their recompute policy form a group, in ``RECOMPUTE``'s order (none, selective, full):
    recomputing adds to a step and saves only memory, so the next policy is priced only where
    the one before is over ``budget``, and never where the group's first price (a step no
    policy of the group beats) is already no faster than the fastest candidate that fits
    (branch and bound: the fastest that fits is the same as with every candidate priced)."""
    groups: dict[Candidate, list[Candidate]] = {}
    for c in sorted(space, key=lambda c: RECOMPUTE.index(c.recompute)):
        groups.setdefault(dataclasses.replace(c, recompute="none"), []).append(c)

    def priced(c: Candidate) -> Ranked:
        line = blocks.line(c.axis("tp"), c.axis("cp"), c.axis("ep"), c.mbs, c.recompute)
        return ranked(c, price(c, line, dm))

    out = [priced(group[0]) for group in groups.values()]
    best = min((r.price.step for r in out if r.price.memory <= budget), default=float("inf"))
    pending = sorted((r for r in out if r.price.memory > budget), key=lambda r: r.price.step)
    left = 0
    for head in pending:
        rest = groups[dataclasses.replace(head.candidate, recompute="none")][1:]
        for i, c in enumerate(rest):
            if head.price.step >= best:  # no policy of this group is faster
                left += len(rest) - i
                break
            r = priced(c)
            out.append(r)
            if r.price.memory <= budget:
                best = min(best, r.price.step)
                break
    return out, left


def _ranked(fits: list[Ranked], budget: float) -> list[Ranked]:
    """Fastest first, each by its plan's figures where planned, else by its price."""
    return sorted((r for r in fits if r.memory <= budget), key=lambda r: r.predicted_step)


def _plan_finalists(fits: list[Ranked], count: int) -> dict[str, str]:
    """Plan in full the fastest candidate of each of the first ``count`` families (mesh,
    ZeRO stage, schedule) in ``fits`` (the next one in place of one that does not plan),
    their figures then their plans'. One of each family: where the composed price of a family
    is off (it leaves out what the program adds around ZeRO's gathers, say), the finalists
    are not all of that family."""
    refused, planned, families = {}, 0, set()
    for r in fits:
        if planned == count:
            break
        c = r.candidate
        family = (c.mesh, c.zero, c.schedule, c.virtual_stages)
        if family in families or r.planned is not None:
            continue
        families.add(family)
        try:
            plan = r.plan()
        except ShardfxError as e:
            refused[str(r.candidate)] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            r.planned_memory = float("inf")  # not a candidate after all
            continue
        r.planned = plan.predicted_step
        r.planned_memory = max(plan.memory_estimate().values())
        planned += 1
    return refused


def flops_per_token(model: torch.nn.Module, shape: Shape) -> float:
    """The model's training FLOPs per token, PaLM's formula (Chowdhery et al. 2022, appendix
    B): 6 N (N: the parameters but the input embedding's, a lookup; all of them where it is
    tied to the LM head) + 12 L H s (attention's scores and their use: L blocks, H hidden,
    s the sequence); recomputation not counted. MFU is these FLOPs over the step's seconds x
    devices x the device model's peak at the compute dtype."""
    n = sum(p.numel() for p in model.parameters())
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if embed is not None and (head is None or head.weight is not embed.weight):
        n -= embed.weight.numel()
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    attention = 12 * shape.layers * hidden * shape.seq if shape.heads else 0
    return 6 * n + attention


def shape_of(model: torch.nn.Module, example_args: tuple, layers: int,
             per_node: int) -> Shape:
    """What the model allows (``space.Shape``): its blocks, from the capture; heads,
    key-value heads and experts from its config (a Hugging Face config, or nanoGPT's
    ``n_head``); the batch and sequence from the example's first tensor."""
    config = getattr(model, "config", None)

    def first(*names: str, default: int = 0) -> int:
        for n in names:
            if isinstance(getattr(config, n, None), int):
                return getattr(config, n)
        return default

    heads = first("num_attention_heads", "n_head", "num_heads")
    kv = first("num_key_value_heads", "n_kv_head", default=heads) or heads
    experts = first("num_local_experts", "n_routed_experts", "num_experts")
    ids = next(t for t in pytree.tree_leaves(example_args) if isinstance(t, torch.Tensor))
    seq = ids.shape[1] if ids.dim() > 1 else 1
    return Shape(layers=layers, heads=heads, kv_heads=kv, experts=experts, seq=seq,
                 batch=ids.shape[0], per_node=per_node)


def _fixed(mesh: dict[str, int] | None, devices: int) -> dict[str, int]:
    where = "search(..., mesh=...)"
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise InputError(f"devices must be a positive int, got {devices!r}",
                         where="search(..., devices=...)", fix="e.g. devices=8")
    fixed = dict(mesh or {})
    for axis, n in fixed.items():
        if axis not in AXES:
            raise InputError(f"unknown mesh axis {axis!r}", where=where,
                             fix=f"fix any of {', '.join(AXES)}")
        if not isinstance(n, int) or n < 1 or devices % n:
            raise InputError(f"mesh axis {axis}={n!r} does not divide {devices} devices",
                             where=where, fix=f"a size that divides {devices}")
    return fixed


def _no_candidate(devices: int, shape: Shape, fixed: dict[str, int]) -> SearchError:
    near = [n for d in range(1, NEAREST) for n in (devices - d, devices + d)
            if n > 0 and next(candidates(n, shape, fixed), None) is not None][:2]
    return SearchError(
        f"no mesh of {devices} devices runs this model and batch: every factorization into "
        f"{', '.join(AXES)} needs an axis the model cannot take (tp divides {shape.heads} "
        f"heads and {shape.kv_heads} key-value heads, within {shape.per_node} devices of a "
        f"node; pp at most {shape.layers} stages; dp x ep divides the batch of {shape.batch})"
        + (f" with {fixed} fixed" if fixed else ""),
        where=f"search(..., devices={devices})",
        fix=(f"use {' or '.join(map(str, sorted(near)))} devices" if near else
             "a global batch with more rows") + (", or fix fewer axes" if fixed else ""))


def _over_budget(priced: list[Ranked], budget: float, devices: int) -> MemoryBudgetError:
    least = min(priced, key=lambda r: r.price.memory)
    return MemoryBudgetError(
        f"no candidate for {devices} devices fits {budget / 1e9:.3g} GB a device: the least "
        f"memory is {least.price.memory / 1e9:.3g} GB ({least.candidate})",
        where=f"search(..., devices={devices})",
        fix=f"more devices (about {devices * least.price.memory / budget:.0f} hold it), a "
            f"larger memory_budget, or a smaller global batch")
