import pytest
import torch

from specdec.drafters import NgramDrafter
from specdec.drafters.base import DraftSampler
from specdec.drafters.tree_builder import TreeSpec
from specdec.sampling import SamplingConfig
from specdec.verify import Verdict

SAMPLER = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def test_copies_the_continuation_of_the_latest_match():
    d = NgramDrafter(max_ngram=3)
    ctx = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    d.prepare(ctx)
    draft = d.propose(ctx, 3, SAMPLER)
    assert draft.tokens.tolist() == [2, 3, 5] and draft.probs is None  # latest earlier "5 6 7"


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    d = NgramDrafter(max_ngram=3)
    ctx = torch.tensor([1, 2, 3, 9, 3])
    d.prepare(ctx)
    assert d.propose(ctx, 4, SAMPLER).tokens.tolist() == [9, 3]
    ctx = torch.tensor([1, 2, 3, 4])
    d.prepare(ctx)
    assert d.propose(ctx, 4, SAMPLER).tokens.numel() == 0


def test_incremental_index_matches_fresh():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 4, (200,), generator=g)
    inc = NgramDrafter()
    inc.prepare(seq[:10])
    for end in range(10, 200, 7):
        fresh = NgramDrafter()
        fresh.prepare(seq[:end])
        a = inc.propose(seq[:end], 5, SAMPLER).tokens.tolist()
        inc.commit(Verdict(0, torch.tensor([0])))
        assert a == fresh.propose(seq[:end], 5, SAMPLER).tokens.tolist()


def _chain(ctx: list[int], gamma: int, **kw) -> list[int]:
    d = NgramDrafter(**kw)
    d.prepare(torch.tensor(ctx))
    return d.propose(torch.tensor(ctx), gamma, SAMPLER).tokens.tolist()


def _tree(ctx: list[int], budget: int, spec: TreeSpec, max_depth: int = 8, **kw) -> tuple[list[int], list[int]]:
    d = NgramDrafter(**kw)
    d.prepare(torch.tensor(ctx))
    draft = d.propose_tree(torch.tensor(ctx), budget, SAMPLER, spec, max_depth=max_depth)
    assert draft.probs is None
    return draft.tokens.tolist(), draft.parents.tolist()


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    # "5 6 7" was followed by 8; the more recent lone "7" by 9
    assert _chain([5, 6, 7, 8, 7, 9, 5, 6, 7], 3, max_ngram=3) == [8, 7, 9]


def test_an_ngram_at_the_start_of_the_context_is_indexed():
    # the only earlier "5 6 7" starts at position 0; the latest "6 7" was followed by 9
    assert _chain([5, 6, 7, 8, 6, 7, 9, 5, 6, 7], 3, max_ngram=3) == [8, 6, 7]


CTX = [5, 6, 7, 8, 5, 6, 7, 9, 1, 6, 7, 2, 5, 6, 7]  # suffix "5 6 7": earlier at 0 and 4; "6 7" also at 9


def test_tree_merges_every_earlier_continuation_most_recent_and_longest_match_first():
    """``spec.depth`` 2: continuations of up to 4 tokens.  "5 6 7" (most recent first: after
    position 4, then 0), then "6 7" (after 9; its other occurrences are already in the trie)."""
    spec = TreeSpec(depth=2)
    toks, pars = _tree(CTX, 20, spec, max_ngram=3)
    assert toks == [9, 1, 6, 7, 8, 5, 6, 7, 2, 5, 6, 7]
    assert pars == [-1, 0, 1, 2, -1, 4, 5, 6, -1, 8, 9, 10]
    toks, pars = _tree(CTX, 10, spec, max_ngram=3)  # the budget cuts the last continuation
    assert toks == [9, 1, 6, 7, 8, 5, 6, 7, 2, 5] and pars == [-1, 0, 1, 2, -1, 4, 5, 6, -1, 8]
    toks, pars = _tree(CTX, 20, spec, max_depth=2, max_ngram=3)  # max_depth bounds the chains
    assert toks == [9, 1, 8, 5, 2, 5] and pars == [-1, 0, -1, 2, -1, 4]


def test_tree_shares_common_prefixes():
    # "3" was followed by "4 1" and by "4 2": one node for 4, two children
    toks, pars = _tree([3, 4, 1, 3, 4, 2, 3], 10, TreeSpec(depth=1), max_ngram=2)
    assert toks == [4, 2, 1] and pars == [-1, 0, 0]


def test_tree_falls_back_to_the_shortest_ngram():
    # only the 1-gram "3" matches: what followed it
    toks, pars = _tree([1, 2, 3, 9, 3], 8, TreeSpec(depth=1), max_ngram=3, min_ngram=1)
    assert toks == [9, 3] and pars == [-1, 0]


@pytest.mark.parametrize("kw", [dict(max_ngram=2, min_ngram=3), dict(max_ngram=3, min_ngram=0)])
def test_refuses_an_empty_or_inverted_ngram_range(kw):
    with pytest.raises(ValueError):
        NgramDrafter(**kw)


def test_a_shorter_context_than_the_last_one_starts_the_index_afresh():
    """A context shorter than what the drafter has seen (a new request without ``prepare``, or a
    rollback) must not reuse the old tokens: the draft equals a fresh drafter's."""
    d = NgramDrafter(max_ngram=2)
    d.prepare(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]))
    short = torch.tensor([5, 6, 9, 5, 6])
    fresh = NgramDrafter(max_ngram=2)
    fresh.prepare(short)
    assert d.propose(short, 3, SAMPLER).tokens.tolist() == fresh.propose(short, 3, SAMPLER).tokens.tolist() == [9, 5, 6]
    toks = d.propose_tree(short, 8, SAMPLER, TreeSpec(depth=2), max_depth=8).tokens.tolist()
    assert toks == fresh.propose_tree(short, 8, SAMPLER, TreeSpec(depth=2), max_depth=8).tokens.tolist()


def test_a_longer_context_of_another_sequence_starts_the_index_afresh():
    """A new, longer sequence given without ``prepare`` (its token at the last seen position
    differs) is not read as the old one extended: the draft equals a fresh drafter's, where the
    old tokens would have matched "1 2" and proposed 3."""
    d = NgramDrafter(max_ngram=2)
    d.prepare(torch.tensor([1, 2, 3, 4]))
    other = torch.tensor([7, 8, 9, 6, 5, 1, 2])
    fresh = NgramDrafter(max_ngram=2)
    fresh.prepare(other)
    assert d.propose(other, 3, SAMPLER).tokens.tolist() == fresh.propose(other, 3, SAMPLER).tokens.tolist() == []
