"""Run a specdec server as a separate process on a free loopback port (integration tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TESTS = Path(__file__).resolve().parent
#: the bundled SmolLM2 draft model: small enough to serve as a fast target in the OpenAI tests
DRAFT_MODEL = "smollm2-135m-draft"
#: the key of the OpenAI tests' server (tests/server/conftest.py)
OPENAI_KEY = "openai-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The server could not listen: its port was taken between :func:`free_port` and its start."""


class ServerProcess:
    """``argv`` is the command after ``python``; ``{port}`` in it is replaced by the port.  Without
    ``port`` a free one is picked, and picked again if another process takes it before the server
    listens (a free port is only free when asked: an outgoing connection of any process may be
    given it next, and a server takes seconds to start)."""

    def __init__(self, argv: list[str], *, port: int | None = None, ready_timeout: float = 120.0,
                 capture_stdout: bool = False) -> None:
        self.capture_stdout = capture_stdout
        self._template = argv
        self._chosen = port is not None
        self._place(port or free_port())
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def _place(self, port: int) -> None:
        self.port = port
        self.argv = [a.replace("{port}", str(port)) for a in self._template]

    @classmethod
    def toy(cls, *extra: str, **kw) -> "ServerProcess":
        return cls([str(TESTS / "toy_server.py"), "--port", "{port}", *extra], **kw)

    @classmethod
    def cli(cls, *extra: str, **kw) -> "ServerProcess":
        return cls(["-m", "specdec.cli", "serve", "--port", "{port}", *extra], **kw)

    @classmethod
    def draft_model(cls, *extra: str, **kw) -> "ServerProcess":
        """``specdec serve`` of the bundled draft model as target, drafting for itself (float32, γ 4)."""
        return cls.cli("--target", DRAFT_MODEL, "--draft", DRAFT_MODEL, "--dtype", "float32", "--gamma", "4", *extra, **kw)

    def openai(self, key: str = "none"):  # noqa: ANN201 - an openai.OpenAI client (imported here only)
        """An ``openai`` client of this server (no retries: a test sees each answer as it is)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait: bool = True) -> "ServerProcess":
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        for attempt in range(3):
            self.proc = subprocess.Popen([sys.executable, *self.argv], env=env,
                                         stdout=subprocess.PIPE if self.capture_stdout else subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True)
            if not wait:
                return self
            try:
                self.wait_ready()
                return self
            except PortTaken:
                self.stop()
                if self._chosen or attempt == 2:
                    raise
                self._place(free_port())
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read()[-2000:]
                kind = PortTaken if "address already in use" in err.lower() else RuntimeError
                raise kind(f"server exited with {self.proc.returncode}: {err}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready")

    def kill(self) -> None:
        """SIGKILL: the server loses every session, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for stream in (self.proc.stderr, self.proc.stdout) if self.proc is not None else ():
            if stream is not None:
                stream.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
