"""The target side of speculative decoding: one sequence's cache, context and verification.

A :class:`TargetSession` owns everything the verifier needs for one sequence (KV cache,
committed tokens, penalty state, the rule's randomness) and exposes one operation,
:meth:`TargetSession.verify`: score ``[pending] + draft`` in one forward pass, apply the rule,
roll the cache back to what was kept.  The local decoder drives one directly; the HTTP server
keeps one per edge session; the edge drives a remote one through the same :class:`Verifier`
protocol, so the decoding loop is written once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft
from specdec.errors import ConfigError, ContextLengthError
from specdec.models.base import LanguageModel
from specdec.sampling import (
    PenaltyState,
    SamplingConfig,
    penalised_logits,
    process_logits,
    target_logprobs,
    top_logprobs,
)
from specdec.verify import Rule, Verdict


@dataclass(frozen=True)
class Outcome:
    """A verdict plus where the time went (seconds)."""

    verdict: Verdict
    target_s: float  # the target forward pass (for a remote target: the whole round trip)
    verify_s: float  # processing + rule + bookkeeping
    metrics: dict = field(default_factory=dict)  # extra figures (bytes, rtt, ...) from remote verifiers


class Verifier(Protocol):
    """What the decoding loop needs from the target side."""

    @property
    def context(self) -> Tensor:
        """[L] int64: prompt + every committed token."""
        ...

    @property
    def max_length(self) -> int: ...

    def verify(self, draft: Draft) -> Outcome: ...

    def close(self) -> None: ...


def check_rule(rule: Rule, cfg: SamplingConfig) -> None:
    if rule.greedy_only and not cfg.greedy:
        raise ConfigError(
            f"method {rule.name!r} needs temperature 0; at temperature {cfg.temperature} use token, block or coupled"
        )


class TargetSession:
    """Target model state for one sequence; implements :class:`Verifier`."""

    def __init__(
        self,
        model: LanguageModel,
        prompt: Tensor | list[int],
        cfg: SamplingConfig,
        rule: Rule,
        *,
        seed: int,
        max_new_tokens: int | None = None,
        logprobs: int | None = None,
    ) -> None:
        check_rule(rule, cfg)
        prompt_t = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        n = prompt_t.numel()
        if n == 0:
            raise ConfigError("the prompt is empty")
        if n >= model.max_length:
            raise ContextLengthError(f"the prompt has {n} tokens but the model's context is {model.max_length}")
        self.model = model
        self.cfg = cfg
        self.rule = rule
        self.seed = seed
        #: when set, every emitted token's log-probability under the target's processed law and the
        #: ``logprobs`` most likely alternatives are recorded in :attr:`emitted_logprobs`
        self.logprobs = logprobs
        self.emitted_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.generator = torch.Generator().manual_seed(seed)
        budget = max_new_tokens if max_new_tokens is not None else cfg.max_new_tokens
        capacity = min(model.max_length, n + budget + defaults.MAX_GAMMA + 1)
        self._ctx = torch.empty(capacity, dtype=torch.long)  # prompt + committed tokens
        self._ctx[:n] = prompt_t
        self._n = n
        self.penalties = PenaltyState.start(prompt_t, model.vocab_size) if cfg.needs_state else None
        self.cache = model.new_cache(capacity)
        started = time.perf_counter()
        if n > 1:
            model.forward(prompt_t[:-1], self.cache, last_only=True)
        self.prefill_s = time.perf_counter() - started

    @property
    def context(self) -> Tensor:
        return self._ctx[: self._n]

    @property
    def max_length(self) -> int:
        return self._ctx.numel()

    @property
    def kv_peak_bytes(self) -> int:
        used = getattr(self.cache, "used_bytes", None)
        return int(used()) if used is not None else int(self.cache.nbytes)

    def verify(self, draft: Draft, *, max_tokens: int | None = None) -> Outcome:
        """One round: score ``[last committed] + draft`` (γ+1 positions), keep a prefix, add one token.

        ``max_tokens`` (>= 1) commits at most that many of the verdict's tokens (a length limit: the
        kept ones are exactly what an unlimited round gives, cut where plain decoding would stop).
        """
        gamma = draft.tokens.numel()
        if self._n + gamma + 1 > self._ctx.numel():
            raise ContextLengthError(f"the sequence would exceed its context of {self._ctx.numel()} tokens")
        t0 = time.perf_counter()
        base = self.cache.length
        feed = torch.cat([self._ctx[self._n - 1 : self._n], draft.tokens])  # [γ+1]
        logits = draft.reuse.forward(self.model, feed, self.cache) if draft.reuse is not None else None
        if logits is None:
            logits = self.model.forward(feed, self.cache)  # [γ+1, V]
        t1 = time.perf_counter()
        cfg, rule = self.cfg, self.rule
        if rule.needs_target_probs:
            scores = process_logits(logits, cfg, self.penalties, draft.tokens)  # [γ+1, V]
        else:
            scores = penalised_logits(logits, cfg, self.penalties, draft.tokens)
        extra: dict[str, object] = {}
        if rule.draft_sampling == "gumbel":
            extra = {"seed": self.seed, "positions": torch.arange(self._n, self._n + gamma + 1)}
        verdict: Verdict = rule.fn(draft.tokens, draft.probs, scores, generator=self.generator, **extra)
        if max_tokens is not None and verdict.tokens.numel() > max_tokens:
            verdict = replace(verdict, num_accepted=max_tokens - 1, tokens=verdict.tokens[:max_tokens].clone())
        self.cache.truncate(base + 1 + verdict.num_accepted)
        k = verdict.tokens.numel()
        if self.logprobs is not None:  # the target's law at each emitted position, never the draft's
            logp = target_logprobs(logits[:k], cfg, self.penalties, draft.tokens)  # [k, V]
            self.emitted_logprobs.extend(top_logprobs(logp, verdict.tokens, self.logprobs))
        self._ctx[self._n : self._n + k] = verdict.tokens
        self._n += k
        if self.penalties is not None:
            self.penalties.append(verdict.tokens)
        return Outcome(verdict=verdict, target_s=t1 - t0, verify_s=time.perf_counter() - t1)

    def close(self) -> None:
        pass
