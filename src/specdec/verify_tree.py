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

Rules: :func:`tree_greedy`; :func:`tree_token` (multi-draft recursive rejection sampling:
SpecInfer's multi-step speculative sampling, Miao et al. 2024; Jeon et al. 2024, "Recursive
Speculative Decoding"); :func:`tree_coupled` (seeded Gumbel-max coupling).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol

import torch
from torch import Tensor

from specdec.errors import ConfigError
from specdec.sampling import gumbel_sample, sample_categorical
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
        raise ValueError(f"expected tokens [N] and parents [N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}")
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


def _alpha_mean(tokens: Tensor, parents: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> float | None:
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
    return _follow(tokens, parents, target_probs, lambda row, depth: int(row.argmax()))


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
    descends into it (the first such child), otherwise the token is emitted and the round ends.
    The emitted tokens are, by construction, what plain seeded sampling would emit: the rule is
    invariant to the drafter and to the tree's shape (so it is lossless for any drafter; a
    drafter that draws children by keyed Gumbel top-k at the same positions maximises the
    chance that the target's sample is among them).
    """
    check_tree(tokens, parents, None, target_probs)
    return _follow(tokens, parents, target_probs, lambda row, depth: gumbel_sample(row, seed, base_position + depth))


# ----------------------------------------------------------------------------- recursive rejection sampling


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


def target_row(target_probs: Tensor, node: int) -> Tensor:  # -> [V] float64, sums to 1
    """The target distribution after ``node`` (``-1``: the root) in float64."""
    row = target_probs[node + 1].double()
    return _normalised(row.clamp_min(0.0), row)


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
    q = q_row.double().clamp_min(0.0)
    if siblings == "without_replacement" and earlier:
        q = q.clone()
        q[earlier] = 0.0
    return _normalised(q, q)


def _proposal(draft_probs: Tensor | None, node: int, token: int, vocab: int, earlier: list[int],
              siblings: SiblingMode) -> Tensor:  # -> [V] float64
    if draft_probs is None:
        q = torch.zeros(vocab, dtype=torch.float64)
        q[token] = 1.0
        return q
    return sibling_proposal(draft_probs[node], earlier, siblings=siblings)


def rejection_residual(p: Tensor, q: Tensor) -> Tensor:  # [V], [V] float64 -> [V] float64
    """The target left after rejecting a candidate drawn from q: norm(max(0, p - q)).

    Its mass is TV(p, q), the probability of the rejection; at mass 0 (p = q, where rejection is
    impossible in exact arithmetic) ``p`` is returned unchanged.
    """
    return _normalised((p - q).clamp_min(0.0), p)


# ----------------------------------------------------------------------------- recursive rejection sampling


@dataclass(frozen=True)
class NodePlan:
    """The deterministic half of multi-draft rejection sampling at one node.

    ``accept[j]`` is the probability of accepting child j *given that children 0..j-1 were
    rejected* (it may stop early: after a child accepted with probability 1 nothing else is
    reached); ``residual`` [V] float64 (sums to 1) is the distribution of the recovered token
    when every child is rejected.
    """

    accept: tuple[float, ...]
    residual: Tensor  # [V] float64


def node_plan(
    p: Tensor,  # [V] float64 target distribution at the node, sums to 1
    proposals: list[Tensor],  # k x [V] float64: what child j was drawn from given children < j
    child_tokens: list[int],
) -> NodePlan:
    """Recursive rejection sampling over the children of one node (Jeon et al. 2024, Alg. 1;
    SpecInfer's multi-step speculative sampling for i.i.d. siblings).

    Child j is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))`` where ``q_j`` is the law
    x_j was drawn from given the earlier siblings (:func:`sibling_proposal`) and ``p_j`` the
    current target; on rejection ``p_{j+1} = norm(max(0, p_j - q_j))``.  Each step is one
    ordinary rejection-sampling step whose "sample from the residual" is delegated to the next
    child, so the emitted token follows ``p`` whatever the proposals are, as long as ``q_j`` is
    the true conditional law of x_j.
    """
    accept: list[float] = []
    for q, tok in zip(proposals, child_tokens):
        a = _accept_prob(float(p[tok]), float(q[tok]))
        accept.append(a)
        if a >= 1.0:  # later siblings are never reached; the residual is irrelevant
            break
        p = rejection_residual(p, q)
    return NodePlan(accept=tuple(accept), residual=p)


def _check_siblings(siblings: str) -> None:
    if siblings not in SIBLING_MODES:
        raise ValueError(f"siblings must be one of {SIBLING_MODES}; got {siblings!r}")


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def children_proposals(
    draft_probs: Tensor | None, tokens: list[int], children: list[int], vocab: int, siblings: SiblingMode
) -> list[Tensor]:
    """:func:`sibling_proposal` for each child of one node, in index order."""
    out: list[Tensor] = []
    earlier: list[int] = []
    for c in children:
        out.append(_proposal(draft_probs, c, tokens[c], vocab, earlier, siblings))
        earlier.append(tokens[c])
    return out


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
    sampling; Jeon et al. 2024, "Recursive Speculative Decoding").

    From the root: try the children in index order with :func:`node_plan`'s acceptance
    probabilities; descend into the first accepted child; if all are rejected emit a token from
    the final residual and stop; at an accepted leaf emit the bonus from its target row.  On a
    chain this is token verification (Leviathan et al. 2023).  Deterministic candidates are
    point-mass proposals: accept x with probability p(x), else remove x from p and renormalise.
    """
    _check_siblings(siblings)
    check_tree(tokens, parents, draft_probs, target_probs)
    toks = tokens.tolist()
    kids = children_lists(parents.tolist())
    vocab = target_probs.shape[1]
    alpha = _alpha_mean(tokens, parents, draft_probs, target_probs)
    path: list[int] = []
    node = -1
    while True:  # the steps of node_plan, drawn as they go (later siblings only when reached)
        p = target_row(target_probs, node)
        nxt = None
        earlier: list[int] = []
        for c in kids[node + 1]:
            q = _proposal(draft_probs, c, toks[c], vocab, earlier, siblings)
            if _uniform(generator) < _accept_prob(float(p[toks[c]]), float(q[toks[c]])):
                nxt = c
                break
            earlier.append(toks[c])
            p = rejection_residual(p, q)
        if nxt is None:  # every child rejected (or a leaf): the residual (or the bonus row)
            return _verdict(path, toks, sample_categorical(p, generator), alpha)
        path.append(nxt)
        node = nxt


# ----------------------------------------------------------------------------- traversal verification


def traversal_child_weight(weight: float, p: Tensor, q: Tensor, token: int) -> float:
    """A child's sequence-level acceptance weight: ``min(1, w · p(x) / q(x))`` (0 if p(x) = 0)."""
    return _accept_prob(weight * float(p[token]), float(q[token]))


def traversal_residual(weight: float, p: Tensor, q: Tensor) -> tuple[float, Tensor]:
    """A node's (weight, target) after the subtree of a child drawn from q was rejected.

    ``r = max(0, w·p − q)``; the new weight is ``|r| / (|r| + 1 − w)`` and the new target
    ``r / |r|`` (Sun et al. 2024's ``h`` and block residual on a chain).  The rejection had
    probability ``1 − Σ min(q, w·p) = |r| + 1 − w``, of which ``r`` is the target mass that
    still has to be produced, hence both formulas.  (0/0, which needs w = 1 and p = q where a
    rejection is impossible, is taken as 0, as :func:`specdec.verify.block_plan` does.)
    """
    r = (weight * p - q).clamp_min(0.0)
    mass = float(r.sum())
    denom = mass + (1.0 - weight)
    new_weight = min(1.0, mass / denom) if denom > 0.0 and mass > 0.0 else 0.0
    return new_weight, (r / mass if mass > 0.0 else p)


def tree_traversal(
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    draft_probs: Tensor | None,  # [N, V]; None => deterministic candidates
    target_probs: Tensor,  # [N+1, V]
    *,
    generator: torch.Generator | None = None,
    siblings: SiblingMode = "iid",
) -> TreeVerdict:
    """Traversal Verification (Weng et al. 2025), derived here for i.i.d., without-replacement and
    deterministic siblings; on a chain it is block verification (Sun et al. 2024).

    Every node carries a sequence-level weight ``w``: the root has 1, a child drawn from ``q``
    at a node with weight ``w`` and target ``p`` gets ``min(1, w·p(x)/q(x))``.  The tree is
    traversed in post-order (leaves first, children in index order).  A node whose children are
    all gone is accepted with probability ``w`` — the path from the root to it is kept and the
    next token drawn from its current target — or else deleted; deleting a child updates its
    parent's ``(w, p)`` by :func:`traversal_residual` (and, without replacement, the next
    sibling's proposal excludes the deleted token), which sets the weights of the siblings not
    yet visited.  The root is never deleted (its weight stays 1).

    Losslessness, by induction over the tree: a node with weight w, whatever its subtree, is
    accepted with total probability w, and given acceptance emits a continuation distributed as
    the target's (the first child takes min(q, w·p) of that mass, the residual r = max(0, w·p − q)
    is left to the later siblings and the node itself, with weight |r| / P(rejection)).
    """
    _check_siblings(siblings)
    check_tree(tokens, parents, draft_probs, target_probs)
    toks = tokens.tolist()
    kids = children_lists(parents.tolist())
    vocab = target_probs.shape[1]

    def visit(node: int, weight: float) -> tuple[list[int], int] | None:
        p = target_row(target_probs, node)
        earlier: list[int] = []
        for c in kids[node + 1]:
            tok = toks[c]
            q = _proposal(draft_probs, c, tok, vocab, earlier, siblings)
            child_weight = traversal_child_weight(weight, p, q, tok)
            if child_weight > 0.0:  # a weight-0 subtree is rejected with certainty: skip it
                found = visit(c, child_weight)
                if found is not None:
                    return [c, *found[0]], found[1]
            earlier.append(tok)
            weight, p = traversal_residual(weight, p, q)
        if node < 0 or _uniform(generator) < weight:
            return [], sample_categorical(p, generator)
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
