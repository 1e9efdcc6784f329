"""The target side of speculative decoding: one sequence's cache, context and verification.

A :class:`TargetSession` owns everything the verifier needs for one sequence (KV cache,
committed tokens, penalty state, the rule's randomness) and exposes one operation,
:meth:`TargetSession.verify`: score ``[pending] + draft`` in one forward pass, apply the rule,
roll the cache back to what was kept.  The local decoder drives one directly; the HTTP server
keeps one per edge session; the edge drives a remote one through the same :class:`Verifier`
protocol, so the decoding loop is written once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft
from specdec.errors import ConfigError, ContextLengthError, ModelError
from specdec.models.base import LanguageModel, layer_count
from specdec.sampling import (
    Constraint,
    PenaltyState,
    SamplingConfig,
    argmax_last,
    path_masks,
    penalise_with_extra,
    penalised_logits,
    process_logits,
    settled,
    target_logprobs,
    top_logprobs,
    with_overrides,
)
from specdec.tree import check_parents, depths, paths, with_root
from specdec.verify import Rule, Verdict
from specdec.verify_tree import TreeRule, get_tree_rule


@dataclass(frozen=True)
class Outcome:
    """A verdict plus where the time went (seconds)."""

    verdict: Verdict
    target_s: float  # the target forward pass (for a remote target: the whole round trip)
    verify_s: float  # processing + rule + bookkeeping
    metrics: dict = field(default_factory=dict)  # extra figures (bytes, rtt, ...) from remote verifiers
    #: the target's features at the positions this round fed and kept (``[pending] + accepted``),
    #: ``[k, len(taps) + 1, D]`` rows (taps..., final hidden state); None unless requested
    features: Tensor | None = None
    #: [N+1] int64: the target's arg-max (raw logits) at the root and after each node of the pass,
    #: when the draft asked for it (``Draft.wants_argmax``); None otherwise
    node_argmax: Tensor | None = None


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


def check_finite(logits: Tensor, tokens: Tensor, position: int) -> None:  # logits: [n, V] raw, row 0 the root
    """Refuse a target whose logits are not finite: NaN weights, or a config such as a negative
    ``rms_norm_eps`` or a zero ``rope_theta``, make every row NaN, and decoding then emitted token 0
    (or noise) with no error.  Row 0's logit of the round's first token is read, one number: such a
    model's rows are NaN throughout, and a sound model's raw logits are always finite."""
    if not math.isfinite(logits[0, int(tokens[0])].item()):
        raise ModelError(f"the target's logits are not finite (NaN or infinite) at position {position}: its weights or"
                         " its config.json are broken (a NaN or infinite weight, a negative rms_norm_eps, a zero rope_theta)")


def check_features(model: LanguageModel, taps: tuple[int, ...] | None) -> None:
    """Raise a clear error when ``model`` cannot hand out the features ``taps`` asks for."""
    if taps is None:
        return
    if getattr(model, "forward_features", None) is None:
        raise ConfigError(
            "this drafter reads the target's hidden states, which this target backend does not expose"
            " (use the native or hf backend)"
        )
    n_layers = layer_count(model)
    if n_layers is not None and any(not 0 <= k <= n_layers for k in taps):
        raise ConfigError(f"the drafter reads layers {list(taps)} but the target has {n_layers} layers")


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
        feature_taps: tuple[int, ...] | None = None,
    ) -> None:
        """``feature_taps`` (target-aware drafters): record the target's features — the residual
        stream after each of these layer counts, then the final hidden state — at every position
        the target commits: :attr:`prompt_features` after the prefill, :attr:`Outcome.features`
        after each round.  Logits and tokens are unchanged (the features are a side output)."""
        check_rule(rule, cfg)
        check_features(model, feature_taps)
        prompt_t = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        n = prompt_t.numel()
        if n == 0:
            raise ConfigError("the prompt is empty")
        if n >= model.max_length:
            raise ContextLengthError(f"the prompt has {n} tokens but the model's context is {model.max_length}")
        low, high = int(prompt_t.min()), int(prompt_t.max())  # ~2 µs: an id past the rows failed in the model
        if low < 0 or high >= model.vocab_size:
            raise ConfigError(f"the prompt holds token id {high if high >= model.vocab_size else low}, outside the "
                              f"target's vocabulary [0, {model.vocab_size}) (is the tokenizer this model's?)")
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
        # room for a token tree's extra branches beyond the context's own capacity
        self.cache = model.new_cache(min(model.max_length, capacity + defaults.MAX_TREE_NODES))
        self._tree_rule: TreeRule | None = None
        self.feature_taps = tuple(feature_taps) if feature_taps is not None else None
        #: [L-1, len(taps) + 1, D] the prompt's features (every prompt position but the last), or None
        self.prompt_features: Tensor | None = None
        started = time.perf_counter()
        if self.feature_taps is not None:
            if n > 1:
                _, self.prompt_features = model.forward_features(prompt_t[:-1], self.cache, self.feature_taps, last_only=True)
            else:
                width = int(getattr(getattr(model, "cfg", None), "hidden_size", 0) or getattr(model, "hidden_size", 0))
                self.prompt_features = torch.zeros(0, len(self.feature_taps) + 1, width)
        elif n > 1:
            model.forward(prompt_t[:-1], self.cache, last_only=True)
        self.prefill_s = time.perf_counter() - started

    @property
    def context(self) -> Tensor:
        return self._ctx[: self._n]

    @property
    def max_length(self) -> int:
        return self._ctx.numel()

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt positions whose keys/values a prefix cache copied instead of the prefill computing them."""
        return int(getattr(self.cache, "restored", 0))

    @property
    def kv_peak_bytes(self) -> int:
        used = getattr(self.cache, "used_bytes", None)
        return int(used()) if used is not None else int(self.cache.nbytes)

    def verify(self, draft: Draft, *, max_tokens: int | None = None) -> Outcome:
        """One round: score ``[last committed] + draft`` (γ+1 positions), keep a prefix, add one token.

        ``max_tokens`` (>= 1) commits at most that many of the verdict's tokens (a length limit: the
        kept ones are exactly what an unlimited round gives, cut where plain decoding would stop).
        A draft with ``parents`` is a token tree (see :meth:`_verify_tree`).
        """
        if draft.parents is not None:
            return self._verify_tree(draft, max_tokens=max_tokens)
        gamma = draft.tokens.numel()
        if self._n + gamma + 1 > self._ctx.numel():
            raise ContextLengthError(f"the sequence would exceed its context of {self._ctx.numel()} tokens")
        t0 = time.perf_counter()
        base = self.cache.length
        feed = torch.cat([self._ctx[self._n - 1 : self._n], draft.tokens])  # [γ+1]
        feats: Tensor | None = None
        if self.feature_taps is not None:
            # a draft that computed part of this pass hands it over with the features (Kangaroo)
            reused = draft.reuse.forward_features(self.model, feed, self.cache, self.feature_taps) \
                if draft.reuse is not None and hasattr(draft.reuse, "forward_features") else None
            if reused is None:
                reused = self.model.forward_features(feed, self.cache, self.feature_taps)
            logits, feats = reused  # [γ+1, V], [γ+1, R, D]
        else:
            logits = draft.reuse.forward(self.model, feed, self.cache) if draft.reuse is not None else None
            if logits is None:
                logits = self.model.forward(feed, self.cache)  # [γ+1, V]
        return self._conclude(draft, logits, feats, base, t0, time.perf_counter(), max_tokens)

    def plain_feed(self) -> Tensor:  # [1] int64
        """What a round without a draft feeds the target: the last committed token."""
        return self._ctx[self._n - 1 : self._n]

    def conclude_plain(self, logits: Tensor, *, target_s: float = 0.0, max_tokens: int | None = None) -> Outcome:
        """A round without a draft whose pass ran elsewhere: ``logits`` [1, V] are the target's
        scores of :meth:`plain_feed` written to :attr:`cache` (several sessions' rounds in one
        batched pass).  Everything after the pass is :meth:`verify`'s."""
        if self._n + 1 > self._ctx.numel():
            raise ContextLengthError(f"the sequence would exceed its context of {self._ctx.numel()} tokens")
        empty = Draft(tokens=self._ctx[:0], probs=None)
        t1 = time.perf_counter()
        return self._conclude(empty, logits, None, self.cache.length - 1, t1 - target_s, t1, max_tokens)

    def _conclude(self, draft: Draft, logits: Tensor, feats: Tensor | None, base: int, t0: float, t1: float,
                  max_tokens: int | None) -> Outcome:  # logits: [γ+1, V], rows base.. of the cache
        """The rule's verdict on a scored chain, the cache cut to what it keeps, the tokens committed."""
        cfg, rule, gamma = self.cfg, self.rule, draft.tokens.numel()
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
        check_finite(logits, verdict.tokens, self._n)
        self.cache.truncate(base + 1 + verdict.num_accepted)
        k = verdict.tokens.numel()
        if self.logprobs is not None:  # the target's law at each emitted position, never the draft's
            logp = target_logprobs(logits[:k], cfg, self.penalties, draft.tokens)  # [k, V]
            self.emitted_logprobs.extend(top_logprobs(logp, verdict.tokens, self.logprobs))
        self._append(verdict.tokens)
        kept = feats[: 1 + verdict.num_accepted] if feats is not None else None
        return Outcome(verdict=verdict, target_s=t1 - t0, verify_s=time.perf_counter() - t1, features=kept,
                       node_argmax=argmax_last(logits) if draft.wants_argmax else None)

    def _verify_tree(self, draft: Draft, *, max_tokens: int | None = None) -> Outcome:
        """One tree round: score ``[last committed] + nodes`` with tree attention, keep one path.

        Each node's target row is processed with the node's own path as penalty context; the
        tree rule is the chain rule's tree counterpart (:func:`specdec.verify_tree.get_tree_rule`).
        """
        tokens, parents = draft.tokens, draft.parents
        assert parents is not None
        n = tokens.numel()
        check_parents(parents, n)
        forward_tree = getattr(self.model, "forward_tree", None)
        if forward_tree is None:
            raise ConfigError("token trees need tree attention, which this target's backend lacks (on the hf backend, a model with layers other than full or sliding-window attention, such as chunked or linear attention, has none)")
        if self._tree_rule is None:
            self._tree_rule = get_tree_rule(self.rule.name)
        rule = self._tree_rule
        depth = int(depths(parents).max()) + 1 if n else 0
        base = self.cache.length
        if self._n + depth + 1 > self._ctx.numel() or base + n + 1 > getattr(self.cache, "max_length", base + n + 1):
            raise ContextLengthError(f"the sequence would exceed its context of {self._ctx.numel()} tokens")
        t0 = time.perf_counter()
        feed = torch.cat([self._ctx[self._n - 1 : self._n], tokens])  # [N+1]
        feats: Tensor | None = None
        if self.feature_taps is not None:
            logits, feats = self.model.forward_features(feed, self.cache, self.feature_taps, parents=with_root(parents))
        else:
            logits = forward_tree(feed, with_root(parents), self.cache)  # [N+1, V]
        t1 = time.perf_counter()
        scores = tree_scores(logits, self.cfg, self.penalties, tokens, parents, probs=rule.needs_target_probs)
        extra: dict[str, object] = {}
        if rule.draft_sampling == "gumbel":
            extra = {"seed": self.seed, "base_position": self._n}
        elif rule.needs_draft_probs:
            extra = {"siblings": draft.siblings}
        tv = rule.fn(tokens, parents, draft.probs, scores, generator=self.generator, **extra)
        if max_tokens is not None and tv.tokens.numel() > max_tokens:  # a length limit, as for chains
            tv = replace(tv, path=tuple(tv.path[: max_tokens - 1]), tokens=tv.tokens[:max_tokens].clone())
        check_finite(logits, tv.tokens, self._n)
        keep = torch.tensor([0, *(1 + i for i in tv.path)], dtype=torch.long)  # [k+1] rows of the pass
        if bool((keep == torch.arange(keep.numel())).all()):
            self.cache.truncate(base + keep.numel())  # the path is a prefix of the node order
        else:
            self.cache.compact(base + keep, base)  # O(path) copy
        verdict = Verdict(num_accepted=len(tv.path), tokens=tv.tokens, alpha_mean=tv.alpha_mean, path=tuple(tv.path))
        k = verdict.tokens.numel()
        if self.logprobs is not None:  # the kept path's rows, each with the path before it as history: a chain's
            logp = target_logprobs(logits[keep[:k]], self.cfg, self.penalties, tokens[list(tv.path)])  # [k, V]
            self.emitted_logprobs.extend(top_logprobs(logp, verdict.tokens, self.logprobs))
        self._append(verdict.tokens)
        return Outcome(verdict=verdict, target_s=t1 - t0, verify_s=time.perf_counter() - t1, metrics={"tree_nodes": n},
                       features=feats[keep] if feats is not None else None,
                       node_argmax=argmax_last(logits) if draft.wants_argmax else None)

    def _append(self, tokens: Tensor) -> None:  # tokens: [k]
        """Commits a round's emitted tokens to the context (and the penalties' history)."""
        k = tokens.numel()
        self._ctx[self._n : self._n + k] = tokens
        self._n += k
        if self.penalties is not None:
            self.penalties.append(tokens)
            self._settle()

    def _settle(self) -> None:
        """A min_tokens floor that was passed leaves the config (:func:`~specdec.sampling.settled`)."""
        constraint = self.cfg.constraint
        if constraint is not None and self.penalties is not None:
            now = settled(constraint, self.penalties.generated)
            if now is not constraint:
                self.cfg = replace(self.cfg, constraint=now)

    def close(self) -> None:
        """The sequence is finished.  A target that keeps finished sequences (``keep_sequence``: the
        interactive chat's prefix cache, :class:`specdec.server.prefix_cache.PrefixCached`) is
        handed the committed tokens whose keys/values the cache holds — every committed token but
        the last, which no pass has fed yet — so that the next turn, which re-sends this reply
        inside its prompt, copies them instead of computing them again."""
        keep = getattr(self.model, "keep_sequence", None)
        if keep is not None:
            n = self.cache.length  # [0, n) are rows of committed tokens: rejected rows were truncated away
            assert n <= self._n, (n, self._n)
            keep(self._ctx[:n], self.cache)


def tree_scores(
    logits: Tensor,  # [N+1, V]: row 0 at the root, row i+1 after node i
    cfg: SamplingConfig,
    penalties: PenaltyState | None,
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    *,
    probs: bool,
) -> Tensor:  # [N+1, V]
    """Target rows of a tree, each processed as if its node's path had been generated.

    On a chain this is exactly what the chain path computes (row i sees draft[:i]); ``probs``
    False gives penalised logits (all greedy needs), True the sampled-from probabilities.
    """
    if cfg.logit_bias:  # step 0 comes before the penalties, as in penalised_logits
        logits = penalised_logits(logits, replace(cfg, repetition_penalty=1.0, frequency_penalty=0.0,
                                                  presence_penalty=0.0, constraint=None), None)
        cfg = with_overrides(cfg, logit_bias=())
    if cfg.has_penalties:
        assert penalties is not None
        extra = torch.zeros(logits.shape, dtype=torch.float32)  # [N+1, V] path token counts
        toks = tokens.tolist()
        for i, p in enumerate(paths(parents)):
            for j in p:
                extra[i + 1, toks[j]] += 1.0
        logits = penalise_with_extra(logits, cfg, penalties, extra)
        cfg = with_overrides(cfg, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    if cfg.constraint is not None:  # after the penalties, as in penalised_logits
        assert penalties is not None
        logits = tree_constraint(logits, cfg.constraint, penalties.generated, tokens, parents)
        cfg = replace(cfg, constraint=None)  # (with_overrides ignores None)
    return process_logits(logits, cfg) if probs else logits


def tree_constraint(
    logits: Tensor,  # [N+1, V]: row 0 at the root, row i+1 after node i
    constraint: Constraint,
    generated: list[int],
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
) -> Tensor:  # [N+1, V]
    """Row i+1: tokens the constraint forbids after ``generated`` + node i's path get -inf.

    A node whose own token its parent's row forbids can never be kept (its target probability is
    0 under every rule, and greedy never picks a -inf token), so neither can anything below it:
    those rows are left as they are, never asked of the constraint (which could not follow a
    forbidden token).
    """
    toks = tokens.tolist()
    node_paths = [[toks[j] for j in path] for path in paths(parents)]
    allowed = path_masks(constraint, generated, [[], *node_paths], logits.shape[1])
    out = logits.clone()
    for row, mask in enumerate(allowed):
        if mask is None:
            continue
        if not bool(mask.any()):
            raise ConfigError("the constraint allows no token here (is end-of-sequence allowed when it is complete?)")
        out[row].masked_fill_(~mask, -math.inf)
    return out


def score_prompt(
    model: LanguageModel, prompt: Tensor | list[int], top: int, *, chunk: int = defaults.PROMPT_SCORE_CHUNK,
) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Each prompt token after the first: its log-probability given the tokens before it, the
    ``top`` most likely tokens there, and its rank (1 + the tokens more likely than it), under the
    target's own law (the log-softmax of its logits: no temperature, truncation, bias or penalty —
    the prompt was not sampled), from a pass over the prompt in pieces of ``chunk`` positions on a
    cache of its own (what OpenAI's legacy completions report with ``echo`` and ``logprobs``, and
    vLLM's ``prompt_logprobs``)."""
    ids = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)  # [n]
    n = ids.numel()
    if n >= model.max_length:
        raise ContextLengthError(f"the prompt has {n} tokens but the model's context is {model.max_length}")
    if n < 2:
        return []
    cache = model.new_cache(n)
    out: list[tuple[float, list[tuple[int, float]], int]] = []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        logits = model.forward(ids[start:end], cache)  # [end - start, V]: the law of tokens start+1 .. end
        logp = torch.log_softmax(logits.double(), dim=-1)
        tokens = ids[start + 1 : end + 1]  # [end - start]
        ranks = (logp > logp.gather(1, tokens.view(-1, 1))).sum(1) + 1  # [end - start]
        out.extend((lp, best, rank) for (lp, best), rank in zip(top_logprobs(logp, tokens, top), ranks.tolist()))
    return out
