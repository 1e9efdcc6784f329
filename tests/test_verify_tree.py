"""Tree verification rules: hand-made cases, closed-form laws in float64, seeded χ² tests.

The closed-form tests enumerate every tree a drafter can draw (siblings i.i.d. or without
replacement) with its probability, compute each rule's exact law of emitted tokens given the
tree (:func:`token_law`, :func:`traversal_law`), complete the emitted tokens with the target's
own law up to a fixed length, and compare with the target's law to 1e-12.  The χ² tests run the
actual sampling functions on drafted trees.  Negative controls (a rule applied to the wrong
sibling law, a residual that is not updated, a plausible wrong traversal update) must fail the
same tests.
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

import pytest
import torch

import specdec.verify_tree as vt
from specdec.errors import ConfigError
from specdec.models.toy import ToyLM
from specdec.sampling import gumbel_sample, sample_categorical
from specdec.verify import block_plan, coupled_verify, greedy_verify, token_plan
from specdec.verify_tree import (
    CHAIN_TO_TREE,
    TREE_RULES,
    TreeVerdict,
    NodeTarget,
    children_lists,
    children_proposals,
    get_tree_rule,
    rrs_accept_prob,
    rrs_reject,
    traversal_child_weight,
    traversal_reject,
    tree_coupled,
    tree_greedy,
    tree_token,
    tree_traversal,
)
from stats import ALPHA, chi_square_pvalue

Law = dict[tuple[int, ...], float]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------- toy models


class Toy:
    """Exact target p and draft q over a tiny vocabulary (order-2 Markov, float64)."""

    def __init__(self, vocab: int, *, seed: int = 3, strength: float = 1.2, prompt=(1, 0)) -> None:
        self.vocab = vocab
        target = ToyLM(vocab, order=2, seed=seed)
        draft = target.perturbed(strength, seed=seed + 1)
        self._p = lru_cache(maxsize=None)(lambda hist: torch.softmax(target.logits_for(list(prompt) + list(hist)), -1))
        self._q = lru_cache(maxsize=None)(lambda hist: torch.softmax(draft.logits_for(list(prompt) + list(hist)), -1))

    def p(self, hist: tuple[int, ...]) -> torch.Tensor:  # [V] float64
        return self._p(tuple(hist))

    def q(self, hist: tuple[int, ...]) -> torch.Tensor:  # [V] float64
        return self._q(tuple(hist))

    def seq_prob(self, seq, prefix=()) -> float:
        prob, hist = 1.0, tuple(prefix)
        for t in seq:
            prob *= float(self.p(hist)[t])
            hist = hist + (t,)
        return prob

    def target_law(self, length: int) -> Law:
        return {s: self.seq_prob(s) for s in itertools.product(range(self.vocab), repeat=length)}


def _paths(tokens, parents) -> list[tuple[int, ...]]:
    """Token path from the root to each node (inclusive)."""
    out: list[tuple[int, ...]] = []
    for i, j in enumerate(parents):
        out.append((out[j] if j >= 0 else ()) + (tokens[i],))
    return out


def _rows(toy: Toy, tokens, parents) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_probs [N, V] (q at each node's parent context) and target_probs [N+1, V]."""
    paths = _paths(tokens, parents)
    ctx = [paths[j] if j >= 0 else () for j in parents]
    q = torch.stack([toy.q(c) for c in ctx]) if tokens else torch.empty(0, toy.vocab, dtype=torch.float64)
    p = torch.stack([toy.p(())] + [toy.p(path) for path in paths])
    return q, p


def enumerate_drafts(toy: Toy, parents: list[int], siblings: str):
    """Every tree of this shape a drafter can draw, with its probability."""
    kids = children_lists(parents)
    n = len(parents)

    def rec(i: int, tokens: list[int], prob: float):
        if prob == 0.0:
            return
        if i == n:
            yield tuple(tokens), prob
            return
        j = parents[i]
        ctx = _paths(tokens, parents[:i])[j] if j >= 0 else ()
        q = toy.q(ctx).clone()
        if siblings == "without_replacement":
            for s in kids[j + 1]:
                if s < i:
                    q[tokens[s]] = 0.0
            q = q / q.sum()
        for tok in range(toy.vocab):
            yield from rec(i + 1, tokens + [tok], prob * float(q[tok]))

    yield from rec(0, [], 1.0)


def draw_tree(toy: Toy, parents: list[int], siblings: str, g: torch.Generator) -> list[int]:
    kids = children_lists(parents)
    tokens: list[int] = []
    for i, j in enumerate(parents):
        ctx = _paths(tokens, parents[:i])[j] if j >= 0 else ()
        q = toy.q(ctx)
        if siblings == "without_replacement":
            q = q.clone()
            for s in kids[j + 1]:
                if s < i:
                    q[tokens[s]] = 0.0
        tokens.append(sample_categorical(q, g))
    return tokens


# ----------------------------------------------------------------------------- exact laws of the rules


def token_law(tokens, parents, draft_probs, target_probs, siblings="iid") -> Law:
    """Exact law of :func:`tree_token`'s emitted tokens for one drafted tree (float64)."""
    kids = children_lists(list(parents))
    law: Law = {}

    def walk(node: int, prefix: tuple[int, ...], reach: float) -> None:
        target = NodeTarget(target_probs[node + 1])
        children = kids[node + 1]
        for c, q in zip(children, children_proposals(draft_probs, list(tokens), children, siblings)):
            a = rrs_accept_prob(target, q, tokens[c])
            walk(c, prefix + (tokens[c],), reach * a)
            reach *= 1.0 - a
            if reach == 0.0:
                return
            rrs_reject(target, q, tokens[c])
        row = target.dense()
        for y in range(row.numel()):
            law[prefix + (y,)] = law.get(prefix + (y,), 0.0) + reach * float(row[y])

    walk(-1, (), 1.0)
    return law


def traversal_law(tokens, parents, draft_probs, target_probs, siblings="iid") -> Law:
    """Exact law of :func:`tree_traversal`'s emitted tokens for one drafted tree (float64)."""
    kids = children_lists(list(parents))

    def visit(node: int, weight: float) -> tuple[Law, float]:  # (law of what is kept below node, P(delete))
        target = NodeTarget(target_probs[node + 1])
        children = kids[node + 1]
        law: Law = {}
        reach = 1.0
        for c, q in zip(children, children_proposals(draft_probs, list(tokens), children, siblings)):
            sub, deleted = visit(c, traversal_child_weight(weight, target, q, tokens[c]))
            for s, pr in sub.items():
                law[(tokens[c],) + s] = law.get((tokens[c],) + s, 0.0) + reach * pr
            reach *= deleted
            weight = traversal_reject(weight, target, q, tokens[c])
        keep = 1.0 if node < 0 else weight
        row = target.dense()
        for y in range(row.numel()):
            law[(y,)] = law.get((y,), 0.0) + reach * keep * float(row[y])
        return law, reach * (1.0 - keep)

    return visit(-1, 1.0)[0]


LAWS = {"token": token_law, "traversal": traversal_law}
RULE_FNS = {"token": tree_token, "traversal": tree_traversal}


def complete(toy: Toy, law: Law, length: int, into: Law, weight: float = 1.0) -> None:
    """Add ``weight`` × the law of the first ``length`` tokens when the round emits ``law`` and
    the target generates the rest."""
    for s, pr in law.items():
        if pr == 0.0:
            continue
        head = s[:length]
        for z in itertools.product(range(toy.vocab), repeat=length - len(head)):
            into[head + z] = into.get(head + z, 0.0) + weight * pr * toy.seq_prob(z, head)


def output_law(toy: Toy, parents: list[int], rule: str, draft_siblings: str, rule_siblings: str, length: int) -> Law:
    out: Law = {}
    for tokens, prob in enumerate_drafts(toy, parents, draft_siblings):
        q, p = _rows(toy, tokens, parents)
        complete(toy, LAWS[rule](tokens, parents, q, p, rule_siblings), length, out, prob)
    return out


def max_gap(a: Law, b: Law) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# ----------------------------------------------------------------------------- closed-form output law

SHAPES = {  # name: (parents, vocabulary, toy seed)
    # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}
    "2x(2,1)": ([-1, -1, 0, 0, 1], 4, 3),
    # root -> {0, 1, 2}; 0 -> {3}; 3 -> {4}: depth 3, three root siblings
    "3+chain": ([-1, -1, -1, 0, 3], 3, 4),
    # root -> {0, 1}; 0 -> {2}; 1 -> {3, 4}; 2 -> {5}
    "deep": ([-1, -1, 0, 1, 1, 2], 3, 4),
}
# (With V = 3 the seed matters: where p > q on a single token, the residual after any rejection
# is a point mass and even a rule fed the wrong sibling law is exact; seed 4 has two such tokens
# at the root, and test_sibling_law_mismatch_breaks_every_shape checks that it discriminates.)


@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
@pytest.mark.parametrize("rule", ["token", "traversal"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tree_rule_reconstructs_target_law_exactly(rule, siblings, shape):
    parents, vocab, seed = SHAPES[shape]
    toy = Toy(vocab, seed=seed)
    depth = max(vt.depths(parents)) + 1
    law = output_law(toy, parents, rule, siblings, siblings, depth + 1)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert max_gap(law, toy.target_law(depth + 1)) < 1e-12


@pytest.mark.parametrize("rule", ["token", "traversal"])
def test_deterministic_candidates_reconstruct_target_law_exactly(rule):
    """Point-mass candidates (draft_probs None): the law is exact for *every* fixed tree,
    duplicates included."""
    toy = Toy(3)
    rng = random.Random(5)
    for parents in ([-1, -1, 0, 0, 1], [-1, -1, -1, 0, 3], [-1, 0, 1], [-1, -1, -1, -1]):
        for _ in range(6):
            tokens = [rng.randrange(3) for _ in parents]
            _, p = _rows(toy, tokens, parents)
            law: Law = {}
            depth = max(vt.depths(parents)) + 1
            complete(toy, LAWS[rule](tokens, parents, None, p), depth + 1, law)
            assert max_gap(law, toy.target_law(depth + 1)) < 1e-12, (parents, tokens)


def _chain_law(plan, block: bool, x: tuple[int, ...], p_rows: torch.Tensor) -> Law:
    """Emitted-token law of a chain rule from its plan (token: a chain of thresholds; block: τ = the
    last position whose uniform falls below its threshold)."""
    h = plan.stop.tolist()
    gamma = len(h)
    law: Law = {}
    for tau in range(gamma + 1):
        if block:
            prob = h[tau - 1] if tau > 0 else 1.0
            for j in range(tau, gamma):
                prob *= 1.0 - h[j]
        else:
            prob = 1.0
            for j in range(tau):
                prob *= h[j]
            if tau < gamma:
                prob *= 1.0 - h[tau]
        row = p_rows[gamma] if tau == gamma else plan.residual[tau] / plan.residual[tau].sum()
        for y in range(p_rows.shape[1]):
            law[x[:tau] + (y,)] = law.get(x[:tau] + (y,), 0.0) + prob * float(row[y])
    return law


@pytest.mark.parametrize(("rule", "plan_fn", "block"), [("token", token_plan, False), ("traversal", block_plan, True)])
def test_tree_rule_on_a_chain_is_the_chain_rule(rule, plan_fn, block):
    """Draft by draft, the tree rule's law on a chain equals token / block verification's."""
    toy = Toy(3)
    for gamma in (1, 2, 3):
        parents = [-1] + list(range(gamma - 1))
        for x, _ in enumerate_drafts(toy, parents, "iid"):
            q, p = _rows(toy, x, parents)
            for dp in (q, None):
                ours = LAWS[rule](x, parents, dp, p)
                theirs = _chain_law(plan_fn(torch.tensor(x), dp, p), block, x, p)
                assert max_gap(ours, theirs) < 1e-12


def test_traversal_accepts_at_least_as_much_as_token_on_a_chain_and_reports_trees():
    """Block verification's optimality on chains carries over; on the test trees traversal's
    expected accepted length is computed for the record (it is not claimed optimal there)."""
    toy = Toy(3)
    parents = [-1, 0, 1]
    mean = {}
    for rule in ("token", "traversal"):
        total = 0.0
        for x, prob in enumerate_drafts(toy, parents, "iid"):
            q, p = _rows(toy, x, parents)
            total += prob * sum(pr * (len(s) - 1) for s, pr in LAWS[rule](x, parents, q, p).items())
        mean[rule] = total
    assert mean["traversal"] >= mean["token"] - 1e-12
    assert mean["traversal"] > mean["token"] + 1e-3  # strictly better on this toy


# ----------------------------------------------------------------------------- negative controls (closed form)


def _no_residual_update(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p  # the target is never corrected after a rejected sibling


def _traversal_unconditional_weight(weight: float, p: torch.Tensor, q: torch.Tensor):
    r = (weight * p - q).clamp_min(0.0)
    mass = float(r.sum())  # plausible slip: |r| is the *unconditional* mass, not divided by P(rejection)
    return mass, (r / mass if mass > 0 else p)


def _traversal_token_level_weight(weight: float, target, q: torch.Tensor, token: int) -> float:
    return rrs_accept_prob(target, q, token)  # slip: the parent's weight is dropped


def _traversal_over_one_minus_q(weight: float, target, q, token: int) -> float:
    """Another reading of the parent update: divide |r| by 1 − q(x) instead of by the deletion
    probability |r| + 1 − w.  Not block verification on a chain, and lossy."""
    p = target.dense()
    r = (weight * p - q).clamp_min(0.0)
    mass, q_x = float(r.sum()), float(q[token])
    target.set_dense(r / mass if mass > 0 else p)
    return min(1.0, mass / (1.0 - q_x)) if q_x < 1.0 and mass > 0 else 0.0


NEGATIVE = {
    # iid rule on siblings drawn without replacement
    "token-iid-on-wor": dict(rule="token", draft="without_replacement", claimed="iid", patch=None),
    "traversal-iid-on-wor": dict(rule="traversal", draft="without_replacement", claimed="iid", patch=None),
    # without-replacement rule on i.i.d. siblings
    "token-wor-on-iid": dict(rule="token", draft="iid", claimed="without_replacement", patch=None),
    # residual not updated after a rejected sibling
    "token-no-residual": dict(
        rule="token", draft="iid", claimed="iid", patch=("rejection_residual", _no_residual_update)
    ),
    # traversal: the parent's new weight is |r| instead of |r| / (|r| + 1 - w)
    "traversal-unconditional": dict(
        rule="traversal", draft="iid", claimed="iid", patch=("traversal_residual", _traversal_unconditional_weight)
    ),
    "traversal-over-1-minus-q": dict(
        rule="traversal", draft="without_replacement", claimed="without_replacement",
        patch=("traversal_reject", _traversal_over_one_minus_q),
    ),
    # traversal: token-level weights min(1, p/q) instead of sequence-level min(1, w p/q)
    "traversal-token-level": dict(
        rule="traversal", draft="iid", claimed="iid", patch=("traversal_child_weight", _traversal_token_level_weight)
    ),
}


def _apply(monkeypatch, patch) -> None:
    if patch is not None:
        monkeypatch.setattr(vt, patch[0], patch[1])
        monkeypatch.setitem(globals(), patch[0], patch[1])  # the law helpers call it by name too


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_controls_break_the_closed_form_law(name, monkeypatch):
    case = NEGATIVE[name]
    _apply(monkeypatch, case["patch"])
    parents, vocab, seed = SHAPES["2x(2,1)"]
    toy = Toy(vocab, seed=seed)
    law = output_law(toy, parents, case["rule"], case["draft"], case["claimed"], 3)
    assert max_gap(law, toy.target_law(3)) > 1e-3


@pytest.mark.parametrize("rule", ["token", "traversal"])
@pytest.mark.parametrize("shape", ["3+chain", "deep"])
def test_sibling_law_mismatch_breaks_every_shape(rule, shape):
    """The other shapes of the exact test discriminate too: a rule told the wrong sibling law
    (i.i.d. vs without replacement, both ways) misses the target law."""
    parents, vocab, seed = SHAPES[shape]
    toy = Toy(vocab, seed=seed)
    length = max(vt.depths(parents)) + 2
    for draft, claimed in (("without_replacement", "iid"), ("iid", "without_replacement")):
        law = output_law(toy, parents, rule, draft, claimed, length)
        assert max_gap(law, toy.target_law(length)) > 1e-3


def enumerate_stopped_drafts(toy: Toy, parents: list[int], siblings: str, stop: float, expand: float = 0.0, *,
                             post_hoc: bool = False):
    """Every tree a drafter with a sibling stop can draw from the largest shape ``parents``, with
    its probability, as (tokens, parents) of the nodes drawn.  A node's first child is always
    drawn; a later one only while the draft probability its drawn siblings leave uncovered is at
    least ``stop`` (what ``TreeSpec.sibling_stop`` does); a node has children only if the product
    of q along its path is at least ``expand`` (``TreeSpec.sample_expand``).  ``post_hoc``: the
    lossy variant that draws every sibling and then drops those whose own q is below ``stop``."""
    kids = children_lists(parents)
    n = len(parents)
    cum: dict[int, float] = {}  # node -> product of q along its path

    def rec(i: int, tokens: list[int | None], prob: float):
        if prob == 0.0:
            return
        if i == n:
            keep = [k for k in range(n) if tokens[k] is not None]
            index = {old: new for new, old in enumerate(keep)}
            yield tuple(tokens[k] for k in keep), tuple(index.get(parents[k], -1) for k in keep), prob
            return
        j = parents[i]
        earlier = [s for s in kids[j + 1] if s < i]
        if (j >= 0 and (tokens[j] is None or cum[j] < expand)) or any(tokens[s] is None for s in earlier):
            yield from rec(i + 1, tokens + [None], prob)  # no parent, a parent not expanded, or a missing earlier sibling
            return
        present = [k for k in range(i) if tokens[k] is not None]
        ctx = _paths([tokens[k] for k in present], [present.index(parents[k]) if parents[k] >= 0 else -1 for k in present])
        ctx = ctx[present.index(j)] if j >= 0 else ()
        q = toy.q(ctx)
        if not post_hoc and earlier and 1.0 - sum(float(q[t]) for t in {tokens[s] for s in earlier}) < stop:
            yield from rec(i + 1, tokens + [None], prob)  # the drawn siblings cover enough: stop
            return
        w = q.clone()
        if siblings == "without_replacement":
            for s in earlier:
                w[tokens[s]] = 0.0
            w = w / w.sum()
        for tok in range(toy.vocab):
            dropped = post_hoc and earlier and float(q[tok]) < stop
            cum[i] = (cum[j] if j >= 0 else 1.0) * float(q[tok])
            yield from rec(i + 1, tokens + [None if dropped else tok], prob * float(w[tok]))

    yield from rec(0, [], 1.0)


def stopped_output_law(toy: Toy, parents: list[int], rule: str, siblings: str, stop: float, length: int, **kw) -> tuple[Law, int]:
    """The output law over every stopped tree, and how many different shapes occurred."""
    out: Law = {}
    shapes = set()
    for tokens, pars, prob in enumerate_stopped_drafts(toy, parents, siblings, stop, **kw):
        shapes.add(pars)
        q, p = _rows(toy, list(tokens), list(pars))
        complete(toy, LAWS[rule](list(tokens), list(pars), q, p, siblings), length, out, prob)
    return out, len(shapes)


@pytest.mark.parametrize(("stop", "expand"), [(0.6, 0.0), (0.0, 0.3), (0.6, 0.3)])
@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
@pytest.mark.parametrize("rule", ["token", "traversal"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sibling_stop_and_expansion_floor_keep_the_target_law_exactly(rule, siblings, shape, stop, expand):
    """A sampled tree whose sibling count is decided from the siblings already drawn (a stopping
    time of the drafter's own draws), and whose nodes get children only when their path is
    likely enough under q, is still verified exactly: each child is an honest draw given
    everything drawn before it, which is all either rule's proof uses."""
    parents, vocab, seed = SHAPES[shape]
    toy = Toy(vocab, seed=seed)
    length = max(vt.depths(parents)) + 2
    law, shapes = stopped_output_law(toy, parents, rule, siblings, stop, length, expand=expand)
    assert shapes > 2  # the stop / floor cut some trees and not others
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert max_gap(law, toy.target_law(length)) < 1e-12


@pytest.mark.parametrize("rule", ["token", "traversal"])
def test_dropping_drawn_siblings_by_probability_breaks_the_law(rule):
    """Negative control: pruning siblings after drawing them (by their own probability) is not a
    stopping rule, and the same closed-form test catches it."""
    parents, vocab, seed = SHAPES["2x(2,1)"]
    toy = Toy(vocab, seed=seed)
    law, _ = stopped_output_law(toy, parents, rule, "without_replacement", 0.3, 3, post_hoc=True)
    assert max_gap(law, toy.target_law(3)) > 1e-3


# ----------------------------------------------------------------------------- χ² tests of the samplers

N_CHI2 = 12_000  # rounds per test; a wrong rule's law differs by >= 0.005 in some cell (see below)
CHI2_PARENTS = [-1, -1, 0, 0, 1]
CHI2_LEN = 3


class DraftSampler:
    """Draws whole trees of one shape at once from their exact law (:func:`enumerate_drafts`)."""

    def __init__(self, toy: Toy, parents: list[int], siblings: str) -> None:
        trees = list(enumerate_drafts(toy, parents, siblings))
        self.trees = [t for t, _ in trees]
        self.probs = torch.tensor([pr for _, pr in trees], dtype=torch.float64)
        self.rows = [_rows(toy, t, parents) for t in self.trees]

    def draw(self, n: int, g: torch.Generator) -> list[int]:
        return torch.multinomial(self.probs, n, replacement=True, generator=g).tolist()


def _simulate(rule, toy: Toy, parents, draft_siblings: str, *, seed: int, n: int = N_CHI2, **kwargs):
    """Outputs (first CHI2_LEN tokens) of n rounds: draw a tree, verify it, let the target go on."""
    g = torch.Generator().manual_seed(seed)
    sampler = DraftSampler(toy, parents, draft_siblings)
    par = _t(parents)
    out = []
    for k in sampler.draw(n, g):
        q, p = sampler.rows[k]
        v = rule(_t(sampler.trees[k]), par, q, p, generator=g, **kwargs)
        seq = tuple(v.tokens.tolist())[:CHI2_LEN]
        while len(seq) < CHI2_LEN:
            seq = seq + (sample_categorical(toy.p(seq), g),)
        out.append(seq)
    return out


def _deterministic(rule):
    """The rule told that the drawn candidates are deterministic (draft_probs None)."""
    return lambda tokens, parents, q, p, **kw: rule(tokens, parents, None, p, **kw)


CHI2_CASES = {
    "token-iid": (tree_token, "iid", dict(siblings="iid")),
    "token-wor": (tree_token, "without_replacement", dict(siblings="without_replacement")),
    "token-deterministic": (_deterministic(tree_token), "iid", {}),
    "traversal-iid": (tree_traversal, "iid", dict(siblings="iid")),
    "traversal-wor": (tree_traversal, "without_replacement", dict(siblings="without_replacement")),
    "traversal-deterministic": (_deterministic(tree_traversal), "iid", {}),
}


@pytest.mark.parametrize("case", sorted(CHI2_CASES))
def test_tree_rule_samples_the_target_law(case):
    rule, draft_siblings, kwargs = CHI2_CASES[case]
    toy = Toy(4)
    outputs = _simulate(rule, toy, CHI2_PARENTS, draft_siblings, seed=11, **kwargs)
    assert chi_square_pvalue(outputs, toy.target_law(CHI2_LEN)) > ALPHA


CHI2_NEGATIVE = {
    "token-iid-on-wor": (tree_token, "without_replacement", dict(siblings="iid"), None),
    "token-no-residual": (tree_token, "iid", dict(siblings="iid"), ("rejection_residual", _no_residual_update)),
    "traversal-unconditional": (
        tree_traversal, "iid", dict(siblings="iid"), ("traversal_residual", _traversal_unconditional_weight)
    ),
}


@pytest.mark.parametrize("case", sorted(CHI2_NEGATIVE))
def test_negative_controls_fail_the_chi2_test(case, monkeypatch):
    rule, draft_siblings, kwargs, patch = CHI2_NEGATIVE[case]
    _apply(monkeypatch, patch)
    toy = Toy(4)
    outputs = _simulate(rule, toy, CHI2_PARENTS, draft_siblings, seed=11, **kwargs)
    assert chi_square_pvalue(outputs, toy.target_law(CHI2_LEN)) < ALPHA


# ----------------------------------------------------------------------------- greedy


def test_tree_greedy_hand_made():
    # root -> {0: tok 1, 1: tok 2}; 0 -> {2: tok 0}; 1 -> {3: tok 2}
    tokens, parents = _t([1, 2, 0, 2]), _t([-1, -1, 0, 1])
    logits = torch.tensor([[0.0, 1, 5], [0, 0, 1], [9, 0, 0], [0, 3, 0], [1, 0, 0]])
    v = tree_greedy(tokens, parents, None, logits)  # arg-max 2 -> node 1; then arg-max 0, no child
    assert v.path == (1,) and v.tokens.tolist() == [2, 0]
    logits[2] = torch.tensor([0.0, 0, 9])  # now node 3 (tok 2) matches; its row says 0
    v = tree_greedy(tokens, parents, None, logits)
    assert v.path == (1, 3) and v.tokens.tolist() == [2, 2, 0]
    logits[0] = torch.tensor([0.0, 5, 1])  # root arg-max 1 -> node 0; row 1 arg-max 2, node 2 is 0
    v = tree_greedy(tokens, parents, None, logits)
    assert v.path == (0,) and v.tokens.tolist() == [1, 2]
    logits[0] = torch.tensor([5.0, 0, 1])  # no root child matches
    v = tree_greedy(tokens, parents, None, logits)
    assert v.path == () and v.tokens.tolist() == [0]


def test_tree_greedy_empty_tree_and_duplicates():
    v = tree_greedy(_t([]), _t([]), None, torch.tensor([[0.0, 2.0, 1.0]]))
    assert v.path == () and v.tokens.tolist() == [1]
    # two root children carry the same token: the deeper match wins, else the first
    logits = torch.tensor([[0.0, 9.0], [9.0, 0.0], [9.0, 0.0], [0.0, 9.0]])  # nodes 0, 1: same context
    v = tree_greedy(_t([1, 1, 0]), _t([-1, -1, 1]), None, logits)
    assert v.path == (1, 2) and v.tokens.tolist() == [1, 0, 1]
    v = tree_greedy(_t([1, 1, 1]), _t([-1, -1, 1]), None, logits)
    assert v.path == (0,) and v.tokens.tolist() == [1, 0]


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return [rng.randrange(vocab) for _ in range(n)], parents


def test_tree_greedy_on_chains_equals_greedy_verify_and_follows_the_argmax_path():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        gamma = rng.randrange(0, 5)
        logits = torch.randn(gamma + 1, 3, generator=g)
        draft = _t([rng.randrange(3) for _ in range(gamma)])
        chain = _t([-1] + list(range(gamma - 1))) if gamma else _t([])
        v = tree_greedy(draft, chain, None, logits)
        w = greedy_verify(draft, None, logits)
        assert v.tokens.tolist() == w.tokens.tolist() and v.num_accepted == w.num_accepted


def _own_samples_check(make, rng: random.Random, vocab: int = 4) -> None:
    """On random trees (rows from a toy model), the emitted tokens are the plain decoder's own
    samples, and the path is as long as the longest root path spelling them.  ``make(trial)``
    gives the rule and the plain decoder's pick ``own(row, offset)`` for that trial."""
    toy = Toy(vocab, strength=0.0)
    for trial in range(150):
        rule_fn, own_fn = make(trial)
        tokens, parents = _random_tree(rng, rng.randrange(0, 9), vocab)
        _, p = _rows(toy, tokens, parents)
        plain: list[int] = []
        for _ in range(10):
            plain.append(own_fn(toy.p(tuple(plain)), len(plain)))
        # half the trees spell a prefix of the plain path on some branch
        if tokens and rng.random() < 0.5:
            node = rng.randrange(len(tokens))
            depth = vt.depths(parents)[node]
            while node >= 0:
                tokens[node] = plain[depth]
                node, depth = parents[node], depth - 1
            _, p = _rows(toy, tokens, parents)
        v = rule_fn(_t(tokens), _t(parents), None, p)
        assert v.tokens.tolist() == plain[: len(v.tokens)]
        spelled = set(_paths(tokens, parents))
        longest = max(m for m in range(len(plain)) if m == 0 or tuple(plain[:m]) in spelled)
        assert v.num_accepted == longest
        assert [tokens[i] for i in v.path] == plain[:longest]
        assert all(parents[b] == a for a, b in zip((-1, *v.path), v.path))


def test_tree_greedy_emits_the_plain_greedy_tokens():
    greedy = (tree_greedy, lambda row, offset: int(row.argmax()))
    _own_samples_check(lambda trial: greedy, random.Random(1))


# ----------------------------------------------------------------------------- coupled


def test_tree_coupled_emits_plain_seeded_samples_whatever_the_tree():
    rng = random.Random(7)

    def make(trial: int):
        seed, base = rng.randrange(1 << 62), rng.randrange(100_000)
        rule = lambda tok, par, dp, p: tree_coupled(tok, par, dp, p, seed=seed, base_position=base)  # noqa: E731
        return rule, lambda row, offset: gumbel_sample(row, seed, base + offset)

    _own_samples_check(make, rng)


def test_tree_coupled_on_chains_equals_coupled_verify():
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    for trial in range(100):
        gamma = rng.randrange(0, 5)
        p = torch.softmax(torch.randn(gamma + 1, 4, generator=g) * 2, -1)
        own = [gumbel_sample(p[i], trial, 100 + i) for i in range(gamma)]
        draft = _t([o if rng.random() < 0.7 else rng.randrange(4) for o in own])
        chain = _t([-1] + list(range(gamma - 1))) if gamma else _t([])
        v = tree_coupled(draft, chain, None, p, seed=trial, base_position=100)
        w = coupled_verify(draft, None, p, seed=trial, positions=torch.arange(100, 101 + gamma))
        assert v.tokens.tolist() == w.tokens.tolist() and v.num_accepted == w.num_accepted


# ----------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("rule", ["token", "traversal"])
@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
def test_contract_paths_shapes_and_reproducibility(rule, siblings):
    fn = RULE_FNS[rule]
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    vocab = 50
    for _ in range(40):
        tokens, parents = _random_tree(rng, rng.randrange(0, 12), vocab)
        n = len(tokens)
        q = torch.softmax(torch.randn(n, vocab, generator=g), -1)
        p = torch.softmax(torch.randn(n + 1, vocab, generator=g), -1).float()
        for dp in (q, None):
            v = fn(_t(tokens), _t(parents), dp, p, generator=torch.Generator().manual_seed(1), siblings=siblings)
            again = fn(_t(tokens), _t(parents), dp, p, generator=torch.Generator().manual_seed(1), siblings=siblings)
            assert isinstance(v, TreeVerdict) and v.tokens.dtype == torch.int64
            assert v.tokens.shape == (v.num_accepted + 1,) and 0 <= int(v.tokens[-1]) < vocab
            assert all(parents[b] == a for a, b in zip((-1, *v.path), v.path))
            assert v.tokens[:-1].tolist() == [tokens[i] for i in v.path]
            assert v.tokens.tolist() == again.tokens.tolist() and v.path == again.path
            assert (v.alpha_mean is None) == (n == 0)
            if n:  # each node's min(1, p/q) reads p from its parent's row (row 0: the root's), q from its own
                p_x = torch.tensor([float(p[j + 1, t]) for t, j in zip(tokens, parents)], dtype=torch.float64)
                q_x = torch.tensor([float(q[i, t]) for i, t in enumerate(tokens)], dtype=torch.float64)
                want = (p_x / q_x).clamp(max=1.0) if dp is not None else p_x.clamp(max=1.0)
                assert v.alpha_mean == pytest.approx(float(want.mean()), rel=1e-9)


@pytest.mark.parametrize("rule", ["token", "traversal"])
def test_identical_distributions_accept_the_first_branch_to_the_bottom(rule):
    """p = q at every node: the first child is always accepted (min(1, p/q) = 1, weight 1)."""
    toy = Toy(4, strength=0.0)
    g = torch.Generator().manual_seed(2)
    parents = CHI2_PARENTS
    for _ in range(100):
        tokens = draw_tree(toy, parents, "iid", g)
        q, p = _rows(toy, tokens, parents)
        v = RULE_FNS[rule](_t(tokens), _t(parents), q, p, generator=g)
        assert v.path == (0, 2)


@pytest.mark.parametrize("rule", ["token", "traversal"])
def test_one_hot_target_with_candidates_is_greedy(rule):
    """At T = 0 (one-hot p) deterministic candidates give exactly the greedy tree verdict."""
    rng = random.Random(4)
    g = torch.Generator().manual_seed(4)
    for _ in range(100):
        tokens, parents = _random_tree(rng, rng.randrange(0, 10), 3)
        logits = torch.randn(len(tokens) + 1, 3, generator=g)
        onehot = torch.nn.functional.one_hot(logits.argmax(-1), 3).float()
        v = RULE_FNS[rule](_t(tokens), _t(parents), None, onehot, generator=g)
        w = tree_greedy(_t(tokens), _t(parents), None, logits)
        assert v.path == w.path and v.tokens.tolist() == w.tokens.tolist()


def test_impossible_tokens_are_never_emitted():
    """q puts mass where p has none (truncated target): those candidates are always rejected."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.0, 0.8]])
    for fn in (tree_token, tree_traversal):
        for s in range(200):
            v = fn(_t([0, 0, 2]), _t([-1, -1, 1]), q, p, generator=torch.Generator().manual_seed(s), siblings="iid")
            assert v.path == () and int(v.tokens[0]) in (1, 2)


def test_numerical_edge_cases():
    """A drafted token the draft row gives 0 (q(x) = 0 < p(x)), a one-hot target, a float32
    target whose rows do not sum exactly to 1: valid verdicts, never an impossible token."""
    p = torch.tensor([[0.0, 0.0, 1.0], [0.3, 0.3, 0.4], [0.2, 0.0, 0.8], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    for fn in (tree_token, tree_traversal):
        for siblings in ("iid", "without_replacement"):
            for s in range(50):
                g = torch.Generator().manual_seed(s)
                v = fn(_t([2, 0, 1]), _t([-1, -1, 1]), q, p, generator=g, siblings=siblings)
                assert v.path == (0,) and int(v.tokens[-1]) in (0, 1, 2)  # q(2) = 0 < p(2) = 1: kept
                v = fn(_t([0, 2, 1]), _t([-1, -1, 0]), None, p, generator=g)
                assert v.path == (1,) and int(v.tokens[-1]) != 1  # only token 2 possible at the root
        rows = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(0)) * 3, -1) * 1.0001
        v = fn(_t([1, 2, 3]), _t([-1, 0, 0]), rows[:3], rows)
        assert v.tokens.shape == (v.num_accepted + 1,)


def test_malformed_trees_are_rejected():
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="parents"):
        tree_token(_t([1, 2]), _t([-1, 1]), None, p)
    with pytest.raises(ValueError, match="target_probs"):
        tree_token(_t([1, 2]), _t([-1, 0]), None, p[:2])
    with pytest.raises(ValueError, match="draft_probs"):
        tree_traversal(_t([1, 2]), _t([-1, 0]), torch.full((3, 4), 0.25), p)
    with pytest.raises(ValueError, match="siblings"):
        tree_token(_t([1, 2]), _t([-1, 0]), None, p, siblings="sorted")


def test_tree_rule_registry():
    assert CHAIN_TO_TREE == {
        "greedy": "tree_greedy", "token": "tree_token", "block": "tree_traversal", "coupled": "tree_coupled"
    }
    for chain, tree in CHAIN_TO_TREE.items():
        assert get_tree_rule(chain).name == tree
        assert get_tree_rule(tree.replace("_", "-")).name == tree
    assert all(rule.lossless for rule in TREE_RULES.values())
    assert get_tree_rule("greedy").greedy_only and not get_tree_rule("block").greedy_only
    assert get_tree_rule("coupled").draft_sampling == "gumbel"
    rule = get_tree_rule("token", siblings="without_replacement")
    p = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    assert rule.fn(_t([1, 0]), _t([-1, -1]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]), p).path == (0,)
    with pytest.raises(ConfigError, match="no tree verification rule"):
        get_tree_rule("lossy_resample_p")


def test_every_tree_rule_refuses_a_malformed_tree():
    """greedy and coupled validate the tree as token and traversal do; traversal checks its
    sibling mode as token does (an unknown mode must not silently mean i.i.d.)."""
    p = torch.full((3, 4), 0.25)
    for bad in (_t([-1, 1]), _t([-1, 2]), _t([-2, 0])):  # a parent that is not earlier / below -1
        with pytest.raises(ValueError, match="parents"):
            tree_greedy(_t([1, 2]), bad, None, p)
        with pytest.raises(ValueError, match="parents"):
            tree_coupled(_t([1, 2]), bad, None, p, seed=0, base_position=0)
    with pytest.raises(ValueError, match="target_probs"):
        tree_greedy(_t([1, 2]), _t([-1, 0]), None, p[:2])
    with pytest.raises(ValueError, match="parents"):  # one parent too many
        tree_token(_t([1, 2]), _t([-1, 0, 1]), None, p)
    with pytest.raises(ValueError, match="siblings"):
        tree_traversal(_t([1, 2]), _t([-1, 0]), None, p, siblings="sorted")


@pytest.mark.parametrize("rule", [tree_token, tree_traversal])
@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
def test_a_token_both_laws_give_zero_is_never_accepted(rule, siblings):
    """A node whose token has p = 0 and q = 0 (a degenerate draft row) must be rejected, never
    accepted as 'q = 0 < p' (200 seeds): the target cannot emit it."""
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4], [0.3, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]], dtype=torch.float64)
    for s in range(200):
        v = rule(_t([0, 0]), _t([-1, -1]), q, p, generator=torch.Generator().manual_seed(s), siblings=siblings)
        assert v.path == () and int(v.tokens[0]) in (1, 2)
        assert v.alpha_mean == 0.0  # min(1, p/q) with p = 0 counts 0 for both nodes, never NaN


@pytest.mark.parametrize("rule", [tree_token, tree_traversal])
@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
def test_the_rules_leave_their_float64_inputs_untouched(rule, siblings):
    """The rules are pure functions: float64 rows (where ``.double()`` is no copy) come back as
    they went in, for sampled nodes and for deterministic candidates (whose rejection removes
    tokens from the row)."""
    g = torch.Generator().manual_seed(0)
    tokens, parents = _t([0, 1, 2, 0, 1]), _t([-1, -1, -1, 0, 0])
    for trial in range(30):
        p = torch.softmax(torch.randn(6, 4, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(5, 4, generator=g, dtype=torch.float64) * 2, -1)
        for dp in (q, None):
            p0, q0 = p.clone(), q.clone()
            v = rule(tokens, parents, dp, p, generator=torch.Generator().manual_seed(trial), siblings=siblings)
            assert torch.equal(p, p0) and torch.equal(q, q0), (trial, dp is None, v.path)


def test_node_target_sample_weights_exclude_removed_tokens():
    """After deterministic candidates were rejected, the emitted token is drawn from the row with
    them removed: the weights give them zero (and the rest in proportion)."""
    t = NodeTarget(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    t.remove(3)
    t.remove(1)
    w = t.sample_weights()
    assert w[1] == 0.0 and w[3] == 0.0
    assert float(w[2] / w[0]) == pytest.approx(3.0)
    assert t.prob(2) == pytest.approx(0.75) and t.prob(3) == 0.0


@pytest.mark.parametrize("rule", [tree_token, tree_traversal])
def test_rejected_candidates_are_never_emitted_after_them(rule):
    """Deterministic candidates at the root, all rejected (p puts most mass elsewhere): the
    emitted token is never one of them (2,000 seeds; each seed's candidates are rejected with
    probability >= 0.35)."""
    p = torch.tensor([[0.3, 0.3, 0.05, 0.35], [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    seen = set()
    for s in range(2000):
        v = rule(_t([0, 1]), _t([-1, -1]), None, p, generator=torch.Generator().manual_seed(s))
        if v.path == ():
            seen.add(int(v.tokens[0]))
    assert seen == {2, 3}


def test_get_tree_rule_normalises_a_chain_rules_name():
    """A chain rule's name maps to its tree rule however it is spelled (case, spaces)."""

    assert get_tree_rule(" Block ").name == "tree_traversal"
    assert get_tree_rule("TOKEN").name == "tree_token"


def test_removing_a_token_twice_removes_its_mass_once():
    """Two duplicate deterministic candidates carry the same token: rejecting the second must not
    take the token's mass off the row a second time (the rest stay in proportion)."""
    t = NodeTarget(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    t.remove(3)
    t.remove(3)
    assert t.prob(3) == 0.0
    assert t.prob(2) == pytest.approx(0.5) and t.prob(0) == pytest.approx(1 / 6)


def test_duplicate_deterministic_candidates_keep_the_residual_law():
    """tree_token with candidates [0, 0] at the root of p = [0.5, 0.25, 0.25]: after rejecting
    token 0 the residual is [0, 0.5, 0.5]; the second duplicate is rejected (p(0) = 0) and must
    leave it so, hence a bonus token 1 or 2 each with probability 1/2 of the rejections and the
    path (0,) with probability 1/2.  Checked exactly through NodeTarget's probabilities."""
    t = NodeTarget(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    t.remove(0)
    t.remove(0)
    assert t.prob(1) == pytest.approx(0.5) and t.prob(2) == pytest.approx(0.5)
    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    for s in range(100):  # 100 seeds: only valid verdicts
        v = tree_token(_t([0, 0]), _t([-1, -1]), None, p, generator=torch.Generator().manual_seed(s))
        assert v.path in ((), (0,)) and (v.path or int(v.tokens[0]) in (1, 2))


def test_dense_then_removed_row_stays_normalised():
    """A NodeTarget whose row was made dense (a sampled sibling's residual) and then loses a token
    gives normalised probabilities: p without the token, renormalised."""
    t = NodeTarget(torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))
    t.set_dense(torch.tensor([0.0, 0.5, 0.25, 0.25], dtype=torch.float64))
    t.remove(1)
    assert t.prob(2) == pytest.approx(0.5) and t.prob(3) == pytest.approx(0.5) and t.prob(1) == 0.0
    assert float(t.dense().sum()) == pytest.approx(1.0)


def test_greedy_follows_the_first_duplicate_row():
    """Two root children carry the same token; when their rows disagree (they should not: same
    context) the first one's row decides, as the docstring of ``_follow`` says."""
    logits = torch.tensor([[0.0, 9.0], [9.0, 0.0], [0.0, 9.0]])  # root -> 1; node 0 -> 0; node 1 -> 1
    v = tree_greedy(_t([1, 1]), _t([-1, -1]), None, logits)
    assert v.path == (0,) and v.tokens.tolist() == [1, 0]


def test_rules_that_compare_probabilities_ask_for_the_draft_rows():
    """token and traversal read q (a drafter must hand its rows over, or sampled nodes would be
    taken for point masses); greedy and coupled do not, and only greedy is greedy-only."""
    assert {n: r.needs_draft_probs for n, r in TREE_RULES.items()} == {
        "tree_greedy": False, "tree_token": True, "tree_traversal": True, "tree_coupled": False}
    assert {n: r.draft_sampling for n, r in TREE_RULES.items()} == {
        "tree_greedy": "argmax", "tree_token": "multinomial", "tree_traversal": "multinomial",
        "tree_coupled": "gumbel"}
    assert get_tree_rule("block", siblings="without_replacement").fn.keywords == {"siblings": "without_replacement"}


def test_token_emits_from_the_residual_after_a_sampled_child_is_rejected():
    """p = [0.5, 0.5] at the root, one child drawn from q = [0, 1] (token 1): on rejection the
    residual norm(max(0, p - q)) = [1, 0], so the emitted token is always 0 (200 seeds; the
    rejection happens with probability 1/2)."""

    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    rejected = 0
    for s in range(200):
        v = tree_token(_t([1]), _t([-1]), q, p, generator=torch.Generator().manual_seed(s))
        if v.path == ():
            rejected += 1
            assert v.tokens.tolist() == [0], s
    assert rejected > 0


def test_traversal_node_whose_residual_is_empty_is_deleted():
    """Chain root -> node 0 (token 0 from q = [1, 0], weight 1/2) -> node 1 (token 0 from q = [1, 0],
    target there [1, 0], weight 1/2).  Deleting node 1 leaves node 0 the residual
    max(0, 1/2 [1, 0] - [1, 0]) = 0: weight 0, so node 0 is deleted too and the root emits token 1
    (its residual [0, 1]).  That happens with probability 1/2; over 200 seeds it must happen, and
    the root never emits token 0."""

    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    at_root = 0
    for s in range(200):
        v = tree_traversal(_t([0, 0]), _t([-1, 0]), q, p, generator=torch.Generator().manual_seed(s))
        if v.path == ():
            at_root += 1
            assert v.tokens.tolist() == [1], s
        else:
            assert v.path == (0, 1), (s, v.path)
    assert at_root > 0


@pytest.mark.parametrize("rule", [tree_token, tree_traversal])
def test_draft_rows_over_another_vocabulary_are_refused(rule):
    """draft_probs must be [N, V] with the target's V: one row per node but a different width
    (a drafter with another vocabulary) is a ValueError naming draft_probs, not silently used."""
    p = torch.full((3, 4), 0.25)
    for q in (torch.full((2, 5), 0.2), torch.full((2, 3), 1 / 3)):
        with pytest.raises(ValueError, match="draft_probs"):
            rule(_t([1, 2]), _t([-1, 0]), q, p)


def test_a_row_whose_mass_was_all_removed_gives_every_token_probability_zero():
    """NodeTarget.prob is the current normalised probability: once the candidates holding all of
    the row's mass were removed, no token left (all of mass 0) may read as probable; an
    all-zero row likewise gives 0 (a token of target probability 0 is never accepted)."""
    t = NodeTarget(torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    t.remove(0)
    t.remove(1)
    assert t.prob(2) == 0.0
    assert NodeTarget(torch.zeros(3, dtype=torch.float64)).prob(1) == 0.0


def test_removing_a_token_from_a_dense_row_leaves_the_row_handed_in_untouched():
    """NodeTarget.remove on a dense row works on a copy: the tensor given to set_dense (a
    caller's residual) keeps its values, and the target is p without the token, renormalised."""
    row = torch.tensor([0.0, 0.5, 0.25, 0.25], dtype=torch.float64)
    t = NodeTarget(torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64))
    t.set_dense(row)
    t.remove(1)
    assert row.tolist() == [0.0, 0.5, 0.25, 0.25]
    assert t.prob(2) == 0.5 and t.prob(1) == 0.0


def test_a_uniform_of_exactly_zero_never_accepts_a_token_the_target_forbids(monkeypatch):
    """tree_token accepts a child when u < min(1, p/q); torch.rand can return 0.0, and then a
    child with p(x) = 0 (acceptance probability 0) must still be rejected."""
    monkeypatch.setattr(vt, "_uniform", lambda generator: 0.0)
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    v = tree_token(_t([0]), _t([-1]), q, p, generator=torch.Generator().manual_seed(0))
    assert v.path == () and int(v.tokens[0]) in (1, 2)


def test_a_node_of_weight_zero_is_deleted_even_for_a_uniform_of_zero(monkeypatch):
    """Traversal keeps a node with probability w (u < w): once deleting its child left node 0 with
    weight 0 (the chain of test_traversal_node_whose_residual_is_empty_is_deleted), a uniform of
    exactly 0.0 must not keep it; the root then emits token 1, its residual."""
    uniforms = iter([0.9, 0.0])  # node 1 (w = 1/2) deleted; then node 0 (w = 0) tried
    monkeypatch.setattr(vt, "_uniform", lambda generator: next(uniforms))
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    v = tree_traversal(_t([0, 0]), _t([-1, 0]), q, p, generator=torch.Generator().manual_seed(0))
    assert v.path == () and v.tokens.tolist() == [1]
