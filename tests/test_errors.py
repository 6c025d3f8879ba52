"""Bad input fails early with the named error, and the message says what, where, and what to do.

Every ``ShardfxError`` carries ``cause``, ``where`` and ``fix``; the message prints all three
(``where:`` and ``fix:`` lines). Each test feeds one kind of bad input and checks the error's
class and that its parts point at the right thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfx
from shardfx.errors import CaptureError, InputError, LossError, MeshError, ShardfxError

from models import HandFilled


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


X, Y = torch.randn(2, 4), torch.randn(2, 4)


def assert_explained(e: ShardfxError, *, cause: str | tuple[str, ...],
                     where: str | None = None) -> None:
    """The error names the cause (each fragment of ``cause`` appears in it), a place and a fix,
    and its message prints all three. Fragments, not whole sentences: wording may improve."""
    for fragment in (cause,) if isinstance(cause, str) else cause:
        assert fragment in e.cause, e
    assert e.where and e.fix, f"error lacks where/fix:\n{e}"
    if where is not None:
        assert where in e.where, e
    msg = str(e)
    assert e.cause in msg and f"where: {e.where}" in msg and f"fix:   {e.fix}" in msg


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python branch: not traceable
            return y * 2
        return y


def test_untraceable_model_names_the_line():
    with pytest.raises(CaptureError) as info:
        shardfx.partition(Branchy(), (X,), F.mse_loss, (Y,))
    e = info.value
    assert_explained(e, cause=("Branchy", "traced"), where=f"{__file__}:")
    assert "if y.sum() > 0:" in e.where  # the offending line itself
    assert "torch.where" in e.fix or "torch.cond" in e.fix


def test_example_args_not_a_tuple():
    with pytest.raises(InputError) as info:
        shardfx.partition(mlp(), X, F.mse_loss, (Y,))
    assert_explained(info.value, cause=("example_args", "tuple", "Tensor[2, 4]"),
                     where="example_args")
    assert ",)" in info.value.fix  # shows how to write a 1-tuple


def test_non_tensor_leaf_in_example_args():
    with pytest.raises(InputError) as info:
        shardfx.partition(mlp(), (X, "relu"), F.mse_loss, (Y,))
    assert_explained(info.value, cause="str 'relu'", where="example_args, flattened leaf 1")


def test_loss_not_a_scalar():
    def per_element(out, y):
        return F.mse_loss(out, y, reduction="none")

    with pytest.raises(LossError) as info:
        shardfx.partition(mlp(), (X,), per_element, (Y,))
    assert_explained(info.value, cause=("scalar", "Tensor[2, 4]"),
                     where="returned by loss_fn")


def test_loss_fn_cannot_take_the_output():
    def hf_style(out, y):
        return F.cross_entropy(out.logits, y)  # a plain module returns a tensor, not .logits

    with pytest.raises(LossError) as info:
        shardfx.partition(mlp(), (X,), hf_style, (Y,))
    e = info.value
    # the underlying AttributeError is quoted; where shows what loss_fn was given
    assert_explained(e, cause=("loss_fn", "AttributeError", "logits"),
                     where="loss_fn(Tensor[2, 4]")


def test_step_with_another_batch_shape():
    plan = shardfx.partition(mlp(), (X,), F.mse_loss, (Y,))
    runner = plan.runner()
    with pytest.raises(InputError) as info:
        runner.step((torch.randn(3, 4),), (torch.randn(3, 4),))
    assert_explained(info.value, cause=("args[0]", "[3, 4]", "[2, 4]"),
                     where="args[0]")


@pytest.mark.parametrize("mesh, cause, where", [
    ({"xp": 1}, ("axis", "'xp'"), "mesh['xp']"),
    ({"dp": 0}, ("dp", "positive"), "mesh['dp']"),
    ("dp2", ("cannot read mesh",), "'dp2'"),
])
def test_bad_mesh(mesh, cause, where):
    with pytest.raises(MeshError) as info:
        shardfx.partition(mlp(), (X,), F.mse_loss, (Y,), mesh=mesh)
    assert_explained(info.value, cause=cause, where=where)


def test_mesh_bigger_than_this_run():
    """Planning for 2 devices works anywhere; running needs 2 processes."""
    plan = shardfx.partition(mlp(), (X,), F.mse_loss, (Y,), mesh={"dp": 2})
    with pytest.raises(MeshError) as info:
        plan.runner()
    assert_explained(info.value, cause=("dp=2", "torch.distributed"),
                     where="device_mesh")
    assert "nproc-per-node 2" in info.value.fix


def test_runner_on_meta_model():
    """A meta model's runner makes its weights (``runtime.materialize``); one nothing can make
    is named, with the fix, at the first step."""
    with torch.device("meta"):
        model = mlp()
    runner = shardfx.partition(model, (X.to("meta"),), F.mse_loss, (Y.to("meta"),)).runner()
    runner.forward((X,))  # reset_parameters made every Linear
    with torch.device("meta"):
        model = HandFilled()
    runner = shardfx.partition(model, (X,), F.mse_loss, (Y,)).runner()
    with pytest.raises(InputError) as info:
        runner.step((X,), (Y,))
    assert_explained(info.value, cause=("scale", "meta device", "unset"), where="scale")
    assert "init=" in info.value.fix


def test_step_on_inference_plan():
    runner = shardfx.partition(mlp(), (X,)).runner()
    with pytest.raises(InputError) as info:
        runner.step((X,), (Y,))
    assert_explained(info.value, cause="inference", where="runner.step")


def test_load_state_dict_missing_key():
    model = mlp()
    runner = shardfx.partition(model, (X,), F.mse_loss, (Y,)).runner()
    state = model.state_dict()
    del state["2.bias"]
    with pytest.raises(InputError) as info:
        runner.load_state_dict(state)
    assert_explained(info.value, cause=("missing", "'2.bias'"), where="runner.load_state_dict")


@pytest.mark.parametrize("call, value, said", [
    ("load_hf", None, "None"), ("load_hf", 123, "123 (an int)"), ("save_hf", None, "None"),
    ("save", None, "None"), ("load", 3.5, "3.5 (a float)"), ("load", "", "an empty string")])
def test_a_path_that_is_not_one_is_named(call, value, said):
    """Not pathlib's TypeError from deep inside: the call, what it was given, and an example."""
    runner = shardfx.partition(mlp(), (X,), F.mse_loss, (Y,)).runner()
    with pytest.raises(InputError) as info:
        getattr(runner, call)(value)
    assert_explained(info.value, cause=f"the path given to runner.{call} is {said}, not a path",
                     where=f"runner.{call}(")
    assert f"runner.{call}(\"" in info.value.fix
