"""vLLM's ``allowed_token_ids`` and ``bad_words`` as a constraint.

Both are pure functions of the tokens generated so far, so they are a constraint like a grammar
(step 2' of :mod:`specdec.sampling`): they mask the draft's rows and the target's alike, a tree's
nodes along each node's own path, and every verification rule stays exact for the law with the
forbidden tokens masked.

* ``allowed_token_ids``: only these ids may be sampled (end-of-sequence too only where listed).
* ``bad_words``: no word's token sequence is ever completed.  A one-token word is never allowed; a
  longer one has its last token masked right after the generated tokens end with the rest of it.
  The generated tokens alone are looked at, not the prompt (as vLLM does).  Each word is tokenized
  as written, with leading spaces dropped, and again with one leading space (the same word inside a
  text): both spellings are banned.

Where the masks together would leave nothing to sample, the narrower wishes give way in a fixed
order: the bad words first, then the allowed ids; an inner constraint (a grammar) always holds.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specdec.errors import ConfigError

#: the most bad words a request may give (each its own token sequences, looked up at every row)
MAX_BAD_WORDS = 256


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences: as written (leading spaces dropped) and after one space; distinct, sorted."""
    if len(words) > MAX_BAD_WORDS:
        raise ConfigError(f"at most {MAX_BAD_WORDS} bad words, got {len(words)}")
    out: set[tuple[int, ...]] = set()
    for word in words:
        bare = word.lstrip(" ")
        if not bare.strip():
            raise ConfigError(f"a bad word must have a character other than white space, got {word!r}")
        for text in (bare, " " + bare):
            ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out.add(ids)
    return tuple(sorted(out))


class TokenFilter:
    """Allowed ids and banned token sequences as a :class:`specdec.sampling.Constraint` over
    ``inner`` (a grammar, or None).  Holds no state of a sequence: one filter without ``inner`` may
    serve many sequences; :meth:`over` puts it over another sequence's grammar.  Its masks are made
    for each vocabulary size it is asked about (a draft's may differ from the target's); with
    ``vocab_size`` the ids are checked against it at once."""

    def __init__(
        self,
        vocab_size: int | None = None,
        *,
        allowed_ids: Sequence[int] | None = None,
        banned: Sequence[Sequence[int]] = (),
        inner: Any = None,
    ) -> None:
        if allowed_ids is not None and not allowed_ids:
            raise ConfigError("allowed_token_ids must not be empty")
        self.allowed_ids = None if allowed_ids is None else tuple(sorted({int(t) for t in allowed_ids}))
        self.banned = tuple(sorted({tuple(int(t) for t in seq) for seq in banned if len(seq)}))
        if any(t < 0 for t in (*(self.allowed_ids or ()), *(t for seq in self.banned for t in seq))):
            raise ConfigError("token ids must be >= 0")
        self.inner = inner
        self._masks: dict[int, tuple[Tensor, Tensor]] = {}  # vocabulary size -> (allowed, own) [V] bool
        after: dict[tuple[int, ...], list[int]] = {}  # a banned sequence's head -> the last tokens it bans
        for seq in self.banned:
            if len(seq) > 1:
                after.setdefault(seq[:-1], []).append(seq[-1])
        self._after = after
        self._heads = sorted({len(h) for h in after})
        if vocab_size is not None:
            bad = [t for t in self.allowed_ids or () if t >= vocab_size]
            if bad:
                raise ConfigError(f"allowed token {bad[0]} is outside the vocabulary [0, {vocab_size})")
            self._masks_for(vocab_size)

    def _masks_for(self, vocab_size: int) -> tuple[Tensor, Tensor]:  # -> (allowed, own): [V] bool each
        """The allowed ids' mask, and it less the one-token bad words, for a vocabulary of ``vocab_size``
        (ids outside it can never be sampled there, so they neither allow nor need a ban)."""
        masks = self._masks.get(vocab_size)
        if masks is not None:
            return masks
        allowed = torch.ones(vocab_size, dtype=torch.bool)  # [V]
        if self.allowed_ids is not None:
            allowed[:] = False
            allowed[[t for t in self.allowed_ids if t < vocab_size]] = True
            if not bool(allowed.any()):
                raise ConfigError(f"no allowed token id is inside the vocabulary [0, {vocab_size})")
        own = allowed.clone()  # [V]
        own[[seq[0] for seq in self.banned if len(seq) == 1 and seq[0] < vocab_size]] = False
        if not bool(own.any()):
            raise ConfigError("the bad words ban every allowed token")
        self._masks[vocab_size] = masks = (allowed, own)
        return masks

    def over(self, inner: Any) -> "TokenFilter":
        """The same filter over ``inner`` (another sequence's grammar), its masks shared."""
        twin = object.__new__(TokenFilter)
        twin.__dict__.update(self.__dict__)
        twin.inner = inner
        return twin

    def banned_after(self, generated: Sequence[int]) -> list[int]:
        """The tokens the multi-token bad words ban right after ``generated``."""
        out: list[int] = []
        n = len(generated)
        for k in self._heads:
            if k <= n:
                out += self._after.get(tuple(int(t) for t in generated[n - k:]), ())
        return out

    def allowed(self, generated: Sequence[int], vocab_size: int) -> Tensor:  # -> [V] bool
        allowed, own = self._masks_for(vocab_size)
        inner = self.inner.allowed(generated, vocab_size) if self.inner is not None else None
        banned = [t for t in self.banned_after(generated) if t < vocab_size]
        mask = own
        if banned:
            mask = mask.clone()
            mask[banned] = False
        if inner is not None:
            mask = mask & inner
        if bool(mask.any()):
            return mask
        # nothing left: the bad words give way, then the allowed ids (the inner constraint holds)
        if inner is None:
            return allowed
        mask = allowed & inner
        return mask if bool(mask.any()) else inner


def constraint_factory(
    tokenizer: Any,
    vocab_size: int,
    *,
    grammar: str | None = None,
    allowed_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] = (),
    after_thinking: tuple[int, int, bool] | None = None,
) -> Callable[[], Any] | None:
    """What makes each sequence's constraint: ``grammar`` (an llguidance grammar; one matcher per
    sequence, each following its own history) under the allowed ids (None: any; empty is an error)
    and bad words (one filter shared by every sequence); None where none is asked for.  A bad id
    or word raises :class:`ConfigError` here, a bad grammar when the first constraint is made.
    ``after_thinking`` (the ``<think>`` and ``</think>`` tokens' ids, whether the prompt opened the
    block): the grammar holds only after a reasoning model's thinking
    (:class:`specdec.grammar.AfterThinking`); the filter holds throughout."""
    token_filter = None
    if allowed_ids is not None or bad_words:
        banned = bad_word_ids(tokenizer, bad_words) if bad_words else ()
        token_filter = TokenFilter(vocab_size, allowed_ids=allowed_ids, banned=banned)
    if grammar is None:
        return None if token_filter is None else (lambda: token_filter)
    from functools import partial

    from specdec.grammar import AfterThinking, GrammarConstraint

    make = partial(GrammarConstraint, tokenizer, grammar, vocab_size)
    if after_thinking is not None:
        alone = make
        make = lambda: AfterThinking(alone(), *after_thinking)  # noqa: E731
    return make if token_filter is None else (lambda: token_filter.over(make()))
