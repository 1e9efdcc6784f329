"""Self-speculative drafters on the real SmolLM2-135M weights (float32, native, batch-invariant).

Each drafter is a view of the target (no second model): greedy speculative output must equal plain
greedy output token for token, and early exit's cache sharing must give verification logits
bitwise equal to the plain verification pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import self_spec
from specdec.drafters.base import DraftSampler
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.sampling import SamplingConfig
from specdec.session import TargetSession
from specdec.text import encode_prompt
from specdec.verify import get_rule

PROMPTS = [
    ("def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items.\"\"\"\n", False),
    ("Explain what a hash table is in two sentences.", True),
]


@pytest.fixture(scope="module")
def target_ids(smollm2):
    target, _ = smollm2
    return target, [encode_prompt(target.tokenizer, p, chat=c) for p, c in PROMPTS]


@pytest.mark.parametrize("vocab", ["full", "reduced"])
@pytest.mark.parametrize("name", ["layerskip:24", "self-skip:FILE", "self-skip", "swift", "kangaroo"])
def test_greedy_self_speculative_equals_plain_greedy(target_ids, name, vocab, tmp_path):
    """Every family, over every token and over the draft's reduced vocabulary (the float32
    target's tied head cut to its 16,384 rows), gives plain greedy output."""
    target, ids = target_ids
    keep = None
    if vocab == "reduced":
        from specdec.engine import EngineConfig, view_vocabulary

        keep = view_vocabulary(EngineConfig(target="smollm2-135m"), "smollm2-135m")  # the default draft's
        assert keep is not None and keep.numel() == 16384 and target.model.reduced_head(keep) is not None
    if name == "self-skip:FILE":  # a hand-written skip set, whatever set ships
        path = tmp_path / "skip.json"
        path.write_text(json.dumps({"n_layers": 30, "skip_attn": list(range(18, 28)), "skip_mlp": [24, 26]}))
        name = f"self-skip:{path}"
    if name == "self-skip" and self_spec.shipped_plan(target.name) is None:  # none shipped yet: a clear error
        with pytest.raises(ConfigError, match="specdec train skip"):
            self_spec.build(name, target.model, target.name)
        return
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    for prompt in ids:
        plain = SpeculativeDecoder(target.model, None, get_rule("greedy")).generate(prompt, cfg).tokens
        drafter, _ = self_spec.build(name, target.model, target.name, vocab=keep)
        assert (drafter.view.vocab_ids is not None) == (keep is not None)
        # a fixed γ: the cost controller may (rightly) stop drafting with a weak view, and these
        # checks must not depend on the machine's timings
        out = SpeculativeDecoder(target.model, drafter, get_rule("greedy"), gamma=FixedGamma(4),
                                 eos_ids=target.eos_ids).generate(prompt, cfg)
        assert out.tokens == plain
        assert out.stats.draft_tokens_accepted > 0


def test_cache_sharing_is_bitwise_the_plain_verification_pass(target_ids):
    target, ids = target_ids
    m = target.model
    cfg = SamplingConfig(temperature=0.0)
    drafter, _ = self_spec.build("layerskip:20", m, target.name)
    shared = TargetSession(m, ids[0], cfg, get_rule("greedy"), seed=0)
    plain = TargetSession(m, ids[0], cfg, get_rule("greedy"), seed=0)
    drafter.prepare(torch.tensor(ids[0]))
    for _ in range(4):
        draft = drafter.propose(shared.context, 5, DraftSampler(cfg, "argmax", penalties=None, generator=None))
        feed = torch.cat([shared.context[-1:], draft.tokens])
        base = shared.cache.length
        with_sharing = draft.reuse.forward(m, feed, shared.cache)
        without = m.forward(feed, plain.cache)
        assert with_sharing is not None and torch.equal(with_sharing, without)
        end = base + feed.numel()
        assert torch.equal(shared.cache.k[:, :, :end], plain.cache.k[:, :, :end])
        assert torch.equal(shared.cache.v[:, :, :end], plain.cache.v[:, :, :end])
        verdict = get_rule("greedy").fn(draft.tokens, None, without)
        for s in (shared, plain):
            s.cache.truncate(base + 1 + verdict.num_accepted)
            s._ctx[s._n : s._n + verdict.tokens.numel()] = verdict.tokens
            s._n += verdict.tokens.numel()
        drafter.commit(verdict)


def test_block_verification_with_early_exit_runs(target_ids):
    target, ids = target_ids
    cfg = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=32)
    drafter, _ = self_spec.build("layerskip:24", target.model, target.name)
    out = SpeculativeDecoder(target.model, drafter, get_rule("block"), gamma=FixedGamma(3)).generate(ids[1], cfg)
    assert len(out.tokens) == 32 and out.stats.draft_tokens_proposed > 0


def test_kangaroo_shares_the_shallow_layers_bitwise(target_ids):
    """The shipped adapter: its drafts' shallow keys/values and residuals give the plain verification pass."""
    target, ids = target_ids
    m = target.model
    cfg = SamplingConfig(temperature=0.0)
    drafter, _ = self_spec.build("kangaroo", m, target.name)
    shared = TargetSession(m, ids[1], cfg, get_rule("greedy"), seed=0)
    plain = TargetSession(m, ids[1], cfg, get_rule("greedy"), seed=0)
    drafter.prepare(torch.tensor(ids[1]))
    draft = drafter.propose(shared.context, 5, DraftSampler(cfg, "argmax", penalties=None, generator=None))
    feed = torch.cat([shared.context[-1:], draft.tokens])
    with_sharing = draft.reuse.forward(m, feed, shared.cache)
    assert with_sharing is not None and torch.equal(with_sharing, m.forward(feed, plain.cache))
    end = shared.cache.length
    assert torch.equal(shared.cache.k[:, :, :end], plain.cache.k[:, :, :end])
    assert torch.equal(shared.cache.v[:, :, :end], plain.cache.v[:, :, :end])


@pytest.mark.parametrize("name", ["layerskip:24", "self-skip"])
def test_the_4bit_targets_int8_head_cut_to_the_draft_vocabulary_keeps_greedy_output_exact(q4_target, name):
    """The q4 SmolLM2 target's LM head is int8 (W8A8): a view drafting over the default draft's
    16,384 tokens runs on those columns of it, bitwise the whole head's there, and greedy
    speculative output equals plain greedy output on both prompts."""
    from specdec.engine import EngineConfig, view_vocabulary
    from specdec.models.linear import W8A8Linear

    m = q4_target.model
    keep = view_vocabulary(EngineConfig(target="smollm2-135m"), "smollm2-135m")
    assert isinstance(m.lm_head, W8A8Linear) and keep is not None
    if m.lm_head.vnni is None:
        pytest.skip("no few-row int8 kernel here: the int8 head keeps every token")
    reduced = m.reduced_head(keep)
    assert reduced is not None and reduced.nbytes < 0.4 * m.lm_head.nbytes  # a third of the head's columns, and the ids
    x = torch.randn(3, m.embed.shape[1], generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(reduced.logits(x, compact=True), m.head(x)[:, keep])
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=32)
    for prompt, chat in PROMPTS:
        ids = encode_prompt(q4_target.tokenizer, prompt, chat=chat)
        plain = SpeculativeDecoder(m, None, get_rule("greedy")).generate(ids, cfg).tokens
        drafter, _ = self_spec.build(name, m, q4_target.name, vocab=keep)
        assert drafter.view.vocab_ids is not None
        out = SpeculativeDecoder(m, drafter, get_rule("greedy"), gamma=FixedGamma(3),
                                 eos_ids=q4_target.eos_ids).generate(ids, cfg)
        assert out.tokens == plain and out.stats.draft_tokens_accepted > 0
