"""The ZeRO stage as a choice: what each stage keeps on a device and moves over dp per step.

``partition(..., zero="auto")`` leaves the stage to the plan. With the solver (``shard="auto"``
on a mesh with tp) it is priced with the placements: one integer program per stage the mesh can
run, the cheapest that fits the memory taken (``auto.shard``); without it, from the
propagated placements (``choose``). Both price a stage by these terms, per byte of a parameter
as one device holds it (after tp), over a dp axis of ``n`` ranks (ring collectives: each rank
moves ``(n-1)/n`` of a buffer per pass over it):

    stage  keeps per parameter byte                 moves over dp (passes of (n-1)/n)
    0      parameter + gradient + state             all-reduce of the gradient         2
    1      parameter + gradient + state / n         that all-reduce, then an all-gather
                                                    of the updated rows                 3
    2      parameter + (gradient + state) / n       reduce-scatter, all-gather          2
    3      (parameter + gradient + state) / n       reduce-scatter, and the parameter
                                                    gathered in forward and backward    3

(ZeRO's own formulas; ``passes.zero`` is what runs them.) HSDP's replicas (``dp_replicate``
of ``r`` groups) add an all-reduce over them of what each rank holds of the gradient after the
dp collectives: the whole of it at stages 0 and 1, its rows (1/n) at 2 and 3. Each collective
also pays its latency once per bucket of ``BUCKET_BYTES``: stage 0 one all-reduce a bucket,
stages 1 and 2 two collectives, stage 3 three. The cheapest stage is the fewest bytes moved,
then the fewest collectives: ZeRO-1/2/3 only pay where the memory needs them.
"""

from __future__ import annotations

import dataclasses
import math

from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.auto.costs import flat, local_bytes, saved
from shardfx.cost.device_model import GRAPH_KEY, default_model
from shardfx.cost.optimizer import optimizer_model
from shardfx.ir import meta as M


CHOSEN = "shardfx.zero_stage"  # gm.meta: the stage ``resolve`` chose for zero="auto"


@dataclasses.dataclass(frozen=True)
class Stage:
    k: int
    state: float  # bytes one device keeps per byte of a parameter it holds
    per_byte: float  # seconds over dp per byte of a parameter it holds
    latency: float  # seconds of latency per bucket
    step: float = 0.0  # seconds of the optimizer's step per byte of a parameter, all its rows
    rows: float = 1.0  # of a parameter's rows, the share this device steps (ZeRO-1+: 1/n)
    copy: float = 0.0  # seconds per byte of gradient copied into its bucket's buffer

    def gathered(self, held: float, largest: float) -> float:
        """Bytes ZeRO-3 holds gathered at once (``passes.zero``: a bucket of a block's
        parameters, at most ``BUCKET_BYTES`` unless one parameter is larger, and the next one
        coming in), for ``held`` bytes of parameters whose largest is ``largest``; 0 below 3."""
        return 2 * min(held, max(BUCKET_BYTES, largest)) if self.k == 3 else 0.0

    def seconds(self, held: float) -> float:
        """Seconds over dp of a step for ``held`` bytes of parameters on one device."""
        return held * self.per_byte + max(1, math.ceil(held / BUCKET_BYTES)) * self.latency \
            if held and self.per_byte else 0.0

    def total(self, held: float) -> float:
        """``seconds`` and ``compute``."""
        return self.seconds(held) + self.compute(held)

    def compute(self, held: float) -> float:
        """Seconds of the optimizer's step of the rows this device steps, and of copying the
        gradients into their buckets."""
        return held * (self.step * self.rows + self.copy)


# stage -> (kinds of the collectives over dp, one each a bucket)
_COLLECTIVES = {0: ("all_reduce",), 1: ("all_reduce", "all_gather"),
                2: ("reduce_scatter", "all_gather"),
                3: ("reduce_scatter", "all_gather", "all_gather")}


def by_cost(candidates: list[Stage], held: float = 1.0, least_state: bool = False) -> list[Stage]:
    """``candidates`` cheapest first for ``held`` bytes of parameters, ties to the lower stage
    (or, with ``least_state``, to the one holding less): plain dp and ZeRO-2 cost the same, and
    the last bits of two sums must not order them."""
    def key(s: Stage):
        return float(f"{s.seconds(held):.9g}"), s.state if least_state else s.k
    return sorted(candidates, key=key)


def allowed(zero, mesh, train: bool = True) -> tuple[int, ...]:
    """The stages ``zero`` leaves to choose on ``mesh`` (the whole mesh, dp and pp with it):
    one where it names one; every stage the mesh runs where it is "auto" (none over dp=1 or
    for inference, which keeps no training state; not 3 inside a pipeline: ``api._zero``)."""
    if zero != "auto":
        return (zero,)
    if mesh.axis("dp") == 1 or not train:
        return (0,)
    return (0, 1, 2) if mesh.axis("pp") > 1 else (0, 1, 2, 3)


def stages(options, model, train: bool = True) -> list[Stage]:
    """The stages ``options`` leave to choose, each priced on the device model's dp link."""
    mesh = options.whole_mesh or options.mesh
    n = mesh.axis("dp")
    optimizer = optimizer_model(options.optimizer)
    states = optimizer.states
    # The step reads each parameter and gradient and writes the parameter, and reads and
    # writes each state tensor (``step_time``): per byte of a parameter whose rows it steps.
    step = 0.0 if not train or optimizer.name == "none" else \
        (3 + 2 * states) / model.memory_bandwidth / options.held_by
    out = []
    for k in allowed(options.zero, mesh, train):
        keep = ((1 / n if k >= 3 else 1) + (1 / n if k >= 2 else 1) +
                states * (1 / n if k >= 1 else 1)) / options.held_by
        rows = 1 / n if k >= 1 else 1.0  # ZeRO: this rank steps its rows
        if n == 1:
            out.append(Stage(k, keep, 0.0, 0.0, step, rows))
            continue
        link = model.link_of(mesh.axes, "dp")
        copy = 2 / model.memory_bandwidth  # read each gradient, write it to the bucket
        kinds = _COLLECTIVES[k]
        per_byte = sum(model.collective_seconds(kind, 1.0, n, link)
                       - model.collective_seconds(kind, 0.0, n, link) for kind in kinds)
        latency = sum(model.collective_seconds(kind, 0.0, n, link) for kind in kinds)
        more, once = _across_replicas(k, n, mesh, model)
        out.append(Stage(k, keep, per_byte + more, latency + once, step, rows, copy))
    return out


def _across_replicas(k: int, n: int, mesh, model) -> tuple[float, float]:
    """HSDP's all-reduce over ``dp_replicate`` (per byte of a parameter, per bucket): of the
    rows each rank reduce-scattered under ZeRO-2/3 (1/n of the bytes), of the whole gradient
    below; (0, 0) without replicas."""
    r = mesh.axis("dp_replicate")
    if r == 1:
        return 0.0, 0.0
    link = model.link_of(mesh.axes, "dp_replicate")
    once = model.collective_seconds("all_reduce", 0.0, r, link)
    share = 1 / n if k >= 2 else 1.0
    return (model.collective_seconds("all_reduce", share, r, link) - once), once


def choose(held: float, largest: float, saved: float, budget: float | None,
           candidates: list[Stage]) -> Stage:
    """The cheapest stage whose state (``held`` bytes of parameters, the largest ``largest``),
    ZeRO-3's gathered buckets and ``saved`` activations fit ``budget``; else the cheapest
    whose state alone fits (remat then cuts the activations); else the one that keeps least
    (the budget's own error then says what is missing)."""
    order = by_cost(candidates, held)
    if budget is None:
        return order[0]
    for extra in (saved, 0.0):
        for stage in order:
            if held * stage.state + stage.gathered(held, largest) + extra <= budget:
                return stage
    return min(candidates, key=lambda s: s.state)


def why(k: int, dp: int) -> str:
    """``print(plan)``'s line for a stage ``zero="auto"`` chose."""
    if k == 0:
        return (f'ZeRO: none (zero="auto"): the state fits replicated over dp={dp}, and each '
                "stage would only add collectives")
    return (f'ZeRO-{k} chosen (zero="auto"): the cheapest stage by the device model whose '
            "state fits the memory" + ("" if k == 3 else f"; ZeRO-{k - 1} does not"))


def resolve(gm, options):
    """``options`` with ``zero="auto"`` made a stage, after the IR's placements are planned:
    the solver's choice (``auto.shard``'s report), else ``choose`` on the parameters and
    saved activations as ``shard_propagate`` placed them; the stage is kept in ``gm.meta[CHOSEN]``,
    so the plan reads the same one later. Other options come back as they are."""
    if options.zero != "auto":
        return options
    if CHOSEN not in gm.meta:
        gm.meta[CHOSEN] = _choose(gm, options)
    return dataclasses.replace(options, zero=gm.meta[CHOSEN])


def _choose(gm, options) -> int:

    report = gm.meta.get(M.AUTO)
    if report is not None:
        return report.zero
    model = gm.meta.get(GRAPH_KEY) or default_model(options)
    sizes = [n for _, n in options.mesh.axes]
    params = [local_bytes(n.meta[M.VAL], n.meta.get(M.ANNOTATION) or (), sizes)
              for n in gm.graph.find_nodes(op="placeholder")
              if n.meta[M.ROLE].kind is M.InputKind.PARAM]
    kept = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function" and saved(node):
            sharding = node.meta.get(M.SHARDING)
            vals = node.meta.get(M.VAL)
            vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
            outs = flat(sharding.out) if sharding is not None else [()] * len(vals)
            kept += sum(local_bytes(v, p or (), sizes) for v, p in zip(vals, outs))
    budget = options.memory_budget or model.memory or None
    train = gm.meta[M.GRAPH].mode is M.Mode.TRAIN
    stage = choose(sum(params), max(params, default=0.0), kept, budget,
                   stages(options, model, train))
    return stage.k


