"""Sampling configuration and the one function that turns logits into the distribution sampled from.

Exactness rule 2 (DESIGN.md §4): the draft distribution ``q`` and the target distribution ``p``
go through *the same* processing.  Everything here is a pure function of its arguments, and the
decoder calls :func:`process_logits` for both sides, so there is no second code path to drift.

Processing order (fixed, documented, identical for ``p`` and ``q``):

1. repetition penalty (Keskar et al. 2019, Hugging Face semantics) over prompt + generated tokens;
2. frequency / presence penalties (OpenAI semantics) over generated tokens only;
3. temperature; ``temperature == 0`` means greedy: the result is the one-hot of the arg-max;
4. top-k, then top-p (nucleus), then min-p, each on the distribution left by the previous step.

Penalties see the draft tokens as context *position by position*: row ``i`` of a verification
block is processed as if ``draft[:i]`` had already been generated, exactly as plain decoding
would have processed that position.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from specdec.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How the target would sample on its own.  Defaults live here and nowhere else."""

    temperature: float = 1.0  # 0 => greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def truncates(self) -> bool:
        """True when some tokens may get probability exactly zero (top-k / top-p / min-p)."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def validate(cfg: SamplingConfig) -> None:
    """Raise :class:`ConfigError` with a one-line message for any value that cannot be honoured."""
    if not math.isfinite(cfg.temperature) or cfg.temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {cfg.temperature}")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise ConfigError(f"top-k must be >= 1, got {cfg.top_k}")
    if cfg.top_p is not None and not (0.0 < cfg.top_p <= 1.0):
        raise ConfigError(f"top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.min_p is not None and not (0.0 <= cfg.min_p <= 1.0):
        raise ConfigError(f"min-p must be in [0, 1], got {cfg.min_p}")
    if not math.isfinite(cfg.repetition_penalty) or cfg.repetition_penalty <= 0:
        raise ConfigError(f"repetition penalty must be > 0, got {cfg.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(cfg, name)
        if not math.isfinite(value):
            raise ConfigError(f"{name.replace('_', ' ')} must be finite, got {value}")
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max new tokens must be >= 1, got {cfg.max_new_tokens}")


#: The reference guide's defaults (§8): temperature 1.0, top-p 0.9, repetition penalty 1.1.
GUIDE_PRESET = SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.1)
PRESETS: dict[str, SamplingConfig] = {"guide": GUIDE_PRESET, "greedy": SamplingConfig(temperature=0.0)}


def with_overrides(cfg: SamplingConfig, **overrides: object) -> SamplingConfig:
    """``cfg`` with the given fields replaced; ``None`` values are ignored (CLI convenience)."""
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class PenaltyState:
    """Token statistics the penalties need, kept incrementally by the decoder.

    ``seen`` marks tokens in prompt + generated text (repetition penalty); ``counts`` counts
    generated tokens only (frequency / presence penalties).
    """

    seen: Tensor  # [V] bool
    counts: Tensor  # [V] float32

    @classmethod
    def start(cls, prompt: Tensor, vocab_size: int) -> "PenaltyState":  # prompt: [L] int64
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[prompt] = True
        return cls(seen=seen, counts=torch.zeros(vocab_size, dtype=torch.float32))

    def append(self, tokens: Tensor) -> None:  # tokens: [n] int64
        self.seen[tokens] = True
        self.counts.index_add_(0, tokens, torch.ones(tokens.numel(), dtype=self.counts.dtype))


def _apply_penalties(
    logits: Tensor,  # [n, V]
    cfg: SamplingConfig,
    state: PenaltyState,
    draft: Tensor,  # [m] int64, m >= n - 1: row i also sees draft[:i]
) -> Tensor:
    n, vocab = logits.shape
    # extra[i, v] = occurrences of v in draft[:i]  (row 0 sees none of the draft)
    extra = torch.zeros(n, vocab, dtype=torch.float32)
    if n > 1:
        extra[torch.arange(1, n), draft[: n - 1]] = 1.0
        extra = extra.cumsum(0)
    return penalise_with_extra(logits, cfg, state, extra)


def penalise_with_extra(
    logits: Tensor,  # [n, V]
    cfg: SamplingConfig,
    state: PenaltyState,
    extra: Tensor,  # [n, V] float32: row i's occurrences of each token beyond ``state``
) -> Tensor:
    """Penalties where row i has seen ``state`` plus ``extra[i]`` (token trees: each node's path)."""
    logits = logits.clone()
    if cfg.repetition_penalty != 1.0:
        seen = state.seen.unsqueeze(0) | (extra > 0)  # [n, V]
        penalised = torch.where(
            logits > 0, logits / cfg.repetition_penalty, logits * cfg.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    if cfg.frequency_penalty != 0.0 or cfg.presence_penalty != 0.0:
        counts = state.counts.unsqueeze(0) + extra  # [n, V]
        logits = logits - cfg.frequency_penalty * counts - cfg.presence_penalty * (counts > 0)
    return logits


def penalised_logits(
    logits: Tensor,  # [n, V]
    cfg: SamplingConfig,
    state: PenaltyState | None,
    draft: Tensor | None = None,  # [m] int64
) -> Tensor:
    """Step 1-2 of the processing: penalties only (what greedy decoding takes the arg-max of)."""
    if not cfg.has_penalties:
        return logits
    if state is None:
        raise ValueError("penalties need a PenaltyState")
    empty = torch.empty(0, dtype=torch.long)
    return _apply_penalties(logits, cfg, state, draft if draft is not None else empty)


#: candidate counts tried by the top-p search before a full sort
_TOP_P_STEPS = (256, 4096)


def _nucleus(vals: Tensor, top_p: float) -> Tensor:  # vals: [n, k] sorted descending -> keep [n, k]
    keep = (vals.cumsum(-1) - vals) < top_p  # mass strictly before the token is below top_p
    keep[:, 0] = True
    return keep


def _top_p_mask(probs: Tensor, top_p: float) -> Tensor:  # probs: [n, V] -> keep mask [n, V]
    """Keep the most probable tokens until their mass reaches ``top_p`` (always >= 1 token).

    Same set as sorting the whole vocabulary and cutting the cumulative sum, but a partial sort
    (top-k) usually suffices; only rows whose nucleus is larger fall back to bigger k, one row at
    a time, so each row's result depends on that row alone (identical for p and q, batched or not).
    """
    n, vocab = probs.shape
    mask = torch.zeros_like(probs, dtype=torch.bool)
    k = min(vocab, _TOP_P_STEPS[0])
    vals, idx = probs.topk(k, dim=-1)  # [n, k] sorted descending
    mask.scatter_(-1, idx, _nucleus(vals, top_p))
    if k == vocab:
        return mask
    for row in (vals.sum(-1) < top_p).nonzero().flatten().tolist():
        for k in (*_TOP_P_STEPS[1:], vocab):
            k = min(k, vocab)
            if k == vocab:
                rv, ri = probs[row].sort(descending=True, stable=True)
            else:
                rv, ri = probs[row].topk(k)
            if k == vocab or float(rv.sum()) >= top_p:
                mask[row].scatter_(0, ri, _nucleus(rv.unsqueeze(0), top_p)[0])
                break
    return mask


def process_logits(
    logits: Tensor,  # [n, V]
    cfg: SamplingConfig,
    state: PenaltyState | None = None,
    draft: Tensor | None = None,  # [m] int64, m >= n - 1
) -> Tensor:
    """Logits -> the probabilities actually sampled from, one row per position.  [n, V]

    Greedy (``temperature == 0``) returns the one-hot of the arg-max of the penalised logits.
    Rows sum to 1; truncated tokens have probability exactly 0.
    """
    scores = penalised_logits(logits, cfg, state, draft)
    if cfg.greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).to(scores.dtype)
    scores = scores / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < scores.shape[-1]:
        kth = scores.topk(cfg.top_k, dim=-1).values[:, -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        probs = probs * _top_p_mask(probs, cfg.top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if cfg.min_p is not None and cfg.min_p > 0.0:
        threshold = cfg.min_p * probs.max(-1, keepdim=True).values
        probs = probs * (probs >= threshold)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_categorical(weights: Tensor, generator: torch.Generator | None) -> int:  # weights: [V] >= 0
    """One draw from ``weights / weights.sum()`` by inverting the float64 CDF with one uniform.

    About 20x faster than ``torch.multinomial`` on a 49k vocabulary; zero-weight tokens can never
    be drawn.
    """
    cdf = weights.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(idx, weights.numel() - 1)


# ----------------------------------------------------------------------------- keyed Gumbel noise

_MASK64 = (1 << 64) - 1


def _to_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_M1 = _to_signed(0xBF58476D1CE4E5B9)
_M2 = _to_signed(0x94D049BB133111EB)


def _srl(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 lanes (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: Tensor) -> Tensor:  # int64 lanes, arithmetic modulo 2**64
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


@functools.lru_cache(maxsize=8)
def _id_hashes(vocab_size: int) -> Tensor:  # [V] int64, position-independent half of the key
    return _splitmix64(torch.arange(vocab_size, dtype=torch.int64) + 0x5DEECE66D)


def keyed_uniform(seed: int, position: int, ids: Tensor | None, vocab_size: int) -> Tensor:
    """Uniforms in (0, 1), float64, one per token id: a pure function of (seed, position, id).

    ``ids`` [m] selects token ids (``None`` = the whole vocabulary).  A counter-based generator
    (SplitMix64 finaliser), so the edge and the cloud draw the same numbers without sharing any
    RNG state, on any device or torch version.
    """
    hashes = _id_hashes(vocab_size)
    if ids is not None:
        hashes = hashes[ids]
    key = _splitmix64(torch.tensor(_to_signed(seed) ^ _to_signed(position * 0x9E3779B1 + 0x1234567), dtype=torch.int64))
    bits = _splitmix64(hashes ^ key)
    return (_srl(bits, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def gumbel_sample(probs: Tensor, seed: int, position: int) -> int:  # probs: [V]
    """Gumbel-max sample ``argmax_v log p(v) + G(seed, position, v)``, distributed as ``p``.

    Only tokens with ``p > 0`` can win, so the noise is drawn for the support alone: with top-p /
    top-k truncation this is a few hundred ids instead of the whole vocabulary.
    """
    vocab = probs.shape[-1]
    support = probs.nonzero().squeeze(-1)  # [m]
    full = support.numel() == vocab
    ids = None if full else support
    u = keyed_uniform(seed, position, ids, vocab)
    # exponential race: argmax log p - log(-log u)  ==  argmax log p + Gumbel
    p = probs.double() if full else probs[support].double()
    best = int((p.log() - torch.log(-torch.log(u))).argmax())
    return best if full else int(support[best])
