"""Activation offload under ``memory_budget`` (``auto.remat``'s third choice,
``codegen.activation_offload``, ``kernels.host_copy``): on a device model with host memory the
plan sends activations to the host after their last forward reader and brings them back before
the backward reads them; training equals eager on one device, dp=2 ZeRO-2, dp=2 x tp=2 and pp=2,
alone and with the optimizer offloaded too; the device's and the host's measured peaks are the
memory model's; the choice between recomputing and offloading follows the device model."""

from __future__ import annotations

import dataclasses

import torch

import shardfx
from shardfx.cost.device_model import PRESETS, DeviceModel, Host, Link
from shardfx.kernels.host_copy import from_host, to_host
from shardfx.report.html import plan_html
from shardfx.runtime.measure import measured_peak
from shardfx.testing import compare_training

from models import lm_loss, tiny, token_batches

LAYERS, ROWS, SHARE = 8, 32, 0.6
SMALL = dict(layers=4, rows=32)  # on a mesh: smaller, so its ranks share 2 cores quicker


def with_host(memory: float = 1e9, link: float = 5e9, **kw) -> DeviceModel:
    """The ``cpu`` preset with ``memory`` bytes of host memory a rank may fill (the preset's
    host is the same DRAM, so it offers none) over a link of ``link`` bytes/s each way."""
    return dataclasses.replace(PRESETS["cpu"], host=Host(memory, Link(link, 1e-6),
                                                          Link(link, 1e-6)), **kw)


def trained(share: float = SHARE, layers: int = LAYERS, rows: int = ROWS, **kw) -> tuple:
    """This rank's (training error against eager, budget, predicted and measured device peak,
    predicted and measured host peak, what was offloaded and recomputed) at ``share`` of the
    plan's unconstrained peak."""
    kw.setdefault("device_model", with_host())
    batches = token_batches(3, batch=rows)
    plan = shardfx.partition(tiny("llama", layers), *batches[0][:1], lm_loss, batches[0][1],
                             **kw)
    budget = int(share * max(plan.memory_estimate().values()))
    report = compare_training(tiny("llama", layers), batches[:2], lm_loss, memory_budget=budget,
                              **kw)
    plan, runner = report.plan, report.runner
    (x,), (y,) = batches[2]
    peak = measured_peak(lambda: runner.step((x,), (y,)), runner, x, y)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    predicted = plan.memory_breakdown()[rank]
    return (report.max(), budget, predicted.total, peak.total - x.nbytes - y.nbytes,
            predicted.host, peak.host, plan.remat.offloaded, plan.remat.recomputed)


def check(row: tuple) -> None:
    error, budget, predicted, measured, host_predicted, host, offloaded, _ = row
    assert error < 1e-5, row
    assert offloaded, row  # the plan offloads: this checks that path
    assert measured <= budget, row
    assert abs(predicted - measured) <= 0.02 * measured, row
    assert host > 0 and abs(host_predicted - host) <= 0.02 * host, row


def test_one_device_offloads_under_budget_and_equals_eager():
    for kw in ({}, {"offload_optimizer": True}):
        check(trained(**kw))


def test_the_program_copies_out_after_the_forward_and_back_before_the_backward(tmp_path):
    batches = token_batches(1, batch=ROWS)
    args = (tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1])
    budget = int(SHARE * max(shardfx.partition(*args, device_model=with_host())
                             .memory_estimate().values()))
    plan = shardfx.partition(*args, device_model=with_host(), memory_budget=budget)
    graph = plan.program.module.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    outs = [n for n in graph.nodes if n.target is to_host]
    assert len(outs) == len(plan.remat.offloaded) > LAYERS
    for out in outs:
        value, (back,) = out.args[0], out.users
        assert back.target is from_host
        assert all(order[u] <= order[out] for u in value.users if u is not out)
        assert all(order[back] < order[u] for u in back.users)
    ahead = [min(order[u] for u in b.users) - order[b] for b in graph.nodes
             if b.target is from_host]
    assert max(ahead) > 20  # brought back a block ahead, not at its reader
    text = " ".join(str(plan).split())
    assert f"Offloaded to host memory under memory_budget: {len(outs)} activations" in text
    assert "model.layers.*.mlp" in text[text.index("Offloaded"):]
    assert "activations offloaded to host memory" in plan_html(plan)


def _meshes() -> list[tuple]:
    """Activations offloaded with the optimizer on dp=2 ZeRO-2, alone on pp=2 (1F1B)."""
    pp = dict(mesh={"pp": 2}, microbatches=4, schedule="1f1b")
    return [trained(mesh={"dp": 2}, zero=2, offload_optimizer=True, **SMALL),
            trained(**pp, offload_optimizer=False, **SMALL)]


def test_dp_zero2_and_pp_offload_and_equal_eager():
    for rows in shardfx.launch(_meshes, nprocs=2, timeout=300, deadline=900):
        for row in rows:
            check(row)


def _dp_tp() -> list[tuple]:
    return [trained(mesh={"dp": 2, "tp": 2}, shard="megatron", zero=2, offload_optimizer=True,
                    **SMALL)]


def test_dp_tp_offloads_and_equals_eager():
    for rows in shardfx.launch(_dp_tp, nprocs=4, timeout=300, deadline=900):
        for row in rows:
            check(row)


def test_the_device_model_chooses_between_recomputing_and_offloading():
    """Copies that hide behind compute cost nothing: on a slow device with a fast host link
    the plan offloads and recomputes little; with a link a thousand times slower, copies cost
    more than recomputing, and it recomputes instead. A host with room for little gets that."""
    batches = token_batches(1, batch=ROWS)
    args = (tiny("llama", LAYERS), *batches[0][:1], lm_loss, batches[0][1])
    budget = int(SHARE * max(shardfx.partition(*args).memory_estimate().values()))
    cpu = PRESETS["cpu"]
    slow_device = dict(peak_flops={k: v / 100 for k, v in cpu.peak_flops.items()},
                       memory_bandwidth=cpu.memory_bandwidth / 100)
    plans = {name: shardfx.partition(*args, memory_budget=budget, device_model=model)
             for name, model in [("fast link", with_host(link=50e9, **slow_device)),
                                 ("slow link", with_host(link=50e6)),
                                 ("no host", PRESETS["cpu"]),
                                 ("small host", with_host(memory=100_000, link=50e9,
                                                          **slow_device))]}
    fast, slow, none, small = (plans[k].remat for k in plans)
    assert fast.offloaded and not slow.offloaded and not none.offloaded, plans
    assert fast.flops < 0.5 * slow.flops, (fast.flops, slow.flops)
    assert slow.recomputed == none.recomputed  # nothing worth offloading: remat as before
    assert 0 < small.offloaded_bytes <= 100_000 < fast.offloaded_bytes
    for plan in plans.values():
        assert max(plan.memory_estimate().values()) <= budget
