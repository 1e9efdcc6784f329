"""Running the app under uvicorn with the limits a public server needs.

* :class:`HeaderTimeoutProtocol`: uvicorn's HTTP/1.1 protocol, plus a deadline for the request
  headers (uvicorn has none: a client sending a partial header line would hold its connection
  open forever);
* :class:`AccessLogRedactor`: the access log shows paths without session ids or query strings
  (clients put keys in ``?api_key=``; a session id is a capability to read and advance it);
* :func:`read_key_file`: several API keys, one per line.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from pathlib import Path
from typing import Any

from specdec import defaults
from specdec.errors import ConfigError

_SESSION_PATH = re.compile(r"(/v1/sessions/)[^/?\s]+")


def redact_path(path: str) -> str:
    """``/v1/sessions/<id>/verify?api_key=x`` -> ``/v1/sessions/<id>/verify`` with the id masked."""
    path = path.split("?", 1)[0]
    return _SESSION_PATH.sub(r"\1…", path)


class AccessLogRedactor(logging.Filter):
    """Filter for ``uvicorn.access``: masks session ids and drops query strings from the logged path."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_path(args[2]), *args[3:])
        return True


def install_log_redaction() -> None:
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessLogRedactor) for f in logger.filters):
        logger.addFilter(AccessLogRedactor())


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """API keys from a file: one per line, blank lines and ``#`` comments ignored."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ConfigError(f"the key file {path} has no keys")
    return keys


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a ``timeout_s`` deadline for each request's headers."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # still no complete request line + headers: drop the connection
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()
            elif self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def serve(app: Any, *, host: str, port: int, log_level: str = "warning", header_timeout_s: float = 10.0,
          limit_concurrency: int | None = None) -> None:
    """Run ``app`` with uvicorn: header deadline, redacted access log, bounded connections.

    On Ctrl-C or SIGTERM the server takes no new connections and says so on stderr (whatever the
    log level); the requests in flight get the app's ``shutdown_timeout_s`` to finish, then each
    ends with an error (``ServerContext.abort_requests``) and the server exits.
    A second signal stops it at once."""
    import uvicorn

    ctx = app.state.ctx
    grace = ctx.settings.shutdown_timeout_s

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if not first:  # a second signal, SIGTERM too (uvicorn's own: a second SIGINT only)
                self.force_exit = True
                # the tasks still running are cancelled as the loop ends: not errors worth a traceback
                logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
                return
            print(f"specdec serve: stopping: no new connections; {len(ctx.live)} request(s) in flight get {grace:g} s"
                  " to finish (signal again to stop at once)", file=sys.stderr, flush=True)
            loop = asyncio.get_running_loop()  # a signal handler runs on the loop's (main) thread
            loop.call_soon_threadsafe(loop.call_later, grace, ctx.abort_requests)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=75,
        http=header_timeout_protocol(header_timeout_s), limit_concurrency=limit_concurrency,
        # after the grace period the aborted requests' handlers need a moment to send their last event
        timeout_graceful_shutdown=grace + defaults.SERVER_SHUTDOWN_FLUSH_S,
    )
    server = Server(config)
    install_log_redaction()
    server.run()
