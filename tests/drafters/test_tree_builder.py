"""The tree builder's early stop: the same pruned tree with fewer draft passes."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.base import DraftSampler
from specdec.drafters.tree_builder import TreeSpec, build_tree
from specdec.sampling import SamplingConfig

V = 40


def _expander(sharpness: float, calls: list[int]):
    """Draft logits that are a fixed function of each node's root path (seeded by it)."""

    def logits_for(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(path) % (2**31))
        return torch.randn(V, generator=g) * sharpness  # [V]

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
def test_early_stop_gives_the_same_dynamic_tree_with_fewer_passes(budget, sharpness):
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    spec = TreeSpec(shape="dynamic", width=3, depth=6)
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
    if sharpness < 1 and budget <= 16:
        assert stopped > 0  # flat drafts: deeper levels cannot enter the best N, passes are saved
