"""Prefix caching: the keys and values of recent prompts, copied into a new sequence's cache
instead of being computed again when its prompt starts the same way.

Chat prompts share their template and system message, a multi-turn chat re-sends its whole
history each turn, and many clients send the same instruction: a server prefills the same tokens
over and over.  Here a prefill of an empty cache copies the longest stored prefix of its prompt
and runs only the rest; afterwards it stores the part of its prompt that it shares with a prompt
seen recently (the whole of it, for a repeated prompt or the next turn of a chat), bounded by
bytes, least recently used dropped first.  Storing only what was seen twice keeps prompts that
never recur (most of a load of distinct requests) from churning the cache: measured with the load
test, whose prompts are all distinct, storing every prompt kept the cache full of them and the
server's resident memory rising ~60 MiB/min, for no reuse.

A finished sequence, reply included, is kept too (:meth:`PrefixCache.keep`, through
``TargetSession.close``): a chat client's next turn re-sends it inside its prompt.  Most finished
sequences never come back, so kept ones are *unproven* until a prefill copies at least half of
one (a next turn does; a prompt that only shares the template and system message with it does
not), and unproven entries may fill at most :data:`UNPROVEN_SHARE` of the budget, least recently
used dropped first: a flood of one-shot requests churns that share and never evicts what was
reused.  A kept sequence that extends a proven entry (the next turn of a conversation that came
back) is proven.

**Exact, not approximate**, and only offered where that holds: the native target is
batch-invariant (``NativeCausalLM(batch_invariant=True)``), so the key/value rows of position
``i`` depend on tokens ``0..i`` alone, not on how many rows the pass that computed them held or
which other sequences shared it.  Copied rows are therefore bitwise the rows a fresh prefill
would write, and every later logit is unchanged (tested on a toy model and on the real weights,
against prefilling the whole prompt).  At least the prompt's last token always runs, so the
caller still gets its logits.  Models that are not batch-invariant (the Hugging Face backend,
``--fast-attention``, a float draft) get no prefix cache.  The draft model gets its own
(:func:`draft_prefix_cache`) where it is batch-invariant (the int8 draft on the compiled kernels).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from torch import Tensor

#: prompts shorter than this are not stored (and the index is keyed by their first tokens)
MIN_TOKENS = 16
#: prompts are remembered as chained hashes of blocks of this many tokens (what was seen before is
#: worth storing); the last partial block of a prompt is not remembered
SEEN_BLOCK = 16
#: blocks remembered at most (a million tokens' worth)
SEEN_BLOCKS = 1 << 16
#: at most this share of the budget holds kept sequences no prefill has copied from yet
UNPROVEN_SHARE = 0.5


def block_hashes(tokens: Tensor) -> list[int]:  # tokens: [n] int64
    """Chained hashes of the whole :data:`SEEN_BLOCK`-token blocks of ``tokens``: block ``i``'s hash
    depends on every token before its end, so equal hashes mean (barring collisions, which only
    change what gets stored, never what a prefill computes) equal prefixes."""
    ids = tokens.tolist()
    out, h = [], 0
    for i in range(0, len(ids) - SEEN_BLOCK + 1, SEEN_BLOCK):
        h = hash((h, *ids[i : i + SEEN_BLOCK]))
        out.append(h)
    return out


@dataclass(eq=False)
class _Entry:
    tokens: Tensor  # [n] int64
    k: Tensor  # [Lyr, Hkv, n, d]
    v: Tensor  # [Lyr, Hkv, n, d]
    #: stored because a prompt shared it, or mostly copied since it was kept (else: a kept sequence
    #: that may never come back, dropped first)
    proven: bool = True

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()


def common_prefix(a: Tensor, b: Tensor) -> int:  # a: [n], b: [m] int64
    """Length of the longest common prefix of two token sequences."""
    m = min(a.numel(), b.numel())
    if m == 0:
        return 0
    diff = (a[:m] != b[:m]).nonzero()
    return m if diff.numel() == 0 else int(diff[0, 0])


def supports_prefix_cache(model: Any) -> bool:
    """True for models whose cached key/value rows do not depend on the pass that wrote them."""
    return bool(getattr(model, "batch_invariant", False)) and hasattr(model, "new_cache")


class PrefixCache:
    """Keys/values of stored prompts, at most ``max_bytes`` of them (thread-safe)."""

    def __init__(self, max_bytes: int, *, min_tokens: int = MIN_TOKENS, on_reuse: Callable[[int], Any] | None = None) -> None:
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError(f"bad prefix cache limits: {max_bytes} bytes, {min_tokens} tokens")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id -> entry, least recently used first
        self._index: dict[tuple[int, ...], set[int]] = {}  # first min_tokens tokens -> entry ids
        self._lock = threading.Lock()
        self._next_id = 0
        self.bytes = 0
        self.unproven_bytes = 0
        #: prompt tokens whose keys/values were copied instead of computed, and prefills that used the cache
        self.reused_tokens = 0
        self.hits = 0
        self.lookups = 0
        self._on_reuse = on_reuse
        #: blocks of prompts seen lately (chained hashes, least recently seen first): what a new
        #: prompt shares with them is what gets stored
        self._seen: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _key(self, tokens: Tensor) -> tuple[int, ...]:
        return tuple(tokens[: self.min_tokens].tolist())

    def _best(self, tokens: Tensor) -> tuple[int | None, int]:
        """(entry id, common prefix length) of the stored prompt sharing the most leading tokens."""
        best, best_n = None, 0
        for eid in self._index.get(self._key(tokens), ()):
            n = common_prefix(self._entries[eid].tokens, tokens)
            if n > best_n:
                best, best_n = eid, n
        return best, best_n

    def restore(self, tokens: Tensor, cache: Any) -> int:  # tokens: [n] int64; cache empty
        """Copy the longest stored prefix of ``tokens`` (never all of them) into the empty ``cache``;
        returns how many positions it now holds."""
        if tokens.numel() <= self.min_tokens:
            return 0
        with self._lock:
            self.lookups += 1
            eid, n = self._best(tokens)
            n = min(n, tokens.numel() - 1)  # the last token runs: the caller wants its logits
            if eid is None or n < self.min_tokens:
                return 0
            entry = self._entries[eid]
            self._entries.move_to_end(eid)
            if not entry.proven and 2 * n >= entry.tokens.numel():  # a next turn, not a shared system prompt
                entry.proven = True
                self.unproven_bytes -= entry.nbytes
            k, v = entry.k[:, :, :n], entry.v[:, :, :n]
            self.hits += 1
            self.reused_tokens += n
        if self._on_reuse is not None:
            self._on_reuse(n)
        start = cache.reserve(n)  # grows the buffers if needed; start == 0
        cache.k[:, :, start : start + n] = k
        cache.v[:, :, start : start + n] = v
        cache.restored = n
        return n

    def _shared_with_seen(self, tokens: Tensor) -> int:  # under the lock
        """How many leading tokens of ``tokens`` (whole blocks of :data:`SEEN_BLOCK`) a recently
        seen prompt shares; then remembers the blocks of ``tokens`` as seen."""
        hashes = block_hashes(tokens)
        shared = 0
        while shared < len(hashes) and hashes[shared] in self._seen:
            shared += 1
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > SEEN_BLOCKS:
            self._seen.popitem(last=False)
        return shared * SEEN_BLOCK

    def store(self, tokens: Tensor, cache: Any) -> None:  # tokens: [n] int64, the cache's first n positions
        """Remember the keys/values of the part of ``tokens`` (the cache's first positions) that a
        recently seen prompt shares, unless a stored prompt already covers it; a stored prompt it
        extends is replaced."""
        self._put(tokens, cache, whole=False)

    def keep(self, tokens: Tensor, cache: Any) -> None:  # tokens: [n] int64, the cache's first n positions
        """Remember all of ``tokens`` now, seen before or not: a finished sequence (prompt + reply)
        whose next turn may start with it (a chat).  Replaces the stored sequence it extends, e.g.
        its own prompt, and is proven if that one was; else unproven until a prefill copies from it."""
        self._put(tokens, cache, whole=True)

    def _put(self, tokens: Tensor, cache: Any, *, whole: bool) -> None:
        if tokens.numel() < self.min_tokens:
            return
        per_position = cache.bytes_per_position
        with self._lock:
            shared = self._shared_with_seen(tokens)  # remembers its blocks as seen either way
            n = tokens.numel() if whole else shared
            if n < self.min_tokens or n * per_position > self.max_bytes:
                return
            tokens = tokens[:n]
            eid, common = self._best(tokens)
            if eid is not None and common == n:  # already stored (as itself or inside a longer prompt)
                self._entries.move_to_end(eid)
                return
            extended = eid if eid is not None and common == self._entries[eid].tokens.numel() else None
        entry = _Entry(tokens.clone(), cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone())  # outside the lock
        with self._lock:
            if self._best(tokens)[1] == n:  # another thread stored the same prompt meanwhile
                return
            if whole:
                entry.proven = extended is not None and extended in self._entries and self._entries[extended].proven
                if not entry.proven and entry.nbytes > self.max_bytes * UNPROVEN_SHARE:
                    return
            if extended is not None and extended in self._entries:  # replaced only now: no window without it
                self._drop(extended)
            eid = self._next_id
            self._next_id += 1
            self._entries[eid] = entry
            self._index.setdefault(self._key(tokens), set()).add(eid)
            self.bytes += entry.nbytes
            if not entry.proven:
                self.unproven_bytes += entry.nbytes
            while self.unproven_bytes > self.max_bytes * UNPROVEN_SHARE:
                self._drop(next(i for i, e in self._entries.items() if not e.proven))
            while self.bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, eid: int) -> None:  # under the lock
        entry = self._entries.pop(eid)
        key = self._key(entry.tokens)
        ids = self._index.get(key)
        if ids is not None:
            ids.discard(eid)
            if not ids:
                del self._index[key]
        self.bytes -= entry.nbytes
        if not entry.proven:
            self.unproven_bytes -= entry.nbytes


def draft_prefix_cache(target: Any, draft: Any, target_bytes: int) -> PrefixCache | None:
    """The draft model's own prefix cache, next to a target's of ``target_bytes`` (None where
    either model is not batch-invariant, or the target has none): room for as many positions as
    the target's holds (a draft position is far smaller: 4 KiB against 45 KiB for SmolLM2's).
    The draft's rows only shape proposals, never the output's law; on a batch-invariant draft
    copied rows are the bits a prefill writes, so proposals, and every output, stay the same."""
    if target_bytes <= 0 or not (supports_prefix_cache(target) and supports_prefix_cache(draft)):
        return None
    return PrefixCache(target_bytes * draft.new_cache(1).bytes_per_position // target.new_cache(1).bytes_per_position)


def prefill(run: Any, prefix_cache: PrefixCache | None, tokens: Tensor, cache: Any, last_only: bool) -> Tensor:
    """``run(tokens, cache, last_only=...)`` for a forward pass, with the prefix cache in front of
    prefills: an empty cache and ``last_only`` (the only logits a prefill wants) reuse the longest
    stored prefix, run the rest, and store the prompt for later ones."""
    if prefix_cache is None or not last_only or cache.length != 0 or tokens.numel() < prefix_cache.min_tokens:
        return run(tokens, cache, last_only=last_only)
    tokens = tokens.reshape(-1)
    reused = prefix_cache.restore(tokens, cache)
    try:
        logits = run(tokens[reused:], cache, last_only=True)
    except BaseException:
        cache.truncate(0)
        cache.restored = 0  # nothing copied is held any more
        raise
    prefix_cache.store(tokens, cache)
    return logits


class PrefixCached:
    """A batch-invariant model whose prefills of an empty cache go through a :class:`PrefixCache`
    (:func:`prefill`); every other pass and attribute is the wrapped model's.  For one process
    that decodes prompt after prompt, e.g. ``specdec generate --interactive``, whose every turn
    re-sends the conversation so far.  A finished sequence's rows, reply included, are kept
    (:meth:`keep_sequence`, called by ``TargetSession.close``): the next turn's prompt starts with
    them.  A reply's rows were written by decoding steps and verification passes rather than a
    prefill; on a batch-invariant model they are the same bits (tested on the real weights)."""

    def __init__(self, model: Any, prefix_cache: PrefixCache) -> None:
        if not supports_prefix_cache(model):
            raise ValueError("prefix caching needs a batch-invariant model (its cached rows must not depend on the pass)")
        self.inner = model
        self.prefix_cache = prefix_cache

    def forward(self, tokens: Tensor, cache: Any, *, last_only: bool = False, **kw: Any) -> Tensor:
        return prefill(partial(self.inner.forward, **kw), self.prefix_cache, tokens, cache, last_only)

    def keep_sequence(self, tokens: Tensor, cache: Any) -> None:  # tokens: [n] int64, the cache's first n positions
        self.prefix_cache.keep(tokens, cache)

    def __getattr__(self, name: str) -> Any:  # every other pass and attribute
        return getattr(self.inner, name)


__all__ = ["MIN_TOKENS", "PrefixCache", "PrefixCached", "common_prefix", "draft_prefix_cache", "prefill", "supports_prefix_cache"]
