"""The toy LM (specdec.models.toy), the tests' oracle: its states, its tree scoring and its toy features."""

from __future__ import annotations

import torch

from specdec.models.toy import ToyLM


def test_token_zero_is_not_the_no_token_symbol():
    """Order 2: after [0] the state is (none, 0), not (none, none) as at the start."""
    lm = ToyLM(3, order=2, seed=5)
    assert lm._row([0]) != lm._row([])
    assert not torch.equal(lm.logits_for([0]), lm.logits_for([]))


def test_features_follow_the_last_pass_chain_or_tree_and_last_only():
    """forward_features gives [n, len(taps)+1, D] for the pass just run (a tree's own nodes too);
    last_only keeps one row of logits but the features of every position (as the native model's)."""
    lm = ToyLM(4, order=1, seed=3)
    cache = lm.new_cache()
    logits, feats = lm.forward_features(torch.tensor([1, 2, 3]), cache, (0, 1), last_only=True)
    assert logits.shape == (1, 4) and feats.shape[1:] == (3, lm.hidden_size)
    tree_logits, tree_feats = lm.forward_features(torch.tensor([0, 1]), cache, (0,), parents=torch.tensor([-1, -1]))
    assert tree_logits.shape == (2, 4) and tree_feats.shape == (2, 2, lm.hidden_size)
    # both tree nodes hang off the prefix: after token 0 and after token 1
    assert torch.equal(tree_logits, torch.stack([lm.logits_for([1, 2, 3, 0]), lm.logits_for([1, 2, 3, 1])]))
    assert not torch.equal(tree_feats[0], tree_feats[1])


def test_truncation_to_any_length_up_to_its_own():
    lm = ToyLM(4, order=1, seed=0)
    cache = lm.new_cache()
    lm.forward(torch.tensor([1, 2, 3]), cache)
    cache.truncate(3)  # to its own length: nothing happens
    assert cache.tokens == [1, 2, 3] and cache.length == 3
    cache.truncate(1)
    assert cache.tokens == [1] and cache.length == 1 and cache.nbytes == 8


def test_compact_keeps_one_path_at_start():
    """keep [2, 4] from start 1: the tokens at 2 and 4 move to positions 1 and 2."""
    lm = ToyLM(5, order=1, seed=0)
    cache = lm.new_cache()
    lm.forward(torch.tensor([0, 1, 2, 3, 4]), cache)
    cache.compact(torch.tensor([2, 4]), 1)
    assert cache.tokens == [0, 2, 4] and cache.length == 3


def test_new_caches_are_independent():
    lm = ToyLM(4, order=1, seed=0)
    a, b = lm.new_cache(), lm.new_cache()
    lm.forward(torch.tensor([1, 2]), a)
    assert b.tokens == [] and b.length == 0


def test_a_tree_pass_can_continue_an_earlier_one_from_the_prefix():
    """prefix 2, two nodes already scored: the new node's parent (node 0) is one of the earlier ones,
    so it is scored after prefix + node 0, not after everything in the cache."""
    lm = ToyLM(4, order=2, seed=7)
    cache = lm.new_cache()
    lm.forward(torch.tensor([1, 2]), cache)
    first = lm.forward_tree(torch.tensor([0, 3]), torch.tensor([-1, -1]), cache)
    assert torch.equal(first, torch.stack([lm.logits_for([1, 2, 0]), lm.logits_for([1, 2, 3])]))
    calls = lm.calls
    more = lm.forward_tree(torch.tensor([2]), torch.tensor([-1, -1, 0]), cache, prefix=2)
    assert torch.equal(more, lm.logits_for([1, 2, 0, 2]).unsqueeze(0))
    assert lm.calls == calls + 1  # a tree pass counts as a call, as a chain pass does
    assert cache.tokens == [1, 2, 0, 3, 2] and cache.length == 5


def test_perturbed_keeps_the_order_and_takes_its_strength_and_seed():
    lm = ToyLM(3, order=2, seed=5)
    draft = lm.perturbed()
    assert draft.order == 2 and draft.table.shape == lm.table.shape
    assert draft._row([0, 1]) != draft._row([1])  # two tokens of context, as the target's
    assert torch.equal(lm.perturbed(0.0).table, lm.table)
    gap = lambda d: (d.table - lm.table).abs().mean()  # noqa: E731
    assert gap(lm.perturbed(1.4)) > 1.5 * gap(lm.perturbed(0.7))
    assert not torch.equal(lm.perturbed(seed=2).table, lm.perturbed(seed=1).table)
    assert torch.equal(lm.perturbed(seed=2).table, lm.perturbed(seed=2).table)


def test_scale_sets_the_spread_of_the_logits():
    assert torch.allclose(ToyLM(4, seed=1, scale=3.0).table, 2 * ToyLM(4, seed=1, scale=1.5).table)


def test_features_of_a_plain_pass_are_those_of_its_own_positions():
    """forward_features without parents: one feature row per token of this pass, a function of the
    context (the same state gives the same features, whatever came before the call)."""
    lm = ToyLM(4, order=1, seed=3)
    cache = lm.new_cache()
    lm.forward_features(torch.tensor([1, 2]), cache, (0,))
    _, feats = lm.forward_features(torch.tensor([3, 0, 1]), cache, (0,))
    assert feats.shape == (3, 2, lm.hidden_size)
    _, alone = lm.forward_features(torch.tensor([3, 0, 1]), lm.new_cache(), (0,))
    assert torch.equal(feats, alone)  # order 1: the same last tokens, the same states
    assert torch.equal(feats[2], alone[2]) and not torch.equal(feats[0], feats[1])
