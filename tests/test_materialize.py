"""A model on the meta device: each runner makes only its rank's shards, one whole tensor at a
time, by the model's own initialisation, and every mesh gets what ``shardfx.materialize`` gives
one device, bit for bit (``runtime.materialize``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.errors import InputError
from shardfx.runtime.materialize import Initializer, _stream, on_meta
from shardfx.runtime.measure import measured_peak
from shardfx.testing import adamw, compare_training

from models import HandFilled as Scale, lm_loss, tiny, token_batches


def on_meta_model(name: str, layers: int = 2) -> torch.nn.Module:
    with torch.device("meta"):
        return tiny(name, layers)


def drawn(fqn: str, shape, draw, seed: int = 0) -> torch.Tensor:
    """What ``draw`` writes into a tensor of ``shape`` on ``fqn``'s own stream."""
    torch.manual_seed(_stream(seed, fqn))
    return draw(torch.empty(shape))


def test_hugging_face_weights_are_its_own_init_on_each_tensors_stream():
    model = shardfx.materialize(on_meta_model("llama"))
    q = "model.layers.0.self_attn.q_proj.weight"
    std = model.config.initializer_range
    assert torch.equal(model.get_parameter(q),
                       drawn(q, model.get_parameter(q).shape, lambda t: t.normal_(0, std)))
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    # RoPE tables: buffers the model's _init_weights writes, as its constructor computes them
    assert torch.equal(model.model.rotary_emb.inv_freq, tiny("llama").model.rotary_emb.inv_freq)
    assert not on_meta(model)


def test_gpt2_keeps_its_tied_head_and_scaled_projections():
    model = shardfx.materialize(on_meta_model("gpt2", layers=4))
    assert model.lm_head.weight is model.transformer.wte.weight
    # GPT-2's _init_weights on a block redraws c_proj with std / sqrt(2 * layers)
    projections = torch.cat([p.flatten() for n, p in model.named_parameters()
                             if n.endswith("c_proj.weight")])
    assert projections.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def test_a_tensor_gets_the_same_values_whatever_else_is_made():
    """Each tensor's own stream: made alone, after others, or in a model made in part."""
    whole = shardfx.materialize(on_meta_model("mixtral"), init_seed=5).state_dict()
    model = on_meta_model("mixtral")
    maker = Initializer(model, init_seed=5)
    experts = "model.layers.0.mlp.experts"
    gate_up, down = f"{experts}.gate_up_proj", f"{experts}.down_proj"
    assert torch.equal(maker.value(down), whole[down])  # alone: its sibling stays on meta
    model.model.layers[0].mlp.experts.gate_up_proj = torch.nn.Parameter(torch.full_like(
        whole[gate_up], 7.0, device="cpu"))  # the sibling made by hand: kept, not drawn for
    shardfx.materialize(model, init_seed=5)
    assert torch.equal(model.get_parameter(down), whole[down])
    assert (model.get_parameter(gate_up) == 7.0).all()
    assert all(torch.equal(t, whole[n]) for n, t in model.state_dict().items() if n != gate_up)


def test_another_seed_gives_other_weights():
    a = shardfx.materialize(on_meta_model("llama"), init_seed=0)
    b = shardfx.materialize(on_meta_model("llama"), init_seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_torch_layers_use_their_reset_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(5)).to("meta")
    shardfx.materialize(model, init_seed=2)
    want = drawn("0.weight", (5, 4), lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
                 seed=2)
    assert torch.equal(model[0].weight, want)
    assert torch.equal(model[1].weight, torch.ones(5))


def test_a_tensor_nothing_initialises_is_an_error_naming_it():
    with torch.device("meta"):
        model = Scale()
    with pytest.raises(InputError, match=r"scale is on the meta device .* left 4 of its 4 values"
                                         r" unset") as e:
        shardfx.materialize(model)
    assert "init=" in e.value.fix


def test_init_fills_what_the_model_cannot():
    def init(module):
        if isinstance(module, Scale):
            torch.nn.init.ones_(module.scale)
        elif isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = Scale()
    shardfx.materialize(model, init=init)
    assert torch.equal(model.scale, torch.ones(4)) and not model.lin.weight.any()

    def half(module):
        if isinstance(module, Scale):
            module.scale[:2] = 1.0

    with torch.device("meta"):
        model = Scale()
    with pytest.raises(InputError, match="init= left 2 of its 4 values unset"):
        shardfx.materialize(model, init=half)


def test_an_init_that_writes_nan_or_inf_is_named_as_such_not_as_unset():
    """NaN was the mark of a value nothing wrote; a value written as NaN is told apart (the
    calls run again from 0 and from 1), and Inf is caught too."""
    def nan(module):
        if isinstance(module, Scale):
            torch.nn.init.constant_(module.scale, float("nan"))

    def inf(module):
        if isinstance(module, Scale):
            module.scale[:] = torch.tensor([1.0, float("inf"), 2.0, 3.0])

    def scaled(module):  # reads what is there: nothing was written
        if isinstance(module, Scale):
            module.scale.mul_(0.5)

    for init, says in [(nan, r"init= wrote NaN into scale \(every value written"),
                       (inf, r"init= wrote Inf into scale"),
                       (scaled, r"init= left 4 of its 4 values unset")]:
        with torch.device("meta"):
            model = Scale()
        with pytest.raises(InputError, match=says):
            shardfx.materialize(model, init=lambda m, init=init: (
                init(m), isinstance(m, torch.nn.Linear) and m.reset_parameters()))


def test_init_seed_or_init_for_a_model_already_made_is_an_error():
    """They would change nothing: the runner trains the weights the model has."""
    (x,), (y,) = token_batches(1)[0]
    plan = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,))
    for kw in ({"init_seed": 3}, {"init": lambda m: None}):
        with pytest.raises(InputError, match=r"has nothing to make: the model's weights are "
                                             r"already made") as e:
            plan.runner(**kw)
        assert "torch.device('meta')" in e.value.fix
    plan.runner()  # without them: the model's own weights


def test_bad_init_arguments_are_errors():
    with pytest.raises(InputError, match="init_seed='1' is not a whole number"):
        Initializer(on_meta_model("llama"), init_seed="1")
    with pytest.raises(InputError, match="is not callable"):
        Initializer(on_meta_model("llama"), init=3)


def test_a_meta_model_trains_on_one_device():
    """The runner makes the whole model in place, equal to materialize's, and trains like it."""
    batches = token_batches(2)
    model = on_meta_model("llama")
    report = compare_training(model, batches, lm_loss)
    assert report.max() < 1e-5
    assert all(p.is_meta for p in model.parameters())  # compare_training plans a copy


# --- on a mesh -------------------------------------------------------------------------------

def _train(cases: list[tuple]) -> list[tuple]:
    """On every rank: ``compare_training`` of a meta model on each mesh (it checks the runner's
    first weights against ``materialize``'s, bit for bit); the largest error."""
    out = []
    for name, mesh, kwargs in cases:
        report = compare_training(on_meta_model(name), token_batches(2), lm_loss, mesh=mesh,
                                  **kwargs)
        out.append((name, str(mesh), report.max()))
    return out


@pytest.mark.multiprocess
def test_meta_models_train_like_one_device_on_every_mesh():
    megatron = {"shard": "megatron"}
    results = shardfx.launch(_train, [
        ("llama", {"dp": 4}, {"zero": 3}),
        ("gpt2", {"dp": 2, "tp": 2}, megatron),  # tied head, Conv1D
        ("llama", {"pp": 2, "tp": 2}, {**megatron, "microbatches": 2}),
        ("mixtral", {"ep": 2, "dp": 2}, {}),
    ], nprocs=4, timeout=180, deadline=900)
    for rank in results:
        for name, mesh, err in rank:
            assert err < 1e-5, (name, mesh, err)


def _init_peak() -> tuple[int, int, int, int]:
    """On every rank: the peak of live storage while ``plan.runner()`` and its first use make
    a meta Llama on dp=4 ZeRO-3; what the runner then holds; the largest tensor; the whole model."""
    (x,), (y,) = token_batches(1)[0]
    model = on_meta_model("llama", layers=4)
    plan = shardfx.partition(model, (x,), lm_loss, (y,), mesh={"dp": 4}, zero=3)
    made = []

    def make():
        made.append(plan.runner())
        made[0].parameters()  # the weights are made on first use

    peak = measured_peak(make)
    held = sum(t.untyped_storage().nbytes() for t in [*made[0]._params.values(),
                                                      *made[0]._buffers.values()])
    sizes = [t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]]
    return peak.total, held, max(sizes), sum(sizes)


@pytest.mark.multiprocess
def test_a_rank_makes_its_shards_with_one_whole_tensor_at_a_time():
    for peak, held, largest, whole in shardfx.launch(_init_peak, nprocs=4, timeout=120):
        assert peak <= 1.1 * (held + largest), (peak, held, largest)
        assert held < 0.4 * whole  # its quarter of the model, and the buffers


def test_meta_model_error_names_an_uninitialisable_tensor_before_any_step():
    """The weights are made on first use: the first step says which one cannot be."""
    x = torch.randn(2, 4)
    with torch.device("meta"):
        model = Scale()
    runner = shardfx.partition(model, (x,), F.mse_loss, (x,)).runner(adamw)
    with pytest.raises(InputError, match="scale is on the meta device"):
        runner.step((x,), (x,))


def test_a_runner_that_loads_its_weights_draws_nothing(tmp_path, monkeypatch):
    """Weights are made on first use: a checkpoint or state dict loaded first leaves nothing
    to make, so a large model starts from its checkpoint without its random init."""
    (x,), (y,) = token_batches(1)[0]
    trained = shardfx.partition(tiny("llama"), (x,), lm_loss, (y,)).runner(adamw)
    trained.step((x,), (y,))
    trained.save(tmp_path / "ckpt")
    want = trained.state_dict()

    made = Initializer.value

    def refuse(self, fqn):  # buffers (RoPE tables) are made with the runner: no parameter
        if "rotary_emb" not in fqn:
            raise AssertionError(f"{fqn} was drawn")
        return made(self, fqn)

    monkeypatch.setattr(Initializer, "value", refuse)
    for load in (lambda r: r.load(tmp_path / "ckpt"), lambda r: r.load_state_dict(want)):
        runner = shardfx.partition(on_meta_model("llama"), (x,), lm_loss, (y,)).runner(adamw)
        load(runner)
        got = runner.state_dict()
        assert all(torch.equal(got[k], t) for k, t in want.items())
