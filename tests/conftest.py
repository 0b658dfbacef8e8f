"""Shared test set-up: fresh random seeds, hypothesis settings, one torch thread per xdist worker.

Design choices:
- Fresh random inputs every run (the point of equivalence tests is to meet inputs nobody chose); the
  seed is printed, so a failure shows it in the captured output and can be replayed with
  ATTNLAB_TEST_SEED=<seed>.
- Hypothesis gets no deadline: the machine is shared and loaded, and timing is never what we test.
- One torch thread per test process: the tests' tensors are tiny, `make test` runs two xdist workers
  on two cores, and the machine is shared; with two threads each, OpenMP's waiting made a tiny
  forward pass 20x slower here.
- No test reaches the real Hugging Face Hub: HF_HUB_OFFLINE=1 is set before anything imports
  huggingface_hub (the download tests set their own environment for a loopback stand-in,
  hub_server.py).
- tests/ is put on sys.path so test modules can `import reference` (the NumPy oracle) however
  pytest was started.
- The explorer's test files share `models` (explorer_models.small_models, once per module) and
  `client` (a TestClient of the explorer serving them); a module that needs other ones defines its
  own, which takes their place.
- The C kernels' tests run once per build this CPU can execute: kernel_builds.py (its fixture
  `kernel_build` and its hooks are registered here).
- ATTNLAB_FLOAT_ROWS=c: float32 prompts and forward passes take the C kernels wherever the build
  has vectorised tiles, whichever side the one-off timing (kernels.float_rows) would pick on the
  machine the tests run on, and not AMX's tiles (kernels.float_products), so that the same tests
  check the same kernels everywhere; the AMX product and the choice itself have their own tests
  (test_amx.py, test_inference_layers.py).
- ATTNLAB_DECODE_LAYOUT=16-row: a decode step streams its block matrices in the 16-row layout
  wherever the build's 16-row product is vectorised, whichever layout the one-off race
  (kernels.repack16_chosen) would pick here, for the same reason; the race has its own test
  (test_blocks.py).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["ATTNLAB_FLOAT_ROWS"] = "c"
os.environ["ATTNLAB_DECODE_LAYOUT"] = "16-row"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_builds import kernel_build, pytest_configure, pytest_generate_tests  # noqa: E402, F401

settings.register_profile(
    "attnlab",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("attnlab")

torch.set_num_threads(1)


@pytest.fixture
def seed() -> int:
    """A fresh seed (or ATTNLAB_TEST_SEED), printed and applied to torch's global generator."""
    value = int(os.environ.get("ATTNLAB_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={value} (replay with ATTNLAB_TEST_SEED={value})")
    torch.manual_seed(value)
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    """A NumPy generator from the test's fresh seed."""
    return np.random.default_rng(seed)


@pytest.fixture
def dequantized_rows(monkeypatch) -> list:
    """The row count of every slice attnlab.quant.blocks.dequantize is asked for while a test runs
    (to check that a large matrix is only ever dequantized a slice at a time)."""
    from attnlab.quant import blocks as blocks_module

    rows, real = [], blocks_module.dequantize

    def counted(part, kind):
        rows.append(part.shape[0])
        return real(part, kind)

    monkeypatch.setattr(blocks_module, "dequantize", counted)
    return rows


@pytest.fixture(scope="module")
def models() -> dict:
    """The explorer tests' three small models (explorer_models.small_models: gpt, llama, bert)."""
    from explorer_models import small_models

    return small_models()


@pytest.fixture(scope="module")
def client(models):
    """A TestClient of the explorer serving `models`, from a loopback address."""
    from explorer_models import LOCAL
    from fastapi.testclient import TestClient

    from attnlab.explorer.app import create_app

    with TestClient(create_app(models, max_tokens=512), base_url=LOCAL) as c:
        yield c
