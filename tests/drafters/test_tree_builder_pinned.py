"""The tree builder on hand-made draft distributions: which nodes a dynamic (EAGLE-2) tree
expands, how it scores and prunes them, and how deep a static tree grows, pinned node by node."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.drafters.base import DraftSampler
from specdec.drafters.tree_builder import TreeSpec, build_tree
from specdec.errors import ConfigError
from specdec.sampling import SamplingConfig

V = 8
GREEDY = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
#: the draft distribution after each root path (any other path: DEFAULT)
TABLE = {
    (): {1: 0.6, 2: 0.4},
    (1,): {3: 0.9, 4: 0.1},
    (2,): {5: 0.55, 6: 0.45},
}
DEFAULT = {7: 0.7, 0: 0.3}


def _row(path: tuple[int, ...]) -> torch.Tensor:  # [V] logits = log q (q = 0 -> -inf)
    q = torch.zeros(V, dtype=torch.float64)
    for t, p in TABLE.get(path, DEFAULT).items():
        q[t] = p
    return q.log().float()


def _path(v: int, tokens: list[int], parents: list[int]) -> tuple[int, ...]:
    out = []
    while v >= 0:
        out.append(tokens[v])
        v = parents[v]
    return tuple(out[::-1])


def _expand(calls: list[list[tuple[int, ...]]]):
    def expand(nodes, tokens, parents):
        paths = [_path(v, tokens, parents) for v in nodes]
        calls.append(paths)
        return torch.stack([_row(p) for p in paths])  # [len(nodes), V]
    return expand


def _tree(spec: TreeSpec, budget: int, max_depth: int = 8, calls: list | None = None, sampler=GREEDY):
    draft, _ = build_tree(_row(()).unsqueeze(0), _expand(calls if calls is not None else []), spec, sampler,
                          position=0, budget=budget, max_depth=max_depth)
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    assert all(p < i for i, p in enumerate(pars))  # topological
    return [_path(v, toks, pars) for v in range(len(toks))]


def test_dynamic_tree_expands_the_most_probable_nodes_of_each_level():
    """width 2: level 1 holds (1,3) .54, (1,4) .06, (2,5) .22, (2,6) .18; the two best, (1,3)
    and (2,5), are expanded, (1,4) and (2,6) are not."""
    calls: list = []
    got = _tree(TreeSpec(shape="dynamic", width=2, depth=3, min_prob=0.0), budget=100, calls=calls)
    assert calls == [[(1,), (2,)], [(1, 3), (2, 5)]]
    assert set(got) == {(1,), (2,), (1, 3), (1, 4), (2, 5), (2, 6),
                        (1, 3, 7), (1, 3, 0), (2, 5, 7), (2, 5, 0)}


def test_dynamic_tree_keeps_the_best_n_by_cumulative_probability():
    """Budget 5: 1 (.6), (1,3) (.54), 2 (.4), (1,3,7) (.378) and (2,5) (.22); (2,6) (.18) and
    (1,4) (.06) are out although they are shallower than (1,3,7)."""
    got = _tree(TreeSpec(shape="dynamic", width=2, depth=3, min_prob=0.0), budget=5)
    assert set(got) == {(1,), (2,), (1, 3), (1, 3, 7), (2, 5)}


def test_a_static_tree_grows_every_level_up_to_its_depth():
    """branching (2, 1, 1), depth 3: both roots, one child each, one grandchild each; depth 2
    stops after two levels, max_depth 2 as well."""
    spec = TreeSpec(shape="static", width=4, depth=3, branching=(2, 1, 1), min_prob=0.0)
    assert _tree(spec, budget=100) == [(1,), (2,), (1, 3), (2, 5), (1, 3, 7), (2, 5, 7)]
    assert _tree(spec, budget=100, max_depth=2) == [(1,), (2,), (1, 3), (2, 5)]


def test_a_node_exactly_at_the_floor_is_kept_and_expanded():
    """The floor is inclusive both ways: a node whose cumulative draft probability equals
    ``min_prob`` stays in the tree and (``expand_child`` 1) gets children; its only child (q = 1)
    is exactly at the floor too and stays."""
    from specdec.drafters.tree_builder import _top_candidates

    root = torch.tensor([[-9.0, 1.5, 0.2] + [-math.inf] * (V - 3)])
    lq = dict(_top_candidates(root, 2)[0])[1]  # the builder's own log q of token 1
    floor = math.exp(lq)
    assert math.log(floor) == lq  # (the round trip is exact for this row)
    one_hot = torch.full((1, V), -math.inf)
    one_hot[0, 3] = 0.0
    calls: list = []

    def expand(nodes, tokens, parents):
        calls.append([_path(v, tokens, parents) for v in nodes])
        return one_hot.expand(len(nodes), V)

    spec = TreeSpec(shape="dynamic", width=2, depth=3, min_prob=floor, expand_child=1.0)
    draft, _ = build_tree(root, expand, spec, GREEDY, position=0, budget=10, max_depth=3)
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    assert [_path(v, toks, pars) for v in range(len(toks))] == [(1,), (1, 3), (1, 3, 3)]
    assert calls == [[(1,)], [(1, 3)]]


def test_a_static_tree_never_exceeds_its_budget():
    """branching (2, 2), budget 3: both roots, then room for one child only (node 1's best)."""
    spec = TreeSpec(shape="static", width=4, depth=2, branching=(2, 2), min_prob=0.0)
    for budget, want in ((3, [(1,), (2,), (1, 3)]), (5, [(1,), (2,), (1, 3), (1, 4), (2, 5)])):
        assert _tree(spec, budget=budget) == want


def test_a_sampled_tree_expands_its_sample_width_best_nodes():
    """Sampled (T = 1, q reported): root q over exactly three tokens, three siblings drawn without
    replacement, so all three are drawn in some order; ``sample_width`` 1 (not ``width`` 4) means
    only the most probable of them (token 1, q .5) draws children."""
    q_root = torch.zeros(V)
    q_root[[1, 2, 3]] = torch.tensor([0.5, 0.3, 0.2])
    q_child = torch.zeros(V)
    q_child[7] = 1.0
    spec = TreeSpec(width=4, sample_branching=(3, 1), sample_width=1, sibling_stop=0.0, sample_expand=0.0)
    for seed in range(5):
        sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                               generator=torch.Generator().manual_seed(seed))
        draft, _ = build_tree(q_root.log().unsqueeze(0), lambda n, t, p: q_child.log().expand(len(n), V), spec, sampler,
                              position=0, budget=16, max_depth=2)
        toks, pars = draft.tokens.tolist(), draft.parents.tolist()
        assert sorted(_path(v, toks, pars) for v in range(len(toks))) == [(1,), (1, 7), (2,), (3,)]


def test_levels_past_the_branching_tuple_use_its_last_factor():
    """branching (2, 1), depth 3: the third level repeats the last factor (1 child), not the first."""
    spec = TreeSpec(shape="static", width=4, depth=3, branching=(2, 1), min_prob=0.0)
    assert [spec.children(d) for d in range(4)] == [2, 1, 1, 1]
    assert _tree(spec, budget=100) == [(1,), (2,), (1, 3), (2, 5), (1, 3, 7), (2, 5, 7)]


def _multinomial(seed: int) -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                        generator=torch.Generator().manual_seed(seed))


def _siblings(q: list[float], spec: TreeSpec, sampler: DraftSampler):
    """A one-level sampled tree under a root whose draft law is ``q`` (the other tokens: 0)."""
    row = torch.zeros(1, V)
    row[0, : len(q)] = torch.tensor(q)
    draft, _ = build_tree(row.log(), lambda n, t, p: row.log().expand(len(n), V), spec, sampler, position=0, budget=8,
                          max_depth=1)
    return draft


def test_sibling_stop_counts_a_token_drawn_twice_once():
    """iid siblings (200 trees, q = (.3, .7), stop .5, 3 siblings): drawing token 0 twice still
    leaves .7 of q uncovered, so a third sibling is drawn; only distinct tokens cover q."""
    q = [0.3, 0.7]
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings="iid", sibling_stop=0.5)
    sampler = _multinomial(3)
    repeated = 0
    for _ in range(200):
        toks = _siblings(q, spec, sampler).tokens.tolist()
        want = 1
        while want < 3 and 1.0 - sum(q[t] for t in set(toks[:want])) >= 0.5 - 1e-12:
            want += 1
        assert len(toks) == want, toks
        repeated += toks[:2] == [0, 0]
    assert repeated > 0


def test_sibling_stop_is_inclusive_when_exactly_the_stop_is_left():
    """q = (.5, .5), stop .5 (40 trees): after the first draw exactly .5 of q is uncovered, which
    is not below the stop, so the second sibling is drawn too (both tokens, without replacement)."""
    spec = TreeSpec(sample_branching=(2,), sample_width=1, sibling_stop=0.5)
    sampler = _multinomial(0)
    for _ in range(40):
        assert sorted(_siblings([0.5, 0.5], spec, sampler).tokens.tolist()) == [0, 1]


def test_iid_siblings_may_repeat_and_the_draft_says_iid():
    """siblings='iid' draws with replacement (q = (.9, .1), 3 siblings, 30 trees: some tree repeats
    a token) and the draft carries the mode, which the verification rule needs."""
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings="iid", sibling_stop=0.0)
    sampler = _multinomial(1)
    repeats = 0
    for _ in range(30):
        draft = _siblings([0.9, 0.1], spec, sampler)
        assert draft.siblings == "iid"
        toks = draft.tokens.tolist()
        assert len(toks) == 3
        repeats += len(set(toks)) < 3
    assert repeats > 0


def test_without_replacement_trees_say_so_in_the_draft():
    """The sibling mode the tree was drawn with travels with the draft (the rule reads it)."""
    spec = TreeSpec(sample_branching=(3,), sample_width=1, siblings="without_replacement", sibling_stop=0.0)
    draft = _siblings([0.5, 0.3, 0.2], spec, _multinomial(0))
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

    flat = torch.zeros(1, V)  # every token q = 1/8
    spec = TreeSpec(shape="static", width=1, depth=3, branching=(1,), min_prob=0.0)
    for seed in range(12):
        sampler = DraftSampler(SamplingConfig(temperature=1.0), "gumbel", penalties=None, generator=None, noise_seed=seed)
        q = sampler.tree_rows(flat)[0]
        draft, _ = build_tree(flat, lambda n, t, p: flat.expand(len(n), V), spec, sampler, position=5, budget=8, max_depth=3)
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
    root = torch.full((1, V), -math.inf)
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
                                 dict(sample_branching=(0,)), dict(width=0), dict(depth=0), dict(expand_child=0.0),
                                 dict(sibling_stop=1.0), dict(sample_expand=1.0), dict(sibling_stop=-0.1),
                                 dict(sample_expand=-0.1), dict(min_prob=-0.1), dict(shape="bushy")])
def test_a_tree_spec_refuses_settings_that_leave_no_tree(bad):
    """sibling_stop / sample_expand 1.0 would stop every sampled tree at one child / expand none:
    their ranges are [0, 1) like min_prob's; an unknown shape is refused, not taken as static."""
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
        q = torch.zeros(V, dtype=torch.float64)
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
    root = torch.randn(1, V, generator=g)  # float32
    below = torch.randn(1, V, generator=g, dtype=torch.float64)
    spec = TreeSpec(sample_branching=(2, 1), sample_width=2, sibling_stop=0.0)
    draft, _ = build_tree(root, lambda n, t, p: below.expand(len(n), V), spec, _multinomial(2), position=0,
                          budget=8, max_depth=2)
    depth = [0 if p < 0 else 1 for p in draft.parents.tolist()]
    assert 1 in depth
    for i, d in enumerate(depth):
        law = torch.softmax(below[0], -1) if d else torch.softmax(root[0], -1).double()  # the float32 root row, widened
        assert torch.equal(draft.probs[i], law.to(draft.probs.dtype)) and draft.probs.dtype == torch.float64, i


def test_compact_rows_drawn_from_q_without_the_vocabulary_size_are_refused():
    """A sampled tree over reduced-vocabulary rows reports q over the whole vocabulary: without
    ``vocab`` it must say so (ValueError), not hand back q over the reduced columns."""
    ids = torch.tensor([1, 2, 3])
    row = torch.tensor([0.5, 0.3, 0.2]).log()
    sampler = _multinomial(0)
    spec = TreeSpec(sample_branching=(2,), sibling_stop=0.0, sample_expand=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        build_tree(row.unsqueeze(0), lambda n, t, p: row.expand(len(n), 3), spec, sampler,
                   position=0, budget=4, max_depth=1, ids=ids)
    draft, _ = build_tree(row.unsqueeze(0), lambda n, t, p: row.expand(len(n), 3), spec, sampler,
                          position=0, budget=4, max_depth=1, ids=ids, vocab=V)
    assert draft.probs.shape == (draft.tokens.numel(), V)


def test_compact_rows_are_refused_for_a_sampler_that_must_see_every_logit():
    """A logit bias reads tokens outside the reduced vocabulary: compact rows are refused."""
    ids = torch.tensor([1, 2, 3])
    row = torch.tensor([0.5, 0.3, 0.2]).log()
    sampler = DraftSampler(SamplingConfig(temperature=0.0, logit_bias=((5, 100.0),)), "argmax", penalties=None,
                           generator=None)
    assert not sampler.compact
    with pytest.raises(ValueError, match="compact"):
        build_tree(row.unsqueeze(0), lambda n, t, p: row.expand(len(n), 3), TreeSpec(depth=1), sampler,
                   position=0, budget=4, max_depth=1, ids=ids, vocab=V)


def _dynamic(budget: int, depth: int):  # -> (root paths in the draft's order, the growth indices kept)
    spec = TreeSpec(shape="dynamic", width=2, depth=depth, min_prob=0.0)
    draft, keep = build_tree(_row(()).unsqueeze(0), _expand([]), spec, GREEDY, position=0, budget=budget, max_depth=8)
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    return [_path(v, toks, pars) for v in range(len(toks))], keep


def test_a_pruned_dynamic_tree_keeps_its_nodes_in_growth_order():
    """Budget 3 of 6 grown nodes: the best three are (1) .6, (1,3) .54, (2) .4; they keep the order
    they were grown in (level by level), not score order, and ``keep`` lists their growth indices."""
    assert _dynamic(budget=3, depth=2) == ([(1,), (2,), (1, 3)], [0, 1, 2])


def test_a_dynamic_tree_one_node_over_its_budget_is_pruned():
    """Depth 1, width 2, budget 1: two root children grown, only the best (token 1) is kept."""
    assert _dynamic(budget=1, depth=1) == ([(1,)], [0])


def test_a_static_tree_that_fills_its_budget_asks_for_no_further_level():
    """branching (2, 2), budget 2: the two root children fill the tree, so ``expand`` (a draft
    pass) is never called."""
    calls: list = []
    spec = TreeSpec(shape="static", width=4, depth=2, branching=(2, 2), min_prob=0.0)
    assert _tree(spec, budget=2, calls=calls) == [(1,), (2,)] and calls == []


def test_a_sampled_trees_depth_is_its_sample_branching_length_not_depth():
    """Sampled (T = 1, q reported): ``sample_branching`` (1, 1) grows two levels even with
    ``depth`` 1 (depth is the deterministic trees' setting)."""
    q = torch.zeros(V)
    q[3] = 1.0
    spec = TreeSpec(depth=1, sample_branching=(1, 1), sample_width=1, sibling_stop=0.0, sample_expand=0.0)
    draft, _ = build_tree(q.log().unsqueeze(0), lambda n, t, p: q.log().expand(len(n), V), spec, _multinomial(0),
                          position=0, budget=8, max_depth=8)
    toks, pars = draft.tokens.tolist(), draft.parents.tolist()
    assert [_path(v, toks, pars) for v in range(len(toks))] == [(3,), (3, 3)]


@pytest.mark.parametrize("bad", [dict(branching=()), dict(sample_branching=())])
def test_a_tree_spec_refuses_an_empty_branching_tuple(bad):
    """No branching factor at all is refused like a zero one (a ConfigError, not a bare error)."""
    with pytest.raises(ConfigError, match="branching"):
        TreeSpec(**bad)


def test_a_static_tree_over_a_vocabulary_smaller_than_its_branching_takes_every_token():
    """A 3-token draft vocabulary under branching 4: the root gets all 3 tokens, best first."""
    root = torch.tensor([[0.0, 2.0, 1.0]])  # [1, 3]
    spec = TreeSpec(shape="static", width=4, depth=1, branching=(4,), min_prob=0.0)
    draft, _ = build_tree(root, lambda n, t, p: root.expand(len(n), 3), spec, GREEDY, position=0, budget=8, max_depth=1)
    assert draft.tokens.tolist() == [1, 2, 0] and draft.parents.tolist() == [-1, -1, -1]


def test_a_deterministic_tree_leaves_out_tokens_the_draft_gives_no_probability():
    """No floor (min_prob 0) and branching 3, but the root's q has only two tokens (1 and 2): a
    token of q = 0 is never a node, however much room is left."""
    spec = TreeSpec(shape="static", width=4, depth=1, branching=(3,), min_prob=0.0)
    assert _tree(spec, budget=8) == [(1,), (2,)]


def test_a_sampled_tree_is_static_whatever_the_shape_says():
    """Sampled trees are never pruned (the default dynamic shape included): the same seed draws
    the same tree under shape "dynamic" as under "static", within the budget, one q row per node."""
    for seed in range(3):
        drafts = []
        for shape in ("dynamic", "static"):
            spec = TreeSpec(shape=shape, width=4, sample_branching=(2, 2), sample_width=2, sibling_stop=0.0,
                            sample_expand=0.0)
            sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                                   generator=torch.Generator().manual_seed(seed))
            draft, _ = build_tree(_row(()).unsqueeze(0), _expand([]), spec, sampler, position=0, budget=3, max_depth=8)
            assert draft.tokens.numel() == 3 and draft.probs.shape[0] == 3
            drafts.append(draft)
        a, b = drafts
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.probs, b.probs)


def test_levels_past_the_branching_tuple_repeat_a_last_factor_above_one():
    """branching (1, 2), depth 3: the third level repeats the last factor, 2 children a node."""
    spec = TreeSpec(shape="static", width=4, depth=3, branching=(1, 2), min_prob=0.0)
    assert [spec.children(d) for d in range(4)] == [1, 2, 2, 2]
    assert _tree(spec, budget=100) == [(1,), (1, 3), (1, 4), (1, 3, 7), (1, 3, 0), (1, 4, 7), (1, 4, 0)]


def test_max_fed_counts_the_nodes_handed_to_expand_not_the_nodes_grown():
    """``max_fed`` 6 and a width-2 tree of depth 4 that wants exactly 6 expansions (2 a level):
    every level is fed, although 2 + 4 + 4 nodes were grown on the way."""
    calls: list = []
    spec = TreeSpec(shape="dynamic", width=2, depth=4, min_prob=0.0)
    build_tree(_row(()).unsqueeze(0), _expand(calls), spec, GREEDY, position=0, budget=100, max_depth=8, max_fed=6)
    assert [len(c) for c in calls] == [2, 2, 2]
