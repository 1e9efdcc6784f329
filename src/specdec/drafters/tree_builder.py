"""Token-tree builders for any drafter that can score a frontier of nodes.

* static: a fixed shape, ``branching[d]`` children per expanded node at depth d, the ``width``
  best nodes of each level expanded (a sparse Medusa-style tree, Cai et al. 2024);
* dynamic: EAGLE-2 (Li et al. 2024): at each depth expand the ``width`` nodes with the highest
  cumulative draft probability, ``width`` children each, then re-rank every node by cumulative
  probability and keep the best N (prefix-closed because a child never beats its parent).

Candidates: deterministic top-k of the draft distribution (greedy; at T > 0 with ``sample``
off, reported without q, which every rule treats as point masses), the keyed Gumbel sample first
for coupled verification, or (the default at T > 0 under a rule that reads q) a static tree whose
siblings are drawn from q, independently or without replacement, with q reported: a drawn
sibling is accepted with probability min(1, p/q) instead of p(x), which at T = 1 makes sampled
trees clearly better than top-k candidates.  A sampled tree is never pruned after drawing: which
nodes are expanded is fixed before their children are drawn (``sample_expand``: by cumulative draft
probability), and whether a node draws one more child is decided from the children it drew so
far (``sibling_stop``), so every child is an honest draw from its q given the earlier ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.drafters.base import Draft, DraftSampler, SiblingMode
from specdec.errors import ConfigError
from specdec.models.base import full_probs
from specdec.sampling import gumbel_column, sample_categorical

TreeShape = Literal["static", "dynamic"]


@dataclass(frozen=True)
class TreeSpec:
    """How a drafter grows its tree (the node budget N comes from the budget controller)."""

    shape: TreeShape = defaults.TREE_SHAPE
    width: int = defaults.TREE_WIDTH  # nodes expanded per level (dynamic: also children per node)
    depth: int = defaults.TREE_DEPTH  # most levels
    branching: tuple[int, ...] = defaults.TREE_BRANCHING  # static: children per node at each depth
    #: at T > 0 under a rule that reads q: draw siblings from q and report it (a static tree of
    #: ``sample_branching`` children per expanded node, ``sample_width`` nodes expanded per
    #: level); False keeps deterministic top-k candidates (no q) at every temperature
    sample: bool = True
    sample_branching: tuple[int, ...] = defaults.TREE_SAMPLE_BRANCHING
    sample_width: int = defaults.TREE_SAMPLE_WIDTH
    siblings: SiblingMode = "without_replacement"
    #: sampled trees: a node draws another child only while the draft probability its children
    #: drawn so far leave uncovered is at least this (0 = always the full ``sample_branching``);
    #: decided from the drawn siblings alone, before the next is drawn, so every child is still an
    #: honest draw given the earlier ones
    sibling_stop: float = defaults.TREE_SIBLING_STOP
    #: sampled trees: a node gets children only if its cumulative draft probability is at least
    #: this (0 = expand the ``sample_width`` best nodes of every level); decided before its
    #: children are drawn
    sample_expand: float = defaults.TREE_SAMPLE_EXPAND
    #: deterministic trees: leave out every node whose cumulative draft probability is below this
    #: (0 = keep the best N whatever their probability)
    min_prob: float = defaults.TREE_MIN_PROB
    #: with a floor: a node gets children (costs a draft pass) only if a child of this draft
    #: probability would still reach the floor; 1 expands every node that made it into the tree
    expand_child: float = defaults.TREE_EXPAND_CHILD

    def __post_init__(self) -> None:
        if self.shape not in ("static", "dynamic"):
            raise ConfigError(f"tree shape must be static or dynamic, not {self.shape!r}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ConfigError(f"a tree's minimum node probability must be in [0, 1), not {self.min_prob}")
        if not 0.0 <= self.sibling_stop < 1.0:
            raise ConfigError(f"a sampled tree's sibling stop must be in [0, 1), not {self.sibling_stop}")
        if not 0.0 <= self.sample_expand < 1.0:
            raise ConfigError(f"a sampled tree's expansion probability must be in [0, 1), not {self.sample_expand}")
        if not 0.0 < self.expand_child <= 1.0:
            raise ConfigError(f"a tree's expansion probability must be in (0, 1], not {self.expand_child}")
        if self.width < 1 or self.depth < 1 or self.sample_width < 1:
            raise ConfigError("tree width and depth must be positive")
        for shape in (self.branching, self.sample_branching):
            if not shape or min(shape) < 1:
                raise ConfigError("tree branching factors must be positive")

    def children(self, depth: int, sampled: bool = False) -> int:
        if sampled:
            return self.sample_branching[depth]
        if self.shape == "dynamic":
            return self.width
        return self.branching[min(depth, len(self.branching) - 1)]


class Expand(Protocol):
    def __call__(self, nodes: list[int], tokens: list[int], parents: list[int]) -> Tensor:
        """Logits ``[len(nodes), V]`` of the children of ``nodes`` (indices into the tree so far)."""
        ...


def _top_candidates(rows: Tensor, k: int, ids: Tensor | None = None) -> list[list[tuple[int, float]]]:  # rows: [m, V]
    """The ``k`` most likely tokens of every row and their log draft probabilities, for a whole
    level at once (greedy drafting): one top-k and one log-sum-exp over ``[m, V]`` instead of a
    float64 log-softmax per row (measured 0.28 vs 1.26 ms for a level of four 49,152-wide rows).
    Log-probabilities only rank the nodes: any ranking is lossless.  ``ids`` [Vd]: the rows are
    over a reduced draft vocabulary with these target ids (the same candidates, ~3x cheaper)."""
    vals, idx = rows.float().topk(min(k, rows.shape[-1]), dim=-1)  # [m, k]
    if ids is not None:
        idx = ids[idx]
    logq = vals.double() - torch.logsumexp(rows.float(), dim=-1, keepdim=True).double()  # [m, k]
    return [list(zip(i.tolist(), lq.tolist())) for i, lq in zip(idx, logq)]


def _candidates(
    row: Tensor,
    k: int,
    sampler: DraftSampler,
    spec: TreeSpec,
    position: int,
    sampled: bool,
    ids: Tensor | None = None,
    vocab: int | None = None,
) -> list[tuple[int, float]]:
    """Up to ``k`` child tokens of one node and their log draft probabilities.  ``ids`` [Vd]: the
    row is over a reduced draft vocabulary with these target ids (drawn columns are mapped; a
    Gumbel draw keys each column by its id, in a vocabulary of ``vocab``)."""
    if sampler.mode == "argmax":
        return _top_candidates(row.unsqueeze(0), k, ids)[0]
    q = row.double()
    logq = q.log()
    tid = (lambda c: c) if ids is None else (lambda c: int(ids[c]))  # column -> target id
    if not sampled:
        first = [gumbel_column(row, sampler.noise_seed, position, ids, vocab)] if sampler.mode == "gumbel" else []
        idx = [int(t) for t in q.topk(min(k + 1, q.numel())).indices if q[t] > 0]
        cols = (first + [t for t in idx if t not in first])[:k]
        return [(tid(c), float(logq[c])) for c in cols]
    out: list[tuple[int, float]] = []
    w = row.clone()
    left = float(q.sum())  # draft probability not covered by the children drawn so far
    stop = spec.sibling_stop * left
    drawn: set[int] = set()
    for _ in range(k):
        if float(w.sum()) <= 0 or (out and left < stop):  # the drawn siblings alone decide
            break
        c = sample_categorical(w, sampler.generator)
        out.append((tid(c), float(logq[c])))
        if c not in drawn:
            drawn.add(c)
            left -= float(q[c])
        if spec.siblings == "without_replacement":
            w[c] = 0.0
    return out


def build_tree(
    root_logits: Tensor,  # [1, V] draft logits after the context
    expand: Expand,
    spec: TreeSpec,
    sampler: DraftSampler,
    *,
    position: int,  # absolute position of the root-level nodes
    budget: int,  # most nodes
    max_depth: int,
    early_stop: bool = True,
    ids: Tensor | None = None,  # [Vd]: the logits are compact rows over these target ids
    vocab: int | None = None,  # the whole vocabulary's size (compact rows drawn from q: q is reported over it)
    max_fed: int | None = None,  # most nodes handed to ``expand`` in all (a draft cache's free rows)
) -> tuple[Draft, list[int]]:
    """Grow a token tree level by level (see the module docstring).

    Returns the draft and, for each of its nodes, its index while growing (the ``expand``
    callback saw those indices; pruning renumbers).  ``early_stop`` (dynamic trees): stop
    growing once no node of the next expansion can enter the best ``budget`` (the same tree,
    fewer draft passes).  Deterministic trees leave out nodes whose cumulative draft probability
    is below ``spec.min_prob`` (such a tree may be empty) and expand only nodes at or above
    ``spec.min_prob / spec.expand_child``.  ``max_fed``: once that many nodes were expanded, the
    tree grows no deeper (a level's most probable nodes are expanded first).
    """
    if ids is not None and not sampler.compact:
        raise ValueError("compact draft rows need arg-max or Gumbel drafting or q reported, with no bias, penalty or constraint")
    toks: list[int] = []
    pars: list[int] = []
    score: list[float] = []
    rows: list[Tensor] = []
    sampled = spec.sample and sampler.mode == "multinomial" and not sampler.deterministic
    prune = spec.shape == "dynamic" and not sampled
    cap = budget if not prune else budget * spec.width + spec.width
    width = spec.sample_width if sampled else spec.width
    depth = min(len(spec.sample_branching) if sampled else spec.depth, max_depth)
    floor = math.log(spec.min_prob) if spec.min_prob > 0 and not sampled else -math.inf
    expand_floor = floor - math.log(spec.expand_child)  # a node below it gets no children
    if sampled and spec.sample_expand > 0:
        expand_floor = math.log(spec.sample_expand)
    level: list[int] = [-1]
    fed = 0  # nodes handed to ``expand`` so far
    paths: list[list[int]] = []  # each node's tokens from the root down (a constraint's history)
    dists = sampler.tree_rows(root_logits, [[]])  # [1, V]
    for d in range(depth):
        new: list[int] = []
        kids = spec.children(d, sampled)
        tops = _top_candidates(dists, kids, ids) if sampler.mode == "argmax" else None
        for i, (parent, row) in enumerate(zip(level, dists)):
            room = cap - len(toks)
            if room <= 0:
                break
            if tops is not None:
                cands = tops[i][: min(kids, room)]
            else:
                cands = _candidates(row, min(kids, room), sampler, spec, position + d, sampled, ids, vocab)
            for tok, lq in cands:
                s = (score[parent] if parent >= 0 else 0.0) + lq
                if s < floor or lq == -math.inf:  # (a top-k past a row's last finite entry: q = 0)
                    continue
                toks.append(tok)
                pars.append(parent)
                score.append(s)
                paths.append((paths[parent] if parent >= 0 else []) + [tok])
                if sampled:
                    rows.append(row)
                new.append(len(toks) - 1)
        if not new or d + 1 >= depth or len(toks) >= cap:
            break
        level = sorted(new, key=lambda i: (-score[i], i))[:width]
        if expand_floor > -math.inf:  # expand only nodes likely enough (deterministic: whose likely children reach the floor)
            level = [i for i in level if score[i] >= expand_floor]
            if not level:
                break
        if early_stop and prune and len(toks) >= budget and max(score[i] for i in level) <= sorted(score, reverse=True)[budget - 1]:
            break  # no descendant can enter the best N (a child never outscores its parent; ties
            # go to the earlier node): the pruned tree is the same, one draft pass cheaper
        if max_fed is not None:
            level = level[: max_fed - fed]  # the best first: ``level`` is in score order here
            if not level:
                break
        fed += len(level)
        level.sort()
        dists = sampler.tree_rows(expand(level, toks, pars), [paths[i] for i in level])  # [len(level), V]
    keep = list(range(len(toks)))
    if prune and len(toks) > budget:
        keep = sorted(sorted(range(len(toks)), key=lambda i: (-score[i], i))[:budget])
        remap = {old: new for new, old in enumerate(keep)}
        toks = [toks[i] for i in keep]
        pars = [remap[pars[i]] if pars[i] >= 0 else -1 for i in keep]
    # q as drawn from, row for row: casting it (to the root logits' dtype) would report a rounded
    # copy of the law a node was sampled from where a level's rows came in another dtype
    probs = torch.stack(rows) if sampled and rows else None  # [n, V] or [n, Vd]
    if probs is not None and ids is not None:
        if vocab is None:
            raise ValueError("compact draft rows drawn from q need the whole vocabulary's size")
        probs = full_probs(probs, ids, vocab)  # [n, V]
    draft = Draft(
        tokens=torch.tensor(toks, dtype=torch.long),
        probs=probs,
        parents=torch.tensor(pars, dtype=torch.long),
        siblings=spec.siblings,
    )
    return draft, keep

