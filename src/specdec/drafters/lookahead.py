"""Lookahead decoding (Fu et al. 2024): the target drafts for itself with Jacobi iterations.

No draft model.  A *window* of guesses for the next ``W`` positions is fed to the target inside
every verification pass, as extra nodes of the token tree; the target's arg-max at each window
node is a better guess one position further on (a Jacobi step).  The trajectories those steps
trace are n-grams the target itself produced; they are collected in a pool keyed by their first
token, and the pool's n-grams that start where the committed text ends are proposed as
candidates in the same tree.  Every node is a deterministic candidate (``q`` one-hot), so every
tree rule verifies it exactly: whatever is accepted, window node or pool candidate, is exact.

The window as a tree (``levels`` = N − 1 rows of W guesses, row 0 the oldest):

* row 0 is a chain hanging off the last committed token: node (0, i) sits i positions ahead;
* node (l, i), l ≥ 1, is a child of (l − 1, i − 1) (or of the root for i = 0), so it attends to
  the diagonal (l − 1, i − 1), (l − 2, i − 2), ... and then to row 0's prefix — the attention
  pattern of the paper's lookahead branch, expressed as ancestors.

After a pass, row l + 1 becomes what the target predicted after row l's nodes (the Jacobi step:
new (l + 1, i) = arg-max after (l, i − 1)), the oldest row is dropped, and each column of the
newest rows with the target's prediction at its end is an N-gram for the pool.  When a round
commits k tokens the window slides k positions (its first k columns are in the past now) and is
padded with tokens of the context.  Deviations from the paper: the window lives in the same tree
as the candidates (one pass, one tree attention), and it is refreshed only on tree rounds.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.tree_builder import TreeSpec
from specdec.verify import Verdict


class LookaheadDrafter:
    """Jacobi lookahead window + n-gram pool, proposed as one token tree per round."""

    supports_trees = True
    #: ask the verifier for the target's arg-max after every node of the tree it just scored
    wants_node_argmax = True

    def __init__(
        self,
        *,
        window: int = defaults.LOOKAHEAD_WINDOW,
        ngram: int = defaults.LOOKAHEAD_NGRAM,
        candidates: int = defaults.LOOKAHEAD_CANDIDATES,
        pool_size: int = defaults.LOOKAHEAD_POOL,
        seed: int = 0,
    ) -> None:
        if window < 1 or ngram < 2 or candidates < 0 or pool_size < 1:
            raise ValueError("lookahead needs window >= 1, ngram >= 2, candidates >= 0, pool_size >= 1")
        self.window = window
        self.ngram = ngram
        self.candidates = candidates
        self.pool_size = pool_size
        self.seed = seed
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        self.rng = random.Random(self.seed)
        #: first token -> its continuations (N − 1 tokens each), most recent last, no duplicates
        self.pool: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()
        self.levels: list[list[int]] = []  # N − 1 rows of W guesses; row 0 the oldest
        self._context: list[int] = []
        self._window_nodes: list[list[int]] = []  # node index of (row, column) in the last tree

    def prepare(self, prompt: Tensor) -> None:  # prompt: [L]
        self.reset()
        self._context = prompt.tolist()
        for i in range(len(self._context) - self.ngram + 1):  # the prompt's own n-grams seed the pool
            self._add(tuple(self._context[i : i + self.ngram]))
        self.levels = [[self._filler() for _ in range(self.window)] for _ in range(self.ngram - 1)]

    def _filler(self) -> int:
        return self.rng.choice(self._context) if self._context else 0

    def _add(self, gram: tuple[int, ...]) -> None:
        first, rest = gram[0], gram[1:]
        conts = self.pool.get(first)
        if conts is None:
            if len(self.pool) >= self.pool_size:
                self.pool.popitem(last=False)  # the least recently refreshed key goes
            conts = self.pool[first] = []
        else:
            self.pool.move_to_end(first)
        if rest in conts:
            conts.remove(rest)
        conts.append(rest)
        del conts[: -defaults.LOOKAHEAD_PER_KEY]

    def _sync(self, context: Tensor) -> None:
        n, known = context.numel(), len(self._context)
        if n < known or (known and int(context[known - 1]) != self._context[-1]):  # another sequence (as the n-gram drafter)
            self._context = context.tolist()
        else:
            self._context.extend(context[len(self._context) :].tolist())

    # ------------------------------------------------------------------ drafting

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        """A chain round: the most recent pool n-gram continuing the last token (no window)."""
        self._sync(context)
        self._window_nodes = []
        conts = self.pool.get(self._context[-1], []) if gamma > 0 else []
        tokens = list(conts[-1][:gamma]) if conts else []
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=None)

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        """Pool candidates (a trie from the root) + the lookahead window, at most ``budget`` nodes."""
        self._sync(context)
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        depth = max(0, min(max_depth, self.ngram - 1))
        # the window first takes what it needs (its size adapts to the budget), then candidates
        rows = len(self.levels)
        width = max(0, min(self.window, max_depth, budget // max(rows, 1) - (1 if self.candidates else 0)))
        if width == 0:
            self._window_nodes = []
        reserved = rows * width
        for cont in reversed(self.pool.get(self._context[-1], [])[-self.candidates :] if self.candidates else []):
            parent = -1
            for tok in cont[:depth]:
                node = children.get((parent, tok))
                if node is None:
                    if len(tokens) + reserved >= budget:
                        break
                    node = len(tokens)
                    children[(parent, tok)] = node
                    tokens.append(tok)
                    parents.append(parent)
                parent = node
        nodes: list[list[int]] = []
        for r in range(rows):
            row: list[int] = []
            for i in range(width):
                parent = -1 if i == 0 else (row[i - 1] if r == 0 else nodes[r - 1][i - 1])
                row.append(len(tokens))
                tokens.append(self.levels[r][i])
                parents.append(parent)
            nodes.append(row)
        self._window_nodes = nodes if width else []
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=None,
                     parents=torch.tensor(parents, dtype=torch.long), wants_argmax=bool(self._window_nodes))

    def observe(self, node_argmax: Tensor) -> None:  # node_argmax: [N+1] int64
        """The target's arg-max at the root (row 0) and after each node of the last tree."""
        nodes = self._window_nodes
        if not nodes:
            return
        out = node_argmax.tolist()
        width = len(nodes[0])
        top = len(nodes) - 1
        # n-grams: each column's diagonal through the rows, ending with the target's next guess
        for i in range(width):
            if i - top < 0:
                continue
            gram = [self.levels[r][i - top + r] for r in range(top + 1)] + [out[nodes[top][i] + 1]]
            self._add(tuple(gram))
        # the Jacobi step: the row after the newest is what the target predicted after it
        new = [out[0]] + [out[nodes[top][i - 1] + 1] for i in range(1, width)]
        new += self.levels[top][width:]  # columns the budget left out keep their old guess
        self.levels = self.levels[1:] + [new]

    def commit(self, verdict: Verdict) -> None:
        """Slide the window past the tokens this round committed."""
        k = verdict.tokens.numel()
        for r, row in enumerate(self.levels):
            self.levels[r] = row[k:] + [self._filler() for _ in range(min(k, self.window))]
