"""Where a plan runs (``kernels.device``): the device chosen, every tensor the programs make
put there, and the runner's weights, batch slices and own tensors with them.

CI has no GPU, so the runner is run on ``meta``, a device other than the CPU the model was
traced on, under a mode that fails any op mixing the plan's device with the CPU (a 0-dim CPU
tensor excepted, as CUDA allows): a tensor left on the CPU here is one a GPU run would trip
on."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import shardfx
from shardfx.errors import InputError
from shardfx.ir import meta as M
from shardfx.kernels.device import choose_device

from models import hf, lm_loss, tiny, token_batches


class OneDevice(TorchDispatchMode):
    """Raises on an op that mixes ``device`` with another (0-dim CPU tensors aside, as CUDA
    allows; a copy onto ``device`` is how data gets there); counts the ops run there."""

    COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}

    def __init__(self, device: str):
        super().__init__()
        self.device, self.ops = torch.device(device), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)]
        devices = {t.device for t in tensors}
        if self.device in devices:
            self.ops += 1
            if len(devices) > 1 and func not in self.COPIES:
                raise AssertionError(f"{func} mixes {sorted(map(str, devices))}: "
                                     f"{[(list(t.shape), str(t.device)) for t in tensors]}")
        return out


def test_the_device_follows_the_request_then_the_model_then_the_inputs():
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert choose_device(None, model, (x,)) == torch.device("cpu")
    assert choose_device("meta", model, (x,)) == torch.device("meta")
    with torch.device("meta"):
        on_meta = nn.Linear(4, 4)
    assert choose_device(None, on_meta, (x.to("meta"),)) == torch.device("cpu")
    plan = shardfx.partition(model, (x,), device="meta")
    assert plan.device == torch.device("meta")


def test_a_device_the_machine_lacks_is_an_error_that_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InputError) as info:
        shardfx.partition(nn.Linear(4, 4), (torch.randn(2, 4),), device="cuda")
    assert "CUDA is not available" in info.value.cause
    with pytest.raises(InputError, match="not a device"):
        shardfx.partition(nn.Linear(4, 4), (torch.randn(2, 4),), device="gpu0")


def _devices_made(module) -> set:
    return {str(n.kwargs["device"]) for gm in module.modules() if isinstance(gm, torch.fx.GraphModule)
            for n in gm.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)}


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # gpt2: a tied LM head
def test_a_cpu_traced_model_trains_on_another_device_from_cpu_batches(name):
    """Traced on the CPU, run on meta: the programs' factory ops (positions, masks) are made
    there, the model's weights move there, and the CPU batch is moved by the runner."""
    model = tiny(name)
    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(model, (x,), lm_loss, (y,), device="meta", optimizer="sgd")
    assert _devices_made(plan.program.module) <= {"meta"}
    assert "cpu" in _devices_made_traced(name)  # so the test tests something
    params = list(model.parameters())
    runner = plan.runner(lambda ps: torch.optim.SGD(ps, lr=0.1), keep_grads=True)
    with OneDevice("meta") as mode:
        loss = runner.step((x,), (y,))
    assert len(list(model.parameters())) == len(params)  # a tied weight is still one
    assert mode.ops > 100 and loss.device.type == "meta"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(p.grad is not None and p.grad.device.type == "meta"
               for p in runner.parameters())


def _devices_made_traced(name: str) -> set:
    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(tiny(name), (x,), lm_loss, (y,))
    return _devices_made(plan.program.module)


def test_dropout_and_constants_follow_the_device():
    """A constant the program holds (an index list) is put on the plan's device (without it
    the index op mixes devices). The dropout seed is moved too, but the program reads it as
    0-dim scalars, which CUDA, and this check, accept from the CPU."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(self.fc(x))[:, [0, 2, 4, 6]]

    x, y = torch.randn(4, 8), torch.randn(4, 4)
    plan = shardfx.partition(Model(), (x,), nn.functional.mse_loss, (y,), device="meta",
                             optimizer="sgd")
    kinds = {n.meta[M.ROLE].kind.value
             for n in plan.program.module.graph.find_nodes(op="placeholder")}
    assert {"constant", "rng"} <= kinds, kinds
    runner = plan.runner(lambda ps: torch.optim.SGD(ps, lr=0.1))
    with OneDevice("meta") as mode:
        runner.step((x,), (y,))
    assert mode.ops > 10


def test_pipeline_parts_make_their_tensors_on_the_device():
    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(hf("gemma3"), (x,), lm_loss, (y,), mesh={"pp": 2},
                             microbatches=2, device="meta")
    assert _devices_made(plan.stage_program) == {"meta"}


def test_inputs_on_another_accelerator_are_refused():
    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,))
    runner = plan.runner()
    with pytest.raises(InputError) as info:
        runner.step((x.to("meta"),), (y,))
    assert "args[0] is on meta; the plan runs on cpu" in info.value.cause
    assert "CPU tensors" in info.value.fix


def test_a_tp_group_that_spans_nodes_is_a_warning(monkeypatch):
    """torchrun numbers ranks node by node, tp varies fastest: tp=4 on 2 GPUs per node puts
    each tp group on two nodes; tp=2 fits."""
    from shardfx.mesh import MeshSpec
    from shardfx.runtime.mesh import _check_nodes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match="tp x ep = 4 does not divide the 2 processes per node"):
        _check_nodes(MeshSpec.parse("dp=2,tp=4"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_nodes(MeshSpec.parse("dp=4,tp=2"))
        _check_nodes(MeshSpec.parse("pp=4,dp=2"))
