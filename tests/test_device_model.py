"""The device model (``shardfx.cost.device_model``), its calibration (``shardfx calibrate``) and the
step time a plan predicts with it (``plan.predicted_step``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.run.calibrate import calibrate, measure_link, write
from shardfx.run.cli import main
from shardfx.cost.device_model import (GRAPH_KEY, PRESETS, DeviceModel, Host, Link, cache_path,
                                  device_model, gpu_preset)
from shardfx.errors import InputError
from shardfx.ir.parse import text_to_ir

H100 = PRESETS["h100"]


class MLP(torch.nn.Module):
    """Named as Megatron's plan expects: up_proj column-parallel, down_proj row-parallel."""

    def __init__(self):
        super().__init__()
        self.up_proj = torch.nn.Linear(64, 256)
        self.down_proj = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


def mlp_plan(batch: int, mesh=None, model="h100"):
    torch.manual_seed(0)
    x, y = torch.randn(batch, 64), torch.randn(batch, 64)
    return shardfx.partition(MLP(), (x,), F.mse_loss, (y,), mesh=mesh, device_model=model,
                             shard="megatron")


# --- presets and the roofline -------------------------------------------------------------------

def test_presets():
    assert H100.peak(torch.bfloat16) == H100.peak("float16") == 989e12
    assert H100.peak(torch.float32) == 67e12  # no TF32: torch's default for fp32 matmuls
    assert H100.memory_bandwidth == 3.35e12
    assert H100.links["intra"] == Link(450e9, 3e-6) and H100.links["inter"] == Link(50e9, 10e-6)
    assert PRESETS["h200"].memory_bandwidth == 4.8e12
    assert PRESETS["h200"].peak_flops == H100.peak_flops
    assert device_model("h100") is H100 and device_model("cpu") is PRESETS["cpu"]
    assert H100.peak(torch.int64) == 67e12  # no entry of its own: float32's


def test_the_host_tier_of_each_preset():
    """PCIe Gen5 beside an H100 or H200 (an HGX node's 2 TB over its 8 GPUs), NVLink-C2C
    beside a GH200; on a CPU the host is the same DRAM, a copy at half its bandwidth."""
    pcie, c2c, cpu = H100.host, PRESETS["gh200"].host, PRESETS["cpu"].host
    assert PRESETS["h200"].host == pcie and pcie.memory == 250e9
    assert pcie.d2h == pcie.h2d == Link(53e9, 10e-6)
    assert c2c.h2d.bandwidth == 450e9 and c2c.memory == 480e9
    assert cpu.d2h.bandwidth == PRESETS["cpu"].memory_bandwidth / 2
    # 1 GB each way: 10 us + 18.9 ms over PCIe, 2.2 ms over C2C
    assert pcie.copy_seconds(1e9, "d2h") == pytest.approx(10e-6 + 1e9 / 53e9)
    assert c2c.copy_seconds(1e9, "h2d") == pytest.approx(2e-6 + 1e9 / 450e9)
    with pytest.raises(InputError, match="copy direction"):
        pcie.copy_seconds(1, "up")
    assert gpu_preset("NVIDIA GH200 480GB") is PRESETS["gh200"]  # not the H200's
    assert gpu_preset("NVIDIA H200") is PRESETS["h200"] and gpu_preset("A100") is None
    assert "host d2h" in H100.describe() and "host memory" in H100.describe()


@pytest.mark.parametrize("make, says", [
    (lambda: Link(0, 10e-6), r"link has bandwidth 0; it must be a positive number of bytes/s"),
    (lambda: Link(53e9, -1.0), r"link has latency -1.0; it must be a number of seconds >= 0"),
    (lambda: Host(-5, Link(53e9, 0), Link(53e9, 0)), r"host memory is -5"),
    (lambda: Host(1e9, Link(53e9, 0), None), r"host h2d is NoneType, not a Link")])
def test_a_hand_made_link_or_host_that_cannot_price_a_copy_is_named(make, says):
    """Not a ZeroDivisionError when a copy is priced: refused where it is made."""
    with pytest.raises(InputError, match=says) as e:
        make()
    assert e.value.where and e.value.fix


def test_op_seconds_is_the_slower_of_compute_and_memory():
    # 1 ms of bf16 compute, 2 ms of memory traffic: memory-bound
    assert H100.op_seconds(989e9, 6.7e9, torch.bfloat16) == pytest.approx(2e-3)
    # the same FLOPs in fp32 take 989/67 ms: compute-bound
    assert H100.op_seconds(989e9, 6.7e9, torch.float32) == pytest.approx(989e9 / 67e12)
    assert H100.op_seconds(0, 3.35e9) == pytest.approx(1e-3)


def test_collective_seconds_follow_the_ring():
    gb = 1e9
    intra = 450e9
    assert H100.collective_seconds("all_reduce", gb, 8) == \
        pytest.approx(14 * 3e-6 + 2 * 7 / 8 * gb / intra)
    assert H100.collective_seconds("all_gather", gb, 4, "inter") == \
        pytest.approx(3 * 10e-6 + 3 / 4 * gb / 50e9)
    assert H100.collective_seconds("reduce_scatter", gb, 4) == \
        H100.collective_seconds("all_gather", gb, 4)
    assert H100.collective_seconds("send", gb, 2) == pytest.approx(3e-6 + gb / intra)
    assert H100.collective_seconds("all_reduce", gb, 1) == 0.0
    with pytest.raises(InputError, match="unknown collective"):
        H100.collective_seconds("broadcast", gb, 2)


def test_link_of_a_mesh_axis():
    axes = (("dp", 4), ("tp", 8))  # row-major: tp's 8 ranks are one node, dp spans 4 nodes
    assert H100.link_of(axes, "tp") == "intra"
    assert H100.link_of(axes, "dp") == "inter"
    assert H100.link_of((("dp", 2), ("tp", 4)), "dp") == "intra"


def test_matmul_is_compute_bound_and_pointwise_memory_bound():
    gm = text_to_ir("""
graph train Tiny
  a: f32[512, 512] = param a
  b: f32[512, 512] = input args[0]
  tangent_loss: f32[] = tangent loss
  mm: f32[512, 512] = aten.mm.default(b, a)  # fwd
  add: f32[512, 512] = aten.add.Tensor(mm, b)  # fwd
  t: f32[512, 512] = aten.t.default(add)  # fwd
  loss: f32[] = aten.sum.default(t)  # fwd
  output loss loss = loss
""")
    nodes = {n.name: n for n in gm.graph.nodes}
    tensor = 512 * 512 * 4
    flops = 2 * 512**3
    assert H100.node_seconds(nodes["mm"]) == pytest.approx(flops / 67e12)  # compute-bound
    assert flops / 67e12 > 3 * tensor / 3.35e12
    # add: reads two tensors, writes one, no FLOPs counted
    assert H100.node_seconds(nodes["add"]) == pytest.approx(3 * tensor / 3.35e12)
    assert H100.node_seconds(nodes["t"]) == 0.0  # a view moves nothing
    # in bf16 the matmul's compute shrinks 989/67 times: then its memory traffic dominates
    low = text_to_ir("""
graph train Tiny
  a: bf16[512, 512] = param a
  b: bf16[512, 512] = input args[0]
  tangent_loss: f32[] = tangent loss
  mm: bf16[512, 512] = aten.mm.default(b, a)  # fwd
  loss: bf16[] = aten.sum.default(mm)  # fwd
  output loss loss = loss
""")
    mm = next(n for n in low.graph.nodes if n.name == "mm")
    assert H100.node_seconds(mm) == pytest.approx(max(flops / 989e12, 3 * tensor / 2 / 3.35e12))


# --- choosing a model ---------------------------------------------------------------------------

def test_unknown_preset_names_the_presets():
    with pytest.raises(InputError) as info:
        device_model("a100")
    assert "unknown device model 'a100'" in str(info.value)
    assert "h100, h200, gh200, cpu" in info.value.fix
    with pytest.raises(InputError, match="device_model"):
        mlp_plan(4, model="a100")


def test_a_json_file_round_trips_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(H100.to_json()))
    assert device_model(str(path)) == H100
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**H100.to_json(), "memory_bandwidth": -1}))
    with pytest.raises(InputError, match="memory_bandwidth must be a positive number"):
        device_model(bad)
    with pytest.raises(InputError, match="no device model file"):
        device_model(tmp_path / "missing.json")
    host = {**H100.to_json()["host"], "h2d": {"bandwidth": 0, "latency": 1e-6}}
    bad.write_text(json.dumps({**H100.to_json(), "host": host}))
    with pytest.raises(InputError, match="host.h2d.bandwidth must be a positive number"):
        device_model(bad)
    old = {k: v for k, v in H100.to_json().items() if k != "host"}  # a file from before the tier
    bad.write_text(json.dumps(old))
    assert device_model(bad).host is None


def test_calibrate_quick_writes_the_cache_the_default_then_picks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDFX_CACHE", str(tmp_path))
    assert device_model(None, "cpu") is PRESETS["cpu"]  # nothing calibrated yet
    assert main(["calibrate", "--quick", "--no-links"]) == 0
    out = capsys.readouterr().out
    path = cache_path("cpu")
    assert path.parent == tmp_path and path.is_file() and f"wrote {path}" in out
    assert "matmul float32" in out and "(measured)" in out and "link intra" in out
    model = device_model(None, torch.device("cpu"))
    assert model.name.startswith("calibrated ")
    assert "peak_flops.float32" in model.measured and "memory_bandwidth" in model.measured
    assert "links.intra" not in model.measured  # --no-links: the preset's link
    assert {"host.d2h", "host.h2d"} <= set(model.measured) and "host h2d" in out
    assert model.host.d2h.bandwidth > 1e7 and model.host.memory == 0  # CPU: RAM is shared
    assert model.links == PRESETS["cpu"].links
    assert all(v > 1e6 for v in model.peak_flops.values()) and model.memory_bandwidth > 1e7
    assert model == DeviceModel.from_json(json.loads(path.read_text()))
    # and a plan made without device_model= uses it
    plan = mlp_plan(4, model=None)
    assert plan.device_model == model and plan.ir.meta[GRAPH_KEY] == model
    assert f"on {model.name}" in str(plan.predicted_step)


@pytest.mark.multiprocess  # shardfx.run.calibrate launches them
def test_link_calibration_over_two_gloo_processes():
    link = measure_link(torch.device("cpu"), tiny_reps=10, big_bytes=1 << 20, big_reps=2)
    assert 1e-7 < link.latency < 0.1  # loopback: tens of microseconds
    assert 1e6 < link.bandwidth < 1e12


def test_calibrated_model_replaces_what_it_measured(tmp_path):
    model = calibrate("cpu", quick=True, links=False)
    assert model.devices_per_node == PRESETS["cpu"].devices_per_node
    assert write(model, tmp_path / "m.json") == tmp_path / "m.json"
    assert device_model(tmp_path / "m.json") == model


# --- the predicted step -------------------------------------------------------------------------

def test_predicted_step_grows_with_the_batch():
    small, large = mlp_plan(8).predicted_step, mlp_plan(512).predicted_step
    assert small.model == large.model == "h100"
    assert large.total > small.total and large.compute > small.compute
    assert small.communication == 0.0  # one device
    assert small.total == pytest.approx(small.compute + small.communication)
    assert 0 < small.optimizer < small.compute


def test_tensor_parallel_plan_communicates():
    plan = mlp_plan(64, mesh={"tp": 2})
    step = plan.predicted_step
    assert plan.collectives and step.communication > 0
    assert step.total == pytest.approx(step.compute + step.communication)
    # the same plan over the slower link between nodes takes longer to communicate
    far = DeviceModel("far", H100.peak_flops, H100.memory_bandwidth, H100.links,
                      devices_per_node=1)
    assert mlp_plan(64, mesh={"tp": 2}, model=far).predicted_step.communication > \
        step.communication
    text = str(plan)
    assert "predicted step" in text and "on h100 (compute" in text
    assert text.index("Memory at the peak") < text.index("predicted step")


def test_pipeline_predicted_step_is_simulated():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    step = shardfx.partition(model, (x,), F.mse_loss, (y,), mesh={"pp": 2}, microbatches=4,
                             device_model="h100").predicted_step
    assert step.communication > 0  # activations and gradients sent between the 2 ranks
    assert step.total >= step.compute + step.communication - 1e-15
