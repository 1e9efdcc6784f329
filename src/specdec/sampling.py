"""Sampling configuration and the one function that turns logits into the distribution sampled from.

Exactness rule: the draft distribution ``q`` and the target distribution ``p``
go through *the same* processing.  Everything here is a pure function of its arguments, and the
decoder calls :func:`process_logits` for both sides, so there is no second code path to drift.

Processing order (fixed, documented, identical for ``p`` and ``q``):

0. logit bias (OpenAI semantics): a per-token constant added to the model's logits;
1. repetition penalty (Keskar et al. 2019, Hugging Face semantics) over prompt + generated tokens;
2. frequency / presence penalties (OpenAI semantics) over generated tokens only;
2'. a constraint (e.g. a grammar): tokens it forbids after the generated history get -inf, so both
   the draft proposes and the target samples only what the constraint allows;
3. temperature; ``temperature == 0`` means greedy: the result is the one-hot of the arg-max;
4. top-k, then top-p (nucleus), then min-p, each on the distribution left by the previous step.

Penalties see the draft tokens as context *position by position*: row ``i`` of a verification
block is processed as if ``draft[:i]`` had already been generated, exactly as plain decoding
would have processed that position.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Mapping, Protocol, Sequence

import torch
from torch import Tensor

from specdec import defaults
from specdec.errors import ConfigError


class Constraint(Protocol):
    """Which tokens may come next: a pure function of the tokens generated so far.

    Being a function of the history (not a mutable state) is what makes rejection safe: a
    rejected draft needs no rollback, the next call simply asks about the shorter history.
    Implementations may cache a matcher and sync it to the history they are asked about.
    """

    def allowed(self, generated: Sequence[int], vocab_size: int) -> Tensor:  # -> [V] bool
        ...


def path_masks(
    constraint: Constraint,
    generated: Sequence[int],
    paths: Sequence[Sequence[int]],  # token paths below ``generated``; a path's parent path comes first
    vocab: int,
    cache: dict[tuple[int, ...], Tensor] | None = None,
) -> list[Tensor | None]:  # per path: [V] bool, or None
    """What ``constraint`` allows after ``generated`` + each path of a token tree.

    None for a path that has left the grammar -- its last token is one its parent path's mask
    forbids (drawn from a row left unmasked) -- and for everything below it: such a node can never
    be kept, and the constraint, which cannot follow a forbidden token, is never asked about it.
    ``cache`` keeps the masks by path across calls (a draft round expands its tree level by level).
    """
    masks: dict[tuple[int, ...], Tensor] = {} if cache is None else cache
    out: list[Tensor | None] = []
    for path in paths:
        key = tuple(path)
        if key:
            above = masks.get(key[:-1])
            if above is None or not bool(above[key[-1]]):
                out.append(None)
                continue
        mask = masks.get(key)
        if mask is None:
            mask = masks[key] = constraint.allowed([*generated, *key], vocab)
        out.append(mask)
    return out



class StopFloor:
    """``min_tokens`` as a constraint: while fewer than ``n`` tokens have been generated, the stop
    tokens ``stop_ids`` are not allowed; ``inner`` (a grammar, or None) is applied as well.

    A pure function of the history like every constraint, so it masks the target's rows, the
    draft's and a tree's nodes alike, and every verification rule stays exact for the law with the
    stop tokens masked (as vLLM's ``min_tokens`` defines it).  Where ``inner`` allows nothing but
    stop tokens (a grammar that is complete), the grammar wins: the stop tokens stay allowed.
    """

    def __init__(self, stop_ids: frozenset[int], n: int, inner: Constraint | None = None) -> None:
        self.stop_ids = tuple(sorted(stop_ids))
        self.n = n
        self.inner = inner
        self._free: Tensor | None = None  # [V] all True, made once

    def _everything(self, vocab_size: int) -> Tensor:  # -> [V] bool
        if self._free is None or self._free.numel() != vocab_size:
            self._free = torch.ones(vocab_size, dtype=torch.bool)
        return self._free

    def allowed(self, generated: Sequence[int], vocab_size: int) -> Tensor:  # -> [V] bool
        base = self.inner.allowed(generated, vocab_size) if self.inner is not None else self._everything(vocab_size)
        if len(generated) >= self.n:
            return base
        ids = [t for t in self.stop_ids if t < vocab_size]
        mask = base.clone()
        mask[ids] = False
        return mask if bool(mask.any()) else base


def settled(constraint: Constraint | None, generated: Sequence[int]) -> Constraint | None:
    """The constraint in force from ``generated`` on, whatever follows: a :class:`StopFloor` whose
    floor was reached is its inner constraint (None: nothing is left to mask).  Putting it in the
    config in the old one's place changes no row's law, and saves every later row the constrained
    path (the penalty state, a mask per row, draft rows scattered over the whole vocabulary)."""
    while isinstance(constraint, StopFloor) and len(generated) >= constraint.n:
        constraint = constraint.inner
    return constraint


def floor_stops(cfg: "SamplingConfig", stop_ids: frozenset[int]) -> "SamplingConfig":
    """``cfg`` with its ``min_tokens`` turned into a :class:`StopFloor` over ``stop_ids`` (the
    sequence's end-of-sequence ids unless ignored, and ``cfg.stop_token_ids``), composed with its
    constraint; ``min_tokens`` is then 0, so a second call changes nothing.  The target's session
    and the drafter must both sample from the returned config."""
    if cfg.min_tokens == 0:
        return cfg
    if not stop_ids:
        return replace(cfg, min_tokens=0)
    return replace(cfg, constraint=StopFloor(frozenset(stop_ids), cfg.min_tokens, cfg.constraint), min_tokens=0)


def checked_bias(pairs: Sequence[tuple[int, float]], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """A logit bias as :class:`SamplingConfig` takes it: ``(token, bias)`` pairs sorted by token,
    each token inside the vocabulary and given once (:class:`ConfigError` otherwise)."""
    out: dict[int, float] = {}
    for token, bias in pairs:
        if not 0 <= token < vocab_size:
            raise ConfigError(f"logit_bias token {token} is outside the vocabulary [0, {vocab_size})")
        if token in out:
            raise ConfigError(f"logit_bias gives token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def offset_seed(seed: int, k: int) -> int:
    """The k-th seed after ``seed`` (seed + k, wrapped into the seed range): choice, turn or prompt
    k of a request, a chat or a batch that was given one seed."""
    return (int(seed) + k) % (defaults.MAX_SEED + 1)

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
    #: tokens that end the output as end-of-sequence does (vLLM's ``stop_token_ids``); the token is
    #: kept in the ids, its text left out of the output text
    stop_token_ids: tuple[int, ...] = ()
    #: the output text keeps the stop string (and a stop token's text) it ended at (vLLM's
    #: ``include_stop_str_in_output``)
    include_stop: bool = False
    #: the fewest tokens to generate: until then the stop tokens (end-of-sequence unless ignored,
    #: ``stop_token_ids``) are masked out of the law, and stop strings are not looked for in the
    #: first ``min_tokens`` tokens' text (vLLM's ``min_tokens``).  Applied by :func:`floor_stops`
    min_tokens: int = 0
    #: special tokens (end-of-turn, a tool call's marker, ...) are left out of the output text;
    #: False keeps them in it, except the end-of-sequence or stop token that ends the output
    #: (vLLM's ``skip_special_tokens``).  Text alone: the tokens and their law do not change
    skip_special_tokens: bool = True
    #: (token id, bias) pairs added to the logits before anything else (OpenAI ``logit_bias``)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: tokens allowed after the generated history (structured output); None = everything
    constraint: Constraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, value in _normalised(self).items():  # a str stop, lists, a bias mapping, numpy ints
            object.__setattr__(self, name, value)
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
    def needs_state(self) -> bool:
        """True when processing needs the generated history (penalties or a constraint)."""
        return self.has_penalties or self.constraint is not None

    @property
    def truncates(self) -> bool:
        """True when some tokens may get probability exactly zero (top-k / top-p / min-p)."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def _normalised(cfg: SamplingConfig) -> dict[str, object]:
    """The fields of ``cfg`` given in another accepted form, as :class:`SamplingConfig` keeps them:
    one stop string as a 1-tuple (a bare string was read as one stop per character), lists as
    tuples, a ``{token: bias}`` mapping as sorted pairs, integers and reals of other types (numpy's)
    as Python's; a value of the wrong kind is a one-line :class:`ConfigError`."""

    def whole(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return int(value)

    def real(name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        return float(value)

    def flag(name: str, value: object) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
        return value

    def items(name: str, value: object) -> tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{name} must be a list or tuple, got {value!r}")
        return tuple(value)

    out: dict[str, object] = {}
    for name in ("temperature", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        out[name] = real(name.replace("_", " "), getattr(cfg, name))
    for name in ("top_p", "min_p"):
        if getattr(cfg, name) is not None:
            out[name] = real(name.replace("_", "-"), getattr(cfg, name))
    for name in ("top_k", "seed"):
        if getattr(cfg, name) is not None:
            out[name] = whole(name.replace("_", "-"), getattr(cfg, name))
    out["max_new_tokens"] = whole("max new tokens", cfg.max_new_tokens)
    out["min_tokens"] = whole("min tokens", cfg.min_tokens)
    out["include_stop"] = flag("include_stop", cfg.include_stop)
    out["skip_special_tokens"] = flag("skip_special_tokens", cfg.skip_special_tokens)
    stop = (cfg.stop,) if isinstance(cfg.stop, str) else items("stop", cfg.stop)
    if not all(isinstance(text, str) and text for text in stop):
        raise ConfigError(f"stop strings must be non-empty strings, got {list(stop)!r}")
    out["stop"] = stop
    out["stop_token_ids"] = tuple(whole("a stop token id", t) for t in items("stop_token_ids", cfg.stop_token_ids))
    bias = cfg.logit_bias
    pairs = tuple(bias.items()) if isinstance(bias, Mapping) else items("logit_bias", bias)
    checked: dict[int, float] = {}
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ConfigError(f"logit bias takes (token id, bias) pairs, got {pair!r}")
        token = whole("a logit bias token id", pair[0])
        if token in checked:
            raise ConfigError(f"logit bias gives token {token} twice")
        checked[token] = real("a logit bias", pair[1])
    out["logit_bias"] = tuple(sorted(checked.items())) if isinstance(bias, Mapping) else tuple(checked.items())
    return {name: value for name, value in out.items() if value is not getattr(cfg, name)}


def validate(cfg: SamplingConfig) -> None:
    """Raise :class:`ConfigError` with a one-line message for any value that cannot be honoured."""
    if not math.isfinite(cfg.temperature) or cfg.temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {cfg.temperature}")
    if cfg.temperature != 0.0 and not defaults.MIN_TEMPERATURE <= cfg.temperature <= defaults.MAX_TEMPERATURE:
        # logits / 1e-300 overflow to inf and the softmax turns to NaN: refuse, never sample garbage
        raise ConfigError(
            f"temperature must be 0 (greedy) or between {defaults.MIN_TEMPERATURE:g} and {defaults.MAX_TEMPERATURE:g},"
            f" got {cfg.temperature}"
        )
    if cfg.top_k is not None and cfg.top_k < 1:
        raise ConfigError(f"top-k must be >= 1, got {cfg.top_k}")
    if cfg.top_p is not None and not (0.0 < cfg.top_p <= 1.0):
        raise ConfigError(f"top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.min_p is not None and not (0.0 <= cfg.min_p <= 1.0):
        raise ConfigError(f"min-p must be in [0, 1], got {cfg.min_p}")
    if not math.isfinite(cfg.repetition_penalty) or cfg.repetition_penalty <= 0:
        raise ConfigError(f"repetition penalty must be > 0, got {cfg.repetition_penalty}")
    if not defaults.MIN_REPETITION_PENALTY <= cfg.repetition_penalty <= defaults.MAX_REPETITION_PENALTY:
        raise ConfigError(
            f"repetition penalty must be between {defaults.MIN_REPETITION_PENALTY:g} and"
            f" {defaults.MAX_REPETITION_PENALTY:g} (1 = off), got {cfg.repetition_penalty}"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and abs(value) <= defaults.MAX_PENALTY):
            # past it, penalty times count overflows float32 and the law turns to NaN
            raise ConfigError(f"{name.replace('_', ' ')} must be between -{defaults.MAX_PENALTY:g} and"
                              f" {defaults.MAX_PENALTY:g}, got {value}")
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max new tokens must be >= 1, got {cfg.max_new_tokens}")
    if not 0 <= cfg.min_tokens <= cfg.max_new_tokens:
        raise ConfigError(f"min tokens must be between 0 and max new tokens ({cfg.max_new_tokens}), got {cfg.min_tokens}")
    if any(t < 0 for t in cfg.stop_token_ids):
        raise ConfigError(f"stop token ids must be >= 0, got {list(cfg.stop_token_ids)}")
    if cfg.seed is not None and not 0 <= cfg.seed <= defaults.MAX_SEED:
        raise ConfigError(f"the seed must be between 0 and 2^63 - 1 ({defaults.MAX_SEED}), got {cfg.seed}")
    for token, bias in cfg.logit_bias:
        if token < 0 or not (math.isfinite(bias) and abs(bias) <= defaults.MAX_PENALTY):
            raise ConfigError(f"logit bias needs token ids >= 0 and values between -{defaults.MAX_PENALTY:g} and"
                              f" {defaults.MAX_PENALTY:g}, got {token}: {bias}")


#: A common preset: temperature 1.0, top-p 0.9, repetition penalty 1.1.
PRESETS: dict[str, SamplingConfig] = {name: SamplingConfig(**fields) for name, fields in defaults.SAMPLING_PRESETS.items()}
GUIDE_PRESET = PRESETS["guide"]


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
    generated: list[int] = field(default_factory=list)  # the generated tokens, in order

    @classmethod
    def start(cls, prompt: Tensor, vocab_size: int) -> "PenaltyState":  # prompt: [L] int64
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[prompt] = True
        return cls(seen=seen, counts=torch.zeros(vocab_size, dtype=torch.float32))

    def copy(self) -> "PenaltyState":
        return PenaltyState(self.seen.clone(), self.counts.clone(), list(self.generated))

    def append(self, tokens: Tensor) -> None:  # tokens: [n] int64
        self.generated.extend(int(t) for t in tokens.reshape(-1).tolist())
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


def check_stop_token_ids(cfg: SamplingConfig, vocab_size: int) -> None:
    """``cfg.stop_token_ids`` are ids of a vocabulary of ``vocab_size``, or a one-line ConfigError
    (an id past it would be accepted and never end anything)."""
    past = sorted({t for t in cfg.stop_token_ids if t >= vocab_size})
    if past:
        raise ConfigError(f"stop token ids {past} are outside the vocabulary [0, {vocab_size}):"
                          " no token could end the output there")


def _apply_bias(logits: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:  # [n, V] -> [n, V]
    vocab = logits.shape[-1]
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long)  # [b]
    if int(ids.max()) >= vocab:
        raise ConfigError(f"logit bias names token {int(ids.max())}, outside the vocabulary [0, {vocab})")
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype)  # [b]
    out = logits.clone()
    out.index_add_(1, ids, values.unsqueeze(0).expand(logits.shape[0], -1))
    return out


def penalised_logits(
    logits: Tensor,  # [n, V]
    cfg: SamplingConfig,
    state: PenaltyState | None,
    draft: Tensor | None = None,  # [m] int64
) -> Tensor:
    """Steps 0-2 of the processing: logit bias and penalties (what greedy decoding takes the arg-max of)."""
    if cfg.logit_bias:
        logits = _apply_bias(logits, cfg.logit_bias)
    if not cfg.needs_state:
        return logits
    if state is None:
        raise ValueError("penalties and constraints need a PenaltyState")
    draft = draft if draft is not None else torch.empty(0, dtype=torch.long)
    if cfg.has_penalties:
        logits = _apply_penalties(logits, cfg, state, draft)
    if cfg.constraint is not None:
        logits = _apply_constraint(logits, cfg.constraint, state.generated, draft)
    return logits


def _apply_constraint(logits: Tensor, constraint: Constraint, generated: list[int], draft: Tensor) -> Tensor:
    """Row i: tokens the constraint forbids after ``generated + draft[:i]`` get -inf.  [n, V]

    A draft that leaves the constraint (a free draft such as prompt lookup's copies text without
    asking it) has probability 0 at its first forbidden token, so no rule keeps that token or
    anything after it: the rows after it are left as they are and the constraint, which cannot
    follow a forbidden history, is never asked about them (:func:`path_masks`, as for a tree)."""
    n, vocab = logits.shape
    drafted = draft.tolist()
    masks = path_masks(constraint, generated, [drafted[:i] for i in range(n)], vocab)
    live = sum(m is not None for m in masks)  # the rows up to the first forbidden token (a prefix)
    allowed = torch.stack(masks[:live])  # type: ignore[arg-type]  # [live, V]
    if not bool(allowed.any(-1).all()):
        raise ConfigError("the constraint allows no token here (is end-of-sequence allowed when it is complete?)")
    if live == n:
        return logits.masked_fill(~allowed, -math.inf)
    out = logits.clone()
    out[:live] = logits[:live].masked_fill(~allowed, -math.inf)
    return out


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
        return torch.nn.functional.one_hot(argmax_last(scores), scores.shape[-1]).to(scores.dtype)
    if cfg.temperature != 1.0:  # x / 1 is x, bit for bit: the division's pass over [n, V] is skipped
        scores = scores / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < scores.shape[-1]:
        kth = scores.topk(cfg.top_k, dim=-1).values[:, -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        probs = probs * _top_p_mask(probs, cfg.top_p)
        probs = probs / row_sums(probs)
    if cfg.min_p is not None and cfg.min_p > 0.0:
        threshold = cfg.min_p * probs.max(-1, keepdim=True).values
        probs = probs * (probs >= threshold)
        probs = probs / row_sums(probs)
    return probs


#: the blocks :func:`row_sums` adds up first
_SUM_BLOCK = 1024


def row_sums(x: Tensor) -> Tensor:  # [n, V] -> [n, 1]
    """Each row's sum, in an order fixed by the row's length alone.

    ``x.sum(-1)`` is not batch-invariant: with one row torch splits the reduction among its
    threads, with several it gives each row to one thread, so a row summed alone and the same row
    summed among others can differ in the last bit (measured: half of the rows renormalised after
    top-p or min-p over SmolLM2's vocabulary).  A verification pass processes γ + 1 rows where plain
    decoding processes one, so the speculative target law, the coupled rule's tokens at near-ties
    and the reported log-probabilities would drift from plain decoding's.  Here each row is cut into
    blocks of ``_SUM_BLOCK`` (zero-padded), each block summed on its own, then the block sums: every
    reduction is short enough that torch never splits it, so the bits depend neither on the other
    rows nor on the thread count."""
    n, vocab = x.shape
    pad = (-vocab) % _SUM_BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)) if pad else x
    return blocks.view(n, -1, _SUM_BLOCK).sum(-1).sum(-1, keepdim=True)


def target_logprobs(
    logits: Tensor,  # [n, V]
    cfg: SamplingConfig,
    state: PenaltyState | None = None,
    draft: Tensor | None = None,  # [m] int64, m >= n - 1
) -> Tensor:
    """Log of the processed law each row's token is drawn from.  [n, V] float64

    At temperature 0 that law is one-hot, so the log-softmax of the biased and penalised logits
    (temperature 1, no truncation) is returned instead.  Truncated tokens get ``-inf``.
    """
    if cfg.greedy:
        return torch.log_softmax(penalised_logits(logits, cfg, state, draft).double(), dim=-1)
    return process_logits(logits, cfg, state, draft).double().log()


def top_logprobs(logp: Tensor, tokens: Tensor, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of ``logp`` [n, V]: the log-probability of ``tokens`` [n] and the ``top`` best (id, log-probability)."""
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()  # [n]
    if top <= 0:
        return [(lp, []) for lp in chosen]
    vals, idx = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [n, top]
    return [(lp, list(zip(i, v))) for lp, v, i in zip(chosen, vals.tolist(), idx.tolist())]


def argmax_last(x: Tensor) -> Tensor:  # [..., V] -> [...] int64
    """The index of the first maximum along the last dimension: ``x.argmax(-1)``, which it equals
    (both return the first maximal index; NaN counts as the maximum, its first index wins).

    ``x.max(-1).indices`` is 2.5-4x faster than ``argmax`` on some CPUs (25 vs 70 us for one
    49k-word row), not on others (~125 us either way on a Zen 3 core, where torch's reduction with
    indices runs scalar); where a model loaded the kernels, float32 rows take one compiled call
    (~8 us a row there) that returns the same indices (tested against torch)."""
    from specdec.models import kernels

    if (kernels.loaded() and x.dtype == torch.float32 and x.dim() in (1, 2) and x.is_contiguous() and x.shape[-1] > 0
            and not x.requires_grad):
        if x.dim() == 2:  # the common case (a pass's rows): no views around the call
            return torch.ops.specdec.argmax_rows(x)
        return torch.ops.specdec.argmax_rows(x.unsqueeze(0))[0]
    return x.max(-1).indices


def sample_categorical(weights: Tensor, generator: torch.Generator | None) -> int:  # weights: [V] >= 0
    """One draw from ``weights / weights.sum()`` by inverting the float64 CDF with one uniform.

    About 20x faster than ``torch.multinomial`` on a 49k vocabulary; zero-weight tokens can never
    be drawn.  Where a model loaded the kernels, one compiled call computes the same CDF and search.
    """
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    from specdec.models import kernels

    if kernels.loaded() and weights.dim() == 1 and weights.is_contiguous() and weights.dtype in (torch.float32, torch.float64):
        return int(torch.ops.specdec.sample_weights(weights, float(u)))  # the same bits in one pass (tested)
    cdf = weights.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if idx == cdf.numel() and cdf[-1] > 0:
        # u * total rounded up to the total: only for a subnormal float64 total (u < 1 keeps the
        # product below any normal total).  The last token that adds to the sum, never a zero
        # weight after it.  All-zero or NaN weights fall through to the last index.
        idx = int(torch.searchsorted(cdf, cdf[-1]))
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
    key = _noise_key(seed, position)
    from specdec.models import kernels

    if kernels.loaded():  # one compiled pass, the same bits (tested); ~10x faster over a whole vocabulary
        return torch.ops.specdec.keyed_uniform(_to_signed(key), ids, vocab_size)
    hashes = _id_hashes(vocab_size)
    if ids is not None:
        hashes = hashes[ids]
    bits = _splitmix64(hashes ^ _to_signed(key))
    return (_srl(bits, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def _splitmix64_int(x: int) -> int:
    """:func:`_splitmix64` of one 64-bit value, on Python integers (unsigned result)."""
    x = (x + _GOLDEN) & _MASK64  # the same constants, read modulo 2**64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _noise_key(seed: int, position: int) -> int:
    """The mixed (seed, position) key of :func:`keyed_uniform`, unsigned."""
    return _splitmix64_int(_to_signed(seed) ^ _to_signed(position * 0x9E3779B1 + 0x1234567))


def _gumbel_compiled(probs: Tensor, seed: int, position: int, ids: Tensor | None = None, vocab: int = 0) -> int | None:
    """:func:`gumbel_sample`'s column in one compiled pass (``csrc/keyed.cpp``), or ``None`` where
    it does not run or cannot vouch for the torch ops' answer (about one row in 10^9; a NaN,
    infinite or negative entry): it decides the arg-max only when it wins by a relative margin
    that no rounding of the torch version's logarithms can close, so the token is the same."""
    from specdec.models import kernels

    if not (kernels.loaded() and probs.dim() == 1 and probs.is_contiguous() and probs.dtype in (torch.float32, torch.float64)):
        return None
    if ids is not None and not (ids.dtype == torch.long and ids.is_contiguous()):
        return None
    won = int(torch.ops.specdec.gumbel_argmax(probs, _to_signed(_noise_key(seed, position)), ids, vocab))
    return won if won >= 0 else None


def gumbel_sample(
    probs: Tensor, seed: int, position: int, ids: Tensor | None = None, vocab: int | None = None
) -> int:  # probs: [V], or [m] over ids [m]
    """Gumbel-max sample ``argmax_v log p(v) + G(seed, position, v)``, distributed as ``p``; a
    token id.

    Only tokens with ``p > 0`` can win, so the noise is drawn for the support alone: with top-p /
    top-k truncation this is a few hundred ids instead of the whole vocabulary.  A compact row
    (``ids`` [m] the target ids of ``probs``' entries, ``vocab`` the whole vocabulary's size; a
    reduced draft vocabulary) draws the token the row scattered into the whole vocabulary would:
    each entry is keyed by its id, and the zeros elsewhere could never win.
    """
    col = gumbel_column(probs, seed, position, ids, vocab)
    return col if ids is None else int(ids[col])


def gumbel_column(
    probs: Tensor, seed: int, position: int, ids: Tensor | None = None, vocab: int | None = None
) -> int:  # probs: [V], or [m] over ids [m]
    """:func:`gumbel_sample`'s draw as an index into ``probs`` (the token id itself without ``ids``)."""
    if ids is not None and (vocab is None or ids.shape != probs.shape):
        raise ValueError("a compact row needs its ids, one per entry, and the vocabulary's size")
    vocab = probs.shape[-1] if ids is None else vocab
    won = _gumbel_compiled(probs, seed, position, ids, vocab)  # (vocab is read only with ids)
    if won is not None:
        return won
    support = probs.nonzero().squeeze(-1)  # [m'] columns with p > 0
    full = ids is None and support.numel() == probs.numel()
    keys = None if full else (support if ids is None else ids[support])  # the token ids the noise is keyed by
    u = keyed_uniform(seed, position, keys, vocab)
    # exponential race: argmax log p - log(-log u)  ==  argmax log p + Gumbel
    p = probs.double() if full else probs[support].double()
    best = int((p.log() - torch.log(-torch.log(u))).argmax())
    return best if full else int(support[best])
