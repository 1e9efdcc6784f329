"""Prompt-lookup / n-gram drafter: copy what followed the last occurrence of the current suffix.

Deterministic (no probabilities): every verification rule treats its ``q`` as one-hot.  Great on
code and on tasks that quote their input; free to run.  Index updates are incremental, so a round
costs O(new tokens), not O(context).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.tree_builder import TreeSpec
from specdec.verify import Verdict


class NgramDrafter:
    #: its drafts cost the target a row each and no model pass (a batching server caps them as it
    #: caps prompt lookup's rounds in front of a draft model: :mod:`specdec.server.draft_cap`)
    free_drafts = True

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        # n -> {n-gram: index right after its most recent occurrence that has a continuation}
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._indexed_until = 0
        # token trees: n -> {n-gram: every index right after an occurrence, most recent last}
        self.occurrences: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.index}

    def _sync(self, context: Tensor) -> None:
        length = context.numel()
        known = len(self.tokens)
        # another sequence (a caller that skipped prepare): shorter, or its token at our last
        # position differs (one token checked, not the whole prefix: a round stays O(new tokens))
        if length < known or (known and int(context[known - 1]) != self.tokens[-1]):
            self.reset()
        self.tokens.extend(context[len(self.tokens) :].tolist())
        # an n-gram ending at k (exclusive) is usable only if token k exists: index k < length
        for k in range(max(self._indexed_until, 1), length):
            for n, table in self.index.items():
                if k >= n:
                    gram = tuple(self.tokens[k - n : k])
                    table[gram] = k
                    self.occurrences[n].setdefault(gram, []).append(k)
        self._indexed_until = max(self._indexed_until, length)

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        self.reset()
        self._sync(prompt)

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        self._sync(context)
        toks = self.tokens
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(toks) < n or gamma <= 0:
                continue
            start = self.index[n].get(tuple(toks[-n:]))
            if start is not None:
                return Draft(tokens=torch.tensor(toks[start : start + gamma], dtype=torch.long), probs=None)
        return Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)

    supports_trees = True

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        """Several continuations merged into a trie: every earlier occurrence of the longest
        matching suffix (most recent first), then of shorter suffixes, until ``budget`` nodes."""
        self._sync(context)
        toks = self.tokens
        depth = min(max_depth, spec.depth * 2)
        out_tokens: list[int] = []
        out_parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(toks) < n:
                continue
            for start in reversed(self.occurrences[n].get(tuple(toks[-n:]), [])):
                parent = -1
                for tok in toks[start : start + depth]:
                    node = children.get((parent, tok))
                    if node is None:
                        if len(out_tokens) >= budget:
                            break
                        node = len(out_tokens)
                        children[(parent, tok)] = node
                        out_tokens.append(tok)
                        out_parents.append(parent)
                    parent = node
                if len(out_tokens) >= budget:
                    break
            if len(out_tokens) >= budget:
                break
        return Draft(
            tokens=torch.tensor(out_tokens, dtype=torch.long),
            probs=None,
            parents=torch.tensor(out_parents, dtype=torch.long),
        )

    def commit(self, verdict: Verdict) -> None:
        pass
