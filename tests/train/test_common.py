"""The pieces the training commands share: the held-out split, the learning-rate schedule, length batches."""

from __future__ import annotations

import random

import pytest

from specdec.train.common import length_batches, split, warmup_cosine


def test_every_nth_sequence_is_held_out_and_the_rest_trained_on() -> None:
    assert split(10, 5) == ([0, 1, 2, 3, 5, 6, 7, 8], [4, 9])
    train, held = split(47, 20)
    assert held == [19, 39] and sorted(train + held) == list(range(47)) and not set(train) & set(held)
    assert split(19, 20) == (list(range(19)), [])  # fewer than `every`: nothing held out (the commands refuse it)


def test_warmup_then_cosine_to_zero() -> None:
    assert [warmup_cosine(s, 10, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the first step already learns
    assert warmup_cosine(4, 10, 4) == 1.0
    assert warmup_cosine(7, 10, 4) == pytest.approx(0.5)  # half-way through the cosine
    assert warmup_cosine(10, 10, 4) == pytest.approx(0.0) and warmup_cosine(50, 10, 4) == pytest.approx(0.0)
    assert warmup_cosine(0, 10, 0) == 1.0 and warmup_cosine(5, 10, 0) == pytest.approx(0.5)


def test_length_batches_cover_each_sequence_once_within_the_token_budget() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(200)]
    index = list(range(0, 200, 3)) + [7]
    groups = length_batches(lengths, index, 64, random.Random(1))
    assert sorted(i for g in groups for i in g) == sorted(index)
    for g in groups:  # about batch_tokens padded tokens: never over, unless one sequence alone is
        assert max(lengths[i] for i in g) * len(g) <= 64 or len(g) == 1
    # full: no group could have taken the next-longer sequence of the order without passing the budget
    assert sum(max(lengths[i] for i in g) * len(g) for g in groups) > 0.6 * 64 * len(groups)
    again = length_batches(lengths, index, 64, random.Random(1))
    assert again == groups  # deterministic in the rng
    longest = [max(lengths[i] for i in g) for g in groups]
    assert longest != sorted(longest)  # the groups come in a shuffled order, not shortest first
    assert [len(g) for g in length_batches([5] * 8, list(range(8)), 20, random.Random(0))] == [4, 4]


def test_a_warmup_as_long_as_the_run_does_not_divide_by_zero() -> None:
    """total == warmup leaves no cosine steps: past the warm-up the factor is 0, not a ZeroDivisionError."""
    assert warmup_cosine(3, 4, 4) == 1.0
    assert warmup_cosine(5, 4, 4) == pytest.approx(0.0) and warmup_cosine(9, 4, 4) == pytest.approx(0.0)
    assert 0.0 <= warmup_cosine(4, 4, 4) <= 1.0


def test_sequences_of_equal_length_are_grouped_at_random() -> None:
    """Ties in length are broken by the rng, so equal-length sequences do not always share a batch
    with the same neighbours (10 seeds, 8 sequences of one length, 4 per batch)."""
    seen = set()
    for seed in range(10):
        groups = length_batches([5] * 8, list(range(8)), 20, random.Random(seed))
        assert sorted(i for g in groups for i in g) == list(range(8))
        seen.update(frozenset(g) for g in groups)
    assert len(seen) > 2


def test_sequences_longer_than_the_budget_get_batches_of_their_own_and_no_batch_is_empty() -> None:
    """A sequence alone over ``batch_tokens`` still gets a batch (of one), and no batch is ever
    empty -- even where the shortest sequence is already over budget (an empty group would be a
    training step over nothing)."""
    groups = length_batches([60, 70], [0, 1], 50, random.Random(1))
    assert sorted(groups) == [[0], [1]]
    lengths = [100, 80, 30, 10, 55]
    groups = length_batches(lengths, [0, 1, 2, 3, 4], 50, random.Random(0))
    assert all(groups) and sorted(map(sorted, groups)) == [[0], [1], [2], [3], [4]]
    groups = length_batches([100, 80, 30, 10], [0, 1, 2, 3], 60, random.Random(0))
    assert sorted(map(sorted, groups)) == [[0], [1], [2, 3]]


def test_a_batch_exactly_at_the_token_budget_is_kept_whole() -> None:
    """The budget is inclusive: 4 sequences of 5 tokens fill a 20-token batch, the fifth starts the next."""
    groups = length_batches([5] * 5, list(range(5)), 20, random.Random(0))
    assert sorted(len(g) for g in groups) == [1, 4]


def test_a_batch_is_padded_to_its_longest_sequence() -> None:
    """A group's cost is its longest sequence times its size: lengths 2, 2, 9 at budget 18 are
    [2, 2] and [9] (2 x 9 = 18 would fit only if 9 were not the longest)."""
    groups = length_batches([2, 2, 9], [0, 1, 2], 17, random.Random(0))
    assert sorted(map(sorted, groups)) == [[0, 1], [2]]
    groups = length_batches([2, 2, 9], [0, 1, 2], 27, random.Random(0))
    assert sorted(map(sorted, groups)) == [[0, 1, 2]]


def test_every_first_sequence_is_held_out_with_every_one() -> None:
    """every = 1 holds out every sequence (nothing to train on: the commands refuse it)."""
    assert split(3, 1) == ([], [0, 1, 2])
