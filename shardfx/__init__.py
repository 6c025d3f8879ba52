"""shardfx: a compiler for distributed training of PyTorch models.

    plan = shardfx.partition(model, (x,), loss_fn=loss, example_targets=(y,))
    print(plan)
    runner = plan.runner(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = runner.step((x,), (y,))

The names below are imported on first use, so ``shardfx --help`` and ``--version`` do not
wait for torch.
"""

import sys as _sys
from importlib import import_module as _import
from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

from shardfx.kernels import choose_triton_mode

try:
    __version__ = _version("shardfx")
except _NotInstalled:  # run from a checkout that was never installed
    __version__ = "0+unknown"

_WHERE = {
    "partition": "shardfx.api", "search": "shardfx.cluster.driver", "Plan": "shardfx.plan", "Precision": "shardfx.request.precision",
    "shard_hint": "shardfx.request.hints", "pipe_split": "shardfx.request.hints", "experts": "shardfx.kernels.experts",
    "launch": "shardfx.runtime.launch", "LaunchError": "shardfx.runtime.launch",
    "LossScaling": "shardfx.runtime.loss_scale", "Runner": "shardfx.runtime.runner",
    "compiled_regions": "shardfx.runtime.lowered", "materialize": "shardfx.runtime.materialize",
    "NotStampedWarning": "shardfx.partitioner.repeats",
    **{name: "shardfx.errors" for name in (
        "ShardfxError", "CaptureError", "InputError", "LossError", "MeshError", "ShardingError",
        "PassError", "VerifyError", "MemoryBudgetError", "CheckpointError", "SearchError")},
}
__all__ = list(_WHERE)


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
