"""The tree builder: early stop (the same pruned tree with fewer draft passes), the probability
floor of deterministic trees, compact rows over a reduced draft vocabulary, and the sampled
trees' sibling stop and expansion floor."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from specdec.drafters.base import DraftSampler
from specdec.drafters.tree_builder import TreeSpec, build_tree
from specdec.errors import ConfigError
from specdec.sampling import SamplingConfig

V = 40


def _logits(sharpness: float):
    def logits_for(path: tuple[int, ...]) -> torch.Tensor:  # [V]
        g = torch.Generator().manual_seed(hash(path) % (2**31))
        return torch.randn(V, generator=g) * sharpness
    return logits_for


def _expander(sharpness: float, calls: list[int]):
    """Draft logits that are a fixed function of each node's root path (seeded by it)."""
    logits_for = _logits(sharpness)

    def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        calls.append(len(nodes))
        rows = []
        for v in nodes:
            path, u = [], v
            while u >= 0:
                path.append(tokens[u])
                u = parents[u]
            rows.append(logits_for(tuple(path[::-1])))
        return torch.stack(rows)  # [len(nodes), V]

    return expand, logits_for(())


@pytest.mark.parametrize("budget", [4, 16, 32])
@pytest.mark.parametrize("sharpness", [0.5, 4.0])
@pytest.mark.parametrize("floor", [0.0, 0.001])
def test_early_stop_gives_the_same_dynamic_tree_with_fewer_passes(budget, sharpness, floor):
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    spec = TreeSpec(shape="dynamic", width=3, depth=6, min_prob=floor)
    stopped = 0
    for trial in range(4):
        runs = []
        for early in (True, False):
            calls: list[int] = []
            expand, root = _expander(sharpness + 0.1 * trial, calls)
            draft, _ = build_tree(root.unsqueeze(0), expand, spec, sampler, position=0, budget=budget, max_depth=6,
                                  early_stop=early)
            runs.append((draft, len(calls)))
        (a, na), (b, nb) = runs
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert na <= nb
        stopped += na < nb
    if sharpness < 1 and budget <= 16 and floor == 0:
        assert stopped > 0  # flat drafts: deeper levels cannot enter the best N, passes are saved
        # (with a floor, flat drafts' deeper levels fall below it before the tree is full)


def _paths(draft) -> set[tuple[int, ...]]:
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    out = set()
    for v in range(len(toks)):
        path, u = [], v
        while u >= 0:
            path.append(toks[u])
            u = pars[u]
        out.add(tuple(path[::-1]))
    return out


def _log_prob(path: tuple[int, ...], logits_for) -> float:
    return sum(float(torch.log_softmax(logits_for(path[:i]), -1)[t]) for i, t in enumerate(path))


@pytest.mark.parametrize("min_prob", [0.02, 0.1, 0.3])
@pytest.mark.parametrize("expand_child", [1.0, 0.3])
@pytest.mark.parametrize("shape", ["dynamic", "static"])
def test_min_prob_leaves_out_exactly_the_unlikely_nodes(min_prob, expand_child, shape):
    """With room for every node, a tree with a floor is the tree without one minus (a) the nodes
    whose cumulative draft probability is below the floor and (b) the descendants of nodes below
    ``floor / expand_child`` (never expanded), and nothing else; 3 draft sharpnesses each.  The
    shapes keep every level's nodes (static: a wide expansion; dynamic: two levels of width 3)."""
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    if shape == "static":
        base = TreeSpec(shape=shape, width=100, depth=3, branching=(3, 2, 2), min_prob=0.0)
    else:
        base = TreeSpec(shape=shape, width=3, depth=2, min_prob=0.0)
    removed = 0
    for sharpness in (0.7, 2.0, 5.0):
        expand, root = _expander(sharpness, [])
        full, _ = build_tree(root.unsqueeze(0), expand, base, sampler, position=0, budget=1000, max_depth=3)
        cut, _ = build_tree(root.unsqueeze(0), expand, replace(base, min_prob=min_prob, expand_child=expand_child),
                            sampler, position=0, budget=1000, max_depth=3)
        logq = {p: _log_prob(p, _logits(sharpness)) for p in _paths(full)}
        want = {p for p in logq if logq[p] >= math.log(min_prob)
                and all(logq[p[:i]] >= math.log(min_prob / expand_child) for i in range(1, len(p)))}
        assert _paths(cut) == want
        removed += len(logq) - len(want)
    assert removed > 0  # the floor removed something


def test_min_prob_above_every_root_candidate_gives_an_empty_tree_and_sampled_trees_ignore_it():
    expand, root = _expander(0.5, [])  # flat: no root candidate reaches 0.9
    greedy = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    draft, _ = build_tree(root.unsqueeze(0), expand, TreeSpec(min_prob=0.9), greedy, position=0, budget=8, max_depth=6)
    assert draft.tokens.numel() == 0 and draft.parents.numel() == 0
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                           generator=torch.Generator().manual_seed(0))
    q = torch.softmax(root, -1).unsqueeze(0)  # sampled trees rank and draw from q
    drawn, _ = build_tree(q, lambda n, t, p: torch.softmax(expand(n, t, p), -1), TreeSpec(min_prob=0.9), sampler,
                          position=0, budget=8, max_depth=6)
    assert drawn.tokens.numel() > 0  # every node of a sampled tree is fixed before it is drawn
    with pytest.raises(ConfigError):
        TreeSpec(min_prob=1.0)


@pytest.mark.parametrize("mode", ["argmax", "gumbel"])
@pytest.mark.parametrize("shape", ["dynamic", "static"])
def test_compact_rows_over_a_reduced_vocabulary_give_the_same_tree(shape, mode):
    """Rows over a reduced draft vocabulary (with its target ids) rank the same candidates as the
    same rows scattered into the whole vocabulary with -inf elsewhere; seeded (Gumbel) trees put
    the same keyed draw first."""
    ids = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(5))[:25].tolist()))
    cfg = SamplingConfig(temperature=0.0 if mode == "argmax" else 1.0)
    sampler = DraftSampler(cfg, mode, penalties=None, generator=None, noise_seed=4)
    spec = TreeSpec(shape=shape, width=3, depth=4, min_prob=0.01)
    for sharpness in (0.5, 3.0):
        expand, root = _expander(sharpness, [])

        def compact(n, t, p):
            return expand(n, t, p)[:, ids]  # [m, Vd]

        def scattered(n, t, p):
            out = torch.full((len(n), V), -math.inf)
            out[:, ids] = compact(n, t, p)
            return out

        full_root = torch.full((1, V), -math.inf)
        full_root[0, ids] = root[ids]
        a, _ = build_tree(root[ids].unsqueeze(0), compact, spec, sampler, position=0, budget=12, max_depth=4, ids=ids, vocab=V)
        b, _ = build_tree(full_root, scattered, spec, sampler, position=0, budget=12, max_depth=4)
        assert a.tokens.numel() > 3
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert set(a.tokens.tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
def test_sibling_stop_draws_another_child_only_while_enough_of_q_is_uncovered(siblings):
    """Checked draw by draw (400 trees): a node's children are a prefix of what the full count
    would draw, cut exactly where the drawn children's distinct tokens first cover all but
    ``sibling_stop`` of q; the stop fires in some trees and not in others."""
    q = torch.tensor([[0.6, 0.25, 0.1, 0.05] + [0.0] * (V - 4)])
    logits = q.log()  # the sampler draws from softmax(logits) = q
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings=siblings, sibling_stop=0.45)
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                           generator=torch.Generator().manual_seed(7))
    counts = set()
    for _ in range(400):
        draft, _ = build_tree(logits, lambda n, t, p: logits.expand(len(n), V), spec, sampler, position=0, budget=8, max_depth=1)
        toks = draft.tokens.tolist()
        assert draft.parents.tolist() == [-1] * len(toks)
        want = 1  # another child exactly while the ones drawn leave >= 0.45 of q uncovered
        while want < 3 and 1.0 - sum(float(q[0, t]) for t in set(toks[:want])) >= 0.45:
            want += 1
        assert len(toks) == want, toks
        counts.add(len(toks))
    assert counts == {1, 2, 3}
    with pytest.raises(ConfigError):
        TreeSpec(sibling_stop=1.0)


def test_sample_expand_gives_children_only_to_likely_nodes():
    """Sampled trees (60 drawn, budget 16): every node with children has a path probability under
    q of at least ``sample_expand``, some nodes below it were left childless, and a tree drawn
    with the same seed but no floor is never smaller."""
    expand, root = _expander(1.5, [])
    sampler = lambda seed: DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,  # noqa: E731
                                        generator=torch.Generator().manual_seed(seed))
    spec = TreeSpec(sample_branching=(3, 2, 2, 1), sample_width=3, sample_expand=0.02)
    cut = 0
    for seed in range(60):
        draft, _ = build_tree(root.unsqueeze(0), expand, spec, sampler(seed), position=0, budget=16, max_depth=4)
        toks, pars = draft.tokens.tolist(), draft.parents.tolist()
        logq = (draft.probs[torch.arange(len(toks)), draft.tokens]).log().tolist()
        cum = []
        for i, j in enumerate(pars):
            cum.append((cum[j] if j >= 0 else 0.0) + logq[i])
        for j in set(pars) - {-1}:
            assert cum[j] >= math.log(0.02) - 1e-9
        cut += sum(1 for i in range(len(toks)) if cum[i] < math.log(0.02) and i not in pars)
        free, _ = build_tree(root.unsqueeze(0), expand, replace(spec, sample_expand=0.0), sampler(seed), position=0,
                             budget=16, max_depth=4)
        assert free.tokens.numel() >= draft.tokens.numel()
    assert cut > 0
    with pytest.raises(ConfigError):
        TreeSpec(sample_expand=1.0)


SMALL_V = 8
GREEDY = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
TABLE = {
    (): {1: 0.6, 2: 0.4},
    (1,): {3: 0.9, 4: 0.1},
    (2,): {5: 0.55, 6: 0.45},
}
DEFAULT = {7: 0.7, 0: 0.3}


def _row(path: tuple[int, ...]) -> torch.Tensor:  # [SMALL_V] logits = log q (q = 0 -> -inf)
    q = torch.zeros(SMALL_V, dtype=torch.float64)
    for t, p in TABLE.get(path, DEFAULT).items():
        q[t] = p
    return q.log().float()


def _path(v: int, tokens: list[int], parents: list[int]) -> tuple[int, ...]:
    out = []
    while v >= 0:
        out.append(tokens[v])
        v = parents[v]
    return tuple(out[::-1])


def _expand(calls: list):
    def expand(nodes, tokens, parents):
        paths = [_path(v, tokens, parents) for v in nodes]
        calls.append(paths)
        return torch.stack([_row(p) for p in paths])  # [len(nodes), SMALL_V]
    return expand


def _tree(spec: TreeSpec, budget: int, max_depth: int = 8, sampler=GREEDY):
    draft, _ = build_tree(_row(()).unsqueeze(0), _expand([]), spec, sampler, position=0, budget=budget, max_depth=max_depth)
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    return [_path(v, toks, pars) for v in range(len(toks))]


def test_levels_past_the_branching_tuple_use_its_last_factor():
    """branching (2, 1), depth 3: the third level repeats the last factor (1 child), not the first."""
    spec = TreeSpec(shape="static", width=4, depth=3, branching=(2, 1), min_prob=0.0)
    assert [spec.children(d) for d in range(4)] == [2, 1, 1, 1]
    assert _tree(spec, budget=100) == [(1,), (2,), (1, 3), (2, 5), (1, 3, 7), (2, 5, 7)]


def _multinomial(seed: int) -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                        generator=torch.Generator().manual_seed(seed))


def test_sibling_stop_counts_a_token_drawn_twice_once():
    """iid siblings (200 trees, q = (.3, .7), stop .5, 3 siblings): drawing token 0 twice still
    leaves .7 of q uncovered, so a third sibling is drawn; only distinct tokens cover q."""
    q = torch.zeros(1, SMALL_V)
    q[0, :2] = torch.tensor([0.3, 0.7])
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings="iid", sibling_stop=0.5)
    sampler = _multinomial(3)
    repeated = 0
    for _ in range(200):
        draft, _ = build_tree(q.log(), lambda n, t, p: q.log().expand(len(n), SMALL_V), spec, sampler, position=0, budget=8, max_depth=1)
        toks = draft.tokens.tolist()
        want = 1
        while want < 3 and 1.0 - sum(float(q[0, t]) for t in set(toks[:want])) >= 0.5 - 1e-12:
            want += 1
        assert len(toks) == want, toks
        repeated += toks[:2] == [0, 0]
    assert repeated > 0


def test_sibling_stop_is_inclusive_when_exactly_the_stop_is_left():
    """q = (.5, .5), stop .5 (40 trees): after the first draw exactly .5 of q is uncovered, which
    is not below the stop, so the second sibling is drawn too (both tokens, without replacement)."""
    q = torch.zeros(1, SMALL_V)
    q[0, :2] = 0.5
    spec = TreeSpec(sample_branching=(2,), sample_width=1, sibling_stop=0.5)
    sampler = _multinomial(0)
    for _ in range(40):
        draft, _ = build_tree(q.log(), lambda n, t, p: q.log().expand(len(n), SMALL_V), spec, sampler, position=0, budget=8, max_depth=1)
        assert sorted(draft.tokens.tolist()) == [0, 1]


def test_iid_siblings_may_repeat_and_the_draft_says_iid():
    """siblings='iid' draws with replacement (q = (.9, .1), 3 siblings, 30 trees: some tree repeats
    a token) and the draft carries the mode, which the verification rule needs."""
    q = torch.zeros(1, SMALL_V)
    q[0, :2] = torch.tensor([0.9, 0.1])
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings="iid", sibling_stop=0.0)
    sampler = _multinomial(1)
    repeats = 0
    for _ in range(30):
        draft, _ = build_tree(q.log(), lambda n, t, p: q.log().expand(len(n), SMALL_V), spec, sampler, position=0, budget=8, max_depth=1)
        assert draft.siblings == "iid"
        toks = draft.tokens.tolist()
        assert len(toks) == 3
        repeats += len(set(toks)) < 3
    assert repeats > 0


def test_without_replacement_trees_say_so_in_the_draft():
    """The sibling mode the tree was drawn with travels with the draft (the rule reads it)."""
    q = torch.zeros(1, SMALL_V)
    q[0, :3] = torch.tensor([0.5, 0.3, 0.2])
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings="without_replacement", sibling_stop=0.0)
    draft, _ = build_tree(q.log(), lambda n, t, p: q.log().expand(len(n), SMALL_V), spec, _multinomial(0), position=0,
                          budget=8, max_depth=1)
    assert draft.siblings == "without_replacement" and sorted(draft.tokens.tolist()) == [0, 1, 2]


def test_multinomial_drafting_without_reported_q_builds_the_deterministic_top_k_tree():
    """A multinomial sampler that reports no q (``want_probs`` False) cannot use a sampled tree:
    its tree is the deterministic top-k one (the greedy tree's shape here) with no probs."""
    spec = TreeSpec(shape="static", width=4, depth=2, branching=(2, 1), min_prob=0.0)
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                           generator=torch.Generator().manual_seed(0), want_probs=False)
    draft, _ = build_tree(_row(()).unsqueeze(0), _expand([]), spec, sampler, position=0, budget=100, max_depth=8)
    assert draft.probs is None
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    assert [_path(v, toks, pars) for v in range(len(toks))] == [(1,), (2,), (1, 3), (2, 5)]


def test_a_gumbel_tree_keys_each_level_by_its_own_position():
    """Gumbel trees (keyed noise, coupled verification): a depth-d node's first child is the
    Gumbel draw at position ``position + d`` (what the target's coupled draw at that position
    reads), checked for 12 seeds over a flat 8-token row."""
    from specdec.sampling import gumbel_column

    flat = torch.zeros(1, SMALL_V)  # every token q = 1/8
    spec = TreeSpec(shape="static", width=1, depth=3, branching=(1,), min_prob=0.0)
    for seed in range(12):
        sampler = DraftSampler(SamplingConfig(temperature=1.0), "gumbel", penalties=None, generator=None, noise_seed=seed)
        q = sampler.tree_rows(flat)[0]
        draft, _ = build_tree(flat, lambda n, t, p: flat.expand(len(n), SMALL_V), spec, sampler, position=5, budget=8, max_depth=3)
        assert draft.tokens.tolist() == [gumbel_column(q, seed, 5 + d) for d in range(3)]
        assert draft.parents.tolist() == [-1, 0, 1]


def test_a_sampled_tree_never_grows_past_max_depth():
    """A sampled tree of ``sample_branching`` (2, 1, 1) under max_depth 1 (the round's room) is
    its root level alone (10 trees)."""
    spec = TreeSpec(sample_branching=(2, 1, 1), sample_width=2, sibling_stop=0.0, sample_expand=0.0)
    sampler = _multinomial(0)
    for _ in range(10):
        draft, _ = build_tree(_row(()).unsqueeze(0), _expand([]), spec, sampler, position=0, budget=16, max_depth=1)
        assert draft.parents.tolist() == [-1, -1]


class _Recording(DraftSampler):
    """A greedy sampler that records the root paths (a constraint's histories) it is asked about."""

    def __init__(self) -> None:
        super().__init__(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
        self.histories: list = []

    def tree_rows(self, logits, histories=None):
        self.histories.append([tuple(h) for h in histories])
        return super().tree_rows(logits, histories)


def test_each_expanded_node_is_handed_to_the_sampler_with_its_whole_root_path():
    """A constraint masks a node's children by what it allows after the node's whole path from
    the root (not just its own token)."""
    spec = TreeSpec(shape="static", width=4, depth=3, branching=(2, 1), min_prob=0.0)
    sampler = _Recording()
    build_tree(_row(()).unsqueeze(0), _expand([]), spec, sampler, position=0, budget=100, max_depth=8)
    assert sampler.histories == [[()], [(1,), (2,)], [(1, 3), (2, 5)]]


def test_of_tied_nodes_the_earlier_one_is_expanded():
    """Two root candidates of equal q and width 1: the node that came first (node 0) gets the
    children, a deterministic tie-break."""
    root = torch.full((1, SMALL_V), -math.inf)
    root[0, 4] = 0.0
    root[0, 6] = 0.0
    calls: list = []
    spec = TreeSpec(shape="static", width=1, depth=2, branching=(2, 1), min_prob=0.0)
    draft, _ = build_tree(root, _expand(calls), spec, GREEDY, position=0, budget=100, max_depth=8)
    first = draft.tokens.tolist()[0]
    assert calls == [[(first,)]]
    assert draft.parents.tolist() == [-1, -1, 0]


def test_max_fed_caps_the_nodes_handed_to_expand_over_all_levels():
    """``max_fed`` 3 (a draft cache with 3 free rows): the first level feeds 2 nodes, the second
    only the best 1, then the tree grows no deeper."""
    calls: list = []
    spec = TreeSpec(shape="dynamic", width=2, depth=4, min_prob=0.0)
    draft, _ = build_tree(_row(()).unsqueeze(0), _expand(calls), spec, GREEDY, position=0, budget=100, max_depth=8,
                          max_fed=3)
    assert calls == [[(1,), (2,)], [(1, 3)]]
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    assert max(len(_path(v, toks, pars)) for v in range(len(toks))) == 3


@pytest.mark.parametrize("bad", [dict(min_prob=1.0), dict(sample_width=0), dict(branching=(2, 0)),
                                 dict(sample_branching=(0,)), dict(width=0), dict(depth=0), dict(expand_child=0.0)])
def test_a_tree_spec_refuses_settings_that_leave_no_tree(bad):
    with pytest.raises(ConfigError):
        TreeSpec(**bad)


def test_expand_child_one_is_allowed():
    """``expand_child`` 1 (expand every node that made it into the tree) is a valid setting."""
    assert TreeSpec(expand_child=1.0).expand_child == 1.0


def test_a_level_is_handed_to_expand_in_tree_order_not_score_order():
    """Level 2 scores (2,5) .4 above (1,3) .3 and (1,4) .24; width 2 expands (2,5) and (1,3),
    handed over in tree (node index) order: (1,3) first."""
    table = {(): {1: 0.6, 2: 0.4}, (1,): {3: 0.5, 4: 0.4}, (2,): {5: 1.0}}

    def row(path):
        q = torch.zeros(SMALL_V, dtype=torch.float64)
        for t, p in table.get(path, DEFAULT).items():
            q[t] = p
        return q.log().float()

    calls: list = []

    def expand(nodes, tokens, parents):
        paths = [_path(v, tokens, parents) for v in nodes]
        calls.append(paths)
        return torch.stack([row(p) for p in paths])

    spec = TreeSpec(shape="dynamic", width=2, depth=3, min_prob=0.0)
    build_tree(row(()).unsqueeze(0), expand, spec, GREEDY, position=0, budget=100, max_depth=8)
    assert calls[1] == [(1, 3), (2, 5)]


def test_a_sampled_tree_reports_each_nodes_q_as_it_was_drawn_from():
    """The reported q of every node is the row its token was drawn from, bit for bit, even where
    the expanded levels' rows come in another dtype than the root's (float64 below a float32 root:
    q must not be rounded to float32, or a rule would verify against another law than the draw's)."""
    g = torch.Generator().manual_seed(5)
    root = torch.randn(1, SMALL_V, generator=g)  # float32
    below = torch.randn(1, SMALL_V, generator=g, dtype=torch.float64)
    spec = TreeSpec(sample_branching=(2, 1), sample_width=2, sibling_stop=0.0)
    draft, _ = build_tree(root, lambda n, t, p: below.expand(len(n), SMALL_V), spec, _multinomial(2), position=0,
                          budget=8, max_depth=2)
    depth = [0 if p < 0 else 1 for p in draft.parents.tolist()]
    assert 1 in depth
    for i, d in enumerate(depth):
        law = torch.softmax(below[0], -1) if d else torch.softmax(root[0], -1).double()  # the float32 root row, widened
        assert torch.equal(draft.probs[i], law.to(draft.probs.dtype)) and draft.probs.dtype == torch.float64, i
