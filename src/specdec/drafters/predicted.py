"""OpenAI's Predicted Outputs: the caller's guess at the answer as free drafts.

A request may bring ``prediction`` — text it expects much of the answer to repeat (a file being
edited, a document being revised).  That text is a draft that costs no model step: at the start
the answer is drafted from the prediction's beginning; later, wherever the answer's last few
tokens occur in the prediction (at or after where the last prediction draft left off, else
anywhere), what follows them there is proposed.  Where the prediction has nothing, the drafter it
wraps (the server's own, or none) drafts as usual.

Lossless like every drafter: a prediction draft is deterministic (q one-hot), which every rule
verifies exactly; the answer is the target's whatever the prediction says, and only the speed
depends on it.  Prediction rounds are ``Draft.free``: a cost-based controller of their own picks
their length, as for prompt lookup's rounds (:mod:`specdec.drafters.hybrid`).
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import CostGamma
from specdec.verify import Verdict


class Predicted:
    """Drafts from ``predicted`` (token ids) first, then from ``inner`` (None: nothing else)."""

    def __init__(self, predicted: Sequence[int], inner: Any = None, *, min_ngram: int = defaults.HYBRID_NGRAM_MIN,
                 max_ngram: int = defaults.HYBRID_NGRAM_MAX) -> None:
        self.predicted = [int(t) for t in predicted]
        self.inner = inner
        # n -> {n-gram: ascending positions right after an occurrence that has a continuation}
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        for n, table in self.index.items():
            for k in range(n, len(self.predicted)):
                table.setdefault(tuple(self.predicted[k - n:k]), []).append(k)
        #: prediction tokens proposed and accepted as drafts, over the sequences since made
        self.proposed = 0
        self.accepted = 0
        self._fresh(0)

    def taken(self) -> tuple[int, int]:
        """OpenAI's usage details for the sequence since :meth:`prepare`: (``accepted_prediction_tokens``,
        ``rejected_prediction_tokens``).  Accepted are the prediction's tokens the answer took in a
        prediction round: each accepted draft token, and the round's own target token where it is
        the prediction's next one too.  Rejected are the rest of the prediction, as OpenAI counts them
        (tokens of the prediction that do not appear in the answer)."""
        return len(self._taken), len(self.predicted) - len(self._taken)

    def _fresh(self, start: int) -> None:
        self._taken: set[int] = set()  # the prediction's positions the answer took (see :meth:`taken`)
        self._start = start  # the prompt's length: the answer starts there
        self._at = 0  # where the answer left the prediction after its last prediction round
        self._from: int | None = None  # this round's prediction draft starts there (None: not a prediction round)
        self._inner_round = False  # the inner drafter proposed this round
        self.length = CostGamma(max_gamma=defaults.HYBRID_LOOKUP_MAX, start=defaults.HYBRID_LOOKUP_START,
                                prior_weight=defaults.HYBRID_LOOKUP_PRIOR_WEIGHT)

    def __getattr__(self, name: str) -> Any:  # the inner drafter's other parts (taps, features, pass costs, ...)
        if name.startswith("_") or name in ("inner", "predicted", "index", "length", "proposed", "accepted", "free_drafts"):
            raise AttributeError(name)
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def free_drafts(self) -> bool:
        """Whether every round is a free one (no draft model behind the prediction: none, or prompt lookup)."""
        return self.inner is None or bool(getattr(self.inner, "free_drafts", False))

    @property
    def supports_trees(self) -> bool:
        return bool(getattr(self.inner, "supports_trees", False))

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()
        self._fresh(0)

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        if self.inner is not None:
            self.inner.prepare(prompt)
        self._fresh(prompt.numel())

    def _found(self, context: Tensor) -> int | None:
        """Where in the prediction the answer goes on (None: nowhere known)."""
        answer = context[self._start:].tolist()
        if not answer:
            return 0 if self.predicted else None
        for n in sorted(self.index, reverse=True):
            if len(answer) < n:
                continue
            places = self.index[n].get(tuple(answer[-n:]))
            if places:
                k = bisect.bisect_left(places, self._at)  # the first at or after where the last draft left off
                return places[k] if k < len(places) else places[-1]
        return None

    def _predicted(self, context: Tensor, room: int) -> Draft | None:
        self._inner_round = False
        at = self._found(context) if room > 0 else None
        if at is None or at >= len(self.predicted):
            return None
        tokens = self.predicted[at:at + max(1, min(self.length.next_gamma(), room))]
        self._from = at
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=None, free=True)

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        found = self._predicted(context, sampler.room if sampler.room is not None else gamma)
        if found is not None:
            return found
        self._from = None
        self._inner_round = self.inner is not None and (gamma > 0 or hasattr(self.inner, "update_free"))
        if not self._inner_round:  # nothing predicted here, and the inner drafter's drafts do not pay now (γ 0)
            return Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)
        return self.inner.propose(context, gamma, sampler)

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        found = self._predicted(context, max_depth)  # a prediction draft stays a chain
        if found is not None:
            return found
        self._from, self._inner_round = None, True
        return self.inner.propose_tree(context, budget, sampler, spec, max_depth=max_depth)

    @property
    def catch_up_s(self) -> float:
        """The inner drafter's catch-up pass of this round (none in a prediction round)."""
        return float(getattr(self.inner, "catch_up_s", 0.0)) if self._inner_round else 0.0

    def commit(self, verdict: Verdict) -> None:
        if self._from is None:
            if self._inner_round:
                self.inner.commit(verdict)
            return
        kept, at = verdict.tokens.tolist(), self._from
        took = 0  # the accepted drafts, then the target's own token where the prediction has it next
        while took < len(kept) and at + took < len(self.predicted) and kept[took] == self.predicted[at + took]:
            took += 1
        self._taken.update(range(at, at + took))
        self._at = at + took  # past the target's own token too where the prediction had it next (took >= accepted)
        self.accepted += verdict.num_accepted

    def update_free(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        """A free round's outcome: the prediction's length controller learns from its own rounds, a
        free round of the inner drafter (its prompt lookup) goes to it."""
        if self._from is None:
            self.inner.update_free(gamma=gamma, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=other_s)
            return
        self.proposed += gamma
        self.length.update(gamma=gamma, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=other_s)


def predicted_ids(tokenizer: Any, prediction: Any) -> list[int]:
    """OpenAI's ``prediction`` (``{"type": "content", "content": str | [{"type": "text", "text": ...}]}``)
    as token ids; a ``ValueError`` naming what is wrong otherwise."""
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise ValueError('prediction must be {"type": "content", "content": ...}')
    content = prediction.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError('prediction content parts must be {"type": "text", "text": ...}')
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError("prediction content must be a string or a list of text parts")
    return list(tokenizer.encode(content, add_special_tokens=False)) if content else []


__all__ = ["Predicted", "predicted_ids"]
