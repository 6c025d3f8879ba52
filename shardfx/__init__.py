"""shardfx: a compiler for distributed training of PyTorch models.

    plan = shardfx.partition(model, (x,), loss_fn=loss, example_targets=(y,))
    print(plan)
    runner = plan.runner(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = runner.step((x,), (y,))

The names below are imported on first use, so ``shardfx --help`` and ``--version`` do not
wait for torch.
"""

import os as _os
import sys as _sys
from importlib import import_module as _import
from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

try:
    __version__ = _version("shardfx")
except _NotInstalled:  # run from a checkout that was never installed
    __version__ = "0+unknown"

_WHERE = {
    "partition": "shardfx.api", "Plan": "shardfx.plan", "Precision": "shardfx.precision",
    "shard_hint": "shardfx.hints", "pipe_split": "shardfx.hints", "experts": "shardfx.moe",
    "launch": "shardfx.runtime.launch", "LaunchError": "shardfx.runtime.launch",
    "LossScaling": "shardfx.runtime.loss_scale", "Runner": "shardfx.runtime.runner",
    **{name: "shardfx.errors" for name in (
        "ShardfxError", "CaptureError", "InputError", "LossError", "MeshError", "ShardingError",
        "PassError", "VerifyError", "MemoryBudgetError")},
}
__all__ = list(_WHERE)


def choose_triton_mode() -> None:
    """Triton kernels run on a CPU only through Triton's interpreter, which has to be chosen
    before triton is first imported (its own library is decorated then): on a machine without
    CUDA, shardfx chooses it unless TRITON_INTERPRET says otherwise (kernels="triton" on CPU).
    Called before anything of shardfx's that plans or runs is imported."""
    import torch

    if "triton" not in _sys.modules and not torch.cuda.is_available():
        _os.environ.setdefault("TRITON_INTERPRET", "1")


if "torch" in _sys.modules:  # torch is here already: choosing costs nothing
    choose_triton_mode()


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'shardfx' has no attribute {name!r}")
    choose_triton_mode()
    value = getattr(_import(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_WHERE])
