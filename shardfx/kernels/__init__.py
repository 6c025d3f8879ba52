"""The ops a program calls that shardfx implements: Triton kernels, the fused LM head and loss,
attention on the plan's device, the experts' op. Importing this package imports nothing
heavy: ``shardfx --help`` imports it."""

import os as _os
import sys as _sys


def choose_triton_mode() -> None:
    """Triton kernels run on a CPU only through Triton's interpreter, which has to be chosen
    before triton is first imported (its own library is decorated then): on a machine without
    CUDA, shardfx chooses it unless TRITON_INTERPRET says otherwise (kernels="triton" on CPU).
    Called before anything of shardfx's that plans or runs is imported."""
    import torch

    if "triton" not in _sys.modules and not torch.cuda.is_available():
        _os.environ.setdefault("TRITON_INTERPRET", "1")
