"""Shared set-up for the test suite.

``SHARDFX_DEBUG=1`` is set before shardfx is imported, so ``verify`` runs after every pass of
every plan a test builds: a pass that leaves the IR broken fails the test that exercised it.
``SHARDFX_CACHE`` points at a folder with no calibration in it, so plans use the ``cpu``
preset's speeds wherever the suite runs.

Models are tiny (hidden 32, 2 layers, vocab 64, sequence 8, batch 2) and dropout is off, so the
eager and the shardfx run compute the same function and the whole suite stays fast on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ["SHARDFX_DEBUG"] = "1"
# Plans are made on the "cpu" device model, not on a `shardfx calibrate` file this machine may
# have: a calibration must not move the stage cuts and recomputation tests expect.
os.environ["SHARDFX_CACHE"] = os.path.join(os.path.dirname(__file__), "no-calibration")
# The ranks shardfx.launch forks get the models' code from the fork server, imported once,
# instead of importing it again each (1-2 s a rank).
os.environ.setdefault("SHARDFX_PRELOAD", ",".join(
    f"transformers.models.{m}.modeling_{m}" for m in ("llama", "gpt2", "mixtral")))

import pytest  # noqa: E402
import torch  # noqa: E402

from models import lm_loss, token_batches  # noqa: E402  (tests/models.py: the shared models)

# Tiny configs trip Hugging Face's config checks (e.g. GPT-2's bos/eos id 50256 outside a
# vocabulary of 64); the warnings are noise here.
try:
    import transformers

    transformers.logging.set_verbosity_error()
except ImportError:  # the HF tests skip themselves
    pass


@dataclass(frozen=True)
class Sizes:
    """The one size every model test uses: small enough for CPU, big enough to have structure."""

    vocab: int = 64
    seq: int = 8
    batch: int = 2
    hidden: int = 32
    layers: int = 2


SIZES = Sizes()


@pytest.fixture
def sizes() -> Sizes:
    return SIZES


@pytest.fixture
def lm_loss_fn():
    return lm_loss


@pytest.fixture
def batches():
    """Factory: ``batches(n)`` gives ``n`` different (args, targets) batches of token ids."""
    return lambda n: token_batches(n, batch=SIZES.batch, seed=0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- the multiprocess marker: `make check` leaves out the tests that start processes ----------

# Names whose call starts processes: shardfx.launch, subprocess, multiprocessing, the CLI.
_SPAWNING = frozenset({"launch", "subprocess", "Popen", "check_output", "check_call",
                       "multiprocessing", "Process", "spawn", "torchrun"})
_SPAWNING_MODULES = ("subprocess", "multiprocessing", "shardfx.runtime.launch", "shardfx.run.cli",
                     "shardfx.run.train")


def _spawns(fn, seen: set, depth: int = 0) -> bool:
    """Whether ``fn`` (a test, a fixture, or a helper of the tests it calls, followed through
    the tests' own modules) may start a process: it names one of ``_SPAWNING`` or calls into
    a module that does. Static, so it errs towards marking: a test marked wrongly only runs in
    ``make test`` and not in ``make check``."""
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or depth > 5 or code in seen:
        return False
    seen.add(code)
    codes = [code]
    while codes:
        c = codes.pop()
        if _SPAWNING & set(c.co_names):
            return True
        codes += [k for k in c.co_consts if hasattr(k, "co_names")]  # lambdas, inner defs
        for name in c.co_names:
            value = getattr(fn, "__globals__", {}).get(name)
            module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
            if isinstance(module, str) and module.startswith(_SPAWNING_MODULES):
                return True
            if callable(value) and _is_tests_code(value) and _spawns(value, seen, depth + 1):
                return True
    return False


def _is_tests_code(value) -> bool:
    path = getattr(getattr(value, "__code__", None), "co_filename", "")
    return path.startswith(os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        fns = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        for defs in (info.name2fixturedefs.values() if info is not None else ()):
            fns += [d.func for d in defs]
        if any(_spawns(fn, set()) for fn in fns if fn is not None):
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request, monkeypatch):
    """A test left unmarked by ``_spawns`` that starts a process anyway fails here, naming
    itself: ``make check``, which leaves the marked ones out, can rely on the marker."""
    if request.node.get_closest_marker("multiprocess") is not None:
        return
    import multiprocessing.process

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process and is not marked "
                             "multiprocess: name its spawning call in tests/conftest.py "
                             "_SPAWNING, or mark it with @pytest.mark.multiprocess")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
