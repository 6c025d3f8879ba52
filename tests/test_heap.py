"""On a CPU the runners keep large freed tensors' memory in the heap (``runtime.heap``): read
off glibc's own count of memory in mmapped chunks, which a 40 MiB tensor no longer adds to."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")

CHECK = textwrap.dedent("""
    import ctypes, torch, shardfx
    from shardfx.testing import adamw

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info

    def mapped_by(numel):
        before = libc.mallinfo2().hblkhd
        t = torch.ones(numel)
        return libc.mallinfo2().hblkhd - before

    big = 10 << 20  # 40 MiB of float32
    print(mapped_by(big) >= 40 << 20)  # glibc maps it apart
    model = torch.nn.Linear(4, 4)
    plan = shardfx.partition(model, (torch.randn(2, 4),), lambda o, t: (o - t).pow(2).mean(),
                             (torch.randn(2, 4),))
    plan.runner(adamw)
    print(mapped_by(big) == 0)  # from the heap, kept there when freed
""")


def _check(**env: str) -> list[str]:
    """CHECK in a process of its own (malloc's settings are the whole process's)."""
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    return out.stdout.split() or [out.stderr]


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_cpu_runner_takes_large_tensors_from_the_heap():
    assert _check() == ["True", "True"]


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_shardfx_keep_heap_0_leaves_malloc_alone():
    assert _check(SHARDFX_KEEP_HEAP="0") == ["True", "False"]
