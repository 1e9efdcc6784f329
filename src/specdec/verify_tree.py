"""Verification rules over token trees: pure functions of the tree, the distributions and the randomness.

A tree draft has N nodes in topological order:

* ``tokens[i]``  the token of node i;
* ``parents[i]`` its parent (``-1``: a child of the last committed token, the *root*), ``< i``;
* ``draft_probs[i]`` the draft distribution q at node i's parent context, i.e. the row node i was
  drawn from (siblings drawn from one context share the same row); ``None`` for deterministic
  candidates (arg-max, top-k, n-gram continuations).

``target_probs`` has N + 1 rows: row 0 is the target's distribution p at the root, row i + 1 its
distribution after node i (at node i's children, or its bonus token).  Children of a node are
processed in index order.  A chain is ``parents = [-1, 0, ..., N-2]``, and on a chain every rule
here gives exactly the law of its chain counterpart in :mod:`specdec.verify`.

Every rule returns a :class:`TreeVerdict`: the accepted root path followed by exactly one
recovered-or-bonus token.  Randomness comes in as a ``torch.Generator`` (or, for coupled
verification, as the Gumbel key); no rule touches a global RNG.

Rules (all lossless): :func:`tree_greedy`; :func:`tree_token` (multi-draft recursive rejection
sampling: SpecInfer's multi-step speculative sampling, Miao et al. 2024; Jeon et al. 2024,
"Recursive Speculative Decoding"); :func:`tree_traversal` (Traversal Verification, Weng et al.
2025; block verification on a chain); :func:`tree_coupled` (seeded Gumbel-max coupling).
Siblings drawn from q may be i.i.d. or drawn without replacement (say which: a rule told the
wrong one is biased); deterministic candidates (``draft_probs`` None) are exact under every rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol

import torch
from torch import Tensor

from specdec.errors import ConfigError
from specdec.sampling import argmax_last, gumbel_sample, sample_categorical
from specdec.verify import DraftSampling

#: how siblings that share a draft row were drawn from it
SiblingMode = Literal["iid", "without_replacement"]
SIBLING_MODES: tuple[str, ...] = ("iid", "without_replacement")


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying one tree draft."""

    path: tuple[int, ...]  # accepted node indices, root level first; () if none
    tokens: Tensor  # [len(path) + 1] int64: the accepted tokens + 1 recovered-or-bonus token
    #: mean over nodes of min(1, p(x_i) / q(x_i)) with p the target row at node i's parent
    #: (the chain's alpha_mean on a chain); None for rules that do not compare probabilities
    alpha_mean: float | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.path)


# ----------------------------------------------------------------------------- tree helpers


def check_tree(tokens: Tensor, parents: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> int:
    """Validate shapes and topology; return N.  Raises ``ValueError`` on a malformed tree."""
    n = tokens.numel()
    if tokens.dim() != 1 or parents.dim() != 1 or parents.numel() != n:
        raise ValueError(
            f"expected tokens [N] and parents [N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"expected target_probs [N+1, V] with N={n}; got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (n, target_probs.shape[1]):
        raise ValueError(f"expected draft_probs [N, V]; got {tuple(draft_probs.shape)}")
    par = parents.tolist()
    for i, j in enumerate(par):
        if not -1 <= j < i:
            raise ValueError(f"parents must satisfy -1 <= parents[i] < i; parents[{i}] = {j}")
    return n


def children_lists(parents: list[int]) -> list[list[int]]:
    """``kids[j + 1]``: the children of node j in index order (``kids[0]``: the root's)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, j in enumerate(parents):
        kids[j + 1].append(i)
    return kids


def depths(parents: list[int]) -> list[int]:
    """Depth of each node; a root-level node has depth 0."""
    out: list[int] = []
    for j in parents:
        out.append(0 if j < 0 else out[j] + 1)
    return out


def _alpha_mean(
    tokens: Tensor, parents: Tensor, draft_probs: Tensor | None, target_probs: Tensor
) -> float | None:
    if tokens.numel() == 0:
        return None
    p_x = target_probs[parents + 1, tokens].double()  # [N]
    if draft_probs is None:
        return float(p_x.clamp(max=1.0).mean())
    q_x = draft_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).double()  # [N]
    return float(torch.where(p_x > 0, (p_x / q_x).clamp(max=1.0), 0.0).mean())


def _verdict(path: list[int], tokens: list[int], last: int, alpha: float | None = None) -> TreeVerdict:
    emitted = [tokens[i] for i in path] + [last]
    return TreeVerdict(path=tuple(path), tokens=torch.tensor(emitted, dtype=torch.int64), alpha_mean=alpha)


def _follow(tokens: Tensor, parents: Tensor, target_probs: Tensor, pick: "_Pick") -> TreeVerdict:
    """Walk from the root: at each step the target picks a token; go on while some child carries
    it, else emit it and stop.  (Greedy and coupled verification.)

    Sibling duplicates are followed together (they share a context, so the target picks the same
    token after each; the first one's row is used) and the path ends in the first of the deepest
    nodes reached, so a duplicate never shortens the accepted path.
    """
    toks = tokens.tolist()
    par = parents.tolist()
    kids = children_lists(par)
    frontier, depth, end = [-1], 0, -1
    while True:
        own = pick(target_probs[frontier[0] + 1], depth)
        frontier = [c for node in frontier for c in kids[node + 1] if toks[c] == own]
        if not frontier:
            path: list[int] = []
            while end >= 0:
                path.append(end)
                end = par[end]
            return _verdict(path[::-1], toks, own)
        end, depth = frontier[0], depth + 1


class _Pick(Protocol):
    def __call__(self, row: Tensor, depth: int) -> int: ...  # row: [V]


# ----------------------------------------------------------------------------- greedy


def tree_greedy(
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    draft_probs: Tensor | None,  # unused
    target_probs: Tensor,  # [N+1, V] probabilities or (penalised) logits: only the arg-max is used
    *,
    generator: torch.Generator | None = None,
) -> TreeVerdict:
    """The longest root path whose tokens equal the target's arg-max at every step, plus the
    target's arg-max after it.  (Ties: the first maximal id, as ``argmax`` and the chain rule.)"""
    check_tree(tokens, parents, None, target_probs)
    return _follow(tokens, parents, target_probs, lambda row, depth: int(argmax_last(row)))


# ----------------------------------------------------------------------------- coupled


def tree_coupled(
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    draft_probs: Tensor | None,  # unused
    target_probs: Tensor,  # [N+1, V]
    *,
    seed: int,
    base_position: int,
    generator: torch.Generator | None = None,
) -> TreeVerdict:
    """Seeded Gumbel-max coupling over a tree.

    At each step the target draws its own keyed sample ``argmax_v log p(v) + G(seed, t, v)`` at
    the absolute position ``t = base_position + depth``; if a child carries that token the walk
    descends into it, otherwise the token is emitted and the round ends (see :func:`_follow`).
    The emitted tokens are, by construction, what plain seeded sampling would emit: the rule is
    invariant to the drafter and to the tree's shape (so it is lossless for any drafter; a
    drafter that draws children by keyed Gumbel top-k at the same positions maximises the
    chance that the target's sample is among them).
    """
    check_tree(tokens, parents, None, target_probs)
    return _follow(tokens, parents, target_probs, lambda row, depth: gumbel_sample(row, seed, base_position + depth))


# ----------------------------------------------------------------------------- one node's target


def _accept_prob(p_tok: float, q_tok: float) -> float:
    """min(1, p/q), and 0 when p = 0: a token the target cannot emit is never accepted.

    q = 0 < p cannot happen for a token that was actually drawn from q; it is taken as 1.
    """
    if p_tok <= 0.0:
        return 0.0
    if q_tok <= 0.0 or p_tok >= q_tok:
        return 1.0
    return p_tok / q_tok


def _normalised(row: Tensor, fallback: Tensor) -> Tensor:  # [V] float64 -> [V] float64
    mass = float(row.sum())
    if mass > 0.0:
        return row / mass
    return fallback  # unreachable in exact arithmetic (see the callers)


class NodeTarget:
    """The target's distribution at one node while the node's children are tried (float64).

    It starts as the node's target row.  Rejecting a point-mass candidate x leaves
    ``norm(max(0, p − δ_x))``, i.e. p without x, renormalised: that is kept as a set of removed
    tokens, O(1) per candidate with no pass over the vocabulary.  Rejecting a candidate drawn
    from a distribution q replaces the row by a dense residual (:meth:`set_dense`).  Nothing is
    computed until asked for, so a leaf that is never reached or never rejected costs nothing.
    """

    def __init__(self, row: Tensor) -> None:  # row: [V] probabilities, any float dtype
        self._row = row
        self._total: float | None = None  # row's mass, float64
        self._removed: dict[int, float] = {}  # removed token -> its mass in row
        self._kept_off = 0.0  # total mass of the removed tokens
        self._dense: Tensor | None = None  # [V] float64, sums to 1, once materialised

    def prob(self, token: int) -> float:
        """The current (normalised) probability of ``token``."""
        if self._dense is not None:
            return float(self._dense[token])
        if token in self._removed:
            return 0.0
        if self._total is None:
            self._total = float(self._row.sum(dtype=torch.float64))
        kept = self._total - self._kept_off
        return float(self._row[token]) / kept if kept > 0.0 else 0.0

    def remove(self, token: int) -> None:
        """Condition on "not ``token``" (the residual after rejecting a point mass on it)."""
        if self._dense is not None:
            dense = self._dense.clone()
            dense[token] = 0.0
            self._dense = _normalised(dense, self._dense)
        elif token not in self._removed:
            self._removed[token] = float(self._row[token])
            self._kept_off += self._removed[token]

    def dense(self) -> Tensor:  # -> [V] float64, sums to 1
        if self._dense is None:
            row = self._row.double()
            if self._removed:
                row = row.clone()
                row[list(self._removed)] = 0.0
            self._dense = _normalised(row, self._row.double())
        return self._dense

    def set_dense(self, row: Tensor) -> None:  # row: [V] float64, sums to 1
        self._dense = row

    def sample_weights(self) -> Tensor:  # -> [V] unnormalised weights of the current distribution
        """What to sample the emitted token from (the raw row when nothing was removed)."""
        if self._dense is None and not self._removed:
            return self._row
        return self.dense()


def sibling_proposal(
    q_row: Tensor,  # [V] the base row child j was drawn from
    earlier: list[int],  # tokens of the earlier siblings, in index order
    *,
    siblings: SiblingMode,
) -> Tensor:  # [V] float64, sums to 1
    """The distribution child j was actually drawn from, *given its earlier siblings*.

    ``"iid"``: the row itself; ``"without_replacement"``: the row with the earlier siblings'
    tokens removed and renormalised.  (Deterministic candidates are point masses on their own
    token whatever the mode: they are not drawn from anything.)
    """
    q = q_row.double()
    if siblings == "without_replacement" and earlier:
        q = q.clone()
        q[earlier] = 0.0
    return _normalised(q, q)


def _proposal(
    draft_probs: Tensor | None, node: int, earlier: list[int], siblings: SiblingMode
) -> Tensor | None:  # [V] float64 or None
    """:func:`sibling_proposal` of ``node``; ``None`` (a point mass on its token) for candidates."""
    if draft_probs is None:
        return None
    return sibling_proposal(draft_probs[node], earlier, siblings=siblings)


def children_proposals(
    draft_probs: Tensor | None, tokens: list[int], children: list[int], siblings: SiblingMode
) -> list[Tensor | None]:
    """:func:`sibling_proposal` for each child of one node, in index order (for exact laws)."""
    earlier = [tokens[c] for c in children]
    return [_proposal(draft_probs, c, earlier[:j], siblings) for j, c in enumerate(children)]


# ----------------------------------------------------------------------------- recursive rejection sampling


def rejection_residual(p: Tensor, q: Tensor) -> Tensor:  # [V], [V] float64 -> [V] float64
    """The target left after rejecting a candidate drawn from q: norm(max(0, p - q)).

    Its mass is TV(p, q), the probability of the rejection; at mass 0 (p = q, where rejection is
    impossible in exact arithmetic) ``p`` is returned unchanged.
    """
    return _normalised((p - q).clamp_min(0.0), p)


def rrs_accept_prob(target: NodeTarget, q: Tensor | None, token: int) -> float:
    """Acceptance probability of a child: ``min(1, p(x) / q(x))`` at the current target, where q
    is the law x was drawn from given its earlier siblings (a point mass: ``p(x)``)."""
    return _accept_prob(target.prob(token), 1.0 if q is None else float(q[token]))


def rrs_reject(target: NodeTarget, q: Tensor | None, token: int) -> None:
    """Update the target after that child was rejected: ``p ← norm(max(0, p − q))``."""
    if q is None:
        target.remove(token)
    else:
        target.set_dense(rejection_residual(target.dense(), q))


def _check_siblings(siblings: str) -> None:
    if siblings not in SIBLING_MODES:
        raise ValueError(f"siblings must be one of {SIBLING_MODES}; got {siblings!r}")


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def tree_token(
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    draft_probs: Tensor | None,  # [N, V] q each node was drawn from; None => deterministic candidates
    target_probs: Tensor,  # [N+1, V]
    *,
    generator: torch.Generator | None = None,
    siblings: SiblingMode = "iid",
) -> TreeVerdict:
    """Multi-draft recursive rejection sampling over a tree (SpecInfer's multi-step speculative
    sampling; Jeon et al. 2024, "Recursive Speculative Decoding", with the without-replacement
    correction).

    From the root: try the children in index order; child j is accepted with probability
    ``min(1, p_j(x_j) / q_j(x_j))`` (:func:`rrs_accept_prob`), where ``q_j`` is the law x_j was
    drawn from given the earlier siblings (:func:`sibling_proposal`) and ``p_j`` the current
    target; on rejection ``p_{j+1} = norm(max(0, p_j − q_j))`` (:func:`rrs_reject`).  The walk
    descends into the first accepted child; if all are rejected it emits a token from the last
    residual and stops; at an accepted leaf it emits the bonus from the leaf's target row.

    Each step is one ordinary rejection-sampling step whose "draw from the residual" is handed
    to the next sibling, so the emitted token follows p whatever the proposals, provided q_j is
    the true conditional law of x_j.  On a chain this is token verification (Leviathan et al.
    2023).  Deterministic candidates are point masses: accept x with probability p(x), else
    drop x from p and renormalise.
    """
    _check_siblings(siblings)
    check_tree(tokens, parents, draft_probs, target_probs)
    toks = tokens.tolist()
    kids = children_lists(parents.tolist())
    alpha = _alpha_mean(tokens, parents, draft_probs, target_probs)
    path: list[int] = []
    node = -1
    while True:
        target = NodeTarget(target_probs[node + 1])
        nxt = None
        earlier: list[int] = []
        for c in kids[node + 1]:
            q = _proposal(draft_probs, c, earlier, siblings)
            if _uniform(generator) < rrs_accept_prob(target, q, toks[c]):
                nxt = c
                break
            rrs_reject(target, q, toks[c])
            earlier.append(toks[c])
        if nxt is None:  # every child rejected (or a leaf): the residual (or the bonus row)
            return _verdict(path, toks, sample_categorical(target.sample_weights(), generator), alpha)
        path.append(nxt)
        node = nxt


# ----------------------------------------------------------------------------- traversal verification


def traversal_child_weight(weight: float, target: NodeTarget, q: Tensor | None, token: int) -> float:
    """A child's sequence-level weight: ``min(1, w · p(x) / q(x))`` at its parent's current
    weight w and target p (0 if p(x) = 0; a point mass has q(x) = 1)."""
    return _accept_prob(weight * target.prob(token), 1.0 if q is None else float(q[token]))


def traversal_residual(weight: float, p: Tensor, q: Tensor) -> tuple[float, Tensor]:
    """A node's (weight, target) after the subtree of a child drawn from q was deleted.

    ``r = max(0, w·p − q)``; the new weight is ``|r| / (|r| + 1 − w)`` and the new target
    ``r / |r|`` (Sun et al. 2024's ``h`` and block residual on a chain).  The deletion had
    probability ``1 − Σ min(q, w·p) = |r| + 1 − w``, of which ``r`` is the target mass still to
    be produced, hence both formulas.  (0/0, which needs w = 1 and p = q where a deletion is
    impossible, is taken as 0, as :func:`specdec.verify.block_plan` does.)
    """
    r = (weight * p - q).clamp_min(0.0)
    mass = float(r.sum())
    denom = mass + (1.0 - weight)
    new_weight = min(1.0, mass / denom) if denom > 0.0 and mass > 0.0 else 0.0
    return new_weight, (r / mass if mass > 0.0 else p)


def traversal_reject(weight: float, target: NodeTarget, q: Tensor | None, token: int) -> float:
    """Delete a child: update the node's target in place and return its new weight
    (:func:`traversal_residual`; for a point mass on x with current probability c, the residual
    is p without x and the weight ``w (1 − c) / (1 − w c)``, no pass over the vocabulary)."""
    if q is None:
        c = target.prob(token)
        target.remove(token)
        mass, denom = weight * (1.0 - c), 1.0 - weight * c
        return min(1.0, mass / denom) if denom > 0.0 and mass > 0.0 else 0.0
    new_weight, row = traversal_residual(weight, target.dense(), q)
    target.set_dense(row)
    return new_weight


def tree_traversal(
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    draft_probs: Tensor | None,  # [N, V]; None => deterministic candidates
    target_probs: Tensor,  # [N+1, V]
    *,
    generator: torch.Generator | None = None,
    siblings: SiblingMode = "iid",
) -> TreeVerdict:
    """Traversal Verification (Weng et al. 2025), for i.i.d., without-replacement and
    deterministic siblings; on a chain it is block verification (Sun et al. 2024, Alg. 2).

    Every node carries a sequence-level weight w: the root has 1, a child x drawn from q at a
    node with weight w and current target p gets ``min(1, w·p(x)/q(x))``.  The tree is
    traversed in post-order (children in index order, each child's subtree before the next
    child).  A node whose children are all deleted is kept with probability w — the path from
    the root to it is accepted and the next token drawn from its current target — or else
    deleted; deleting a child updates its parent's (w, p) (:func:`traversal_reject`), which sets
    the weights of the siblings not yet visited.  The root is never deleted.

    Losslessness, by induction over the tree: a node of weight w, whatever its subtree, is kept
    (it or a descendant accepted) with total probability w, and then emits a continuation
    distributed as the target's.  Its first child takes ``min(q, w·p)`` of that mass; the
    remainder ``r = max(0, w·p − q)`` is left to the later siblings and the node itself, which
    are reached with probability ``|r| + 1 − w`` and so run with weight ``|r| / (|r| + 1 − w)``
    on target ``r / |r|``.
    """
    _check_siblings(siblings)
    check_tree(tokens, parents, draft_probs, target_probs)
    toks = tokens.tolist()
    kids = children_lists(parents.tolist())

    def visit(node: int, weight: float) -> tuple[list[int], int] | None:
        target = NodeTarget(target_probs[node + 1])
        earlier: list[int] = []
        for c in kids[node + 1]:
            q = _proposal(draft_probs, c, earlier, siblings)
            child_weight = traversal_child_weight(weight, target, q, toks[c])
            if child_weight > 0.0:  # a weight-0 subtree is deleted with certainty: skip it
                found = visit(c, child_weight)
                if found is not None:
                    return [c, *found[0]], found[1]
            weight = traversal_reject(weight, target, q, toks[c])
            earlier.append(toks[c])
        if node < 0 or _uniform(generator) < weight:
            return [], sample_categorical(target.sample_weights(), generator)
        return None

    found = visit(-1, 1.0)
    assert found is not None  # the root is never deleted
    return _verdict(found[0], toks, found[1], _alpha_mean(tokens, parents, draft_probs, target_probs))


# ----------------------------------------------------------------------------- registry


class TreeVerifyFn(Protocol):
    def __call__(
        self,
        tokens: Tensor,
        parents: Tensor,
        draft_probs: Tensor | None,
        target_probs: Tensor,
        **kwargs: object,
    ) -> TreeVerdict: ...


@dataclass(frozen=True)
class TreeRule:
    """A tree verification rule and what it asks of the rest of the engine (as :class:`verify.Rule`)."""

    name: str
    fn: TreeVerifyFn
    lossless: bool
    #: how the drafter must sample at temperature > 0 so that the rule's guarantee holds
    draft_sampling: DraftSampling
    #: whether the rule reads the full draft distribution q
    needs_draft_probs: bool
    needs_target_probs: bool = True
    greedy_only: bool = False


TREE_RULES: dict[str, TreeRule] = {
    r.name: r
    for r in (
        TreeRule("tree_greedy", tree_greedy, True, "argmax", False, needs_target_probs=False, greedy_only=True),
        TreeRule("tree_token", tree_token, True, "multinomial", True),
        TreeRule("tree_traversal", tree_traversal, True, "multinomial", True),
        TreeRule("tree_coupled", tree_coupled, True, "gumbel", False),
    )
}

#: the tree counterpart of each lossless chain rule (the plumbing looks trees up by chain name)
CHAIN_TO_TREE: dict[str, str] = {
    "greedy": "tree_greedy",
    "token": "tree_token",
    "block": "tree_traversal",
    "coupled": "tree_coupled",
}


def get_tree_rule(name: str, **params: object) -> TreeRule:
    """Look a tree rule up by its own name (``tree-token``) or its chain rule's name (``token``)."""
    key = name.strip().lower().replace("-", "_")
    key = CHAIN_TO_TREE.get(key, key)
    if key not in TREE_RULES:
        choices = ", ".join(sorted({*CHAIN_TO_TREE, *TREE_RULES}))
        raise ConfigError(f"no tree verification rule for {name!r}; choose from: {choices}")
    rule = TREE_RULES[key]
    if params:
        rule = TreeRule(**{**rule.__dict__, "fn": partial(rule.fn, **params)})
    return rule
