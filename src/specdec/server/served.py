"""What the server's model wrappers share: caches sized for a session and grown on demand."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable

from specdec.errors import ConfigError
from specdec.server.compute import one_openmp_thread
from specdec.server.prefix_cache import prefill, supports_prefix_cache


def compact_kw(compact: bool) -> dict[str, bool]:
    """Keyword arguments asking a model pass for compact draft rows: none unless asked, so models
    without a reduced vocabulary (which never are asked) need not take the argument."""
    return {"compact": True} if compact else {}


class ServedModel:
    """A :class:`~specdec.models.base.LanguageModel` wrapped for serving; subclasses decide how a
    forward pass runs (``_forward``: under a lock, or through the batching scheduler).  Caches
    start at ``initial_length`` positions and grow on demand, for models whose ``new_cache``
    supports it.  With a ``prefix_cache`` (batch-invariant models only, see
    :mod:`specdec.server.prefix_cache`), prefills reuse the keys/values of earlier prompts and of
    finished requests' replies."""

    def __init__(self, model: Any, *, initial_length: int | None = None, prefix_cache: Any | None = None) -> None:
        if prefix_cache is not None and not supports_prefix_cache(model):
            raise ValueError("prefix caching needs a batch-invariant model (its cached rows must not depend on the pass)")
        self.prefix_cache = prefix_cache
        self.inner = model
        self.vocab_size = model.vocab_size
        self.max_length = model.max_length
        self.initial_length = initial_length
        try:
            self._grows = "initial_length" in inspect.signature(model.new_cache).parameters
        except (TypeError, ValueError):
            self._grows = False

    def new_cache(self, max_length: int | None = None, *, initial_length: int | None = None) -> Any:
        """A cache of the wrapped model, starting at ``initial_length`` positions (the caller's, else
        the wrapper's) where the model's caches grow; else sized for ``max_length`` at once."""
        one_openmp_thread()  # a request thread: its own operations run without an OpenMP team
        start = initial_length if initial_length is not None else self.initial_length
        if self._grows and start is not None:
            return self.inner.new_cache(max_length, initial_length=start)
        return self.inner.new_cache(max_length)

    @property
    def vocab_ids(self) -> Any:
        """The wrapped draft model's reduced vocabulary (its target ids), or None: passes give its
        rows as they are when asked (``compact=True``), whole-vocabulary rows otherwise."""
        return getattr(self.inner, "vocab_ids", None)

    def forward(self, tokens: Any, cache: Any, *, last_only: bool = False, compact: bool = False) -> Any:
        """tokens: [n] -> [n|1, V] ([n|1, Vd] with ``compact``, for a model with :attr:`vocab_ids`)."""
        one_openmp_thread()
        return prefill(partial(self._forward, compact=compact), self.prefix_cache, tokens, cache, last_only)

    def keep_sequence(self, tokens: Any, cache: Any) -> None:  # tokens: [n] int64, the cache's first n positions
        """A finished request's sequence, reply included (``TargetSession.close``), kept in the prefix
        cache for a chat client's next turn, which re-sends it (no-op without a prefix cache)."""
        if self.prefix_cache is not None:
            one_openmp_thread()  # any server thread may end a sequence (a DELETE's, the TTL sweeper's)
            self.prefix_cache.keep(tokens, cache)

    def _forward(self, tokens: Any, cache: Any, *, last_only: bool = False, compact: bool = False) -> Any:
        raise NotImplementedError

    def _alone(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, a pass of the wrapped model that ``_forward`` does not run, with no
        other pass of that model running (a model object runs one forward at a time)."""
        raise NotImplementedError

    def _features_fn(self) -> Callable[..., Any]:
        """The wrapped model's ``forward_features`` (a target-aware drafter's verification pass), or a
        clear error where its backend exposes no hidden states."""
        fn = getattr(self.inner, "forward_features", None)
        if fn is None:
            raise ConfigError("this drafter reads the target's hidden states, which this target backend does not expose")
        return fn

    @property
    def forward_tree(self) -> Callable[..., Any]:
        """The wrapped model's tree pass, run alone; absent (``hasattr`` False) where the wrapped model
        has none (the hf backend, a self-speculative view), so drafters keep to chains there and a
        verifier asked for a tree says what is missing, as they do without the server."""
        fn = getattr(self.inner, "forward_tree", None)
        if fn is None:
            raise AttributeError("forward_tree")

        def forward_tree(tokens: Any, parents: Any, cache: Any, *, prefix: int | None = None,
                         compact: bool = False) -> Any:  # -> [n, V] ([n, Vd] with compact)
            one_openmp_thread()
            return self._alone(fn, tokens, parents, cache, prefix=prefix, **compact_kw(compact))

        return forward_tree

    def __getattr__(self, name: str) -> Any:  # anything else (dtype, n_params, ...) passes through
        return getattr(self.inner, name)
