"""Server processes shared by the server tests: a toy model (vocab 6, order 2, max γ 8, context 512), and
the bundled draft model behind `specdec serve` for the OpenAI endpoints (one per test module); and a
test's OpenMP thread count."""

from __future__ import annotations

import httpx
import pytest
import torch

from serverproc import OPENAI_KEY, ServerProcess

API_KEY = "test-key-123"
VOCAB = 6
MAX_GAMMA = 8
MAX_LENGTH = 512


@pytest.fixture(scope="package")
def toy_server():
    srv = ServerProcess.toy("--api-key", API_KEY, "--vocab", str(VOCAB), "--order", "2", "--seed", "3",
                            "--max-gamma", str(MAX_GAMMA), "--max-length", str(MAX_LENGTH), "--max-body-bytes", "65536")
    with srv:
        yield srv


@pytest.fixture
def api(toy_server):
    with httpx.Client(base_url=toy_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def server():
    """The bundled draft model behind ``specdec serve``, with a key (one process per test module)."""
    with ServerProcess.draft_model("--api-key", OPENAI_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """An ``openai`` client of :func:`server`."""
    with server.openai(OPENAI_KEY) as c:
        yield c


@pytest.fixture
def two_threads():
    """Two OpenMP threads for the test (the count a request thread's passes must not inherit)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
