"""shardfx: a compiler for distributed training of PyTorch models.

    plan = shardfx.partition(model, (x,), loss_fn=loss, example_targets=(y,))
    print(plan)
    runner = plan.runner(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = runner.step((x,), (y,))
"""

import os as _os
import sys as _sys

import torch as _torch

# Triton kernels run on a CPU only through Triton's interpreter, which has to be chosen before
# triton is first imported (its own library is decorated then): on a machine without CUDA,
# shardfx chooses it unless TRITON_INTERPRET says otherwise (kernels="triton" on CPU).
if "triton" not in _sys.modules and not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from importlib.metadata import PackageNotFoundError as _NotInstalled  # noqa: E402
from importlib.metadata import version as _version  # noqa: E402

try:
    __version__ = _version("shardfx")
except _NotInstalled:  # run from a checkout that was never installed
    __version__ = "0+unknown"

from shardfx.api import partition  # noqa: E402
from shardfx.errors import (CaptureError, InputError, LossError, MemoryBudgetError, MeshError,
                            PassError, ShardfxError, ShardingError, VerifyError)
from shardfx.hints import pipe_split, shard_hint
from shardfx.plan import Plan
from shardfx.precision import Precision
from shardfx.runtime.launch import LaunchError, launch
from shardfx.runtime.loss_scale import LossScaling
from shardfx.runtime.runner import Runner

__all__ = ["partition", "Precision", "LossScaling", "shard_hint", "pipe_split", "launch", "Plan", "Runner", "ShardfxError", "CaptureError",
           "InputError", "LossError", "MeshError", "ShardingError", "PassError", "VerifyError",
           "LaunchError", "MemoryBudgetError"]
