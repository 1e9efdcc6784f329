"""The test servers' own start: a port taken between picking it and listening on it is picked again."""

from __future__ import annotations

import socket

import httpx
import pytest

import serverproc
from serverproc import PortTaken, ServerProcess


def test_a_taken_port_is_picked_again(monkeypatch):
    """The first port handed out is already listened on (as when another process took it in the
    meantime): the server fails to listen, and the next start takes another port and comes up.
    A port the caller chose is not changed: the failure is raised."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = iter([taken, serverproc.free_port()])
        monkeypatch.setattr(serverproc, "free_port", lambda: next(ports))
        with ServerProcess.toy() as srv:
            assert srv.port != taken and httpx.get(srv.url + "/health", timeout=5).status_code == 200
        with pytest.raises(PortTaken):
            ServerProcess.toy(port=taken).start()
