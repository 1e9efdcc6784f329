"""The speculative decoding loop (Algorithm 3 of Sun et al. 2024; Leviathan et al. 2023).

One round: the drafter proposes γ tokens; the target scores ``[pending] + draft`` (γ+1 positions)
in one forward pass; the rule keeps a prefix and adds one token; both caches roll back to what
was kept.  ``drafter=None`` (or γ = 0) is plain target decoding through the very same code.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, Drafter, DraftSampler
from specdec.errors import ConfigError, ContextLengthError
from specdec.gamma import FixedGamma, GammaController
from specdec.models.base import LanguageModel
from specdec.sampling import PenaltyState, SamplingConfig, penalised_logits, process_logits
from specdec.verify import Rule, Verdict


@dataclass(frozen=True)
class RoundStats:
    gamma: int  # tokens actually drafted this round
    accepted: int
    emitted: int  # tokens appended (accepted + 1, fewer if a stop cut the round)
    draft_ms: float
    target_ms: float
    verify_ms: float

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
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.rule = rule
        self.gamma = gamma or FixedGamma(4)
        self.eos_ids = eos_ids
        self.drafter_name = drafter_name or ("none" if drafter is None else type(drafter).__name__)

    def generate(
        self,
        prompt: Tensor | list[int],
        cfg: SamplingConfig,
        *,
        stop: StopCheck | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        rule = self.rule
        if rule.greedy_only and not cfg.greedy:
            raise ConfigError(
                f"method {rule.name!r} needs temperature 0; at temperature {cfg.temperature} use token, block or coupled"
            )
        prompt_t = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
        n_prompt = prompt_t.numel()
        if n_prompt == 0:
            raise ConfigError("the prompt is empty")
        if n_prompt >= self.target.max_length:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens but the model's context is {self.target.max_length}"
            )
        max_new = min(cfg.max_new_tokens, self.target.max_length - n_prompt)
        seed = cfg.seed if cfg.seed is not None else _fresh_seed()
        gen = torch.Generator().manual_seed(seed)
        draft_gen = torch.Generator().manual_seed(seed + defaults.DRAFT_SEED_OFFSET)
        vocab = self.target.vocab_size
        penalties = PenaltyState.start(prompt_t, vocab) if cfg.has_penalties else None
        extra: dict[str, object] = {}

        started = time.perf_counter()
        # context buffer: prompt + generated, with room for the longest round
        ctx = torch.empty(n_prompt + max_new + 1, dtype=torch.long)
        ctx[:n_prompt] = prompt_t
        n_ctx = n_prompt
        cache = self.target.new_cache(min(self.target.max_length, n_prompt + max_new + defaults.MAX_GAMMA + 1))
        if n_prompt > 1:
            self.target.forward(prompt_t[:-1], cache, last_only=True)
        drafter = self.drafter
        if drafter is not None:
            drafter.prepare(prompt_t)
        prefill_s = time.perf_counter() - started

        generated: list[int] = []
        rounds: list[RoundStats] = []
        ttft = 0.0
        finish = "length"
        while len(generated) < max_new:
            remaining = max_new - len(generated)
            t0 = time.perf_counter()
            g = min(self.gamma.next_gamma(), remaining - 1, defaults.MAX_GAMMA) if drafter is not None else 0
            context = ctx[:n_ctx]
            if g > 0:
                sampler = DraftSampler(
                    cfg,
                    rule.draft_sampling,
                    penalties=penalties,
                    generator=draft_gen,
                    noise_seed=seed,
                    want_probs=rule.needs_draft_probs,
                )
                draft = drafter.propose(context, g, sampler)
            else:
                draft = Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)
            drafted = draft.tokens.numel()
            t1 = time.perf_counter()
            base = cache.length
            logits = self.target.forward(torch.cat([ctx[n_ctx - 1 : n_ctx], draft.tokens]), cache)  # [γ+1, V]
            t2 = time.perf_counter()
            if rule.needs_target_probs:
                scores = process_logits(logits, cfg, penalties, draft.tokens)  # [γ+1, V]
            else:
                scores = penalised_logits(logits, cfg, penalties, draft.tokens)
            if rule.draft_sampling == "gumbel":
                extra = {"seed": seed, "positions": torch.arange(n_ctx, n_ctx + drafted + 1)}
            verdict: Verdict = rule.fn(draft.tokens, draft.probs, scores, generator=gen, **extra)
            cache.truncate(base + 1 + verdict.num_accepted)
            if drafter is not None and g > 0:
                drafter.commit(verdict)
            new = verdict.tokens.tolist()[:remaining]
            for i, tok in enumerate(new):
                if tok in self.eos_ids:
                    new = new[: i + 1]
                    finish = "eos"
                    break
            ctx[n_ctx : n_ctx + len(new)] = torch.tensor(new, dtype=torch.long)
            n_ctx += len(new)
            if penalties is not None:
                penalties.append(torch.tensor(new, dtype=torch.long))
            generated.extend(new)
            t3 = time.perf_counter()
            if not rounds:
                ttft = t3 - started
            rounds.append(
                RoundStats(drafted, verdict.num_accepted, len(new), (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
            )
            self.gamma.update(gamma=drafted, accepted=verdict.num_accepted, draft_s=t1 - t0, target_s=t2 - t1, other_s=t3 - t2)
            if stop is not None:
                keep = stop(generated)
                if keep is not None:
                    cut = len(generated) - keep
                    if cut > 0:
                        new = new[: max(0, len(new) - cut)]
                        del generated[keep:]
                    finish = "stop"
            if on_tokens is not None and new:
                on_tokens(new)
            if finish != "length":
                break
        wall = time.perf_counter() - started
        return GenerationResult(
            tokens=generated,
            stats=self._stats(rounds, generated, n_prompt, wall, ttft, prefill_s, cache, finish),
            rounds=tuple(rounds),
        )

    def _stats(self, rounds, generated, n_prompt, wall, ttft, prefill_s, cache, finish) -> GenerationStats:
        proposed = sum(r.gamma for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        longest = max((r.gamma for r in rounds), default=0)
        drafted_at = [sum(1 for r in rounds if r.gamma >= k) for k in range(1, longest + 1)]
        accepted_at = [sum(1 for r in rounds if r.gamma >= k and r.accepted >= k) for k in range(1, longest + 1)]
        kv_peak = cache.used_bytes() if hasattr(cache, "used_bytes") else cache.nbytes
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
        )
