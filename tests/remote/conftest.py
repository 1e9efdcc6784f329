"""A toy-model server process for the edge tests: the target is ToyLM(4, order=2, seed=0)."""

from __future__ import annotations

import pytest

from serverproc import ServerProcess

API_KEY = "edge-test-key"


@pytest.fixture(scope="package")
def toy_server():
    with ServerProcess.toy("--api-key", API_KEY, "--vocab", "4", "--order", "2", "--seed", "0", "--max-sessions", "256") as srv:
        yield srv
