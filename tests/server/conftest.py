"""A toy-model server process shared by the server tests (vocab 6, order 2, max γ 8, context 512)."""

from __future__ import annotations

import httpx
import pytest

from serverproc import ServerProcess

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
