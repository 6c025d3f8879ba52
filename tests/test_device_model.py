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
from shardfx.estimate.step_time import _message_seconds
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
    # NCCL's bus bandwidth on NVLink 4 and one 400 Gb/s port, its per-step ring latencies
    assert H100.links["intra"] == Link(360e9, 3.4e-6) and H100.links["inter"] == Link(45e9, 9.6e-6)
    assert H100.collective_latency == 8.4e-6
    a100 = PRESETS["a100"]
    assert a100.peak("bfloat16") == 312e12 and a100.links["intra"].bandwidth == 235e9
    assert a100.links["inter"].bandwidth == 22.5e9 and a100.memory == 80e9
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
    assert gpu_preset("NVIDIA H200") is PRESETS["h200"] and gpu_preset("V100") is None
    assert gpu_preset("NVIDIA A100-SXM4-80GB") is PRESETS["a100"]
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
    """At the peaks: ``op_seconds`` is the plain roofline (node_seconds refines matmuls)."""
    # 1 ms of bf16 compute, 2 ms of memory traffic: memory-bound
    assert H100.op_seconds(989e9, 6.7e9, torch.bfloat16) == pytest.approx(2e-3)
    # the same FLOPs in fp32 take 989/67 ms: compute-bound
    assert H100.op_seconds(989e9, 6.7e9, torch.float32) == pytest.approx(989e9 / 67e12)
    assert H100.op_seconds(0, 3.35e9) == pytest.approx(1e-3)


def test_collective_seconds_follow_the_ring():
    gb = 1e9
    intra, base = 360e9, 8.4e-6
    assert H100.collective_seconds("all_reduce", gb, 8) == \
        pytest.approx(base + 14 * 3.4e-6 + 2 * 7 / 8 * gb / intra)
    assert H100.collective_seconds("all_gather", gb, 4, "inter") == \
        pytest.approx(base + 3 * 9.6e-6 + 3 / 4 * gb / 45e9)
    assert H100.collective_seconds("reduce_scatter", gb, 4) == \
        H100.collective_seconds("all_gather", gb, 4)
    assert H100.collective_seconds("send", gb, 2) == pytest.approx(base + 3.4e-6 + gb / intra)
    assert H100.collective_seconds("all_reduce", gb, 1) == 0.0
    with pytest.raises(InputError, match="unknown collective"):
        H100.collective_seconds("broadcast", gb, 2)


def test_link_of_a_mesh_axis():
    axes = (("dp", 4), ("tp", 8))  # row-major: tp's 8 ranks are one node, dp spans 4 nodes
    assert H100.link_of(axes, "tp") == H100.links["intra"]
    assert H100.link_of(axes, "dp") == H100.links["inter"]
    assert H100.link_of((("dp", 2), ("tp", 4)), "dp") == H100.links["intra"]


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
    # compute-bound, at the share of peak a 512^3 GEMM reaches
    eff = H100.throughput.matmul_efficiency(1, 512, 512, 512)
    assert H100.node_seconds(nodes["mm"]) == pytest.approx(flops / (67e12 * eff))
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
    assert H100.node_seconds(mm) == pytest.approx(max(flops / (989e12 * eff),
                                                      3 * tensor / 2 / 3.35e12))


# --- choosing a model ---------------------------------------------------------------------------

def test_unknown_preset_names_the_presets():
    with pytest.raises(InputError) as info:
        device_model("b200")
    assert "unknown device model 'b200'" in str(info.value)
    assert "h100, h200, gh200, a100, cpu" in info.value.fix
    with pytest.raises(InputError, match="device_model"):
        mlp_plan(4, model="b200")


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


# --- what real clusters reach: matmuls by shape, attention, collectives by size and span -------

def test_matmul_efficiency_grows_with_size_up_to_the_measured_best():
    """Square GEMMs from 256 to 16k: never slower per FLOP as they grow, never past the best
    large shape measured (80.1% of peak on an H100, 85.9% on an A100); a short K pays the
    tiles' fixed cost more often."""
    for preset in ("h100", "a100"):
        t = PRESETS[preset].throughput
        sizes = [2 ** i for i in range(8, 15)]
        eff = [t.matmul_efficiency(1, n, n, n) for n in sizes]
        assert eff == sorted(eff) and eff[-1] <= t.matmul and eff[-1] > 0.95 * t.matmul
        assert eff[0] < 0.1  # 256 x 256: two tiles on 100+ SMs
        depth = [t.matmul_efficiency(1, 8192, 8192, k) for k in (128, 512, 2048, 8192)]
        assert depth == sorted(depth) and depth[0] < 0.6 * depth[-1]
    h100 = PRESETS["h100"].throughput
    assert h100.matmul == pytest.approx(792.1 / 989)
    # a last partial wave: 133 tiles of 128 x 256 on 132 SMs take two waves
    assert h100.matmul_efficiency(1, 7 * 256, 19 * 256, 4096) < \
        h100.matmul_efficiency(1, 8 * 256, 16 * 256, 4096)


def test_attention_at_its_kernels_speed_and_half_the_pairs_when_causal():
    def flash(causal: bool, backward: bool = False):
        t = "bf16[1, 32, 8192, 128]"
        if backward:
            call = (f"att: ({t}, {t}, {t}) = aten._scaled_dot_product_flash_attention_for_cpu"
                    f"_backward.default(g, q, k, v, q, lse, 0.0, {causal})  # bwd")
        else:
            call = (f"att: ({t}, f32[1, 32, 8192]) = aten._scaled_dot_product_flash_attention"
                    f"_for_cpu.default(q, k, v, 0.0, {causal})  # fwd")
        return text_to_ir(f"""
graph train Tiny
  q: {t} = input args[0]
  k: {t} = input args[1]
  v: {t} = input args[2]
  g: {t} = input args[3]
  lse: f32[1, 32, 8192] = input args[4]
  tangent_loss: f32[] = tangent loss
  {call}
  o: {t} = operator.getitem(att, 0)  # fwd
  loss: bf16[] = aten.sum.default(o)  # fwd
  output loss loss = loss
""")
    attention = H100.throughput.attention
    pairs = 4 * 32 * 128 * 8192 * 8193 // 2  # causal: each query its keys up to itself
    seconds = [H100.node_seconds(n) for gm in (flash(True), flash(False), flash(True, True))
               for n in gm.graph.nodes if "flash" in str(n.target)]
    assert seconds[0] == pytest.approx(pairs / attention.rate(8192, False))
    assert seconds[1] == pytest.approx(2 * seconds[0], rel=1e-3)
    assert seconds[2] == pytest.approx(2.5 * pairs / attention.rate(8192, True))


def test_core_attention_unfused_moves_its_scores():
    """Megatron's attention before FlashAttention: every score element computed (causal or
    not), written and read by its softmax and dropout: 13 bytes an element forward, 19
    backward, beside two and four batched matmuls."""
    a100 = PRESETS["a100"]
    heads, s, d = 4 * 8, 2048, 96  # kort-22b-sel's: micro-batch 4, 64 heads over tp = 8
    forward = a100.core_attention_seconds(heads, s, s, d, False)
    backward = a100.core_attention_seconds(heads, s, s, d, True)
    memory = heads * s * s / a100.memory_bandwidth
    assert forward > 13 * memory and backward > 19 * memory
    gemms = forward - 13 * memory  # QK^T and PV: 2 * 2 * heads * s * s * d FLOPs
    assert 4 * heads * s * s * d / a100.peak("float16") < gemms
    # twice the FLOPs, two of the four at a long K (the keys, not the head dim): faster
    assert gemms < backward - 19 * memory < 2 * gemms
    flash = a100.throughput.attention.rate(s, False)
    assert forward > 3 * (4 * heads * d * s * s / 2) / flash  # the fused kernel: far less
    assert a100.core_attention_seconds(heads, s, 2 * s, d, False) > 1.9 * forward


@pytest.mark.parametrize("preset", ["h100", "a100"])
def test_collective_bandwidth_grows_with_the_message_to_the_links(preset):
    """Bus bandwidth (nccl-tests' busbw) of an 8-rank all-reduce by message size: latency-bound
    at a kilobyte, within 2% of the link at a gigabyte."""
    model = PRESETS[preset]
    sizes = [2 ** i for i in range(10, 31, 4)]
    busbw = [2 * 7 / 8 * s / model.collective_seconds("all_reduce", s, 8) for s in sizes]
    assert busbw == sorted(busbw)
    assert busbw[0] < 0.01 * model.links["intra"].bandwidth
    assert busbw[-1] == pytest.approx(model.links["intra"].bandwidth, rel=0.02)


def test_the_span_rule_counts_each_nodes_ports():
    """Inside a node NVLink; across nodes one 400 Gb/s port per rank of the group in a node."""
    intra, port = H100.links["intra"], H100.links["inter"]
    assert H100.link_of((("dp", 8), ("tp", 8)), "tp") == intra
    assert H100.link_of((("dp", 8), ("tp", 8)), "dp") == port  # one rank of dp per node
    fsdp = H100.link_of((("dp", 32), ("cp", 2)), "dp")  # 4 ranks of each dp group per node
    assert fsdp.bandwidth == 4 * port.bandwidth and fsdp.latency == port.latency
    assert H100.link_of((("dp", 32), ("cp", 2)), "dp", p2p=True) == port
    assert H100.link_of((("tp", 16),), "tp").bandwidth == intra.bandwidth  # 8 ports = NVLink
    assert H100.link_of((("dp", 4), ("pp", 4), ("tp", 4)), "pp") == \
        Link(2 * port.bandwidth, port.latency)
    gb = 1e9  # the same 1 GB reduce-scatter: 4 ports take a quarter of one port's time
    one = H100.collective_seconds("reduce_scatter", gb, 32, port)
    four = H100.collective_seconds("reduce_scatter", gb, 32, fsdp)
    assert four < 0.3 * one


def test_the_span_rule_for_a_group_of_axes():
    """Megatron's dp x cp gradient group: with cp's ranks in one node beside tp, each node
    holds two ranks of the group, two ports; with tp filling the node, one."""
    port = H100.links["inter"]
    axes = (("dp", 2), ("pp", 4), ("cp", 2), ("tp", 4))
    assert H100.link_of(axes, ("dp", "cp")) == Link(2 * port.bandwidth, port.latency)
    assert H100.link_of(axes, ("cp",)) == H100.link_of(axes, "cp") == H100.links["intra"]
    assert H100.link_of((("dp", 4), ("pp", 8), ("cp", 2), ("tp", 8)), ("dp", "cp")) == port
    assert H100.link_of(axes, ("ep",)) == H100.links["intra"]  # no such axis: one rank


def test_a_model_with_throughput_round_trips_through_json(tmp_path):
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(PRESETS["a100"].to_json()))
    assert device_model(path) == PRESETS["a100"]
    assert "attention" in PRESETS["a100"].describe() and "86% of peak" in \
        PRESETS["a100"].describe()


def test_dp_buckets_hide_behind_the_backward_tp_collectives_do_not():
    """What the program overlaps: dp's gradient buckets are issued during the backward and
    waited for at its end; tp's redistributions are waited for at once."""
    dp = mlp_plan(4096, mesh={"dp": 2}).predicted_step
    assert 0 < dp.exposed < dp.communication
    assert dp.total == pytest.approx(dp.compute + dp.exposed)
    tp = mlp_plan(4096, mesh={"tp": 2}).predicted_step
    assert tp.exposed == pytest.approx(tp.communication)


def test_transfers_delay_the_receiver_not_the_sender():
    from shardfx.schedule import simulate
    from shardfx.schedule.generate import generate

    sched = generate("gpipe", 2, 2)
    plain = simulate(sched, lambda a: 1.0)
    late = simulate(sched, lambda a: 1.0, transfer=lambda a: 0.5)
    # rank 1 waits 0.5 for its first forward, rank 0 0.5 for its first backward
    assert late.makespan == pytest.approx(plain.makespan + 1.0)


def test_megatron_scatter_gather_sends_a_tp_share_through_each_port():
    """p2p-scatter-gather (Megatron, SC21 sec. 4.1): each of tp ranks sends 1/tp of a
    pipeline message through its own port, then the receivers all-gather it over NVLink. At
    sc21-1t's size (a 2048 x 25600 fp16 activation, pp across DGX A100 nodes) the message
    that took 4.7 ms whole takes about 1 ms."""
    a100, axes = PRESETS["a100"], (("dp", 6), ("pp", 64), ("tp", 8))
    link = a100.link_of(axes, "pp", p2p=True)
    val = torch.empty(2048, 25600, dtype=torch.float16, device="meta")
    whole = _message_seconds(a100, val, link, axes)
    split = _message_seconds(a100, val, link, axes, split=8)
    assert link == a100.links["inter"] and whole == pytest.approx(105e6 / 22.5e9, rel=0.01)
    assert whole / 6 < split < whole / 3
