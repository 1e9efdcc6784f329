"""Every drafter family over toy draft models, by a short name (the differential tests draw them)."""

from __future__ import annotations

from typing import Any

import torch

from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.base import Draft
from specdec.drafters.hybrid import LookupThenModel
from specdec.drafters.lookahead import LookaheadDrafter


def toy_drafter(kind: str, drafts: dict[str, Any]) -> Any:
    """A fresh drafter: ``ngram``, ``lookahead``, ``hybrid`` (lookup, else ``drafts["close"]``),
    ``sharp`` (``drafts["close"]`` sampled at 0.6 × T), or the draft model ``drafts[kind]``."""
    if kind == "ngram":
        return NgramDrafter()
    if kind == "lookahead":
        return LookaheadDrafter(window=3, ngram=3, candidates=3, pool_size=8)
    if kind == "hybrid":
        return LookupThenModel(ModelDrafter(drafts["close"]))
    if kind == "sharp":
        return ModelDrafter(drafts["close"], temperature_factor=0.6)
    return ModelDrafter(drafts[kind])


class Forced:
    """A draft sampler that returns given tokens (q None) and records the rows it was shown: a
    drafter's logits at each step, teacher-forced."""

    compact = False  # rows over the target's whole vocabulary
    stop_requested = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.rows = tokens, []

    def __call__(self, logits, position):
        self.rows.append(logits[0])
        return self.tokens[len(self.rows) - 1], None


class FixedDrafter:
    """Drafts the same tokens every round: a chain (cut to γ), or a tree that is one path of them."""

    supports_trees = True

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = list(tokens)

    def prepare(self, prompt) -> None:  # noqa: ANN001
        pass

    def reset(self) -> None:
        pass

    def commit(self, verdict) -> None:  # noqa: ANN001
        pass

    def propose(self, context, gamma, sampler):  # noqa: ANN001, ANN201
        return Draft(tokens=torch.tensor(self.tokens[:gamma], dtype=torch.long), probs=None)

    def propose_tree(self, context, budget, sampler, spec, *, max_depth):  # noqa: ANN001, ANN201
        return Draft(tokens=torch.tensor(self.tokens, dtype=torch.long), probs=None,
                     parents=torch.arange(len(self.tokens)) - 1)
