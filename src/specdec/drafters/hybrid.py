"""Prompt lookup first, the draft model otherwise: free drafts where the text repeats itself.

Each round looks the current suffix up in the context (an n-gram of at least ``min_ngram``
tokens that occurred before and has a continuation); if it is found, the round proposes what
followed it, a draft that costs no model step; if not, the draft model proposes as usual.  Code
repeats identifiers, signatures and whole lines, so lookup rounds are frequent and long there;
chat falls back to the model almost every round.

Lossless like every drafter: a lookup draft is deterministic (q one-hot), which every
verification rule handles; which source a round uses depends only on the context.  The
lookup rounds are marked ``Draft.free``: the γ controller learns the model's acceptance and
draft cost from the model's rounds only.

The draft model's cache simply falls behind during lookup rounds; its next round feeds the
tokens it lacks in one pass (``ModelDrafter.propose`` always does).
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.verify import Verdict


class LookupThenModel:
    """A :class:`NgramDrafter` over the context, falling back to a :class:`ModelDrafter`."""

    def __init__(
        self,
        model: ModelDrafter,
        *,
        min_ngram: int = defaults.HYBRID_NGRAM_MIN,
        max_ngram: int = defaults.HYBRID_NGRAM_MAX,
        lookup_tokens: int = defaults.HYBRID_LOOKUP_TOKENS,
    ) -> None:
        if lookup_tokens < 1:
            raise ValueError("lookup_tokens must be at least 1")
        self.model = model
        self.lookup = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.lookup_tokens = lookup_tokens
        self._model_round = False
        #: rounds proposed by each source since the last ``reset`` / ``prepare``
        self.rounds = {"lookup": 0, "model": 0}

    @property
    def supports_trees(self) -> bool:
        return self.model.supports_trees

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self._model_round = False
        self.rounds = {"lookup": 0, "model": 0}

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        self.model.prepare(prompt)
        self.lookup.prepare(prompt)
        self._model_round = False
        self.rounds = {"lookup": 0, "model": 0}

    def _lookup(self, context: Tensor, tokens: int, sampler: DraftSampler) -> Draft | None:
        found = self.lookup.propose(context, tokens, sampler)
        if found.tokens.numel() == 0:
            return None
        self.rounds["lookup"] += 1
        self._model_round = False
        return replace(found, free=True)

    def _lookup_length(self, gamma: int, sampler: DraftSampler) -> int:
        """A lookup draft costs no model step, so it may be longer than the model's γ (up to
        ``lookup_tokens``), never longer than the round's room."""
        room = sampler.room if sampler.room is not None else gamma
        return max(1, min(max(gamma, self.lookup_tokens), room))

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        found = self._lookup(context, self._lookup_length(gamma, sampler), sampler)
        if found is not None:
            return found
        self.rounds["model"] += 1
        self._model_round = True
        return self.model.propose(context, gamma, sampler)

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        found = self._lookup(context, max(1, min(self.lookup_tokens, max_depth)), sampler)
        if found is not None:
            return found
        self.rounds["model"] += 1
        self._model_round = True
        return self.model.propose_tree(context, budget, sampler, spec, max_depth=max_depth)

    def commit(self, verdict: Verdict) -> None:
        if self._model_round:
            self.model.commit(verdict)
        self._model_round = False
