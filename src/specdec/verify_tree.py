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
    n = tokens.numel()
    if n == 0:
        return None
    rows = torch.arange(n)
    p_x = target_probs[parents + 1, tokens].double()  # [N]
    q_x = draft_probs[rows, tokens].double() if draft_probs is not None else torch.ones(n, dtype=torch.float64)
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-300), (p_x > 0).double())
    return float(ratio.clamp(max=1.0).mean())


def _verdict(path: list[int], tokens: list[int], last: int, alpha: float | None = None) -> TreeVerdict:
    emitted = [tokens[i] for i in path] + [last]
    return TreeVerdict(path=tuple(path), tokens=torch.tensor(emitted, dtype=torch.int64), alpha_mean=alpha)


def _follow(
    tokens: Tensor, parents: Tensor, target_probs: Tensor, pick: "_Pick"
) -> TreeVerdict:
    """Walk from the root: at each node the target picks a token; descend into the first child
    carrying it, else emit it and stop.  (Greedy and coupled verification.)"""
    toks = tokens.tolist()
    kids = children_lists(parents.tolist())
    path: list[int] = []
    node, depth = -1, 0
    while True:
        own = pick(target_probs[node + 1], depth)
        nxt = next((c for c in kids[node + 1] if toks[c] == own), None)
        if nxt is None:
            return _verdict(path, toks, own)
        path.append(nxt)
        node, depth = nxt, depth + 1


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
    invariant to the drafter and to the tree's shape.
    """
    check_tree(tokens, parents, None, target_probs)
    return _follow(tokens, parents, target_probs, lambda row, depth: gumbel_sample(row, seed, base_position + depth))


# ----------------------------------------------------------------------------- recursive rejection sampling


@dataclass(frozen=True)
class NodePlan:
    """The deterministic half of multi-draft rejection sampling at one node.

    ``accept[j]`` is the probability of accepting child j *given that children 0..j-1 were
    rejected*; ``residual`` [V] float64 (sums to 1) is the distribution of the recovered token
    when every child is rejected.
    """

    accept: tuple[float, ...]
    residual: Tensor  # [V] float64


def _accept_prob(p_tok: float, q_tok: float) -> float:
    """min(1, p/q), with 0 when p = 0 (never accept a token the target cannot emit)."""
    if p_tok <= 0.0:
        return 0.0
    if q_tok <= 0.0 or p_tok >= q_tok:
        return 1.0
    return p_tok / q_tok


def _normalised(row: Tensor, fallback: Tensor) -> Tensor:  # [V] float64 -> [V] float64
    mass = float(row.sum())
    if mass > 0.0:
        return row / mass
    return fallback  # unreachable in exact arithmetic (a rejection has probability |residual|)


def node_plan(
    p_row: Tensor,  # [V] target distribution at the node
    child_tokens: list[int],
    child_q: Tensor | None,  # [k, V] draft rows the children were drawn from; None => point masses
    *,
    siblings: SiblingMode = "iid",
) -> NodePlan:
    """Recursive rejection sampling over the children of one node (Jeon et al. 2024, Alg. 1).

    Child j is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))`` where ``q_j`` is the
    distribution x_j was drawn from *given the earlier siblings* and ``p_j`` the current residual
    target; on rejection ``p_{j+1} = norm(max(0, p_j - q_j))``.  ``q_j`` is:

    * ``"iid"``: the child's own row (siblings independent);
    * ``"without_replacement"``: the child's row with the earlier siblings' tokens removed and
      renormalised (the base row is what is stored);
    * deterministic candidates (``child_q is None``): the point mass on x_j, so the acceptance
      probability is ``p_j(x_j)`` and the residual removes x_j from ``p_j``.
    """
    p = _normalised(p_row.double().clamp_min(0.0), p_row.double())
    base = p
    accept: list[float] = []
    removed: list[int] = []
    for j, tok in enumerate(child_tokens):
        if child_q is None:
            q = torch.zeros_like(p)
            q[tok] = 1.0
        else:
            q = child_q[j].double().clamp_min(0.0)
            if siblings == "without_replacement" and removed:
                q = q.clone()
                q[removed] = 0.0
            q = _normalised(q, q)
        a = _accept_prob(float(p[tok]), float(q[tok]))
        accept.append(a)
        removed.append(tok)
        if a >= 1.0:  # later siblings are never reached; the residual is irrelevant
            break
        p = _normalised((p - q).clamp_min(0.0), base)
    return NodePlan(accept=tuple(accept), residual=p)


def _check_siblings(siblings: str) -> None:
    if siblings not in SIBLING_MODES:
        raise ValueError(f"siblings must be one of {SIBLING_MODES}; got {siblings!r}")


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
    chain this is token verification (Leviathan et al. 2023).
    """
    _check_siblings(siblings)
    check_tree(tokens, parents, draft_probs, target_probs)
    toks = tokens.tolist()
    kids = children_lists(parents.tolist())
    path: list[int] = []
    node = -1
    while True:
        row = target_probs[node + 1]
        children = kids[node + 1]
        if not children:
            return _verdict(path, toks, sample_categorical(row, generator), _alpha_mean(tokens, parents, draft_probs, target_probs))
        child_q = draft_probs[children] if draft_probs is not None else None
        plan = node_plan(row, [toks[c] for c in children], child_q, siblings=siblings)
        nxt = None
        for c, a in zip(children, plan.accept):
            if float(torch.rand(1, generator=generator, dtype=torch.float64)) < a:
                nxt = c
                break
        if nxt is None:
            last = sample_categorical(plan.residual, generator)
            return _verdict(path, toks, last, _alpha_mean(tokens, parents, draft_probs, target_probs))
        path.append(nxt)
        node = nxt


# ----------------------------------------------------------------------------- traversal verification


def tree_traversal(
    tokens: Tensor,  # [N] int64
    parents: Tensor,  # [N] int64
    draft_probs: Tensor | None,  # [N, V]
    target_probs: Tensor,  # [N+1, V]
    *,
    generator: torch.Generator | None = None,
    siblings: SiblingMode = "iid",
) -> TreeVerdict:
    """Traversal Verification (Weng et al. 2025): not implemented yet."""
    raise NotImplementedError("tree_traversal is not implemented yet")


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
        TreeRule("tree_coupled", tree_coupled, True, "gumbel", False),
    )
}

#: the tree counterpart of each lossless chain rule (the plumbing looks trees up by chain name)
CHAIN_TO_TREE: dict[str, str] = {
    "greedy": "tree_greedy",
    "token": "tree_token",
    "block": "tree_token",  # until tree_traversal lands
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
