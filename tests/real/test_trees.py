"""Token trees on the real SmolLM2-135M weights: tree attention is bitwise sequential decoding."""

from __future__ import annotations

import torch

from specdec.text import encode_prompt
from specdec.tree import paths

PROMPT = "Explain what a hash table is in two sentences."
#: pending token + 9 nodes: three root candidates, branches of depth up to 4
PARENTS = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 7, 5])


def _tree_tokens(ids: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 49152, (PARENTS.numel(),), generator=gen)


def test_tree_scoring_is_bitwise_sequential(smollm2):
    target, _ = smollm2
    m = target.model
    ids = torch.tensor(encode_prompt(target.tokenizer, PROMPT, chat=True))
    toks = _tree_tokens(ids.tolist())
    toks[0] = ids[-1]
    cache = m.new_cache(256)
    m.forward(ids[:-1], cache)
    start = cache.length
    tree = m.forward_tree(toks, PARENTS, cache)  # [n, V]
    assert cache.length == start + toks.numel()
    ref = m.new_cache(256)
    m.forward(ids[:-1], ref)
    for j, p in enumerate(paths(PARENTS)):
        ref.truncate(start)
        seq = torch.cat([m.forward(toks[i : i + 1], ref) for i in p])  # path token by token
        assert torch.equal(tree[j], seq[-1]), f"node {j}"
    # keep one path: the cache then continues exactly like sequential decoding of that path
    keep = torch.tensor(paths(PARENTS)[8]) + start
    cache.compact(keep, start)
    nxt = torch.tensor([5])
    ref.truncate(start)
    m.forward(toks[keep - start], ref)
    assert torch.equal(m.forward(nxt, cache), m.forward(nxt, ref))


def test_fast_tree_attention_matches_within_float_tolerance(smollm2):
    """Without batch invariance (one masked attention call) the logits agree to float error."""
    target, _ = smollm2
    m = target.model
    ids = torch.tensor(encode_prompt(target.tokenizer, PROMPT, chat=True))
    toks = _tree_tokens(ids.tolist())
    toks[0] = ids[-1]
    m.batch_invariant = False
    try:
        cache = m.new_cache(256)
        m.forward(ids[:-1], cache)
        fast = m.forward_tree(toks, PARENTS, cache)
    finally:
        m.batch_invariant = True
    cache = m.new_cache(256)
    m.forward(ids[:-1], cache)
    exact = m.forward_tree(toks, PARENTS, cache)
    assert torch.allclose(fast, exact, atol=1e-3, rtol=1e-4)
