import torch

from specdec.drafters import ModelDrafter
from specdec.drafters.base import DraftSampler
from specdec.models.toy import ToyLM
from specdec.sampling import PenaltyState, SamplingConfig, process_logits
from specdec.verify import Verdict


def test_reports_the_distribution_it_sampled_from_and_rolls_back():
    model = ToyLM(5, order=2, seed=3)
    d = ModelDrafter(model)
    ctx = torch.tensor([1, 2, 3])
    d.prepare(ctx)
    cfg = SamplingConfig(temperature=0.9, repetition_penalty=1.3)
    state = PenaltyState.start(ctx, 5)
    sampler = DraftSampler(cfg, "multinomial", penalties=state, generator=torch.Generator().manual_seed(0))
    draft = d.propose(ctx, 4, sampler)
    assert draft.tokens.shape == (4,) and draft.probs.shape == (4, 5)
    hist = ctx.tolist()
    ref_state = PenaltyState.start(ctx, 5)
    for i, tok in enumerate(draft.tokens.tolist()):
        q = process_logits(model.logits_for(hist).unsqueeze(0), cfg, ref_state)[0]
        assert torch.allclose(draft.probs[i], q)
        hist.append(tok)
        ref_state.append(torch.tensor([tok]))
    assert d.cache.length == 3 + 3  # the last draft token is sampled, never fed
    d.commit(Verdict(1, torch.tensor([int(draft.tokens[0]), 4])))
    assert d.cache.length == 4
    assert d.cache.tokens == ctx.tolist() + [int(draft.tokens[0])]
    # the original penalty state was not touched by drafting
    assert int(state.counts.sum()) == 0


def test_gumbel_mode_reports_no_probs():
    model = ToyLM(5, seed=1)
    d = ModelDrafter(model)
    ctx = torch.tensor([0])
    d.prepare(ctx)
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "gumbel", penalties=None, generator=None, noise_seed=3)
    draft = d.propose(ctx, 3, sampler)
    assert draft.probs is None and draft.tokens.numel() == 3


# ----------------------------------------------------------------------------- a reduced draft vocabulary


import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from specdec.decoder import SpeculativeDecoder  # noqa: E402
from specdec.gamma import FixedGamma  # noqa: E402
from specdec.models.native import NativeCausalLM  # noqa: E402
from specdec.verify import get_rule  # noqa: E402


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama as the target and the same weights as a draft over 2,000 of its
    49,152 tokens (the target's own greedy choices are mostly among them: it is its own draft)."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path_factory.mktemp("subset") / "m", seed=4)
    target = NativeCausalLM.from_folder(folder, batch_invariant=True)
    prompt = [1, 504, 3300, 288, 3400]
    cache = target.new_cache(64)
    greedy = SpeculativeDecoder(target, None, get_rule("greedy")).generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=24)).tokens
    ids = torch.tensor(sorted(set(greedy) | set(range(2000))))
    draft = NativeCausalLM.from_folder(folder, vocab_subset=ids)
    del cache
    return folder, target, draft, ids, prompt, greedy


def test_a_reduced_vocabulary_draft_scores_its_tokens_only(tiny_pair):
    _, target, draft, ids, prompt, _ = tiny_pair
    full = target.forward(torch.tensor(prompt), target.new_cache(64))  # [n, V]
    sub = draft.forward(torch.tensor(prompt), draft.new_cache(64))
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(sub[:, outside]).all()) and bool(torch.isfinite(sub[:, ids]).all())
    assert torch.allclose(sub[:, ids], full[:, ids], atol=1e-5, rtol=1e-5)


class _Strict:
    """A constraint allowing the given tokens only, which fails if a token it forbids is ever fed
    to it (as a grammar matcher does: a draft must never propose such a token)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def allowed(self, generated, vocab_size):
        bad = [t for t in generated if t not in self.tokens]
        assert not bad, f"the constraint was fed forbidden tokens {bad}"
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.tokens] = True
        return mask


def test_a_reduced_vocabulary_draft_keeps_greedy_output_exact(tiny_pair):
    _, target, draft, _, prompt, greedy = tiny_pair
    out = SpeculativeDecoder(target, ModelDrafter(draft), get_rule("greedy"), gamma=FixedGamma(3)).generate(
        prompt, SamplingConfig(temperature=0.0, max_new_tokens=24))
    assert out.tokens == greedy and out.stats.draft_tokens_accepted > 0


def _forced_full(monkeypatch):
    """Make every sampler scatter reduced-vocabulary rows into the whole vocabulary."""
    monkeypatch.setattr(DraftSampler, "compact", property(lambda self: False))


@pytest.mark.parametrize("tree", [False, True])
def test_compact_draft_rows_propose_what_scattered_rows_propose(tiny_pair, monkeypatch, tree):
    """Greedy drafting over a reduced vocabulary reads the LM head's rows as they are (no scatter
    into 49,152 columns): the same chain / tree as the scattered rows, and the draft model was
    really asked for compact rows."""
    from specdec.drafters.tree_builder import TreeSpec

    _, _, draft, ids, prompt, _ = tiny_pair
    asked: list[bool] = []
    for name in ("forward", "forward_tree"):
        orig = getattr(NativeCausalLM, name)

        def spy(self, *a, _orig=orig, **kw):
            asked.append(kw.get("compact", False))
            return _orig(self, *a, **kw)

        monkeypatch.setattr(NativeCausalLM, name, spy)

    def propose() -> tuple[list[int], list[int] | None]:
        d = ModelDrafter(draft)
        ctx = torch.tensor(prompt)
        d.prepare(ctx)
        sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
        out = d.propose_tree(ctx, 8, sampler, TreeSpec(min_prob=0.0), max_depth=4) if tree else d.propose(ctx, 5, sampler)
        return out.tokens.tolist(), None if out.parents is None else out.parents.tolist()

    compact = propose()
    assert asked and all(asked[1:])  # the prefill of prepare() is the only full-row call
    asked.clear()
    with monkeypatch.context() as m:
        _forced_full(m)
        scattered = propose()
    assert not any(asked)
    assert compact == scattered and len(compact[0]) >= 5
    assert set(compact[0]) <= set(ids.tolist())


def test_compact_rows_only_where_no_other_token_counts():
    """Sampling, penalties, a logit bias and a constraint all read (or change) logits outside the
    draft's vocabulary: those rounds keep whole rows, and a compact row is refused there."""
    def sampler(**kw):
        mode = "multinomial" if kw.get("temperature", 0.0) > 0 else "argmax"
        return DraftSampler(SamplingConfig(**kw), mode, penalties=PenaltyState.start(torch.tensor([1]), 8),
                            generator=torch.Generator().manual_seed(0))

    assert sampler(temperature=0.0).compact
    for kw in ({"temperature": 1.0}, {"temperature": 0.0, "repetition_penalty": 1.2},
               {"temperature": 0.0, "logit_bias": ((3, 5.0),)}, {"temperature": 0.0, "constraint": _Strict([1, 2])}):
        s = sampler(**kw)
        assert not s.compact, kw
        with pytest.raises(ValueError, match="compact"):
            s(torch.zeros(1, 4), 0, torch.tensor([0, 2, 5, 7]))
    s = sampler(temperature=0.0)
    assert s(torch.tensor([[0.0, 3.0, 1.0, 3.0]]), 0, torch.tensor([0, 2, 5, 7]))[0] == 2  # first maximum, as argmax


@pytest.mark.parametrize("method,temperature,seed", [("greedy", 0.0, None), ("token", 1.0, None), ("block", 1.0, None),
                                                      ("coupled", 1.0, 4)])
def test_a_constraint_outside_a_reduced_vocabulary_stops_the_draft(tiny_pair, method, temperature, seed):
    """A constraint allowing only tokens outside the draft's vocabulary leaves nothing the draft
    may propose (every score -inf): the draft stops — in every sampling mode, argmax and Gumbel
    included — instead of handing NaN to the rule or a forbidden token to the constraint (a real
    grammar rejects it; found by the OpenAI server's structured-output test)."""
    _, target, draft, ids, prompt, _ = tiny_pair
    allowed = [40000, 40001, 40002]  # none of them in the draft's vocabulary
    assert not set(allowed) & set(ids.tolist())
    cfg = SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=8, constraint=_Strict(allowed))
    out = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(3)).generate(prompt, cfg)
    assert len(out.tokens) == 8 and set(out.tokens) <= set(allowed)
    assert out.stats.draft_tokens_proposed == 0


def test_the_engine_reads_a_draft_folder_s_vocabulary(tiny_pair, tmp_path: Path):
    from specdec.engine import EngineConfig, draft_vocabulary
    from specdec.errors import ConfigError

    folder, *_ = tiny_pair
    assert draft_vocabulary(EngineConfig(), str(folder)) is None  # no file: the whole vocabulary
    (folder / "draft_vocab.json").write_text(json.dumps({"ids": [0, 2, 7]}))
    try:
        assert draft_vocabulary(EngineConfig(), str(folder)).tolist() == [0, 2, 7]
        assert draft_vocabulary(EngineConfig(draft_vocab="full"), str(folder)) is None
        with pytest.raises(ConfigError, match="auto or full"):
            draft_vocabulary(EngineConfig(draft_vocab="half"), str(folder))
        (folder / "draft_vocab.json").write_text(json.dumps({"ids": [7, 2]}))
        with pytest.raises(ConfigError, match="sorted"):
            draft_vocabulary(EngineConfig(), str(folder))
        with pytest.raises(ConfigError, match="must lie in"):
            NativeCausalLM.from_folder(folder, vocab_subset=torch.tensor([3, 49152]))
        (folder / "draft_vocab.json").write_text("{")
        with pytest.raises(ConfigError, match="not a draft vocabulary"):
            draft_vocabulary(EngineConfig(), str(folder))
    finally:
        (folder / "draft_vocab.json").unlink()
