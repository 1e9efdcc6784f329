"""The seam every backend implements: a causal LM that scores new tokens against its own cache."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class Cache(Protocol):
    """Per-sequence state of a model.  ``truncate`` is O(1) for every backend that decodes fast."""

    length: int

    def truncate(self, length: int) -> None: ...

    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model with an explicit, per-sequence cache.

    ``forward(tokens, cache)`` appends ``tokens`` at positions ``[cache.length, cache.length + n)``
    and returns the next-token logits of every new position (``[n, V]``, float32) or, with
    ``last_only=True``, of the last one only (``[1, V]``; prefill of long prompts).
    """

    vocab_size: int
    max_length: int  # context window in tokens

    def new_cache(self, max_length: int | None = None) -> Cache: ...

    def forward(self, tokens: Tensor, cache: Cache, *, last_only: bool = False) -> Tensor: ...
