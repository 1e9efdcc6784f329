"""Shared fixtures.  Statistical helpers live in ``tests/stats.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# every test runs the calibration pass and builds the int8 layers it asks for: a model's ranges or
# layers kept on disk by an earlier load would answer instead (tests/models/test_calibration_cache.py
# and test_quantised_cache.py turn the caches on for themselves)
os.environ["SPECDEC_CALIBRATION_CACHE"] = "off"
os.environ["SPECDEC_QUANTISED_CACHE"] = "off"

# one thread per xdist worker: OpenMP threads oversubscribing the cores slow everything down badly
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


def pytest_report_header(config):
    # whether the compiled kernels built: where they did not, every test of them skips, and the run's
    # header (and the warning above it) is where that shows
    from specdec.models import kernels

    if kernels.load():
        return f"specdec kernels: {kernels.library()}"
    return ("specdec kernels: NOT BUILT (no C++ compiler, or the build failed): the tests of them skip, and "
            "test_kernel_toolchain.py fails if a one-op torch extension builds here")


def pytest_collection_modifyitems(config, items):
    # an empty run is a failure of the set-up, never a pass
    if not items:
        raise pytest.UsageError("no tests collected")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M target and its distilled draft (float32, native backend).

    The README's test command prepares them (``specdec setup``); a missing model is an error,
    not a skip, so CI cannot pass without exercising the real-model tests.
    """
    from specdec.models.registry import load

    target = load("smollm2-135m")
    draft = load("smollm2-135m-draft")
    return target, draft


@pytest.fixture(scope="session")
def int8_target():
    """The real SmolLM2-135M target quantised to int8 (what ``--dtype auto`` loads on x86),
    batch-invariant; loaded once per session (calibration takes a while on two cores)."""
    from specdec.models.linear import w8a8_available
    from specdec.models.registry import load

    if not w8a8_available():
        pytest.skip("this torch build has no fbgemm int8 engine")
    return load("smollm2-135m", quant="int8")


@pytest.fixture(scope="session")
def q4_target():
    """The real SmolLM2-135M target with its GGUF's 4-bit blocks as shipped (``--dtype q4``),
    batch-invariant; loaded once per session."""
    from specdec.models.linear import w8a8_available
    from specdec.models.registry import load

    if not w8a8_available():
        pytest.skip("the 4-bit target's LM head needs torch's fbgemm int8 engine")
    return load("smollm2-135m", quant="q4")


@pytest.fixture(scope="module")
def single_thread():
    """Tests that start single-threaded servers run their local references single-threaded too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
