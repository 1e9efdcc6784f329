"""What the server's model wrappers share: caches sized for a session and grown on demand."""

from __future__ import annotations

import inspect
from typing import Any


class ServedModel:
    """A :class:`~specdec.models.base.LanguageModel` wrapped for serving; subclasses decide how a
    forward pass runs (under a lock, or through the batching scheduler).  Caches start at
    ``initial_length`` positions and grow on demand, for models whose ``new_cache`` supports it."""

    def __init__(self, model: Any, *, initial_length: int | None = None) -> None:
        self.inner = model
        self.vocab_size = model.vocab_size
        self.max_length = model.max_length
        self.initial_length = initial_length
        try:
            self._grows = "initial_length" in inspect.signature(model.new_cache).parameters
        except (TypeError, ValueError):
            self._grows = False

    def new_cache(self, max_length: int | None = None) -> Any:
        if self._grows and self.initial_length is not None:
            return self.inner.new_cache(max_length, initial_length=self.initial_length)
        return self.inner.new_cache(max_length)

    def __getattr__(self, name: str) -> Any:  # anything else (dtype, n_params, ...) passes through
        return getattr(self.inner, name)
