"""Small-model drafter: a separate causal LM with its own KV cache (Leviathan et al. 2023)."""

from __future__ import annotations

import inspect
import sys
import time

import torch
from torch import Tensor

from specdec import defaults

from specdec.drafters.base import Draft, DraftChain, DraftSampler
from specdec.drafters.tree_builder import TreeSpec, build_tree
from specdec.models.base import Cache, LanguageModel
from specdec.verify import Verdict


class ModelDrafter:
    """Samples γ tokens autoregressively from a draft model and reports ``q`` for each.

    Cache discipline: after ``propose`` the cache holds the context plus the first γ-1 draft
    tokens (the last one is sampled, never fed); ``commit`` truncates to what the target kept, and
    the next ``propose`` feeds whatever context tokens the cache lacks (usually the target's
    recovered or bonus token, plus the last draft token when all γ were accepted).
    """

    def __init__(self, model: LanguageModel, *, max_length: int | None = None, temperature_factor: float = 1.0,
                 lazy_prefill: bool = False) -> None:
        """``lazy_prefill``: :meth:`prepare` runs nothing; the first round that drafts feeds the
        whole context (a batching server, whose load may keep a sequence from drafting at all)."""
        self.model = model
        self.lazy_prefill = lazy_prefill
        #: the draft samples at this factor x the request's temperature (see ``draft_config``)
        self.temperature_factor = temperature_factor
        self.max_length = max_length
        self.cache: Cache | None = None
        self._round_start = 0
        self._fed = 0
        self._slots: dict[int, int] | None = None  # tree rounds: node index -> region slot
        #: seconds of this round's catch-up pass (see :meth:`_after`): 0.0 when there was none
        self.catch_up_s = 0.0
        #: (the model asked, whether its new_cache takes initial_length): see :meth:`reset`
        self._grows: tuple[LanguageModel, bool] | None = None

    @property
    def supports_trees(self) -> bool:
        return hasattr(self.model, "forward_tree")

    def with_model(self, model: LanguageModel) -> "ModelDrafter":
        """A fresh drafter of the same settings over ``model`` (e.g. the draft behind a prefix cache)."""
        return ModelDrafter(model, max_length=self.max_length, temperature_factor=self.temperature_factor,
                            lazy_prefill=self.lazy_prefill)

    def finish(self, context: Tensor) -> None:  # context: [L] the sequence's committed tokens
        """The sequence is finished: a draft model that keeps finished sequences (``keep_sequence``:
        a prefix cache in front of it) is handed the committed tokens whose rows the draft cache
        holds, so the next turn of a chat, which re-sends them, copies them instead of prefilling."""
        keep = getattr(self.model, "keep_sequence", None)
        if keep is None or self.cache is None or self.cache.length == 0:
            return
        n = self.cache.length  # after commit: rows of committed tokens only
        assert n <= context.numel(), (n, context.numel())
        keep(context[:n], self.cache)

    def reset(self, expected: int = 0) -> None:
        """A fresh cache; one that can grow starts ``expected`` + a margin positions long."""
        if self._grows is None or self._grows[0] is not self.model:  # asked once per model: inspect costs ~0.15 ms
            self._grows = (self.model, "initial_length" in inspect.signature(self.model.new_cache).parameters)
        if self._grows[1]:
            initial = expected + defaults.DRAFT_KV_INITIAL_LENGTH
            self.cache = self.model.new_cache(self.max_length, initial_length=initial)  # type: ignore[call-arg]
        else:
            self.cache = self.model.new_cache(self.max_length)

    @property
    def room(self) -> int:
        """Positions the draft's cache can hold: the draft model's context, or the ``max_length``
        asked for if shorter.  A draft's context may be shorter than its target's; past it the
        drafter drafts nothing, and a round without a draft is a plain round, so the output is
        unchanged."""
        return min(getattr(self.model, "max_length", None) or sys.maxsize, self.max_length or sys.maxsize)

    def _no_room(self) -> Draft:
        """An empty draft for a context the draft's cache cannot hold; :meth:`commit` keeps the cache."""
        self._round_start = self.cache.length if self.cache is not None else 0
        self._fed = 0
        self._slots = None
        self.catch_up_s = 0.0
        return Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)

    def _begin_round(self, length: int) -> None:
        """A round drafted after ``length`` context tokens: nothing fed yet, no tree slots (a
        tree round sets them once drafted); :meth:`_after` times the catch-up."""
        if self.cache is None:
            self.reset()
        self._round_start = length
        self._fed = 0
        self._slots = None

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        """Prefill the draft cache with all but the last prompt token (outside the timed rounds),
        unless the prefill is lazy or the prompt leaves the draft no room to draft."""
        self.reset(min(prompt.numel(), self.room))
        assert self.cache is not None
        if 1 < prompt.numel() <= self.room and not self.lazy_prefill:
            self.model.forward(prompt[:-1], self.cache, last_only=True)

    def _compact_ids(self, sampler: DraftSampler) -> Tensor | None:
        """The draft vocabulary's target ids when this round can draft on its rows as they are
        (a reduced vocabulary and :attr:`DraftSampler.compact`), else None."""
        ids = getattr(self.model, "vocab_ids", None)
        return ids if ids is not None and sampler.compact else None

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        length = context.numel()
        gamma = min(gamma, self.room - length + 1)  # the cache ends holding the context and γ - 1 drafted tokens
        if gamma <= 0:
            return self._no_room()
        self._begin_round(length)
        ids = self._compact_ids(sampler)
        kw = {} if ids is None else {"compact": True}  # rows over the draft vocabulary: [1, Vd]
        logits = self._after(context, kw)  # [1, V]
        chain = DraftChain()
        for j in range(gamma):
            drawn = sampler(logits, length + j) if ids is None else sampler(logits, length + j, ids, self.model.vocab_size)
            if getattr(sampler, "undefined", False):
                break  # a constraint allows no token of a reduced draft vocabulary here
            # stops at low draft confidence, or at a gate (specdec.remote.gating) at a hard token
            if not chain.add(drawn, sampler) or j + 1 == gamma:
                break
            logits = self._forward(torch.tensor(chain.tokens[-1:]), **kw)
            self._fed += 1
        return chain.draft()

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        """A token tree of at most ``budget`` nodes; each level's expanded nodes go through the
        draft model in one pass with tree attention (``forward_tree`` over the tree region)."""
        length = context.numel()
        fed_room = self.room - length  # the cache ends holding the context and the fed (expanded) nodes
        if fed_room <= 0:
            return self._no_room()
        self._begin_round(length)
        ids = self._compact_ids(sampler)
        kw = {} if ids is None else {"compact": True}  # rows over the draft vocabulary: [m, Vd]
        logits = self._after(context, kw)  # [1, V]
        slots: dict[int, int] = {}
        region: list[int] = []  # parents of the fed nodes, in region-slot terms

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            for v in nodes:
                region.append(slots[parents[v]] if parents[v] >= 0 else -1)
                slots[v] = len(slots)
            new = torch.tensor([tokens[v] for v in nodes], dtype=torch.long)
            return self._forward_tree(new, torch.tensor(region, dtype=torch.long), prefix=length, **kw)

        draft, grown = build_tree(
            logits, expand, spec, sampler, position=length, budget=budget, max_depth=max_depth, ids=ids,
            vocab=self.model.vocab_size if ids is not None else None, max_fed=fed_room,
        )
        self._slots = {new: slots[old] for new, old in enumerate(grown) if old in slots}
        return draft

    def _after(self, context: Tensor, kw: dict[str, bool]) -> Tensor:  # context: [L] -> [1, V]
        """The draft's logits after ``context``, the tokens its cache lacks fed first.  Drafting
        every round, that is one or two tokens (the last round's bonus, perhaps its last draft).
        A longer backlog — the prompt of a lazy prefill, or what was committed while the drafter
        did not draft (rounds at γ = 0, prompt lookup's rounds) — goes first in a pass of its own,
        timed as :attr:`catch_up_s`: a one-off, which the γ controller must not read as the cost of
        this round's drafted tokens (seen: a server's first drafted token of a new prompt read
        10 ms instead of 0.3, and γ auto backed off for the rest of the request)."""
        assert self.cache is not None
        self.catch_up_s = 0.0
        upto = context.numel() - 1
        if upto - self.cache.length >= defaults.DRAFT_CATCH_UP_SPLIT:
            t0 = time.perf_counter()
            self._forward(context[self.cache.length : upto], last_only=True, **kw)
            self.catch_up_s = time.perf_counter() - t0
        return self._forward(context[self.cache.length :], last_only=True, **kw)

    def _forward(self, tokens: Tensor, **kw: bool) -> Tensor:  # tokens: [n] -> logits
        """The draft model over ``tokens`` at the end of its cache (a fed draft adds its features)."""
        return self.model.forward(tokens, self.cache, **kw)

    def _forward_tree(self, tokens: Tensor, parents: Tensor, *, prefix: int, **kw: bool) -> Tensor:  # -> [n, V]
        return self.model.forward_tree(tokens, parents, self.cache, prefix=prefix, **kw)

    def commit(self, verdict: Verdict) -> None:
        if self.cache is None:
            return
        if self._slots is not None:  # a tree round: keep the fed prefix of the accepted path
            keep = []
            for v in verdict.path or ():
                if v not in self._slots:
                    break
                keep.append(self._round_start + self._slots[v])
            self.cache.compact(torch.tensor(keep, dtype=torch.long), self._round_start)
            self._slots = None
            return
        self.cache.truncate(self._round_start + min(verdict.num_accepted, self._fed))
