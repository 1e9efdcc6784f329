"""The seam every backend implements: a causal LM that scores new tokens against its own cache."""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
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


def layer_count(model: object) -> int | None:
    """How many decoder layers ``model`` has (the native backend's ``cfg.n_layers``, the hf
    backend's ``n_layers``), or None where it does not say."""
    n = getattr(model, "n_layers", None)
    return n if n is not None else getattr(getattr(model, "cfg", None), "n_layers", None)


def full_vocab(logits: Tensor, ids: Tensor, vocab: int) -> Tensor:  # [m, Vd] -> [m, V] float32
    """Logits over a draft vocabulary (target ids ``ids``, sorted) as rows over the target's whole
    vocabulary, ``-inf`` elsewhere: the draft gives zero probability to every other token (lossless:
    the rules only need the q the token was drawn from, which this is).  A draft model over a reduced
    vocabulary and every draft head use it."""
    out = torch.full((logits.shape[0], vocab), -math.inf)
    return out.index_copy_(1, ids, logits.float())


def full_probs(probs: Tensor, ids: Tensor, vocab: int) -> Tensor:  # [m, Vd] -> [m, V]
    """Probabilities over a draft vocabulary (target ids ``ids``) as rows over the target's whole
    vocabulary, zero elsewhere: the q a token drawn from the compact row was drawn from."""
    out = torch.zeros((probs.shape[0], vocab), dtype=probs.dtype)
    return out.index_copy_(1, ids, probs)
