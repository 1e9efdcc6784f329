"""Tree verification rules: hand-made cases, closed-form laws in float64, seeded χ² tests."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import ConfigError
from specdec.verify_tree import TREE_RULES, get_tree_rule, tree_greedy


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_tree_greedy_hand_made():
    # root -> {0: tok 1, 1: tok 2}; 0 -> {2: tok 0}; 1 -> {3: tok 2}
    tokens, parents = _t([1, 2, 0, 2]), _t([-1, -1, 0, 1])
    logits = torch.tensor([[0.0, 1, 5], [0, 0, 1], [9, 0, 0], [0, 3, 0], [1, 0, 0]])
    v = tree_greedy(tokens, parents, None, logits)  # arg-max 2 -> node 1; then arg-max 0, no child
    assert v.path == (1,) and v.tokens.tolist() == [2, 0]
    logits[2] = torch.tensor([0.0, 0, 9])  # now node 3 (tok 2) matches; its row says 0
    v = tree_greedy(tokens, parents, None, logits)
    assert v.path == (1, 3) and v.tokens.tolist() == [2, 2, 0]
    logits[0] = torch.tensor([0.0, 5, 1])  # root arg-max 1 -> node 0; row 1 arg-max 2, node 2 is 0
    v = tree_greedy(tokens, parents, None, logits)
    assert v.path == (0,) and v.tokens.tolist() == [1, 2]
    logits[0] = torch.tensor([5.0, 0, 1])  # no root child matches
    v = tree_greedy(tokens, parents, None, logits)
    assert v.path == () and v.tokens.tolist() == [0]


def test_tree_greedy_empty_tree_and_duplicates():
    v = tree_greedy(_t([]), _t([]), None, torch.tensor([[0.0, 2.0, 1.0]]))
    assert v.path == () and v.tokens.tolist() == [1]
    # two root children carry the same token: the first one is followed
    logits = torch.tensor([[0.0, 9.0], [0.0, 9.0], [9.0, 0.0], [0.0, 9.0]])
    v = tree_greedy(_t([1, 1, 0]), _t([-1, -1, 1]), None, logits)
    assert v.path == (0,) and v.tokens.tolist() == [1, 1]


def test_tree_rule_registry():
    for chain, tree in {"greedy": "tree_greedy", "token": "tree_token", "coupled": "tree_coupled"}.items():
        assert get_tree_rule(chain).name == tree
        assert get_tree_rule(tree.replace("_", "-")).name == tree
    assert all(rule.lossless for rule in TREE_RULES.values())
    with pytest.raises(ConfigError, match="no tree verification rule"):
        get_tree_rule("lossy_resample_p")
