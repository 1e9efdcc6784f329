"""HTTP server: the edge-cloud verify API and OpenAI-compatible completions (needs the ``serve`` extra)."""

from typing import TYPE_CHECKING, Any

from specdec.server.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app(*args: Any, **kwargs: Any) -> "FastAPI":  # see specdec.server.app.create_app
    """Build the FastAPI app (imported lazily so ``specdec`` works without the ``serve`` extra)."""
    from specdec.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["ServerSettings", "create_app"]
