"""Self-speculative drafters: the target drafts for itself with part of its computation skipped.

* **Early exit** (``layerskip:K``; Elhoushi et al. 2024, *LayerSkip*): the target's first ``K``
  layers, then its final norm and LM head.  The draft's keys/values for layers < K are exactly
  what the target computes for the same tokens (the native target is batch-invariant), so the
  verification pass reuses them and runs only layers >= K for the drafted positions, starting
  from the draft's layer-K hidden states (*cache sharing*, see :class:`SharedLayers`); the other
  way round, the draft copies the target's keys/values of layers < K for committed tokens from
  the target's cache instead of running its layers over them (:meth:`SelfSpecDrafter.bind_target`).
* **Layer skipping** (``self-skip``; Zhang et al. 2024, *Draft & Verify*): every layer, with a
  set of attention and MLP sub-layers skipped; the set is searched offline on calibration
  prompts (``specdec train skip``) and shipped per target as a small JSON file.  ``swift`` (Xia
  et al. 2024, *SWIFT*) adapts the set on the fly from the tokens the target has committed.

Every drafter here is a *view* of the target: it holds a reference to the target's weights, never
a copy.  Its memory is its own KV cache (the layers it runs) and, drafting over a reduced
vocabulary, the copy of the LM head's rows for it (Qwen2.5-Coder-1.5B: 44 MB of 4-bit rows) — see
:func:`extra_bytes`.  It
is an ordinary chain drafter (:class:`~specdec.drafters.model.ModelDrafter` over a
:class:`LayerView`), so every verification rule and sampling option applies unchanged.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from specdec import defaults
from specdec.bench.theory import best_chain_speedup
from specdec.catalog import SKIP_SETS_DIR, check_shipped, describe_families, parse_self_spec  # noqa: F401 - re-exported
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.model import ModelDrafter
from specdec.errors import ConfigError
from specdec.kv_cache import KVCache, cache_length


@dataclass(frozen=True)
class LayerPlan:
    """Which of the target's sub-layers a self-speculative draft runs.

    ``exit_after`` = K runs layers ``0 .. K-1`` (early exit); ``skip_attn`` / ``skip_mlp`` name
    sub-layers (by layer index) that are skipped inside that range (their residual branch is
    dropped: ``x + 0``).
    """

    n_layers: int
    exit_after: int
    skip_attn: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 1 <= self.exit_after <= self.n_layers:
            raise ConfigError(f"early exit must be after 1 to {self.n_layers} layers, got {self.exit_after}")
        bad = [i for i in (*self.skip_attn, *self.skip_mlp) if not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"skipped layer indices must be in 0..{self.n_layers - 1}, got {sorted(bad)}")

    @classmethod
    def early_exit(cls, n_layers: int, k: int) -> "LayerPlan":
        return cls(n_layers, k)

    @classmethod
    def skipping(cls, n_layers: int, attn: "frozenset[int] | set[int]", mlp: "frozenset[int] | set[int]") -> "LayerPlan":
        return cls(n_layers, n_layers, frozenset(attn), frozenset(mlp))

    @property
    def steps(self) -> tuple[tuple[int, bool, bool], ...]:
        """``(layer, attention on, MLP on)`` for every layer that runs at least one sub-layer."""
        out = []
        for li in range(self.exit_after):
            a, m = li not in self.skip_attn, li not in self.skip_mlp
            if a or m:
                out.append((li, a, m))
        return tuple(out)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose attention runs, in order: the draft cache holds exactly these."""
        return tuple(li for li, a, _ in self.steps if a)

    def to_json(self) -> dict[str, Any]:
        return {"n_layers": self.n_layers, "exit_after": self.exit_after,
                "skip_attn": sorted(self.skip_attn), "skip_mlp": sorted(self.skip_mlp)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "LayerPlan":
        """The plan a skip-set file holds (``specdec train skip`` writes them), or a one-line
        ConfigError naming what is wrong: every count and index a JSON integer (1.7 was cut to 1)."""
        if not isinstance(obj, dict):
            raise ConfigError(f"not a layer plan: expected a JSON object, got {type(obj).__name__}")
        if "n_layers" not in obj:
            raise ConfigError("not a layer plan: it has no 'n_layers' (the target's layer count)")

        def whole(value: Any, what: str) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"not a layer plan: {what} must be a whole number, got {json.dumps(value)}")
            return value

        def indices(key: str) -> frozenset[int]:
            values = obj.get(key, [])
            if not isinstance(values, list):
                raise ConfigError(f"not a layer plan: {key} must be a list of layer indices, got {json.dumps(values)}")
            return frozenset(whole(v, f"each index in {key}") for v in values)

        n = whole(obj["n_layers"], "n_layers")
        return cls(n, whole(obj.get("exit_after", n), "exit_after"), indices("skip_attn"), indices("skip_mlp"))


class ViewCache(KVCache):
    """A draft cache for a :class:`LayerView`: keys/values of the layers the view runs, plus
    (for cache sharing) the residual stream leaving the view's last layer and the token at
    every position.  Like :class:`KVCache` it may start short (``initial_length``) and grow.
    ``kv_dtype``: the keys' and values' dtype where it is not the residuals' ``dtype`` (the
    target's own, :meth:`NativeCausalLM.set_kv_dtype`): the view's layers must see the rounded
    keys and values the target's passes see, or what it shares with them would not be theirs."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_length: int, *, dtype: torch.dtype,
                 hidden_size: int = 0, initial_length: int | None = None, kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(max(n_layers, 1), n_kv_heads, head_dim, max_length, dtype=kv_dtype or dtype,
                         initial_length=initial_length)
        cap = self.capacity
        self.resid: Tensor | None = torch.zeros(cap, hidden_size, dtype=dtype) if hidden_size else None  # [C, D]
        self.tokens = torch.full((cap,), -1, dtype=torch.long)  # [C]

    def _grow(self, capacity: int) -> None:
        super()._grow(capacity)
        n = self.length
        tokens = torch.full((capacity,), -1, dtype=torch.long)  # [C']
        tokens[:n] = self.tokens[:n]
        self.tokens = tokens
        if self.resid is not None:
            resid = self.resid.new_zeros(capacity, self.resid.shape[1])  # [C', D]
            resid[:n] = self.resid[:n]
            self.resid = resid

    @property
    def nbytes(self) -> int:
        extra = self.resid.numel() * self.resid.element_size() if self.resid is not None else 0
        return super().nbytes + extra + self.tokens.numel() * 8

    @property
    def bytes_per_position(self) -> int:
        """Keys/values of every layer, plus the residual row and the token id kept per position."""
        resid = self.resid.shape[1] * self.resid.element_size() if self.resid is not None else 0
        return super().bytes_per_position + resid + 8


class LayerView:
    """The target seen through a :class:`LayerPlan`: a :class:`~specdec.models.base.LanguageModel`
    that shares the target's weights (no copy) and keeps its own, smaller cache."""

    def __init__(self, target: Any, plan: LayerPlan, *, keep_hidden: bool = False, reduced: Any = None) -> None:
        """``reduced``: a :class:`~specdec.models.native.ReducedHead` of the target, the head the
        view drafts through (its reduced vocabulary's rows alone), or None for the whole head."""
        if not hasattr(target, "run_layers"):
            raise ConfigError(
                "self-speculative drafters need the native backend (a Llama, Qwen2, Qwen3, Mistral or Gemma 3 target loaded with --backend native or auto)"
            )
        if plan.n_layers != target.cfg.n_layers:
            raise ConfigError(f"the layer plan is for {plan.n_layers} layers, the target has {target.cfg.n_layers}")
        self.target = target
        self.plan = plan
        self.vocab_size = target.vocab_size
        self.max_length = target.max_length
        self.keep_hidden = keep_hidden
        self.reduced = reduced
        self._steps = plan.steps
        slot = {li: i for i, li in enumerate(plan.attention_layers)}
        self._slots = [slot.get(li, 0) for li, _, _ in self._steps]

    def new_cache(self, max_length: int | None = None, *, initial_length: int | None = None) -> ViewCache:
        cfg = self.target.cfg
        length = cache_length(max_length, self.max_length)
        return ViewCache(len(self.plan.attention_layers), cfg.n_kv_heads, cfg.head_dim, length, dtype=self.target.dtype,
                         hidden_size=cfg.hidden_size if self.keep_hidden else 0, initial_length=initial_length,
                         kv_dtype=self.target.kv_dtype)

    def _layers(self, tokens: Tensor, cache: ViewCache) -> tuple[Tensor, int]:  # [n] -> ([n, D], start)
        """Run the plan's layers for ``tokens`` on ``cache`` (recording tokens and residuals)."""
        n = tokens.numel()
        start = cache.reserve(n)
        cache.tokens[start : start + n] = tokens
        x = self.target.run_layers(self.target.embed_tokens(tokens), cache, self._steps, start=start, slots=self._slots)
        if cache.resid is not None:
            cache.resid[start : start + n] = x
        return x, start

    @property
    def vocab_ids(self) -> Tensor | None:
        """Target ids of the draft vocabulary's rows (sorted) where the view drafts over a reduced
        one, else None (see :meth:`ModelDrafter._compact_ids`)."""
        return None if self.reduced is None else self.reduced.ids

    def logits(self, x: Tensor, *, compact: bool = False) -> Tensor:  # [n, D] residual stream -> [n, V | Vd]
        """The view's final norm + LM head: the target's, or its reduced vocabulary's rows
        (``compact``: as they are; otherwise scattered over the whole vocabulary)."""
        return self.target.head(x) if self.reduced is None else self.reduced.logits(x, compact=compact)

    def greedy(self, x: Tensor) -> Tensor:  # [n, D] residual stream -> [n] target token ids
        """The view's arg-max token for each row."""
        top = self.logits(x, compact=True).argmax(-1)
        return top if self.reduced is None else self.reduced.ids[top]

    def forward(self, tokens: Tensor, cache: ViewCache, *, last_only: bool = False, compact: bool = False
                ) -> Tensor:  # [n] -> [n|1, V], or [n|1, Vd] with ``compact``
        with torch.inference_mode():
            x, _ = self._layers(tokens, cache)
            return self.logits(x[-1:] if last_only else x, compact=compact)


@dataclass(frozen=True)
class SharedLayers:
    """Cache sharing for early exit: lets the verification pass reuse what the draft computed.

    The draft ran layers ``< k`` for ``[pending] + draft[:-1]`` with the target's own operations,
    one row at a time; the target is batch-invariant, so those keys/values and the residual
    stream entering layer ``k`` are bitwise what its verification pass would compute for the
    same rows.  :meth:`forward` copies them into the target's cache, runs layers ``< k`` only for
    the rows the draft did not feed (the last draft token), and layers ``>= k`` for all rows.
    Verified bitwise against the plain pass on the real weights (``tests/real``).
    """

    target: Any  # the NativeCausalLM the draft is a view of
    k: int
    cache: ViewCache = field(repr=False)

    def forward(self, model: Any, tokens: Tensor, cache: KVCache) -> Tensor | None:  # tokens: [n] -> [n, V] | None
        """Logits of the verification pass, or None when nothing can be reused (then the caller
        runs its plain pass)."""
        passed = self._pass(model, tokens, cache)
        return None if passed is None else self.target.head(passed[1])

    def forward_features(self, model: Any, tokens: Tensor, cache: KVCache, taps: tuple[int, ...]
                         ) -> tuple[Tensor, Tensor] | None:  # tokens: [n] -> ([n, V], [n, 2, D]) | None
        """:meth:`forward` with the features of ``taps == (k,)``: per row the residual stream after
        the first k layers and the final hidden state (the layout of the target's
        ``forward_features``, bitwise its values); None for other taps or when nothing can be reused."""
        if tuple(taps) != (self.k,):
            return None
        passed = self._pass(model, tokens, cache)
        if passed is None:
            return None
        x, h = passed
        with torch.inference_mode():
            return self.target.head(h), torch.stack([x, self.target.final_norm(h)], dim=1)

    def _pass(self, model: Any, tokens: Tensor, cache: KVCache) -> tuple[Tensor, Tensor] | None:
        """The residual stream after layer k-1 and after the last layer, [n, D] each, or None."""
        if model is not self.target or self.cache.resid is None:
            return None
        n = tokens.numel()
        base = cache.length
        m = min(n, self.cache.length - base)
        if m <= 0 or not torch.equal(self.cache.tokens[base : base + m], tokens[:m]):
            return None
        k, target = self.k, self.target
        with torch.inference_mode():
            cache.reserve(n)
            cache.k[:k, :, base : base + m] = self.cache.k[:k, :, base : base + m]
            cache.v[:k, :, base : base + m] = self.cache.v[:k, :, base : base + m]
            x = self.cache.resid[base : base + m]  # [m, D]
            if m < n:
                lower = tuple((li, True, True) for li in range(k))
                rest = target.run_layers(target.embed_tokens(tokens[m:]), cache, lower, start=base + m)  # [n-m, D]
                x = torch.cat([x, rest])
            upper = tuple((li, True, True) for li in range(k, target.cfg.n_layers))
            return x, target.run_layers(x, cache, upper, start=base)


class SelfSpecDrafter(ModelDrafter):
    """A :class:`ModelDrafter` over a :class:`LayerView` of the target; with ``share`` (early exit
    only) its drafts carry :class:`SharedLayers` for the verification pass."""

    def __init__(self, view: LayerView, *, share: bool = False, max_length: int | None = None) -> None:
        super().__init__(view, max_length=max_length)
        if share and (view.plan.skip_attn or view.plan.skip_mlp):
            raise ConfigError("cache sharing needs a pure early-exit plan (no skipped sub-layers)")
        #: sharing is bitwise only when the target scores a block row by row as it scores one
        #: token (batch-invariant); a --fast-attention target verifies the plain way
        self.share = share and bool(getattr(view.target, "batch_invariant", False))
        self._target_cache: KVCache | None = None
        self._synced = 0  # leading positions of the view's cache holding the target's keys/values
        self._use_view(view)

    def _use_view(self, view: LayerView) -> None:
        """Draft through ``view`` (SWIFT moves to another skip set): its cache's layer i is the
        target's layer ``attention_layers[i]``, the map :meth:`_copy_committed` copies by."""
        self.view = view
        self._layers = torch.tensor(view.plan.attention_layers, dtype=torch.long)

    def bind_target(self, model: Any, cache: KVCache | None) -> None:
        """The target's own cache for the coming sequence (the decoder calls this before
        :meth:`prepare`, for a local target).  At committed positions the view takes the keys and
        values of the layers whose attention it runs from there instead of running its layers over
        the prompt and over every token committed while it was not drafting (the second prefill
        and the catch-ups a view with a cache of its own paid for):

        * early exit: they are what the view would compute — the same layers on the same inputs,
          and the batch-invariant target computes a row alike in any pass;
        * a skip set: the view's own would differ after its first skipped sub-layer, and the
          target's are the better context (Draft & Verify and SWIFT draft over the target's cache).
          Positions the view computed itself while drafting are replaced by the target's once
          committed.

        Either way what the view holds only shapes its drafts: verification is the target's own
        pass, so the output law is untouched.  A server's wrapper around the target (``inner``: its
        passes serialised or batched) binds the same way."""
        target = getattr(model, "inner", model)
        self._target_cache = cache if target is self.view.target else None

    def reset(self, expected: int = 0) -> None:
        super().reset(expected)
        self._synced = 0

    @property
    def whole_target(self) -> bool:
        """Whether the view runs every sub-layer of the target (a searched skip set that came out
        empty): then a drafted token costs a whole target step and drafting cannot pay, which the
        decoder tells the γ controller before the first round (:meth:`CostGamma.start_idle`)."""
        plan = self.view.plan
        return plan.exit_after == plan.n_layers and not plan.skip_attn and not plan.skip_mlp

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        if self._target_cache is None and not self.whole_target:
            super().prepare(prompt)
        else:  # copied from the target's cache when drafting starts (early exit), or fed by the
            # first round that drafts at all (a whole-target view rarely does: no prefill up front)
            self.reset(prompt.numel())

    def _copy_committed(self, context: Tensor) -> None:  # context: [L]
        """Bring the view's cache up to the target's for committed positions (see
        :meth:`bind_target`): those it lacks, and those it computed itself that are committed now;
        the last context token is left to the view's own forward, whose logits drafting needs."""
        source, cache = self._target_cache, self.cache
        if source is None or cache is None:
            return
        have, upto = cache.length, min(source.length, context.numel() - 1)
        start = min(self._synced, have)
        if upto <= start:
            return
        if upto > have:
            cache.reserve(upto - have)
        n_layers = self._layers.numel()
        if n_layers:  # [A, Hkv, n, d] of the attention layers the view runs
            cache.k[:n_layers, :, start:upto] = source.k[:, :, start:upto].index_select(0, self._layers)
            cache.v[:n_layers, :, start:upto] = source.v[:, :, start:upto].index_select(0, self._layers)
        cache.tokens[start:upto] = context[start:upto]
        self._synced = upto

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        if gamma > 0:
            self._copy_committed(context)
        draft = super().propose(context, gamma, sampler)
        if not self.share or self.cache is None or draft.tokens.numel() == 0:
            return draft
        shared = SharedLayers(self.view.target, self.view.plan.exit_after, self.cache)  # type: ignore[arg-type]
        return Draft(tokens=draft.tokens, probs=draft.probs, reuse=shared)

    def spawn(self, wrap: Callable[[Any], Any] = lambda m: m) -> "SelfSpecDrafter":
        """A fresh drafter of the same kind (per-request state), its view wrapped by ``wrap``
        (the server serialises forward passes); a wrapped view's drafts are verified plainly."""
        fresh = SelfSpecDrafter(self.view, share=self.share)
        # a wrapped (serialised) view binds to the request's target cache through the wrapper's
        # ``inner`` (bind_target), but its drafts are verified by the wrapper's own pass
        fresh.model = wrap(self.view)
        fresh.lazy_prefill = True  # the first round that drafts feeds the context: none for a request that never does
        return fresh

    def extra_bytes(self) -> int:
        """Memory beyond the target: the draft cache's positions used so far (its buffer is
        allocated lazily by the OS: untouched pages cost nothing) and a reduced vocabulary's head rows."""
        head = self.view.reduced.nbytes if self.view.reduced is not None else 0
        return head + (int(self.cache.used_bytes()) if self.cache is not None else 0)


def param_shares(cfg: Any, *, head_share: float = 1.0) -> tuple[float, float, float]:
    """(one attention sub-layer, one MLP sub-layer, the LM head): each part's share of the weights
    a decoding step reads, a timing-free cost model (decoding on a CPU is memory-bound);
    ``head_share``: the share of the head's rows a draft computes (a reduced vocabulary's)."""
    attn = (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    head = cfg.vocab_size * cfg.hidden_size
    total = cfg.n_layers * (attn + mlp) + head
    return attn / total, mlp / total, head * head_share / total


class SwiftDrafter(SelfSpecDrafter):
    """Layer skipping adapted on the fly (Xia et al. 2024, *SWIFT*), with no offline step.

    Every ``every`` rounds it scores the current skip set and ``tries`` random neighbours (one
    sub-layer added or removed; seeded, so runs are reproducible) on the last ``window``
    committed tokens: teacher-forced agreement of the draft's arg-max with the committed token
    (exactly the greedy acceptance of a first draft token), each row scored as the view drafts
    it, over the target's keys and values (:meth:`_agreement`), turned into an expected speed-up
    with a cost model from the sub-layers' parameter counts.  It moves to the best; the draft cache is then rebuilt
    (the next ``propose`` re-feeds the context).  Which tokens it drafts never affects the
    output law, only the speed.

    A scoring costs ``1 + tries`` passes of ``window - 1`` rows, on a 2-core CPU ~13 target steps
    for Qwen2.5-Coder-1.5B: at a fixed γ 1, rescoring every 12 rounds, SWIFT drafted at ~4 target
    steps a token.  So the interval doubles after each scoring that keeps the set (up to
    ``every * max_backoff`` rounds, carried from sequence to sequence) and falls back to ``every``
    when the set changes: a set that has settled is rescored ever more rarely.

    Scorings are also held to a time budget: a scoring runs only if its cost is at most ``budget``
    (default :data:`defaults.SWIFT_SCORING_BUDGET`) of the decoding time the drafter has seen since
    the last one (None: no budget), so they take at most that share of any stretch of decoding, not
    only of the total.  Decoding time seen is the time from each of the drafter's calls to the next
    within a sequence, sequences added up.  A scoring's cost is the last scoring's measured time,
    or before the first an upper bound from the cheapest draft step measured, ``(1 + tries)``
    passes of ``window - 1`` rows each at most as dear as that many one-row steps.  With no draft
    step measured yet there is no bound, and no scoring.  On replies of a few dozen tokens a scoring
    costs more than it can return, so there SWIFT drafts with the set it started from; over long
    ones it adapts.  ``clock``: the time source (tests pass their own).
    """

    def __init__(self, target: Any, plan: LayerPlan, *, every: int = 12, window: int = 48, tries: int = 3,
                 seed: int = 0, reduced: Any = None, max_backoff: int = 16,
                 budget: float | None = defaults.SWIFT_SCORING_BUDGET,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(LayerView(target, plan, reduced=reduced))
        if budget is not None and not budget >= 0:
            raise ConfigError(f"SWIFT's scoring budget must be a share >= 0 of the decoding time, got {budget!r}")
        self.every, self.window, self.tries, self.max_backoff = every, window, tries, max_backoff
        self.budget, self._clock = budget, clock
        self.seen_s = 0.0  # decoding time seen: from each call to the next within a sequence
        self._scored_at = 0.0  # seen_s where the last scoring's own time ends
        self.scoring_s = 0.0  # time all scorings took
        self._called: float | None = None  # this sequence's last call (None: none yet)
        self._step_s: float | None = None  # the cheapest one-token draft step measured
        self._scoring_cost: float | None = None  # the last scoring's measured time
        self._interval = every  # rounds until the next scoring: doubles while the set holds
        self._wrap: Callable[[Any], Any] = lambda m: m
        self.seed = seed  # a spawned copy draws the neighbours this drafter was seeded for
        self._rng = torch.Generator().manual_seed(seed)
        self._rounds = 0
        # the view's head: its reduced rows alone
        self._cost = param_shares(target.cfg, head_share=1.0 if reduced is None else reduced.share)
        self.switches = 0
        self.scorings = 0

    def reset(self, expected: int = 0) -> None:
        super().reset(expected)
        self._rounds = 0
        self._called = None  # the gap before the next sequence is not decoding time

    def _affordable(self) -> bool:
        """Whether a scoring now costs at most ``budget`` of the decoding time seen since the last."""
        if self.budget is None:
            return True
        cost = self._scoring_cost
        if cost is None:  # before the first: a pass of n rows costs at most n one-row steps
            if self._step_s is None:
                return False
            cost = (1 + self.tries) * (self.window - 1) * self._step_s
        return cost <= self.budget * (self.seen_s - self._scored_at)

    def _agreement(self, plan: LayerPlan, context: Tensor) -> float:  # context: [L]
        """The first draft token's greedy acceptance over the last ``window`` committed tokens:
        each row scored as the view drafts it, over the target's keys and values before its
        position (one pass, ``run_layers(as_drafted=True)``), where the target's cache holds
        them; else over a cache of the window alone (a server's view of a batched target)."""
        target, source = self.view.target, self._target_cache
        length = context.numel()
        start = length - self.window
        recent = context[start:]  # [w]
        view = LayerView(target, plan, reduced=self.view.reduced)
        with torch.inference_mode():
            if source is not None and source.length >= length - 2:
                x = target.run_layers(target.embed_tokens(recent[:-1]), source, plan.steps, start=start, as_drafted=True)
            else:
                x = view._layers(recent[:-1], view.new_cache(recent.numel()))[0]  # [w - 1, D]
            return float((view.greedy(x) == recent[1:]).float().mean())

    def _speedup(self, plan: LayerPlan, context: Tensor) -> float:  # context: [L]
        alpha = self._agreement(plan, context)
        a, m, fixed = self._cost
        return best_chain_speedup(alpha, fixed + sum(a * at + m * ml for _, at, ml in plan.steps))[0]

    def spawn(self, wrap: Callable[[Any], Any] = lambda m: m) -> "SwiftDrafter":
        fresh = SwiftDrafter(self.view.target, self.view.plan, every=self.every, window=self.window, tries=self.tries,
                             reduced=self.view.reduced, max_backoff=self.max_backoff, budget=self.budget,
                             seed=self.seed, clock=self._clock)
        fresh._wrap = wrap
        fresh.model = wrap(fresh.view)
        fresh.lazy_prefill = True  # as SelfSpecDrafter.spawn: no prefill for a request that never drafts
        return fresh

    def _neighbour(self, plan: LayerPlan) -> LayerPlan:
        n = plan.n_layers
        i = int(torch.randint(2 * n, (1,), generator=self._rng))
        attn, mlp = set(plan.skip_attn), set(plan.skip_mlp)
        group = attn if i < n else mlp
        group.symmetric_difference_update({i % n})
        return LayerPlan.skipping(n, attn, mlp)

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        now = self._clock()
        if self._called is not None:
            self.seen_s += now - self._called
        self._called = now
        self._rounds += 1
        if self._rounds >= self._interval and context.numel() > self.window and self._affordable():
            self._rounds = 0
            self._interval = min(2 * self._interval, self.every * self.max_backoff)
            self.scorings += 1
            plan = self.view.plan
            best, best_plan = self._speedup(plan, context), plan
            for _ in range(self.tries):
                trial = self._neighbour(plan)
                s = self._speedup(trial, context)
                if s > best:
                    best, best_plan = s, trial
            if best_plan != plan:
                self._use_view(LayerView(self.view.target, best_plan, reduced=self.view.reduced))
                self.model = self._wrap(self.view)
                self.reset()
                self._called = now  # (reset is for a new sequence; this one goes on)
                self._rounds, self._interval = 1, self.every
                self.switches += 1
            self._scoring_cost = self._clock() - now
            self.scoring_s += self._scoring_cost
            self._scored_at = self.seen_s + self._scoring_cost  # the gap to the next call holds this scoring
        drafting = self._clock()
        draft = super().propose(context, gamma, sampler)
        if draft.tokens.numel():
            step = (self._clock() - drafting) / draft.tokens.numel()
            self._step_s = step if self._step_s is None else min(self._step_s, step)
        return draft


# ----------------------------------------------------------------------------- names


parse_name = parse_self_spec  # the drafter names (torch-free, in the catalog for ``specdec setup``)


def load_plan(path: str | Path) -> LayerPlan:
    p = Path(path).expanduser()
    try:
        obj = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"skip-set file {str(p)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read skip-set file {str(p)!r}: {exc}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{str(p)!r} is not a skip-set file (expected a JSON object)")
    return LayerPlan.from_json(obj.get("plan", obj))


def shipped_plan(target_name: str) -> LayerPlan | None:
    path = SKIP_SETS_DIR / f"{target_name}.json"
    return load_plan(path) if path.is_file() else None


def build(name: str, target: Any, target_name: str, *, vocab: Tensor | None = None) -> tuple[SelfSpecDrafter, str]:
    """The drafter a self-speculative ``name`` means for ``target`` (a NativeCausalLM), and its
    display name; ``vocab``: a reduced draft vocabulary (sorted target ids) to draft over where the
    target's head can be cut to its rows (:meth:`NativeCausalLM.reduced_head`)."""
    parsed = parse_name(name)
    if parsed is None:
        raise ConfigError(f"{name!r} is not a self-speculative drafter name")
    family, arg = parsed
    n_layers = getattr(getattr(target, "cfg", None), "n_layers", None)
    if n_layers is None:
        LayerView(target, LayerPlan(1, 1))  # raises the backend error
    reduced = target.reduced_head(vocab) if vocab is not None else None
    if family == "kangaroo":
        from specdec import defaults
        from specdec.drafters import kangaroo

        return kangaroo.build(arg, target, target_name, stop_below=defaults.KANGAROO_STOP_BELOW, reduced=reduced)
    if family == "layerskip":
        try:
            k = int(arg)
        except ValueError:
            raise ConfigError(f"layerskip needs a layer count, e.g. layerskip:12 (got {name!r})") from None
        if not 1 <= k < n_layers:
            raise ConfigError(f"layerskip:K needs 1 <= K < {n_layers} (the target's layers), got {k}")
        view = LayerView(target, LayerPlan.early_exit(n_layers, k), keep_hidden=True, reduced=reduced)
        return SelfSpecDrafter(view, share=True), f"layerskip:{k}"
    if arg:
        plan = load_plan(arg)
        label = f"{family}:{Path(arg).name}"
    else:
        check_shipped(family, target_name)
        plan = shipped_plan(target_name)
        if plan is None:  # swift: start from no skipped sub-layer
            plan = LayerPlan.skipping(n_layers, set(), set())
        label = family
    if family == "swift":
        return SwiftDrafter(target, plan, reduced=reduced), label
    return SelfSpecDrafter(LayerView(target, plan, reduced=reduced)), label
