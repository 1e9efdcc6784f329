"""Prompt lookup first, the draft model otherwise: free drafts where the text repeats itself.

Each round looks the current suffix up in the context (an n-gram of at least ``min_ngram``
tokens that occurred before and has a continuation); if it is found, the round proposes what
followed it, a draft that costs no model step; if not, the draft model proposes as usual.  Code
repeats identifiers, signatures and whole lines, so lookup rounds are frequent and long there;
chat falls back to the model almost every round.

Lossless like every drafter: a lookup draft is deterministic (q one-hot), which every
verification rule handles; which source a round uses depends only on the context and on
timings, never on the target's randomness.  The lookup rounds are marked ``Draft.free``: the
decoder's γ controller learns the model's acceptance and draft cost from the model's rounds
only, and hands the lookup rounds' outcomes to :meth:`LookupThenModel.update_free`, where a
cost-based controller of its own picks the lookup draft's length (a draft step costs nothing
there, so the length is set by the verification pass's cost per position against the lookup
rounds' acceptance: long where the text repeats verbatim, one token where lookups mislead).

Lookup rounds happen even when the decoder's γ controller has stopped the model's drafting
(γ = 0: the model's drafts do not pay on this text); the decoder asks any drafter with
``update_free`` every round.  The draft model's cache simply falls behind during lookup rounds;
its next round feeds the tokens it lacks in one pass (``ModelDrafter.propose`` always does).
In tree rounds a lookup draft is still a chain; the model's rounds build trees as before.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import CostGamma, FixedGamma, GammaController
from specdec.verify import Verdict

#: ``--draft NAME+lookup`` spells the hybrid of prompt lookup and the draft model NAME
LOOKUP_SUFFIX = "+lookup"


def split_lookup(draft: str) -> tuple[str, bool]:
    """``NAME+lookup`` -> (NAME, True): prompt lookup first, the draft model NAME otherwise."""
    text = draft.strip()
    if text.lower().endswith(LOOKUP_SUFFIX):
        base = text[: -len(LOOKUP_SUFFIX)].strip()
        if not base:
            raise ConfigError(f"'{LOOKUP_SUFFIX}' needs a draft model before it, e.g. smollm2-135m-draft{LOOKUP_SUFFIX}")
        return base, True
    return text, False


class LookupThenModel:
    """A :class:`NgramDrafter` over the context, falling back to a :class:`ModelDrafter` (a draft
    model, the target itself, or a self-speculative view of it)."""

    def __init__(
        self,
        model: ModelDrafter,
        *,
        min_ngram: int = defaults.HYBRID_NGRAM_MIN,
        max_ngram: int = defaults.HYBRID_NGRAM_MAX,
        lookup_tokens: int | None = None,
    ) -> None:
        """``lookup_tokens`` fixes the lookup draft's length; None = chosen by cost, per sequence."""
        if lookup_tokens is not None and lookup_tokens < 1:
            raise ValueError("lookup_tokens must be at least 1")
        self.model = model
        self.lookup = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.lookup_tokens = lookup_tokens
        self.length: GammaController  # the lookup draft's length controller (per sequence)
        self._model_round = False
        #: rounds proposed by each source since the last ``reset`` / ``prepare``
        self.rounds: dict[str, int]
        self._fresh()

    def spawn(self, wrap: Callable[[Any], Any] = lambda m: m) -> "LookupThenModel":
        """A fresh hybrid for another sequence (the server: one per request) around a fresh
        drafter of the same kind; only for drafters that can spawn (self-speculative views)."""
        return LookupThenModel(self.model.spawn(wrap), min_ngram=self.lookup.min_ngram, max_ngram=self.lookup.max_ngram,
                               lookup_tokens=self.lookup_tokens)

    @property
    def supports_trees(self) -> bool:
        return self.model.supports_trees

    def with_model(self, model: Any) -> "LookupThenModel":
        """A fresh hybrid whose model drafter runs ``model`` (see :meth:`ModelDrafter.with_model`)."""
        return LookupThenModel(self.model.with_model(model), min_ngram=self.lookup.min_ngram, max_ngram=self.lookup.max_ngram,
                               lookup_tokens=self.lookup_tokens)

    def finish(self, context: Tensor) -> None:  # context: [L]
        finish = getattr(self.model, "finish", None)
        if finish is not None:
            finish(context)

    @property
    def temperature_factor(self) -> float:
        """The model drafter's (lookup drafts are deterministic: no temperature to scale)."""
        return float(getattr(self.model, "temperature_factor", 1.0))

    @temperature_factor.setter
    def temperature_factor(self, value: float) -> None:
        self.model.temperature_factor = value

    def _new_length(self) -> GammaController:
        if self.lookup_tokens is not None:
            return FixedGamma(self.lookup_tokens)
        return CostGamma(max_gamma=defaults.HYBRID_LOOKUP_MAX, start=defaults.HYBRID_LOOKUP_START,
                         prior_weight=defaults.HYBRID_LOOKUP_PRIOR_WEIGHT)

    def _fresh(self) -> None:  # per-sequence state
        self._model_round = False
        self.rounds = {"lookup": 0, "model": 0}
        self.length = self._new_length()

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self._fresh()

    def bind_target(self, model: Any, cache: Any) -> None:
        """Passed on to the model drafter where it can use the target's cache (see the decoder)."""
        bind = getattr(self.model, "bind_target", None)
        if bind is not None:
            bind(model, cache)

    @property
    def feature_taps(self) -> tuple[int, ...] | None:
        """The model drafter's (Kangaroo reads the target's residual stream: see its drafter)."""
        return getattr(self.model, "feature_taps", None)

    def add_features(self, features: Tensor) -> None:
        self.model.add_features(features)  # type: ignore[attr-defined]

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        self.model.prepare(prompt)
        self.lookup.prepare(prompt)
        self._fresh()

    def observe_pass(self, rows: int, target_s: float) -> None:
        """A model round's verification pass: the cost curve is the target's, whoever drafted."""
        observe = getattr(self.length, "observe_cost", None)
        if observe is not None:
            observe(rows, target_s)

    def update_free(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        """A lookup round's outcome (called by the decoder instead of its γ controller's update)."""
        self.length.update(gamma=gamma, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=other_s)

    def _lookup(self, context: Tensor, tokens: int, sampler: DraftSampler) -> Draft | None:
        found = self.lookup.propose(context, tokens, sampler)
        if found.tokens.numel() == 0:
            return None
        self.rounds["lookup"] += 1
        self._model_round = False
        return replace(found, free=True)

    def _lookup_length(self, room: int) -> int:
        """The lookup controller's length, at least one token (one more verified position is
        cheap, and it keeps the controller's acceptance estimate alive), at most ``room``."""
        return max(1, min(self.length.next_gamma(), room))

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        room = sampler.room if sampler.room is not None else gamma
        found = self._lookup(context, self._lookup_length(room), sampler) if room > 0 else None  # room 0: a busy server's cap
        if found is not None:
            return found
        self._model_round = False
        if gamma <= 0:  # the γ controller says the model's drafts do not pay now; lookup found nothing
            return Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)
        self.rounds["model"] += 1
        self._model_round = True
        return self.model.propose(context, gamma, sampler)

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        found = self._lookup(context, self._lookup_length(max_depth), sampler)
        if found is not None:
            return found
        self.rounds["model"] += 1
        self._model_round = True
        return self.model.propose_tree(context, budget, sampler, spec, max_depth=max_depth)

    @property
    def catch_up_s(self) -> float:
        """The model drafter's catch-up pass of this round (none in a lookup round)."""
        return float(getattr(self.model, "catch_up_s", 0.0)) if self._model_round else 0.0

    def commit(self, verdict: Verdict) -> None:
        if self._model_round:
            self.model.commit(verdict)
        self._model_round = False
