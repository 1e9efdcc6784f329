"""The tree builder on hand-made draft distributions: which nodes a dynamic (EAGLE-2) tree
expands, how it scores and prunes them, and how deep a static tree grows, pinned node by node."""

from __future__ import annotations

import math

import torch

from specdec.drafters.base import DraftSampler
from specdec.drafters.tree_builder import TreeSpec, build_tree
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


def _tree(spec: TreeSpec, budget: int, max_depth: int = 8, calls: list | None = None):
    draft, _ = build_tree(_row(()).unsqueeze(0), _expand(calls if calls is not None else []), spec, GREEDY,
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
