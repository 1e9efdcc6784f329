"""The one exception the HTTP layer turns into a 4xx/5xx JSON error body."""

from __future__ import annotations

from specdec import defaults


class ApiError(Exception):
    """An HTTP error with a one-line message that says what is wrong (and what to do)."""

    def __init__(self, status: int, message: str, *, kind: str | None = None, retry_after: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _default_kind(status)
        self.param = param  # the request field at fault, where one is
        if retry_after is None and status in (429, 503):
            retry_after = defaults.SERVER_RETRY_AFTER_S
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        headers: dict[str, str] = {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return headers or None


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    """The error object every endpoint answers with, in OpenAI's shape: ``param`` names the request
    field at fault where one is (else ``null``), ``code`` is the HTTP status (as vLLM sends it)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _default_kind(status: int) -> str:
    if status in (401, 403):
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 409:
        return "conflict_error"
    if status == 413:
        return "request_too_large"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "overloaded_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"
