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
    last_only keeps one row of logits and of features alike."""
    lm = ToyLM(4, order=1, seed=3)
    cache = lm.new_cache()
    logits, feats = lm.forward_features(torch.tensor([1, 2, 3]), cache, (0, 1), last_only=True)
    assert logits.shape == (1, 4) and feats.shape[1:] == (3, lm.hidden_size)
    tree_logits, tree_feats = lm.forward_features(torch.tensor([0, 1]), cache, (0,), parents=torch.tensor([-1, -1]))
    assert tree_logits.shape == (2, 4) and tree_feats.shape == (2, 2, lm.hidden_size)
    # both tree nodes hang off the prefix: after token 0 and after token 1
    assert torch.equal(tree_logits, torch.stack([lm.logits_for([1, 2, 3, 0]), lm.logits_for([1, 2, 3, 1])]))
    assert not torch.equal(tree_feats[0], tree_feats[1])
