"""A candidate's price: one optimizer step composed from the pass of its tp x cp x ep mesh
(``blocks.Line``) and what its dp, ZeRO stage and pipeline add, on the device model.

With ``p`` pipeline stages of ``k = layers / p`` blocks, ``m`` microbatches and ``dp`` (x
``dp_replicate``) replicas, on one device (a pipeline's busiest, its stage with the LM head):

    pass        the line at k blocks (p = 1: all of them): its ops and the tp/cp/ep
                communication they wait for
    dp          each pass's gradients (the stage's parameters' bytes) all-reduced over dp
                (ZeRO-2/3: reduce-scattered), then 1/dp of them all-reduced over dp_replicate,
                in buckets of ``BUCKET_BYTES`` issued during the backward: what the backward
                does not hide, plus the last bucket's (the embedding's gradient, made last),
                is exposed; the gradients averaged (read and written once); accumulation
                reduces at every pass, as the program does
    ZeRO-3      each pass gathers the parameters twice (forward, backward), hidden behind the
                pass's ops but for what exceeds them and the first block's gather, and copies
                each gathered parameter out of the gathered buffer (read and written)
    ZeRO-1/2    the updated rows gathered after the optimizer's step, exposed
    optimizer   the line's step over the device's parameters, 1/dp of its rows under ZeRO
    pipeline    m passes plus the schedule's bubble (``formula_bubble``: (p-1)/(v m) for 1F1B
                and interleaved 1F1B, ZB-H1's for zero bubble with W half the backward); the
                stage's gradients reduced after its last backward, exposed

Memory: parameters (ZeRO-3: 1/dp), gradients (ZeRO-2/3: 1/dp), the optimizer's state (ZeRO:
1/dp), the activations of the microbatches in flight (a pipeline's first rank: min(m, p) of
its k blocks, interleaved 1F1B (1 + (p-1)/(p v)) times that, as Megatron counts them; else
one), the head's activations once, the pass's temporaries. All at once, as the step's
fullest moment under accumulation holds them (the pass's gradients and the next pass's
activations): with one microbatch this is a little above the plan's peak.

Requires: ``line`` drawn for the candidate's tp, cp, ep, micro-batch and recompute policy.
Ensures:  ``price`` is a ``Price`` of one optimizer step over the global batch; the finalists'
          plans (``partition`` with ``Candidate.options()``) say how close it came.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfx.codegen.bucketing import BUCKET_BYTES
from shardfx.cost.device_model import DeviceModel
from shardfx.schedule.check import Costs
from shardfx.schedule.generate import formula_bubble
from shardfx.cluster.blocks import Line
from shardfx.cluster.space import Candidate


@dataclass(frozen=True)
class Price:
    """One optimizer step of a candidate on one device (a pipeline: its busiest)."""

    step: float  # seconds
    compute: float  # of step: every pass's ops and the optimizer's step
    exposed: float  # of step: communication nothing hides
    bubble: float  # of step: a pipeline's idle time
    optimizer: float  # of compute
    memory: float  # peak bytes on the device


def price(c: Candidate, line: Line, model: DeviceModel) -> Price:
    """``c``'s step (module docstring)."""
    p, v, m = c.axis("pp"), c.virtual_stages, c.microbatches
    dp = c.axis("dp")
    k = line.blocks / p
    one = line.at(k) if p > 1 else line.whole
    grads = one.params  # the gradients' bytes: one per parameter, its dtype
    reduce = _reduce(c, model, grads)
    # the last bucket (the embedding's gradient, made last, in one of its own where larger)
    last_bucket = _reduce(c, model, min(grads, max(BUCKET_BYTES, line.base.params)))
    average = model.op_seconds(0, 2 * grads) if dp * c.axis("dp_replicate") > 1 else 0.0
    # ZeRO-3 copies each gathered parameter out of the gathered buffer (codegen.zero: a
    # strided view reshaped), in the forward and again in the backward
    copies = model.op_seconds(0, 2 * 2 * one.params) if c.zero == 3 else 0.0
    gather = 2 * model.collective_seconds("all_gather", one.params / dp, dp,
                                          model.link_of(c.mesh, "dp")) if c.zero == 3 else 0.0
    first_gather = gather * line.block.params / max(one.params, 1)
    backward = one.compute - one.forward
    if p == 1:
        late_reduce = max(0.0, reduce - backward) + min(reduce, last_bucket)
        late_gather = max(0.0, gather - one.compute) + min(gather, first_gather)
        exposed = m * (one.exposed + late_reduce + late_gather + average)
        compute_copies = m * copies
        bubble = 0.0
    else:
        exposed = m * one.exposed + reduce + average
        compute_copies = 0.0  # no ZeRO-3 with pp
        costs = Costs(forward=one.forward, backward=backward,
                      weight=min(backward / 2, one.forward))  # ZB-H1 fills its bubble with W
        bubble = m * one.seconds * formula_bubble(c.schedule, p, m, v, costs)
    optimizer = one.optimizer / (dp if c.zero else 1)
    after = model.collective_seconds("all_gather", one.params, dp, model.link_of(c.mesh, "dp")) \
        if c.zero in (1, 2) else 0.0
    compute = m * one.compute + compute_copies + optimizer
    exposed += after
    return Price(step=compute + exposed + bubble, compute=compute, exposed=exposed,
                 bubble=bubble, optimizer=optimizer, memory=_memory(c, line, one))


def _reduce(c: Candidate, model: DeviceModel, nbytes: float) -> float:
    """Seconds to reduce ``nbytes`` of gradients over dp, then dp_replicate."""
    dp, rep = c.axis("dp"), c.axis("dp_replicate")
    kind = "reduce_scatter" if c.zero >= 2 else "all_reduce"
    out = model.collective_seconds(kind, nbytes, dp, model.link_of(c.mesh, "dp"))
    share = nbytes / dp if c.zero >= 2 else nbytes
    return out + model.collective_seconds("all_reduce", share, rep,
                                           model.link_of(c.mesh, "dp_replicate"))


def _memory(c: Candidate, line: Line, one) -> float:
    p, v, m, dp = c.axis("pp"), c.virtual_stages, c.microbatches, c.axis("dp")
    params = one.params / (dp if c.zero == 3 else 1)
    grads = one.params / (dp if c.zero >= 2 else 1)
    state = one.state / (dp if c.zero else 1)
    if p == 1:
        saved = one.saved
    else:
        flight = min(m, p) * ((1 + (p - 1) / (p * v)) if c.schedule == "interleaved-1f1b" else 1)
        saved = line.block.saved * (line.blocks / p) * flight + line.base.saved
    return params + grads + state + saved + one.other
