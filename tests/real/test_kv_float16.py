"""``--kv-dtype float16`` on the real SmolLM2-135M target (its GGUF's 4-bit blocks, batch-invariant).

A float16 cache makes a slightly different target (its keys and values rounded); every exactness
property must hold relative to it: a block scored in one pass is bitwise its rows one by one, and
greedy speculative decoding with every drafter family — the draft model, prompt lookup, trees,
Lookahead, and the self-speculative views that share the target's cache (early exit, skip sets,
SWIFT, Kangaroo), whose shared keys and values must be the rounded ones too — equals plain greedy
decoding over the same cache dtype; coupled sampling equals plain seeded sampling.
"""

from __future__ import annotations

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter, self_spec
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import CostGamma, FixedGamma
from specdec.sampling import GUIDE_PRESET, SamplingConfig
from specdec.text import encode_prompt
from specdec.verify import get_rule

PROMPTS = [
    ("def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items.\"\"\"\n", False),
    ("Write a short story about a robot who learns to paint.", True),
]


@pytest.fixture
def half_target(q4_target):
    """The shared 4-bit target with float16 caches for the test, its own dtype again after it."""
    q4_target.model.set_kv_dtype(torch.float16)
    try:
        yield q4_target
    finally:
        q4_target.model.set_kv_dtype(None)


def _run(target, drafter, method, cfg, prompt, gamma=None, tree=None):
    dec = SpeculativeDecoder(target.model, drafter, get_rule(method), gamma=gamma or FixedGamma(4), tree=tree,
                             eos_ids=target.eos_ids)
    return dec.generate(prompt, cfg)


def test_a_float16_cache_target_scores_a_block_bitwise_and_is_a_different_target(half_target):
    m = half_target.model
    ids = torch.tensor(encode_prompt(half_target.tokenizer, PROMPTS[1][0], chat=True))
    a, b = m.new_cache(256), m.new_cache(256)
    assert a.k.dtype == torch.float16
    m.forward(ids[:-9], a)
    m.forward(ids[:-9], b)
    block = m.forward(ids[-9:], b)
    assert torch.equal(block, torch.cat([m.forward(ids[i : i + 1], a) for i in range(len(ids) - 9, len(ids))]))
    m.set_kv_dtype(None)  # the float32-cache target's
    try:
        ref = m.forward(ids, m.new_cache(256))[-9:]
    finally:
        m.set_kv_dtype(torch.float16)
    assert not torch.equal(block, ref)
    assert (block.softmax(-1) - ref.softmax(-1)).abs().max() < 0.1  # close: 0.05 measured


@pytest.mark.parametrize("name", ["draft", "draft-cost-gamma", "draft-tree", "ngram-tree", "lookahead", "layerskip:24",
                                  "self-skip", "swift", "kangaroo"])
def test_greedy_speculative_over_a_float16_cache_equals_plain_greedy(half_target, smollm2, name):
    _, draft = smollm2
    target = half_target
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=48)
    for text, chat in PROMPTS:
        prompt = encode_prompt(target.tokenizer, text, chat=chat)
        plain = _run(target, None, "greedy", cfg, prompt).tokens
        gamma, tree = None, None
        if name.startswith("draft"):
            drafter = ModelDrafter(draft.model)
            gamma = CostGamma() if name == "draft-cost-gamma" else FixedGamma(8 if name == "draft-tree" else 4)
            tree = TreeSpec(min_prob=0.0) if name == "draft-tree" else None
        elif name == "ngram-tree":
            drafter, gamma, tree = NgramDrafter(), FixedGamma(12), TreeSpec()
        elif name == "lookahead":
            drafter, gamma, tree = LookaheadDrafter(), FixedGamma(8), TreeSpec()
        else:
            if name == "self-skip" and self_spec.shipped_plan(target.name) is None:
                pytest.skip("no skip set ships for this target")
            drafter, _ = self_spec.build(name, target.model, target.name)
        spec = _run(target, drafter, "greedy", cfg, prompt, gamma, tree)
        assert spec.tokens == plain, (name, text[:20])
        if name in ("draft", "draft-tree", "layerskip:24"):
            assert spec.stats.tokens_per_target_call > 1.2, name  # it did speculate


def test_coupled_over_a_float16_cache_equals_plain_seeded_sampling(half_target, smollm2):
    _, draft = smollm2
    cfg = SamplingConfig(**{**GUIDE_PRESET.__dict__, "seed": 3, "max_new_tokens": 48})
    for text, chat in PROMPTS:
        prompt = encode_prompt(half_target.tokenizer, text, chat=chat)
        plain = _run(half_target, None, "coupled", cfg, prompt).tokens
        assert _run(half_target, ModelDrafter(draft.model), "coupled", cfg, prompt, FixedGamma(5)).tokens == plain


def test_a_server_over_float16_caches_is_bitwise_each_sequence_alone(half_target):
    """The server's way: three chat prompts sharing a system message, each in its own thread,
    through the batching scheduler (chunked prefills of 16 rows) and the prefix cache, twice (the
    second wave restores the first's float16 rows): every logit bitwise what the target computes
    for the sequence alone; /health names the cache."""
    import threading

    from specdec.server.app import precision
    from specdec.server.prefix_cache import PrefixCache
    from specdec.server.scheduler import BatchedModel, Scheduler, SchedulerConfig

    model, tok = half_target.model, half_target.tokenizer
    system = "You are a careful assistant. Answer briefly and exactly."
    prompts = [torch.tensor(encode_prompt(tok, q, chat=True, system=system))
               for q in ("What is a hash table?", "Explain recursion to a child.", "Name three sorting algorithms.")]
    steps = [torch.tensor([tok.encode(" The")[0]]), torch.tensor(tok.encode(" answer is")[:2])]
    solo = []
    for p in prompts:
        c = model.new_cache(256)
        solo.append([model.forward(p, c, last_only=True)] + [model.forward(s, c) for s in steps])
    served = BatchedModel(model, Scheduler(model, SchedulerConfig(max_tokens=64, chunk=16)), prefix_cache=PrefixCache(64 << 20))
    got: list = [None] * 6
    restored = [0] * 6

    def run(i: int) -> None:
        c = served.new_cache(256)
        got[i] = [served.forward(prompts[i % 3], c, last_only=True)] + [served.forward(s, c) for s in steps]
        restored[i] = c.restored

    for wave in (range(3), range(3, 6)):
        threads = [threading.Thread(target=run, args=(i,)) for i in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, out in enumerate(got):
        assert out is not None and all(torch.equal(a, b) for a, b in zip(out, solo[i % 3])), i
    assert all(r > 0 for r in restored[3:]), restored  # the second wave's prefills came from the cache
    assert precision(model).endswith(", float16 cache")
