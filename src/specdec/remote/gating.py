"""Gating: how much to draft before calling the cloud.

Per draft token the gate reads the drafter's own predictive distribution (its softmax at
temperature 1, before any sampling processing, so the numbers mean the same at every temperature):

* NLL of the drafted token, ``-log2 q(x)`` (bits);
* entropy ``H = -sum q log2 q`` (bits);
* margin between the two most likely tokens, ``q_(1) - q_(2)``;
* MC-dropout variance of ``q(x)`` over several stochastic forward passes — only where the draft
  model has dropout (a Hugging Face model with a dropout rate > 0); otherwise reported
  ``unavailable``;

and rule triggers on the decoded text: numbers, dates, amounts, capitalised names inside a
sentence, and rare tokens (by a token-frequency table and a count threshold).  A token is *hard*
when ``nll > T_nll or H > T_H or margin < T_margin or var > T_var`` (unset thresholds are off).

Policies:

``shape`` (lossless, the default when gating is on)
    stop drafting right after the first hard or triggering token: the cloud call comes earlier
    with a shorter draft.  Output is untouched (any draft length is exact).
``lossy-local-commit``
    draft the whole block; if ``hard_ratio <= R_hard`` and no rule fired, commit it on the edge
    without the cloud (at most ``max_local_rounds`` blocks in a row).  Not exact; every such token
    is counted as unverified.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from torch import Tensor

from specdec.drafters.base import Draft, Drafter, DraftSampler
from specdec.errors import ConfigError
from specdec.verify import Verdict

GatePolicy = Literal["off", "shape", "lossy-local-commit"]
RULE_NAMES: tuple[str, ...] = ("number", "date", "amount", "name", "rare")
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class GateConfig:
    """Thresholds (defaults: T_H ~ 2.5 bits, T_margin = 0.2, R_hard = 0.3; T_nll: calibrate)."""

    policy: GatePolicy = "shape"
    t_entropy_bits: float | None = 2.5
    t_margin: float | None = 0.2
    t_nll_bits: float | None = None  # the 80th percentile on validation data (see calibrate_nll)
    t_mc_var: float | None = None  # set to use MC dropout (only where the draft has dropout)
    r_hard: float = 0.3
    rules: frozenset[str] = frozenset(RULE_NAMES)
    rare_max_count: int = 0  # a token seen at most this often in the frequency table is rare
    min_draft: int = 1  # ``shape`` never cuts a draft shorter than this
    mc_passes: int = 8
    max_local_rounds: int = 4  # ``lossy-local-commit``: then a cloud call is forced

    def __post_init__(self) -> None:
        if self.policy not in ("off", "shape", "lossy-local-commit"):
            raise ConfigError(f"gate policy must be off, shape or lossy-local-commit, got {self.policy!r}")
        unknown = set(self.rules) - set(RULE_NAMES)
        if unknown:
            raise ConfigError(f"unknown gate rules {sorted(unknown)}; choose from {', '.join(RULE_NAMES)}")
        if not 0.0 <= self.r_hard <= 1.0:
            raise ConfigError(f"R_hard must be in [0, 1], got {self.r_hard}")
        for name, value, high in (("T_H (entropy bits)", self.t_entropy_bits, math.inf), ("T_margin", self.t_margin, 1.0),
                                  ("T_nll (bits)", self.t_nll_bits, math.inf), ("T_var", self.t_mc_var, math.inf)):
            if value is not None and not (0.0 <= value <= high and math.isfinite(value)):
                bound = "a finite number >= 0" if high == math.inf else f"in [0, {high:g}]"
                raise ConfigError(f"the gate's {name} must be {bound}, got {value}")
        if self.rare_max_count < 0:
            raise ConfigError(f"the rare-token count must be >= 0, got {self.rare_max_count}")
        if self.min_draft < 1 or self.mc_passes < 2 or self.max_local_rounds < 1:
            raise ConfigError("min_draft and max_local_rounds must be >= 1, mc_passes >= 2")

    @property
    def lossless(self) -> bool:
        return self.policy != "lossy-local-commit"


# ----------------------------------------------------------------------------- per-token signals


@dataclass(frozen=True)
class TokenSignals:
    nll_bits: float
    entropy_bits: float
    margin: float
    mc_var: float | None  # None: not measured (no dropout in the draft, or not asked for)
    triggers: tuple[str, ...]
    hard: bool


def uncertainty(logits: Tensor, token: int) -> tuple[float, float, float]:  # logits: [V] or [1, V]
    """(NLL bits of ``token``, entropy bits, top-1 minus top-2 probability) of ``softmax(logits)``."""
    logp = torch.log_softmax(logits.reshape(-1).float(), dim=-1)  # [V]
    p = logp.exp()
    entropy = float(-(p * logp).nan_to_num(0.0).sum()) / _LN2
    top = p.topk(min(2, p.numel())).values
    margin = float(top[0] - top[1]) if top.numel() > 1 else 1.0
    return float(-logp[token]) / _LN2, entropy, margin


def is_hard(cfg: GateConfig, nll: float, entropy: float, margin: float, mc_var: float | None) -> bool:
    return (
        (cfg.t_nll_bits is not None and nll > cfg.t_nll_bits)
        or (cfg.t_entropy_bits is not None and entropy > cfg.t_entropy_bits)
        or (cfg.t_margin is not None and margin < cfg.t_margin)
        or (cfg.t_mc_var is not None and mc_var is not None and mc_var > cfg.t_mc_var)
    )


def calibrate_nll(nll_bits: Sequence[float], quantile: float = 0.8) -> float:
    """T_nll: a quantile (default the 80th percentile) of NLLs on validation data."""
    if not nll_bits:
        raise ConfigError("calibration needs at least one NLL value")
    return float(torch.quantile(torch.tensor(list(nll_bits), dtype=torch.float64), quantile))


# ----------------------------------------------------------------------------- MC dropout


def _torch_module(model: Any) -> torch.nn.Module | None:
    inner = getattr(model, "inner", model)  # a SerializedModel wrapper
    module = getattr(inner, "model", None)
    return module if isinstance(module, torch.nn.Module) else None


def has_dropout(model: Any) -> bool:
    """True when ``model`` (a LanguageModel) is a torch module with a dropout rate > 0 somewhere."""
    module = _torch_module(model)
    if module is None:
        return False
    cfg = getattr(module, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "hidden_dropout_prob"):
        value = getattr(cfg, name, 0.0)
        if isinstance(value, (int, float)) and value > 0:
            return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())


def mc_dropout_variance(model: Any, context: Tensor, tokens: Tensor, passes: int = 8) -> Tensor | None:
    """Variance over ``passes`` dropout-on forward passes of ``q(tokens[i])``.  [γ] float64, or None.

    ``context`` [L] and ``tokens`` [γ] int64.  Runs the whole sequence without a cache (the
    signal's price: ``passes`` full forwards), so it is off unless a threshold asks for it.
    """
    module = _torch_module(model)
    if module is None or not has_dropout(model) or tokens.numel() == 0:
        return None
    ids = torch.cat([context, tokens]).unsqueeze(0)  # [1, L + γ]
    start, gamma = context.numel() - 1, tokens.numel()
    was_training = module.training
    module.train()
    try:
        with torch.no_grad():
            rows = []
            for _ in range(passes):
                logits = module(input_ids=ids).logits[0, start : start + gamma].float()  # [γ, V]
                rows.append(torch.softmax(logits, -1)[torch.arange(gamma), tokens])
    finally:
        module.train(was_training)
    return torch.stack(rows).double().var(0)  # [γ]


# ----------------------------------------------------------------------------- rule triggers

_MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december|"
    "jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec|monday|tuesday|wednesday|thursday|friday|saturday|sunday"
)
_DATE_WORD = re.compile(rf"^(?:{_MONTHS})\.?$", re.IGNORECASE)
_DATE_TAIL = re.compile(r"(?:\d{1,4}[-/.]\d{1,2}(?:[-/.]\d{0,4})?|\b(?:1[5-9]|20)\d{2})$")
_CURRENCY = re.compile(r"[$€£¥₹₩¢]|\b(?:USD|EUR|GBP|JPY|CNY|RMB|CHF)\b|元")
_AMOUNT_WORD = re.compile(r"^(?:%|percent|per cent|dollars?|euros?|pounds?|yen|yuan|cents?|bucks?|million|billion|k)$", re.IGNORECASE)
_NAME = re.compile(r"^[A-Z][a-z]+(?:['’-][A-Za-z]+)*$")
_SENTENCE_END = frozenset('.!?:;"\n“”')


class RuleTriggers:
    """Text rules that force a cloud call: numbers, dates, amounts, names, rare tokens."""

    def __init__(self, tokenizer: Any | None, *, rules: frozenset[str] = frozenset(RULE_NAMES),
                 frequency: Tensor | None = None, rare_max_count: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rules = rules
        self.frequency = frequency  # [V] counts, or None (the rare rule is then off)
        self.rare_max_count = rare_max_count
        self._texts: dict[int, str] = {}

    @property
    def active(self) -> bool:
        text_rules = self.tokenizer is not None and bool(self.rules - {"rare"})
        return text_rules or ("rare" in self.rules and self.frequency is not None)

    def text(self, token: int) -> str:
        cached = self._texts.get(token)
        if cached is None:
            cached = self._texts[token] = self.tokenizer.decode([token]) if self.tokenizer is not None else ""
        return cached

    def check(self, prefix: str, token: int) -> tuple[str, ...]:
        """Rules that ``token`` fires after the text ``prefix``."""
        fired: list[str] = []
        rules = self.rules
        if "rare" in rules and self.frequency is not None:
            if token >= self.frequency.numel() or int(self.frequency[token]) <= self.rare_max_count:
                fired.append("rare")
        if self.tokenizer is None:
            return tuple(fired)
        text = self.text(token)
        word = text.strip()
        has_digit = any(c.isdigit() for c in text)
        if "number" in rules and has_digit:
            fired.append("number")
        if "date" in rules and (_DATE_WORD.match(word) or (has_digit and _DATE_TAIL.search((prefix + text)[-16:]))):
            fired.append("date")
        if "amount" in rules:
            tail = prefix[-4:]
            if _CURRENCY.search(text) or (has_digit and _CURRENCY.search(tail)) or (
                _AMOUNT_WORD.match(word) and prefix.rstrip()[-1:].isdigit()
            ):
                fired.append("amount")
        if "name" in rules and word and _NAME.match(word) and word not in ("I",):
            before = prefix.rstrip()
            starts_word = text[:1].isspace() or prefix[-1:].isspace()
            if before and starts_word and before[-1] not in _SENTENCE_END:
                fired.append("name")
        return tuple(fired)


def token_frequency(source: str | Path, *, tokenizer: Any | None, vocab_size: int) -> Tensor:
    """Token counts [V] from a JSON file (a list of counts by id, or ``{"id": count}``) or a text corpus."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"frequency table {str(source)!r} is not a file")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    if path.suffix.lower() == ".json":
        data = json.loads(path.read_text())
        items = enumerate(data) if isinstance(data, list) else ((int(k), v) for k, v in data.items())
        for tok, count in items:
            if 0 <= int(tok) < vocab_size:
                counts[int(tok)] = int(count)
        return counts
    if tokenizer is None:
        raise ConfigError("a text corpus as frequency table needs a tokenizer")
    ids = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
    ids_t = torch.tensor([i for i in ids if i < vocab_size], dtype=torch.long)
    counts.index_add_(0, ids_t, torch.ones_like(ids_t))
    return counts


# ----------------------------------------------------------------------------- the gate


@dataclass(frozen=True)
class BlockReport:
    """What the gate saw in one draft block."""

    signals: tuple[TokenSignals, ...]
    hard_ratio: float
    triggered: tuple[str, ...]
    escalate: bool  # the 'send to the cloud' decision
    stopped_early: bool


@dataclass
class GateStats:
    rounds: int = 0
    tokens: int = 0
    hard_tokens: int = 0
    early_stops: int = 0
    escalations: int = 0
    local_commits: int = 0
    triggers: dict[str, int] = field(default_factory=dict)
    hard_ratio_sum: float = 0.0

    def summary(self, cfg: GateConfig, mc: str) -> dict[str, Any]:
        return {
            "policy": cfg.policy,
            "lossless": cfg.lossless,
            "rounds": self.rounds,
            "gated_tokens": self.tokens,  # the drafted tokens the gate judged; hard_tokens of them hard
            "hard_tokens": self.hard_tokens,
            "mean_hard_ratio": self.hard_ratio_sum / self.rounds if self.rounds else 0.0,
            "early_stops": self.early_stops,
            "escalations": self.escalations,
            "local_commits": self.local_commits,
            "cloud_call_ratio": 1.0 - self.local_commits / self.rounds if self.rounds else 1.0,
            "triggers": dict(self.triggers),
            "mc_dropout": mc,
        }


class Gate:
    """Signals + decisions; shared by :class:`GatedDrafter` and the remote verifier's local commit."""

    def __init__(self, cfg: GateConfig, *, triggers: RuleTriggers | None = None, draft_model: Any | None = None) -> None:
        self.cfg = cfg
        self.triggers = triggers or RuleTriggers(None, rules=frozenset())
        self.draft_model = draft_model
        self.stats = GateStats()
        self.last: BlockReport | None = None
        self._last_tokens: Tensor | None = None
        self._local_streak = 0
        self.mc_available = draft_model is not None and has_dropout(draft_model)

    @property
    def mc_status(self) -> str:
        if self.cfg.t_mc_var is None:
            return "off"
        return "on" if self.mc_available else "unavailable"

    def summary(self) -> dict[str, Any]:
        return self.stats.summary(self.cfg, self.mc_status)

    def finish_block(self, context: Tensor, draft: Draft, signals: list[TokenSignals], requested: int) -> Draft:
        """Add MC dropout where asked, cut the draft (``shape``), decide escalation, record stats.

        ``context`` [L]; ``requested`` is the γ the decoder asked for.
        """
        cfg = self.cfg
        gamma = draft.tokens.numel()
        signals = signals[:gamma]
        if cfg.t_mc_var is not None and self.mc_available and signals:
            var = mc_dropout_variance(self.draft_model, context, draft.tokens[: len(signals)], cfg.mc_passes)
            if var is not None:
                signals = [
                    TokenSignals(s.nll_bits, s.entropy_bits, s.margin, float(v), s.triggers,
                                 is_hard(cfg, s.nll_bits, s.entropy_bits, s.margin, float(v)))
                    for s, v in zip(signals, var.tolist())
                ]
        if cfg.policy == "shape" and signals:
            cut = next((i + 1 for i, s in enumerate(signals) if s.hard or s.triggers), gamma)
            cut = max(cut, min(cfg.min_draft, gamma))
            if cut < gamma:
                draft = Draft(tokens=draft.tokens[:cut], probs=None if draft.probs is None else draft.probs[:cut])
                signals = signals[:cut]
        stopped = draft.tokens.numel() < requested and bool(signals)
        n = len(signals)
        hard = sum(1 for s in signals if s.hard)
        fired = tuple(sorted({t for s in signals for t in s.triggers}))
        ratio = hard / n if n else 0.0
        # without signals (a deterministic drafter) there is nothing to judge: always ask the cloud
        escalate = not n or ratio > cfg.r_hard or bool(fired)
        report = BlockReport(tuple(signals), ratio, fired, escalate, stopped)
        st = self.stats
        st.rounds += 1
        st.tokens += n
        st.hard_tokens += hard
        st.hard_ratio_sum += ratio
        st.early_stops += int(stopped)
        st.escalations += int(escalate)
        for s in signals:
            for t in s.triggers:
                st.triggers[t] = st.triggers.get(t, 0) + 1
        self.last = report
        self._last_tokens = draft.tokens
        return draft

    def local_commit(self, draft: Draft) -> bool:
        """``lossy-local-commit``: may the edge keep ``draft`` (the block just gated) without the cloud?"""
        report = self.last
        ok = (
            self.cfg.policy == "lossy-local-commit"
            and report is not None
            and self._last_tokens is not None
            and torch.equal(self._last_tokens, draft.tokens)
            and not report.escalate
            and self._local_streak < self.cfg.max_local_rounds
        )
        self._local_streak = self._local_streak + 1 if ok else 0
        if ok:
            self.stats.local_commits += 1
        return ok


class _GateSampler:
    """Wraps the decoder's :class:`DraftSampler`: samples exactly as it does, records the signals,
    and raises ``stop_requested`` (read by :class:`specdec.drafters.ModelDrafter`) at a hard token."""

    def __init__(self, inner: DraftSampler, gate: Gate, prefix: str) -> None:
        self.inner = inner
        self.gate = gate
        self.prefix = prefix
        self.signals: list[TokenSignals] = []
        self.stop_requested = False

    #: the signals read the row at the drawn token's id: whole-vocabulary rows only
    compact = False

    def __call__(self, logits: Tensor, position: int) -> tuple[int, Tensor | None]:  # logits: [1, V]
        token, q = self.inner(logits, position)
        cfg = self.gate.cfg
        nll, entropy, margin = uncertainty(logits, token)
        triggers = self.gate.triggers.check(self.prefix, token) if self.gate.triggers.active else ()
        if self.gate.triggers.tokenizer is not None:
            self.prefix = (self.prefix + self.gate.triggers.text(token))[-64:]
        hard = is_hard(cfg, nll, entropy, margin, None)
        self.signals.append(TokenSignals(nll, entropy, margin, None, triggers, hard))
        if cfg.policy == "shape" and (hard or triggers) and len(self.signals) >= cfg.min_draft:
            self.stop_requested = True
        return token, q

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GatedDrafter:
    """A :class:`Drafter` whose drafts the gate shapes (and, in the lossy policy, judges)."""

    def __init__(self, inner: Drafter, gate: Gate, *, context_tokens: int = 8) -> None:
        self.inner = inner
        self.gate = gate
        self.context_tokens = context_tokens

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        self.inner.prepare(prompt)

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        if self.gate.cfg.policy == "off":
            return self.inner.propose(context, gamma, sampler)
        triggers = self.gate.triggers
        prefix = ""
        if triggers.tokenizer is not None:
            prefix = triggers.tokenizer.decode(context[-self.context_tokens :].tolist())
        spy = _GateSampler(sampler, self.gate, prefix)
        draft = self.inner.propose(context, gamma, spy)  # type: ignore[arg-type]
        return self.gate.finish_block(context, draft, spy.signals, gamma)

    def commit(self, verdict: Verdict) -> None:
        self.inner.commit(verdict)

    def __getattr__(self, name: str) -> Any:
        """The inner drafter's other hooks (a hybrid's ``update_free``, ``finish``, ...), but not its
        trees (the gate judges chain drafts token by token), nor its copies (``spawn``,
        ``with_model``: they would be ungated)."""
        if name in ("inner", "supports_trees", "propose_tree", "spawn", "with_model"):
            raise AttributeError(name)
        return getattr(self.inner, name)
