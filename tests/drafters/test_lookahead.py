"""Lookahead decoding: the window as a tree, the Jacobi step, the pool, and exactness.

The law tests draw N = 2,000 independent generations (seed = sample index) of 2 new tokens from
a 5-token, 3-layer random Llama (25 possible outputs), drafted by Lookahead as 10-node trees
(a 2 x 3 window + pool candidates), verified by the token-level tree rule (recursive rejection
sampling) and by Traversal Verification, and run a chi-square goodness-of-fit test against the
exact law (enumerated); they fail at p < 1e-4.  The negative control runs the same test with the
tree rule accepting each candidate with twice its probability (min(1, 2 p(x) / q(x)), a plausible
slip) and must fail.
"""

from __future__ import annotations

import pytest
import torch

import specdec.verify_tree as vt
from specdec import defaults
from specdec.decoder import SpeculativeDecoder
from specdec.drafters.base import DraftSampler
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import FixedGamma
from specdec.sampling import SamplingConfig
from specdec.session import TargetSession
from specdec.tree import paths
from specdec.verify import Verdict, get_rule
from stats import ALPHA, chi_square_pvalue, exact_law

from tiny import NativeOracle as Oracle, tiny_vocab_llama as tiny_native

N_SAMPLES = 2_000
N_NEW = 2
PROMPT = [1, 3, 0, 1, 3]
TARGET = tiny_native(layers=3, batch_invariant=False)
INVARIANT = tiny_native(layers=3)
SPEC = TreeSpec()


def _sampler() -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def _drafter(**kw) -> LookaheadDrafter:
    d = LookaheadDrafter(**{"window": 3, "ngram": 3, "candidates": 2, **kw})
    d.prepare(torch.tensor(PROMPT))
    return d


# ----------------------------------------------------------------------------- structure


def test_window_is_a_tree_whose_ancestors_are_the_lookahead_diagonals():
    d = _drafter(candidates=0)
    draft = d.propose_tree(torch.tensor(PROMPT), 16, _sampler(), SPEC, max_depth=8)
    nodes = d._window_nodes  # [[row 0 nodes], [row 1 nodes]]
    assert [len(r) for r in nodes] == [3, 3] and draft.tokens.numel() == 6 and draft.wants_argmax
    par = draft.parents.tolist()
    assert all(p < i for i, p in enumerate(par))  # topological
    anc = paths(draft.parents)  # node -> its path from the root (node included)
    for i, node in enumerate(nodes[0]):
        assert anc[node] == nodes[0][: i + 1]  # row 0: a chain off the root
        assert draft.tokens[node] == d.levels[0][i]
    # row 1, column i: the diagonal (row 0, column i - 1), then row 0's prefix
    assert anc[nodes[1][0]] == [nodes[1][0]]
    assert anc[nodes[1][2]] == [nodes[0][0], nodes[0][1], nodes[1][2]]


def test_pool_candidates_form_a_trie_and_the_budget_holds():
    d = _drafter()
    d.pool.clear()
    for gram in ((3, 4, 4), (3, 4, 2), (3, 2, 2)):
        d._add(gram)
    for budget in (4, 9, 12):
        draft = d.propose_tree(torch.tensor(PROMPT), budget, _sampler(), SPEC, max_depth=8)
        assert draft.tokens.numel() <= budget
    draft = d.propose_tree(torch.tensor(PROMPT), 12, _sampler(), SPEC, max_depth=8)  # last token: 3
    window = {n for row in d._window_nodes for n in row}
    cand = [(int(t), int(p)) for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)) if i not in window]
    # 2 most recent continuations of 3: (4, 2) and (2, 2); distinct roots, no duplicate edges
    assert sorted(t for t, p in cand if p == -1) == [2, 4] and len(cand) == 4


def test_jacobi_step_pool_and_slide():
    d = _drafter(candidates=0)
    d.levels = [[1, 2, 3], [4, 0, 1]]
    draft = d.propose_tree(torch.tensor(PROMPT), 16, _sampler(), SPEC, max_depth=8)
    r0, r1 = d._window_nodes
    out = torch.zeros(draft.tokens.numel() + 1, dtype=torch.long)
    out[0] = 2  # the target's next token at the root
    for i, node in enumerate(r1):
        out[node + 1] = 10 + i  # what the target predicts after row 1's nodes (fake ids)
    d.pool.clear()
    d.observe(out)
    # the new newest row: root prediction, then the prediction after row 1's column i - 1
    assert d.levels == [[4, 0, 1], [2, 10, 11]]
    # n-grams: column i's diagonal (row 0, i - 1), (row 1, i), then the prediction after it
    assert d.pool[1] == [(0, 11)] and d.pool[2] == [(1, 12)]
    d.commit(Verdict(num_accepted=1, tokens=torch.tensor([2, 10])))  # 2 tokens committed
    assert [row[:1] for row in d.levels] == [[1], [11]] and all(len(row) == 3 for row in d.levels)


def test_pool_is_bounded():
    d = LookaheadDrafter(window=2, ngram=2, candidates=1, pool_size=3)
    d.prepare(torch.arange(10))
    assert len(d.pool) == 3 and list(d.pool) == [6, 7, 8]
    for _ in range(20):
        d._add((6, 1))
        d._add((6, 2))
    assert d.pool[6] == [(7,), (1,), (2,)]  # no duplicates, most recent last


def test_node_argmax_is_the_teacher_forced_argmax_of_each_path():
    cfg = SamplingConfig(temperature=0.0)
    d = _drafter()
    session = TargetSession(INVARIANT, PROMPT, cfg, get_rule("greedy"), seed=0)
    draft = d.propose_tree(session.context, 9, _sampler(), SPEC, max_depth=8)
    out = session.verify(draft).node_argmax
    assert out is not None and out.numel() == draft.tokens.numel() + 1
    ctx = PROMPT
    assert out[0] == INVARIANT.forward(torch.tensor(ctx), INVARIANT.new_cache(32))[-1].argmax()
    for i, path in enumerate(paths(draft.parents)):
        seq = torch.tensor(ctx + [int(draft.tokens[j]) for j in path])
        assert out[i + 1] == INVARIANT.forward(seq, INVARIANT.new_cache(32))[-1].argmax()


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("budget", [4, 10, 16])
def test_greedy_lookahead_equals_plain_greedy(budget):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(PROMPT, cfg)
    dec = SpeculativeDecoder(INVARIANT, LookaheadDrafter(window=3, ngram=3, candidates=2), get_rule("greedy"),
                             gamma=FixedGamma(budget), tree=SPEC)
    out = dec.generate(PROMPT, cfg)
    assert out.tokens == plain.tokens
    assert out.stats.tokens_per_target_call > 1.0  # a 5-token model repeats itself: the pool pays


class _Spy(LookaheadDrafter):
    """Records, at each ``observe``, whether the window is still the one its tree was built from."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.built: list[list[int]] | None = None
        self.seen: list[bool] = []

    def propose_tree(self, *args, **kw):
        draft = super().propose_tree(*args, **kw)
        self.built = [list(row) for row in self.levels]
        return draft

    def observe(self, node_argmax):
        self.seen.append([list(row) for row in self.levels] == self.built)
        super().observe(node_argmax)


def test_the_decoder_hands_over_the_arg_maxes_before_it_commits():
    """The Jacobi step reads the window that built the tree; a commit first slides it, and the pool
    then learns n-grams from the wrong diagonals (the output stays exact, acceptance moves)."""
    spy = _Spy(window=3, ngram=3, candidates=2)
    SpeculativeDecoder(INVARIANT, spy, get_rule("greedy"), gamma=FixedGamma(10), tree=SPEC).generate(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=30))
    assert len(spy.seen) >= 5 and all(spy.seen), spy.seen


def _samples(method: str, cfg: SamplingConfig) -> list[tuple[int, ...]]:
    dec = SpeculativeDecoder(TARGET, LookaheadDrafter(window=3, ngram=3, candidates=2), get_rule(method),
                             gamma=FixedGamma(10), tree=SPEC)
    return [tuple(dec.generate(PROMPT, SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})).tokens)
            for i in range(N_SAMPLES)]


@pytest.mark.parametrize("method", ["token", "block"])
def test_output_law_at_t1(method):
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    assert chi_square_pvalue(_samples(method, cfg), law) > ALPHA


def test_negative_control_over_accepting_rule_fails(monkeypatch):
    monkeypatch.setattr(vt, "_accept_prob", lambda p, q: min(1.0, 2.0 * p / q) if q > 0 else 0.0)
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    assert chi_square_pvalue(_samples("token", cfg), law) < ALPHA


def test_the_prompt_seeds_the_pool_with_each_of_its_ngrams():
    d = LookaheadDrafter(window=3, ngram=3, candidates=2)
    d.prepare(torch.tensor(PROMPT))
    assert dict(d.pool) == {1: [(3, 0)], 3: [(0, 1)], 0: [(1, 3)]}  # the last n-gram (0 1 3) too
    assert list(d.pool) == [1, 3, 0]


def test_a_chain_round_proposes_the_most_recent_continuation():
    d = LookaheadDrafter(window=3, ngram=3, candidates=2)
    d.prepare(torch.tensor(PROMPT))
    d.pool.clear()
    for gram in ((3, 4, 4), (3, 2, 1), (3, 4, 2)):
        d._add(gram)
    assert d.propose(torch.tensor(PROMPT), 2, _sampler()).tokens.tolist() == [4, 2]
    assert d.propose(torch.tensor(PROMPT), 1, _sampler()).tokens.tolist() == [4]


def test_the_pool_keeps_the_latest_continuations_per_key_and_drops_the_stalest_key():
    d = LookaheadDrafter(window=2, ngram=2, candidates=1, pool_size=2)
    d.prepare(torch.tensor([0]))
    per_key = defaults.LOOKAHEAD_PER_KEY
    for t in range(per_key + 3):
        d._add((5, t))
    assert d.pool[5] == [(t,) for t in range(3, per_key + 3)]
    d.pool.clear()
    d._add((1, 9))
    d._add((2, 9))
    d._add((1, 8))  # refreshes key 1: key 2 is now the least recently refreshed
    d._add((3, 9))
    assert list(d.pool) == [1, 3] and d.pool[1] == [(9,), (8,)]


def test_the_window_leaves_room_for_the_candidates():
    """Budget 8, 2 window rows, a window of 5: 8 // 2 - 1 = 3 columns (6 nodes), the other 2
    nodes for the most recent pool continuation of the last token."""
    d = LookaheadDrafter(window=5, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    d.pool.clear()
    d._add((3, 4, 2))
    draft = d.propose_tree(torch.tensor(PROMPT), 8, _sampler(), TreeSpec(), max_depth=8)
    assert [len(r) for r in d._window_nodes] == [3, 3] and draft.tokens.numel() == 8
    window = {n for row in d._window_nodes for n in row}
    cand = [(int(t), int(p)) for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)) if i not in window]
    assert cand == [(4, -1), (2, 0)]


@pytest.mark.parametrize("kw", [dict(ngram=1), dict(window=0), dict(candidates=-1), dict(pool_size=0)])
def test_refuses_settings_without_a_window_or_an_ngram(kw):
    with pytest.raises(ValueError):
        LookaheadDrafter(**kw)


def _depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def test_the_seed_picks_the_windows_initial_guesses_from_the_prompt():
    """The window starts as seeded draws from the prompt's tokens: the same seed gives the same
    window, another seed another one (prompt of 8 distinct tokens, 2 x 5 guesses)."""
    prompt = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])
    windows = []
    for seed in (0, 0, 1):
        d = LookaheadDrafter(window=5, ngram=3, candidates=1, seed=seed)
        d.prepare(prompt)
        assert all(t in prompt.tolist() for row in d.levels for t in row)
        windows.append(d.levels)
    assert windows[0] == windows[1] and windows[0] != windows[2]
    assert len({t for row in windows[0] for t in row}) > 1


def test_no_node_is_deeper_than_max_depth():
    """max_depth 1 (one token left to generate): pool candidates and window alike stay at depth 1."""
    d = LookaheadDrafter(window=3, ngram=3, candidates=2)
    d.prepare(torch.tensor(PROMPT))
    d.pool.clear()
    d._add((3, 4, 2))
    draft = d.propose_tree(torch.tensor(PROMPT), 16, _sampler(), TreeSpec(), max_depth=1)
    assert draft.tokens.numel() > 0
    assert max(_depths(draft.parents.tolist())) == 1
    assert draft.tokens.tolist()[0] == 4  # the candidate's first token is still proposed


def test_a_tree_without_a_window_does_not_ask_for_arg_maxes():
    """A budget too small for a window column (budget 2, 2 rows, a candidate): no window nodes,
    so the draft does not ask the verifier for the target's arg-max after each node."""
    d = LookaheadDrafter(window=3, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    draft = d.propose_tree(torch.tensor(PROMPT), 2, _sampler(), TreeSpec(), max_depth=8)
    assert d._window_nodes == [] and not draft.wants_argmax
    assert draft.tokens.numel() == 2  # the pool's continuation of 3: (0, 1)


def test_columns_the_budget_left_out_keep_their_newest_guess():
    """Window 5 but room for 3 columns (budget 8): after the Jacobi step the new newest row's
    columns 3 and 4 are the old newest row's (its guesses there were not refreshed)."""
    d = LookaheadDrafter(window=5, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    d.levels = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    d.pool.clear()
    d._add((3, 4, 2))
    draft = d.propose_tree(torch.tensor(PROMPT), 8, _sampler(), TreeSpec(), max_depth=8)
    assert [len(r) for r in d._window_nodes] == [3, 3]
    d.observe(torch.full((draft.tokens.numel() + 1,), 7, dtype=torch.long))
    assert d.levels == [[20, 21, 22, 23, 24], [7, 7, 7, 23, 24]]


def test_a_round_committing_more_than_the_window_keeps_every_row_window_wide():
    """5 tokens committed past a window of 3: every row is 3 fresh guesses, no longer."""
    d = LookaheadDrafter(window=3, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    d.commit(Verdict(num_accepted=4, tokens=torch.tensor([1, 3, 0, 1, 3])))
    assert [len(row) for row in d.levels] == [3, 3]


def test_without_candidates_the_whole_budget_goes_to_the_window():
    """candidates=0: no pool continuation enters the tree (even though the pool has one for the
    last token), and the window is not shrunk to leave room for one: budget 7, 2 rows -> 3 columns,
    and the node left over stays unused."""
    d = LookaheadDrafter(window=5, ngram=3, candidates=0)
    d.prepare(torch.tensor(PROMPT))
    assert d.pool.get(3)  # the prompt's "3 0 1" is in the pool
    draft = d.propose_tree(torch.tensor(PROMPT), 7, _sampler(), TreeSpec(), max_depth=8)
    assert [len(r) for r in d._window_nodes] == [3, 3]
    window = {n for row in d._window_nodes for n in row}
    assert draft.tokens.numel() == 6 and window == set(range(6))  # every node is a window node


def test_a_chain_round_forgets_the_last_trees_window_nodes():
    """After a chain round (no window in the draft) the arg-maxes the verifier hands over (if
    any) must not be read against the previous tree's window: the window is left as it was."""
    d = LookaheadDrafter(window=3, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    d.propose_tree(torch.tensor(PROMPT), 12, _sampler(), TreeSpec(), max_depth=8)
    assert d._window_nodes
    before = [row[:] for row in d.levels]
    d.propose(torch.tensor(PROMPT), 2, _sampler())
    d.observe(torch.full((3,), 4, dtype=torch.long))
    assert d.levels == before


def test_a_shorter_context_replaces_the_remembered_one():
    """A context shorter than the one seen last (a new request without ``prepare``) is taken as
    it is: the chain round continues its last token (0 -> the pool's (1, 3)), not the old one's."""
    d = LookaheadDrafter(window=3, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    assert d.propose(torch.tensor([3, 0]), 2, _sampler()).tokens.tolist() == [1, 3]


def test_a_longer_context_of_another_sequence_replaces_the_remembered_one():
    """A new, longer sequence without ``prepare`` whose token at the last seen position differs is
    taken whole: the chain round continues its own last token (0 -> the pool's (1, 3)), not the old
    context extended by the new one's tail."""
    d = LookaheadDrafter(window=3, ngram=3, candidates=1)
    d.prepare(torch.tensor(PROMPT))
    other = torch.tensor([9] * (len(PROMPT) - 1) + [5, 3, 0])
    assert d.propose(other, 2, _sampler()).tokens.tolist() == [1, 3]
    assert d._context == other.tolist()


def test_the_most_recent_pool_continuation_gets_the_room_first():
    """Two continuations of the last token, room for one (budget 8: 6 window nodes + 2): the more
    recent one, (5, 6), is proposed, not the older (4, 2)."""
    d = LookaheadDrafter(window=5, ngram=3, candidates=2)
    d.prepare(torch.tensor(PROMPT))
    d.pool.clear()
    d._add((3, 4, 2))
    d._add((3, 5, 6))
    draft = d.propose_tree(torch.tensor(PROMPT), 8, _sampler(), TreeSpec(), max_depth=8)
    window = {n for row in d._window_nodes for n in row}
    cand = [(int(t), int(p)) for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)) if i not in window]
    assert cand == [(5, -1), (6, 0)]


def test_a_second_prepare_starts_from_the_seeds_window_again():
    """prepare() starts a request afresh: the same drafter prepared twice with one prompt (a
    reused decoder) has the same initial window as a new drafter with that seed, so a request's
    rounds do not depend on the requests before it."""
    prompt = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])
    fresh = LookaheadDrafter(window=5, ngram=3, candidates=1, seed=3)
    fresh.prepare(prompt)
    reused = LookaheadDrafter(window=5, ngram=3, candidates=1, seed=3)
    reused.prepare(prompt)
    reused.commit(Verdict(num_accepted=2, tokens=torch.tensor([11, 12, 13])))  # draws fresh fillers
    reused.prepare(prompt)
    assert reused.levels == fresh.levels


def test_the_windows_initial_guesses_may_be_any_prompt_token_the_last_included():
    """The fillers are drawn from the whole prompt: with a 2-token prompt and 2 x 8 seeded
    guesses, both tokens occur (the last one, 9, too), and nothing else."""
    d = LookaheadDrafter(window=8, ngram=3, candidates=1, seed=0)
    d.prepare(torch.tensor([7, 9]))
    assert {t for row in d.levels for t in row} == {7, 9}
