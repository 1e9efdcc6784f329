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
