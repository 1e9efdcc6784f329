"""The speculative decoding loop (Algorithm 3 of Sun et al. 2024; Leviathan et al. 2023).

One round: the drafter proposes γ tokens; the target scores ``[pending] + draft`` (γ+1 positions)
in one forward pass; the rule keeps a prefix and adds one token; both caches roll back to what
was kept.  ``drafter=None`` (or γ = 0) is plain target decoding through the very same code.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, Drafter, DraftSampler, draft_config, feature_taps, temperature_factor
from specdec.errors import ConfigError
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import FixedGamma, GammaController
from specdec.models.base import LanguageModel
from specdec.sampling import PenaltyState, SamplingConfig, check_stop_token_ids, floor_stops, settled
from specdec.session import TargetSession, Verifier, check_rule
from specdec.verify import Rule


@dataclass(frozen=True)
class RoundStats:
    gamma: int  # tokens actually drafted this round
    accepted: int
    emitted: int  # tokens appended (accepted + 1, fewer if a stop cut the round)
    draft_ms: float
    target_ms: float
    verify_ms: float
    alpha_mean: float | None = None  # mean min(1, p/q) over the draft (probabilistic rules)
    cumulative_acceptance: float = 0.0  # accepted / proposed over all rounds so far (A_cum)
    tree: bool = False  # the draft was a token tree (gamma = its node count)
    free: bool = False  # the draft cost no model step (a hybrid drafter's prompt-lookup round)

    @property
    def accept_ratio(self) -> float:
        return self.accepted / self.gamma if self.gamma else 0.0


@dataclass(frozen=True)
class GenerationStats:
    method: str
    lossless: bool
    drafter: str
    gamma_policy: str
    generated_tokens: int
    prompt_tokens: int
    target_calls: int
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    tokens_per_target_call: float
    acceptance_rate: float
    acceptance_per_position: list[float]  # P(accepted >= k | drafted >= k), k = 1..
    proposed_per_position: list[int]
    mean_gamma: float
    wall_s: float  # decoding time (prefill included, model loading excluded)
    tokens_per_s: float
    ttft_s: float
    prefill_s: float
    draft_s: float
    target_s: float
    verify_s: float
    kv_peak_bytes: int
    finish_reason: str
    #: rounds by accepted draft length: accepted_histogram[k] = rounds that kept k draft tokens
    accepted_histogram: list[int] = field(default_factory=list)
    tree_rounds: int = 0  # rounds whose draft was a token tree
    #: rounds drafted without a model step (prompt lookup in front of a model) and what they kept
    free_rounds: int = 0
    free_tokens_accepted: int = 0
    #: the drafter sampled at this factor x the temperature (``--draft-temperature-factor``)
    draft_temperature_factor: float = 1.0
    #: prompt tokens whose keys/values a prefix cache copied instead of the prefill computing them
    cached_prompt_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # generated only
    stats: GenerationStats
    rounds: tuple[RoundStats, ...] = field(repr=False)


class StopCheck(Protocol):
    def __call__(self, tokens: list[int]) -> int | None:
        """Given all generated tokens, return how many to keep if generation must stop, else None."""
        ...


def cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first end-of-sequence token, and whether there was one."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1], True
    return tokens, False


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(6), "little")


class SpeculativeDecoder:
    """Target + optional drafter + verification rule + γ policy."""

    def __init__(
        self,
        target: LanguageModel,
        drafter: Drafter | None,
        rule: Rule,
        *,
        gamma: GammaController | None = None,
        eos_ids: frozenset[int] = frozenset(),
        drafter_name: str = "",
        q_top_k: int | None = None,
        min_confidence: float = 0.0,
        tree: TreeSpec | None = None,
        max_draft: int | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.rule = rule
        self.gamma = gamma or FixedGamma(4)
        self.eos_ids = eos_ids
        self.drafter_name = drafter_name or ("none" if drafter is None else type(drafter).__name__)
        self.q_top_k = q_top_k  # draft-only truncation of q (sparse-q wire mode)
        self.min_confidence = min_confidence  # dynamic draft length (see DraftSampler)
        #: token trees: how the drafter grows them (the γ controller's number is then the node
        #: budget); drafters without tree support keep drafting chains
        self.tree = tree if tree is not None and getattr(drafter, "supports_trees", False) else None
        self.max_draft = max_draft  # the most tokens (tree nodes) a round drafts: a server's --max-gamma

    def stop_ids(self, cfg: SamplingConfig) -> frozenset[int]:
        """The tokens that end a sequence under ``cfg``: end-of-sequence (unless ignored) and its
        ``stop_token_ids``."""
        return self.eos_ids | frozenset(cfg.stop_token_ids) if cfg.stop_token_ids else self.eos_ids

    def generate(
        self,
        prompt: Tensor | list[int],
        cfg: SamplingConfig,
        *,
        stop: StopCheck | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        verifier: Verifier | None = None,
    ) -> GenerationResult:
        """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt``.

        ``verifier`` is the target side; by default a local :class:`TargetSession` on
        ``self.target`` (the edge passes a remote one).
        """
        rule = self.rule
        check_rule(rule, cfg)
        check_stop_token_ids(cfg, self.target.vocab_size)
        stops = self.stop_ids(cfg)
        if cfg.min_tokens:
            if verifier is not None:  # its law must mask the stop tokens too: it was built from cfg
                raise ConfigError("min_tokens: build the verifier from floor_stops(cfg, decoder.stop_ids(cfg)) and pass"
                                  " that config (a remote verifier: give it floor_ids=decoder.stop_ids(cfg))")
            cfg = floor_stops(cfg, stops)
        prompt_t = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        seed = cfg.seed if cfg.seed is not None else _fresh_seed()
        started = time.perf_counter()
        taps = feature_taps(self.drafter)
        owned = verifier is None  # closed here when the sequence ends (see TargetSession.close)
        if verifier is None:
            verifier = TargetSession(self.target, prompt_t, cfg, rule, seed=seed, feature_taps=taps)
        elif taps is not None and getattr(verifier, "feature_taps", None) != taps:
            raise ConfigError(
                f"drafter {self.drafter_name!r} reads the target's hidden states, which this verifier does not provide"
                " (a remote target sends none over the wire): run it locally, or draft with a model or ngram"
            )
        n_prompt = prompt_t.numel()
        # the context's last position can take a token: that token's own row is never fed
        max_new = min(cfg.max_new_tokens, verifier.max_length - n_prompt)
        draft_gen = torch.Generator().manual_seed(seed + defaults.DRAFT_SEED_OFFSET)
        # the drafter's own view of the penalties (the verifier keeps its own)
        penalties = PenaltyState.start(prompt_t, self.target.vocab_size) if cfg.needs_state else None
        drafter = self.drafter
        if drafter is not None:
            bind = getattr(drafter, "bind_target", None)  # early exit reads the target's cache (self_spec)
            if bind is not None:
                cache = verifier.cache if isinstance(verifier, TargetSession) else None
                bind(self.target, cache)
            drafter.prepare(prompt_t)
            start_idle = getattr(self.gamma, "start_idle", None)
            if getattr(drafter, "whole_target", False) and start_idle is not None:
                start_idle()  # a drafted token costs a target step: back off before the first round
            if taps is not None:
                drafter.add_features(verifier.prompt_features)  # type: ignore[attr-defined]
        prefill_s = time.perf_counter() - started

        generated: list[int] = []
        rounds: list[RoundStats] = []
        ttft = 0.0
        finish = "length"
        empty = Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)
        proposed_so_far = accepted_so_far = 0
        free_drafts = hasattr(drafter, "update_free")  # a hybrid: prompt lookup in front of a model
        free_limit = getattr(self.gamma, "free_limit", None) if free_drafts else None
        free_update = getattr(self.gamma, "update_free", None) if free_drafts else None
        observe_pass = getattr(drafter, "observe_pass", None)  # ... whose lookup controller learns pass costs
        # the longest draft a round: this decoder's own bound and a remote server's (both --max-gamma)
        bound = min((b for b in (self.max_draft, getattr(verifier, "max_draft", None)) if b is not None), default=None)
        draft_cfg = draft_config(cfg, temperature_factor(drafter))  # the drafter samples at its factor x T
        while len(generated) < max_new:
            remaining = max_new - len(generated)
            t0 = time.perf_counter()
            tree = self.tree if self.tree is not None and getattr(self.gamma, "tree_round", True) else None
            if tree is not None:  # every node takes a row of the target's cache: at most what the context has left
                limit = min(defaults.MAX_TREE_NODES, verifier.max_length - verifier.context.numel())
            else:
                limit = min(remaining - 1, defaults.MAX_GAMMA)
            if bound is not None:
                limit = min(limit, bound)
            advised = getattr(verifier, "gamma_limit", None)  # a busy remote verifier's draft cap
            if advised is not None and tree is None:
                limit = min(limit, advised)
            g = min(self.gamma.next_gamma(), limit) if drafter is not None and remaining > 1 else 0
            room = limit  # free drafts' ceiling: a busy server's own (see server/draft_cap.py), else γ's
            if free_limit is not None and tree is None:
                ceiling = free_limit()
                room = limit if ceiling is None else min(limit, ceiling)
            # a drafter with free drafts (prompt lookup) is asked even when γ is 0: a free draft
            # may pay where the model's drafts do not
            asked = g > 0 or (free_drafts and remaining > 1 and room > 0)
            draft = empty
            if asked:
                sampler = DraftSampler(
                    draft_cfg,
                    rule.draft_sampling,
                    penalties=penalties,
                    generator=draft_gen,
                    noise_seed=seed,
                    want_probs=rule.needs_draft_probs,
                    q_top_k=self.q_top_k,
                    min_confidence=self.min_confidence,
                    room=room,
                )
                if tree is not None and g > 0:
                    draft = drafter.propose_tree(verifier.context, g, sampler, tree, max_depth=remaining - 1)  # type: ignore[attr-defined]
                else:
                    draft = drafter.propose(verifier.context, g, sampler)
            t1 = time.perf_counter()
            # a drafter's catch-up pass (a lazy prefill, the backlog of rounds without drafting) is a
            # one-off, not the cost of this round's drafted tokens: the controllers do not see it.
            # Read before commit: a hybrid reports its model's catch-up only until the round ends
            catch_up = getattr(drafter, "catch_up_s", 0.0) if asked else 0.0
            outcome = verifier.verify(draft)
            verdict = outcome.verdict
            if drafter is not None and outcome.node_argmax is not None:  # before commit: the tree's layout
                drafter.observe(outcome.node_argmax)  # type: ignore[attr-defined]
            if drafter is not None and asked:
                drafter.commit(verdict)
            if taps is not None:  # every round, drafted or not: the features of what was committed
                drafter.add_features(outcome.features)  # type: ignore[union-attr]
            new = verdict.tokens.tolist()[:remaining]
            new, ended = cut_at_eos(new, stops)
            if ended:
                finish = "eos"
            if penalties is not None:
                penalties.append(torch.tensor(new, dtype=torch.long))
            generated.extend(new)
            if draft_cfg.constraint is not None:  # a passed min_tokens floor leaves the drafts' config too
                now = settled(draft_cfg.constraint, generated)
                if now is not draft_cfg.constraint:
                    draft_cfg = replace(draft_cfg, constraint=now)
                    if not draft_cfg.needs_state:
                        penalties = None
            t2 = time.perf_counter()
            if not rounds:
                ttft = t2 - started
            drafted = draft.tokens.numel()
            other_s = (t2 - t1) - outcome.target_s
            proposed_so_far += drafted
            accepted_so_far += verdict.num_accepted
            rounds.append(
                RoundStats(
                    drafted, verdict.num_accepted, len(new), (t1 - t0) * 1e3, outcome.target_s * 1e3, other_s * 1e3,
                    alpha_mean=verdict.alpha_mean,
                    cumulative_acceptance=accepted_so_far / proposed_so_far if proposed_so_far else 0.0,
                    tree=draft.parents is not None,
                    free=draft.free,
                )
            )
            measured = dict(gamma=drafted, accepted=verdict.num_accepted, draft_s=t1 - t0 - catch_up,
                            target_s=outcome.target_s, other_s=other_s)
            if draft.free:  # a lookup round says nothing about the draft model; the drafter learns from it
                drafter.update_free(**measured)  # type: ignore[union-attr]
                if free_update is not None:
                    free_update(**measured)
            else:
                self.gamma.update(**measured)
                if observe_pass is not None:
                    observe_pass(drafted + 1, outcome.target_s)
            if stop is not None:
                keep = stop(generated)
                if keep is not None:
                    cut = len(generated) - keep
                    if cut > 0:
                        new = new[: max(0, len(new) - cut)]
                        del generated[keep:]
                        rounds[-1] = replace(rounds[-1], emitted=len(new))  # what the round appended after the cut
                    finish = "stop"
            if on_tokens is not None and new:
                on_tokens(new)
            if finish != "length":
                break
        if owned:
            verifier.close()
        finished = getattr(drafter, "finish", None)  # a draft model behind a prefix cache keeps its rows too
        if finished is not None:
            finished(verifier.context)
        wall = time.perf_counter() - started
        kv = getattr(verifier, "kv_peak_bytes", 0)
        return GenerationResult(
            tokens=generated,
            stats=self._stats(rounds, generated, n_prompt, wall, ttft, prefill_s, kv, finish,
                              cached=int(getattr(verifier, "cached_prompt_tokens", 0))),
            rounds=tuple(rounds),
        )

    def nothing(self, n_prompt: int, wall_s: float = 0.0) -> GenerationResult:
        """The result of generating no token after a prompt of ``n_prompt`` tokens, nothing run
        (a server asked only to echo and score a prompt); ``wall_s``: the time that took."""
        return GenerationResult(tokens=[], stats=self._stats([], [], n_prompt, wall_s, 0.0, 0.0, 0, "length"), rounds=())

    def _stats(self, rounds, generated, n_prompt, wall, ttft, prefill_s, kv_peak, finish, *, cached: int = 0) -> GenerationStats:
        proposed = sum(r.gamma for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        longest = max((r.gamma for r in rounds), default=0)
        drafted_at = [sum(1 for r in rounds if r.gamma >= k) for k in range(1, longest + 1)]
        accepted_at = [sum(1 for r in rounds if r.gamma >= k and r.accepted >= k) for k in range(1, longest + 1)]
        return GenerationStats(
            method=self.rule.name,
            lossless=self.rule.lossless,
            drafter=self.drafter_name,
            gamma_policy=self.gamma.name if self.drafter is not None else "none",
            generated_tokens=len(generated),
            prompt_tokens=n_prompt,
            target_calls=len(rounds),
            draft_tokens_proposed=proposed,
            draft_tokens_accepted=accepted,
            tokens_per_target_call=len(generated) / len(rounds) if rounds else 0.0,
            acceptance_rate=accepted / proposed if proposed else 0.0,
            acceptance_per_position=[a / d for a, d in zip(accepted_at, drafted_at)],
            proposed_per_position=drafted_at,
            mean_gamma=proposed / len(rounds) if rounds else 0.0,
            wall_s=wall,
            tokens_per_s=len(generated) / wall if wall > 0 else 0.0,
            ttft_s=ttft,
            prefill_s=prefill_s,
            draft_s=sum(r.draft_ms for r in rounds) / 1e3,
            target_s=sum(r.target_ms for r in rounds) / 1e3,
            verify_s=sum(r.verify_ms for r in rounds) / 1e3,
            kv_peak_bytes=int(kv_peak),
            finish_reason=finish,
            accepted_histogram=[sum(1 for r in rounds if r.accepted == k) for k in range(max((r.accepted for r in rounds), default=-1) + 1)],
            tree_rounds=sum(1 for r in rounds if r.tree),
            free_rounds=sum(1 for r in rounds if r.free),
            free_tokens_accepted=sum(r.accepted for r in rounds if r.free),
            draft_temperature_factor=temperature_factor(self.drafter),
            cached_prompt_tokens=cached,
        )
