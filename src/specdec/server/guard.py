"""ASGI middleware that runs before any body is read: authentication, Host/Origin checks, owners.

* With keys, ``Authorization: Bearer <key>`` is checked from the headers alone, so a client
  without a valid key is answered 401 before a byte of its body is read or buffered.  The key's
  digest becomes the request's *owner*: sessions belong to the key that created them.
* Without a key (loopback only) a web page could still reach the server through DNS rebinding
  (a hostile name resolving to 127.0.0.1): the ``Host`` header must then name a loopback address
  (or one of the configured host names) and a browser's ``Origin``, when sent, too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from specdec.server.command import is_loopback
from specdec.server.errors import error_body

#: paths anyone may read (no key): health checks, the version and the API description
PUBLIC_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
#: the scope key holding the caller's owner id
OWNER = "specdec.owner"


def owner_of(key: str) -> str:
    """A stable, non-secret id for ``key`` (what sessions record as their owner)."""
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"specdec-owner").hexdigest()


def host_name(value: str) -> str:
    """``"[::1]:8000"`` -> ``"::1"``, ``"localhost:80"`` -> ``"localhost"``."""
    value = value.strip()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


async def _send_error(send: Callable[..., Awaitable[None]], status: int, message: str, kind: str,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Authenticate (or check Host/Origin when keyless) from the headers, then call the app."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, keys: tuple[str, ...], allowed_hosts: tuple[str, ...] = (),
                 on_error: Callable[[int], None] | None = None, open_metrics: bool = True) -> None:
        self.app = app
        #: /metrics readable without a key (Prometheus scrapers), unless the operator asks otherwise
        self.public = PUBLIC_PATHS | ({"/metrics"} if open_metrics else set())
        self.keys = [(k.encode(), owner_of(k)) for k in keys]
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.on_error = on_error or (lambda status: None)

    def _host_ok(self, name: str) -> bool:
        name = name.lower()
        return bool(name) and (is_loopback(name) or name in self.allowed_hosts)

    def _owner(self, headers: dict[bytes, bytes]) -> str | None:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for key, owner in self.keys:  # compare with every key: no early exit to time
            if hmac.compare_digest(given, key):
                found = owner
        return found

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        path = scope.get("path", "")
        if not self.keys:
            if not self._host_ok(host_name(headers.get(b"host", b"").decode("latin-1"))):
                self.on_error(403)
                await _send_error(send, 403, "this server has no API key and answers only to a loopback Host header"
                                  " (DNS rebinding guard); connect to 127.0.0.1 / localhost or set a key", "permission_error")
                return
            origin = headers.get(b"origin")
            if origin is not None and not self._host_ok(urlsplit(origin.decode("latin-1")).hostname or ""):
                self.on_error(403)
                await _send_error(send, 403, "cross-origin request refused: this keyless server accepts only loopback"
                                  " Origins", "permission_error")
                return
            scope[OWNER] = ""
        elif path not in self.public:
            owner = self._owner(headers)
            if owner is None:
                self.on_error(401)
                await _send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  "authentication_error", {"WWW-Authenticate": "Bearer"})
                return
            scope[OWNER] = owner
        await self.app(scope, receive, send)
