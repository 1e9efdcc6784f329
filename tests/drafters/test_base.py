"""The draft sampler and draft containers of ``specdec.drafters.base`` on hand-made logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from specdec.drafters.base import (
    Draft,
    DraftChain,
    DraftSampler,
    feature_taps,
    temperature_factor,
    truncate_top_k,
)
from specdec.sampling import PenaltyState, SamplingConfig


class _Only:
    """A toy constraint: the same tokens are allowed after any history."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def allowed(self, generated, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.tokens] = True
        return mask


def _sampler(cfg: SamplingConfig, mode: str, **kw) -> DraftSampler:
    state = PenaltyState.start(torch.tensor([0]), 8) if cfg.needs_state else None
    return DraftSampler(cfg, mode, penalties=state, generator=torch.Generator().manual_seed(0), **kw)


def test_a_chain_draft_has_chain_parents_and_is_not_a_tree():
    """A chain's parents are -1, 0, 1, ...; a chain is no tree, a draft with parents is."""
    chain = Draft(tokens=torch.tensor([5, 6, 7]), probs=None)
    assert chain.chain_parents().tolist() == [-1, 0, 1]
    assert Draft(tokens=torch.tensor([4]), probs=None).chain_parents().tolist() == [-1]
    assert not chain.is_tree
    tree = Draft(tokens=torch.tensor([5, 6]), probs=None, parents=torch.tensor([-1, -1]))
    assert tree.is_tree and tree.chain_parents().tolist() == [-1, -1]


def test_a_draft_chain_stops_when_the_sampler_asks():
    """DraftChain.add returns False once the sampler set stop_requested, True otherwise."""
    chain = DraftChain()
    sampler = SimpleNamespace(stop_requested=False)
    assert chain.add((3, None), sampler)
    sampler.stop_requested = True
    assert not chain.add((4, None), sampler)
    assert not chain.add(None, sampler)
    assert chain.draft().tokens.tolist() == [3, 4] and chain.draft().probs is None


def test_multinomial_drafting_without_reported_probs_is_deterministic():
    """A multinomial sampler that reports no q counts as deterministic; one that does, not."""
    cfg = SamplingConfig(temperature=1.0)
    assert DraftSampler(cfg, "multinomial", penalties=None, generator=None, want_probs=False).deterministic
    assert not DraftSampler(cfg, "multinomial", penalties=None, generator=None).deterministic


def test_a_greedy_config_drafts_by_argmax_whatever_the_mode():
    """A greedy config makes the sampler arg-max: no q is reported even in multinomial mode."""
    sampler = _sampler(SamplingConfig(temperature=0.0), "multinomial")
    assert sampler.mode == "argmax"
    assert sampler(torch.tensor([[0.0, 2.0, 1.0]]), 0) == (1, None)


def test_the_confidence_stop_needs_a_top_probability_strictly_below_the_threshold():
    """min_confidence: a top-1 of exactly the threshold does not stop the draft; just below it does."""
    logits = torch.zeros(1, 2)  # softmax 0.5, 0.5 exactly
    at = _sampler(SamplingConfig(temperature=0.0), "argmax", min_confidence=0.5)
    at(logits, 0)
    assert not at.stop_requested
    above = _sampler(SamplingConfig(temperature=0.0), "argmax", min_confidence=0.5000001)
    above(logits, 0)
    assert above.stop_requested


def test_draft_only_top_k_truncation_leaves_gumbel_drafting_alone():
    """q_top_k truncates the multinomial q only: a Gumbel draft of a uniform q still varies by position."""
    sampler = _sampler(SamplingConfig(temperature=1.0), "gumbel", q_top_k=1, noise_seed=5)
    tokens = {sampler(torch.zeros(1, 8), p)[0] for p in range(16)}
    assert len(tokens) > 1


def test_undefined_is_cleared_by_the_next_call():
    """A call that finds no allowed token sets undefined; the next one that draws clears it."""
    sampler = _sampler(SamplingConfig(temperature=1.0, constraint=_Only([3])), "multinomial")
    none_allowed = torch.zeros(1, 8)
    none_allowed[0, 3] = -math.inf
    assert sampler(none_allowed, 0) == (0, None) and sampler.undefined
    token, q = sampler(torch.zeros(1, 8), 0)
    assert token == 3 and not sampler.undefined and float(q[3]) == 1.0


def test_truncate_top_k_keeps_the_k_best_renormalised():
    """truncate_top_k keeps the k most likely tokens, renormalised to sum to 1."""
    q = torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(truncate_top_k(q, 2), torch.tensor([0.0, 0.625, 0.375]))
    assert truncate_top_k(q, 3) is q


def test_feature_taps_keeps_an_empty_tuple_apart_from_none():
    """A drafter declaring no taps (final hidden state only) gets (), one without the attribute None."""
    assert feature_taps(SimpleNamespace(feature_taps=[])) == ()
    assert feature_taps(SimpleNamespace(feature_taps=[2, 4])) == (2, 4)
    assert feature_taps(object()) is None


def test_temperature_factor_reads_the_drafters_factor():
    """temperature_factor returns the drafter's own factor, 1 without one or without a drafter."""
    assert temperature_factor(SimpleNamespace(temperature_factor=0.5)) == 0.5
    assert temperature_factor(object()) == 1.0
    assert temperature_factor(None) == 1.0


def test_tree_rows_mask_by_the_constraint_unless_a_row_would_be_empty():
    """tree_rows masks each row with what the constraint allows; a row it would empty stays as it was."""
    sampler = _sampler(SamplingConfig(temperature=0.0, constraint=_Only([1, 2])), "argmax")
    logits = torch.zeros(2, 8)
    logits[1, :] = -math.inf
    logits[1, 5] = 0.0  # the second row can only propose token 5, which the grammar forbids
    rows = sampler.tree_rows(logits, [[], []])
    assert torch.isfinite(rows[0]).tolist() == [i in (1, 2) for i in range(8)]
    assert torch.equal(rows[1], logits[1])


def test_tree_rows_apply_penalties_once_in_sampling_mode():
    """tree_rows with penalties in multinomial mode penalise the committed context once and return q."""
    cfg = SamplingConfig(temperature=1.0, repetition_penalty=2.0)
    sampler = _sampler(cfg, "multinomial")  # token 0 was seen (the prompt)
    logits = torch.zeros(1, 8)
    logits[0, 0] = math.log(4.0)
    rows = sampler.tree_rows(logits)
    expected = torch.softmax(torch.tensor([math.log(2.0)] + [0.0] * 7), -1)  # log 4 / 2
    assert torch.allclose(rows[0], expected)


def test_compact_rows_are_refused_where_a_penalty_reads_other_tokens():
    """Calling a sampler that is not compact (penalties) with draft-vocabulary ids raises ValueError."""
    sampler = _sampler(SamplingConfig(temperature=0.0, repetition_penalty=1.5), "argmax")
    assert not sampler.compact
    with pytest.raises(ValueError, match="compact draft rows need"):
        sampler(torch.zeros(1, 2), 0, ids=torch.tensor([3, 5]), vocab=8)


def test_greedy_drafting_under_a_constraint_picks_the_best_allowed_token():
    """Arg-max drafting with a constraint draws the best allowed token and is not undefined."""
    sampler = _sampler(SamplingConfig(temperature=0.0, constraint=_Only([3, 4])), "argmax")
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    assert sampler(logits, 0) == (4, None) and not sampler.undefined


def test_draft_only_top_k_truncates_the_multinomial_q_and_reports_it():
    """q_top_k=1 in multinomial mode draws the most likely token and reports a one-hot q."""
    sampler = _sampler(SamplingConfig(temperature=1.0), "multinomial", q_top_k=1)
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for position in range(8):
        token, q = sampler(logits, position)
        assert token == 1 and q.tolist() == [float(i == 1) for i in range(8)]


def test_tree_rows_without_histories_leave_the_rows_unconstrained():
    """tree_rows under a constraint but without node paths return the plain processed q."""
    sampler = _sampler(SamplingConfig(temperature=1.0, constraint=_Only([1])), "multinomial")
    rows = sampler.tree_rows(torch.zeros(2, 8))
    assert torch.allclose(rows, torch.full((2, 8), 1 / 8))


def test_tree_rows_apply_the_requests_temperature_and_truncation():
    """tree_rows in sampling mode return the processed q: temperature and top-k applied."""
    sampler = _sampler(SamplingConfig(temperature=0.5, top_k=2), "multinomial")
    logits = torch.tensor([[0.0, math.log(2.0), -0.5, -1.0]])
    rows = sampler.tree_rows(logits)
    assert torch.allclose(rows[0], torch.tensor([0.2, 0.8, 0.0, 0.0]))  # exp(2 x logits) over the top 2


def test_a_logit_bias_keeps_whole_rows():
    """A logit bias changes logits of tokens outside a reduced draft vocabulary: no compact rows."""
    for temperature, mode in ((0.0, "argmax"), (1.0, "multinomial"), (1.0, "gumbel")):
        assert not _sampler(SamplingConfig(temperature=temperature, logit_bias=((3, 5.0),)), mode).compact, mode
        assert _sampler(SamplingConfig(temperature=temperature), mode).compact, mode


def test_a_sparse_wire_q_keeps_whole_rows():
    """q_top_k truncates the whole row's q: a multinomial sampler with it drafts on whole rows."""
    assert not _sampler(SamplingConfig(temperature=1.0), "multinomial", q_top_k=2).compact
    assert _sampler(SamplingConfig(temperature=1.0), "gumbel", q_top_k=2).compact  # q_top_k is multinomial's only


def test_greedy_drafting_where_the_constraint_allows_nothing_is_undefined():
    """Arg-max drafting whose row has no token the constraint allows (a reduced draft vocabulary)
    draws nothing: (0, None), ``undefined`` set, and the penalty state does not move."""
    sampler = _sampler(SamplingConfig(temperature=0.0, constraint=_Only([3])), "argmax")
    logits = torch.zeros(1, 8)
    logits[0, 3] = -math.inf
    assert sampler(logits, 0) == (0, None) and sampler.undefined
    assert sampler.penalties.generated == []
    assert sampler(torch.zeros(1, 8), 0) == (3, None) and not sampler.undefined


def test_the_confidence_stop_holds_where_compact_draws_are_compiled():
    """With the kernels loaded, a compact multinomial draw still asks to stop where the drawn
    token's q is below ``min_confidence``: q = (0.7, 0.3) on ids 2 and 5 of 8, bar 0.5, 40 seeded
    draws (both tokens are drawn)."""

    from specdec.models import kernels

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    ids, row = torch.tensor([2, 5]), torch.tensor([[math.log(0.7), math.log(0.3)]])
    seen = set()
    for seed in range(40):
        sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                               generator=torch.Generator().manual_seed(seed), min_confidence=0.5)
        token, q = sampler(row, seed, ids, 8)
        assert sampler.stop_requested == (token == 5), (seed, token)
        seen.add(token)
    assert seen == {2, 5}


def test_tree_rows_under_a_constraint_leave_the_callers_logits_alone():
    """tree_rows masks copies of the rows: the logits handed in (a tree builder may read them
    again) keep every token, in arg-max and in sampling mode."""
    for temperature, mode in ((0.0, "argmax"), (1.0, "multinomial")):
        sampler = _sampler(SamplingConfig(temperature=temperature, constraint=_Only([1, 2])), mode)
        logits = torch.zeros(2, 8)
        rows = sampler.tree_rows(logits, [[], [1]])
        assert torch.equal(logits, torch.zeros(2, 8)), mode
        assert (rows[0] > (-math.inf if mode == "argmax" else 0)).tolist() == [i in (1, 2) for i in range(8)]


def test_greedy_drafting_without_a_confidence_bar_picks_the_logits_arg_max():
    """Without ``min_confidence`` arg-max drafting reads the logits themselves: two logits 1e-9
    apart (equal once through a float32 softmax) give the larger one."""
    sampler = _sampler(SamplingConfig(temperature=0.0), "argmax")
    assert sampler(torch.tensor([[0.0, 1e-9, -1.0]]), 0) == (1, None)
