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
