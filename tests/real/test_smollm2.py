"""Exactness on the real SmolLM2-135M target with its distilled draft (float32, CPU, native path).

The target is loaded batch-invariant (the default): scoring a draft block is bitwise identical to
scoring its tokens one by one, so these equalities hold exactly, not just up to float ties.
"""

from __future__ import annotations

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.gamma import CostGamma, FixedGamma
from specdec.models.registry import load
from specdec.sampling import GUIDE_PRESET, SamplingConfig
from specdec.text import encode_prompt
from specdec.verify import get_rule
from clock import ModelledCostGamma

PROMPTS = [
    ("def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items.\"\"\"\n", False),
    ("Explain what a hash table is in two sentences.", True),
    ("import os\n\ndef list_python_files(root):\n", False),
]


@pytest.fixture(scope="module")
def pair(smollm2):
    target, draft = smollm2
    ids = [encode_prompt(target.tokenizer, p, chat=c) for p, c in PROMPTS]
    return target, draft, ids


def _generate(target, drafter, method, cfg, prompt, gamma=None):
    dec = SpeculativeDecoder(target.model, drafter, get_rule(method), gamma=gamma or FixedGamma(4), eos_ids=target.eos_ids)
    return dec.generate(prompt, cfg)


def test_native_matches_transformers_on_real_weights(pair):
    from transformers import AutoModelForCausalLM

    target, _, ids = pair
    hf = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
    x = torch.tensor(ids[0])
    with torch.no_grad():
        ref = hf(x.unsqueeze(0)).logits[0]
    out = target.model.forward(x, target.model.new_cache(256))
    assert torch.allclose(out, ref, atol=2e-3, rtol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_block_scoring_is_batch_invariant(pair):
    target, _, ids = pair
    m = target.model
    x = torch.tensor(ids[1])
    a = m.new_cache(256)
    m.forward(x[:-9], a)
    one_by_one = torch.cat([m.forward(x[i : i + 1], a) for i in range(len(x) - 9, len(x))])
    b = m.new_cache(256)
    m.forward(x[:-9], b)
    assert torch.equal(m.forward(x[-9:], b), one_by_one)


def test_greedy_speculative_equals_plain_greedy(pair):
    """γ 4 and γ auto against one plain run per prompt; γ auto on a modelled clock (a drafted
    token 0.12 of a pass, an extra row 0.06: about this pair on an idle 2-core CPU, 5.5 ms a
    drafted token, 45 ms a pass), so that the draft's help can be held to a figure."""
    target, draft, ids = pair
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=96)
    for prompt in ids:
        plain = _generate(target, None, "greedy", cfg, prompt).tokens
        for ctrl in (FixedGamma(4), ModelledCostGamma()):
            spec = _generate(target, ModelDrafter(draft.model), "greedy", cfg, prompt, ctrl)
            assert spec.tokens == plain, ctrl
            assert spec.stats.tokens_per_target_call > 1.2, ctrl  # the draft really helps
        assert _generate(target, NgramDrafter(), "greedy", cfg, prompt).tokens == plain


def test_int8_head_draft_keeps_greedy_exact(pair):
    """The draft's precision never changes the output: an int8-head draft gives plain greedy."""
    from specdec.models.linear import int8_available

    if not int8_available():
        pytest.skip("this torch build has no int8 CPU engine")
    target, _, ids = pair
    draft8 = load("smollm2-135m-draft", batch_invariant=False, int8_head=True)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=64)
    for prompt in ids[:2]:
        plain = _generate(target, None, "greedy", cfg, prompt).tokens
        spec = _generate(target, ModelDrafter(draft8.model), "greedy", cfg, prompt)
        assert spec.tokens == plain and spec.stats.tokens_per_target_call > 1.2


@pytest.mark.parametrize("method", ["token", "block", "coupled"])
def test_drafting_with_the_target_itself_accepts_everything(pair, method):
    target, _, ids = pair
    cfg = SamplingConfig(**{**GUIDE_PRESET.__dict__, "seed": 1, "max_new_tokens": 48})
    res = _generate(target, ModelDrafter(target.model), method, cfg, ids[1])
    assert res.stats.draft_tokens_proposed > 20
    assert res.stats.acceptance_rate == 1.0


def test_coupled_equals_plain_seeded_sampling(pair):
    target, draft, ids = pair
    for seed in range(2):
        cfg = SamplingConfig(**{**GUIDE_PRESET.__dict__, "seed": seed, "max_new_tokens": 64})
        for prompt in ids[:2]:
            plain = _generate(target, None, "coupled", cfg, prompt).tokens
            assert _generate(target, ModelDrafter(draft.model), "coupled", cfg, prompt, FixedGamma(5)).tokens == plain


@pytest.mark.parametrize("quant", ["float32", "int8", "q4"])
def test_a_prompt_scored_in_pieces_is_bitwise_one_pass(pair, quant, request, monkeypatch):
    """A long prompt's pass runs in pieces of ``PROMPT_PASS_CHUNK`` rows (1,024; 16 here, so this
    prompt takes several): every row's logits and the whole cache equal one pass's, bitwise."""
    from specdec import defaults

    target = pair[0] if quant == "float32" else request.getfixturevalue(f"{quant}_target")
    m = target.model
    x = torch.tensor(pair[2][0] + pair[2][1] + pair[2][2])
    one = m.new_cache(256)
    whole = m.forward(x, one)
    monkeypatch.setattr(defaults, "PROMPT_PASS_CHUNK", 16)
    seen: list[int] = []
    hidden = m.hidden
    monkeypatch.setattr(m, "hidden", lambda tokens, cache, **kw: seen.append(tokens.numel()) or hidden(tokens, cache, **kw))
    cache = m.new_cache(256)
    assert torch.equal(m.forward(x, cache), whole)
    n = x.numel()
    assert n > 3 * 16 and seen[1:] == [16] * (n // 16) + [n % 16] * (n % 16 > 0)
    assert cache.length == n
    assert all(torch.equal(cache.k[i][:, :n], one.k[i][:, :n]) and torch.equal(cache.v[i][:, :n], one.v[i][:, :n])
               for i in range(m.cfg.n_layers))


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_quantized_target_exactness(pair, quant, request):
    """A quantised target is a model of its own; speculation must reproduce *it* exactly:
    block scoring is bitwise token-by-token scoring, greedy speculative == plain greedy,
    coupled == plain seeded sampling, with the same int8 / 4-bit target."""
    _, draft, ids = pair
    int8_target = request.getfixturevalue(f"{quant}_target")
    m = int8_target.model
    x = torch.tensor(ids[1])
    a, b = m.new_cache(256), m.new_cache(256)
    m.forward(x[:-9], a)
    m.forward(x[:-9], b)
    assert torch.equal(m.forward(x[-9:], b), torch.cat([m.forward(x[i : i + 1], a) for i in range(len(x) - 9, len(x))]))
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=96)
    for prompt in ids:
        plain = _generate(int8_target, None, "greedy", greedy, prompt).tokens
        spec = _generate(int8_target, ModelDrafter(draft.model), "greedy", greedy, prompt, FixedGamma(4))
        assert spec.tokens == plain and spec.stats.tokens_per_target_call > 1.2
        assert _generate(int8_target, ModelDrafter(draft.model), "greedy", greedy, prompt, CostGamma()).tokens == plain
    cfg = SamplingConfig(**{**GUIDE_PRESET.__dict__, "seed": 3, "max_new_tokens": 64})
    for prompt in ids[:2]:
        plain = _generate(int8_target, None, "coupled", cfg, prompt).tokens
        assert _generate(int8_target, ModelDrafter(draft.model), "coupled", cfg, prompt, FixedGamma(5)).tokens == plain
