"""The experimental llama.cpp backend on the real SmolLM2-135M Q4_1 GGUF, as shipped.

Skipped where llama-cpp-python (the ``llamacpp`` extra) is not installed.  What must hold is the
same as for the native backend, relative to the model as llama.cpp runs it: block scoring is
bitwise batch-invariant, so greedy speculative decoding equals plain greedy decoding and coupled
speculative sampling equals plain coupled sampling, token for token.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from specdec.decoder import SpeculativeDecoder  # noqa: E402
from specdec.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from specdec.gamma import CostGamma, FixedGamma  # noqa: E402
from specdec.models.llamacpp import LlamaCppConfig, LlamaCppLM  # noqa: E402
from specdec.models.registry import gguf_file, load  # noqa: E402
from specdec.sampling import GUIDE_PRESET, SamplingConfig  # noqa: E402
from specdec.text import encode_prompt  # noqa: E402
from specdec.verify import get_rule  # noqa: E402

PROMPTS = [
    ("def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items.\"\"\"\n", False),
    ("Explain what a hash table is in two sentences.", True),
]


@pytest.fixture(scope="module")
def setup():
    target = LlamaCppLM(gguf_file("smollm2-135m"), LlamaCppConfig(n_ctx=1024, n_threads=1))  # one thread: a second worker shares the two cores, and llama.cpp's threads spin
    draft = load("smollm2-135m-draft")  # the native draft (its precision never affects exactness)
    ids = [encode_prompt(draft.tokenizer, p, chat=c) for p, c in PROMPTS]
    return target, draft, ids


def _score(model, prefix, block, split):
    cache = model.new_cache()
    model.forward(torch.tensor(prefix), cache, last_only=True)
    if split:
        return torch.cat([model.forward(torch.tensor([t]), cache) for t in block])
    return model.forward(torch.tensor(block), cache)


@pytest.mark.parametrize("k", [2, 5, 9, 13])
def test_block_scoring_is_batch_invariant(setup, k):
    target, _, ids = setup
    for prompt in ids:
        prefix, block = prompt[:-k], prompt[-k:]
        together = _score(target, prefix, block, split=False)
        assert together.shape == (k, target.vocab_size)
        assert torch.equal(together, _score(target, prefix, block, split=True))


def test_prefill_in_one_batch_equals_token_by_token(setup):
    """The cache a long prompt leaves behind does not depend on how it was batched."""
    target, _, ids = setup
    prompt = ids[1]
    a = target.new_cache()
    target.forward(torch.tensor(prompt[:-1]), a, last_only=True)
    last_a = target.forward(torch.tensor(prompt[-1:]), a)
    b = target.new_cache()
    for t in prompt[:-1]:
        target.forward(torch.tensor([t]), b)
    assert torch.equal(last_a, target.forward(torch.tensor(prompt[-1:]), b))


def test_truncation_rolls_the_cache_back(setup):
    target, _, ids = setup
    prompt = ids[0]
    cache = target.new_cache()
    target.forward(torch.tensor(prompt[:-3]), cache)
    first = target.forward(torch.tensor(prompt[-3:]), cache)
    target.forward(torch.tensor([5, 6, 7]), cache)  # a rejected draft
    cache.truncate(len(prompt) - 3)
    assert cache.length == len(prompt) - 3
    assert torch.equal(target.forward(torch.tensor(prompt[-3:]), cache), first)
    with pytest.raises(ValueError):
        cache.truncate(cache.length + 1)


def test_a_new_cache_supersedes_the_old_one(setup):
    from specdec.errors import SpecdecError

    target, _, ids = setup
    old = target.new_cache()
    target.new_cache()
    with pytest.raises(SpecdecError):
        target.forward(torch.tensor(ids[0][:2]), old)


def _long_ids(ids, n):  # [n] token ids: the prompts repeated
    out = (ids[0] + ids[1]) * (n // (len(ids[0]) + len(ids[1])) + 1)
    return out[:n]


@pytest.mark.parametrize("prefix", [300, 700])
def test_one_thread_scores_blocks_invariantly_past_256_positions(setup, prefix):
    target, _, ids = setup  # one thread (the fixture)
    seq = _long_ids(ids, prefix + 9)
    together = _score(target, seq[:prefix], seq[prefix:], split=False)
    assert torch.equal(together, _score(target, seq[:prefix], seq[prefix:], split=True))


def test_two_threads_cap_the_context_where_block_scoring_stops_being_invariant(setup):
    from specdec.errors import SpecdecError
    from specdec.models.llamacpp import INVARIANT_POSITIONS

    _, _, ids = setup
    two = LlamaCppLM(gguf_file("smollm2-135m"), LlamaCppConfig(n_ctx=1024, n_threads=2))
    assert two.max_length == INVARIANT_POSITIONS == 256
    seq = _long_ids(ids, INVARIANT_POSITIONS + 1)
    # up to the cap a block's logits are the token-by-token ones ...
    together = _score(two, seq[:251], seq[251:256], split=False)
    assert torch.equal(together, _score(two, seq[:251], seq[251:256], split=True))
    # ... one position more is refused, saying why
    cache = two.new_cache()
    two.forward(torch.tensor(seq[:256]), cache, last_only=True)
    with pytest.raises(SpecdecError, match="not be exact.*n_threads=1"):
        two.forward(torch.tensor(seq[256:]), cache)


def _generate(target, drafter, method, cfg, prompt, gamma=None, eos=frozenset()):
    dec = SpeculativeDecoder(target, drafter, get_rule(method), gamma=gamma or FixedGamma(4), eos_ids=eos)
    return dec.generate(prompt, cfg)


@pytest.mark.parametrize("gamma", ["4", "auto"])
def test_greedy_speculative_equals_plain_greedy(setup, gamma):
    target, draft, ids = setup
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=96)
    for prompt in ids:
        plain = _generate(target, None, "greedy", cfg, prompt, eos=draft.eos_ids).tokens
        ctrl = CostGamma() if gamma == "auto" else FixedGamma(int(gamma))
        spec = _generate(target, ModelDrafter(draft.model), "greedy", cfg, prompt, ctrl, eos=draft.eos_ids)
        assert spec.tokens == plain
        if gamma != "auto":  # γ auto follows measured timings (a busy machine drafts less): no figure to hold it to
            assert spec.stats.tokens_per_target_call > 1.2  # the draft really helps
        assert _generate(target, NgramDrafter(), "greedy", cfg, prompt, eos=draft.eos_ids).tokens == plain


def test_coupled_equals_plain_seeded_sampling(setup):
    target, draft, ids = setup
    for seed in range(2):
        cfg = SamplingConfig(**{**GUIDE_PRESET.__dict__, "seed": seed, "max_new_tokens": 64})
        for prompt in ids:
            plain = _generate(target, None, "coupled", cfg, prompt).tokens
            assert _generate(target, ModelDrafter(draft.model), "coupled", cfg, prompt, FixedGamma(5)).tokens == plain
