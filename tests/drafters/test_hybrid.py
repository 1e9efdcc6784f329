"""Prompt lookup first, the draft model otherwise (``DRAFT+lookup``): structure and exactness.

The law tests draw N = 2,000 independent generations (seed = sample index) of 3 new tokens from a
5-token, 3-layer random Llama (125 possible outputs), drafted by the hybrid over a second random
Llama (lookup rounds wherever a 2-token suffix repeats, model rounds otherwise; both occur, and
the test checks that they do), verified by the token-level and the block rule, and run a
chi-square goodness-of-fit test against the exact law (enumerated); they fail at p < 1e-4.  The
negative control runs the same test with a plausible slip — lookup drafts reported with a
uniform q instead of as the point masses they are — and must fail.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from specdec import defaults
from specdec.decoder import SpeculativeDecoder
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.hybrid import LookupThenModel, split_lookup
from specdec.drafters.model import ModelDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import CostGamma, FixedGamma
from specdec.sampling import SamplingConfig
from specdec.verify import Verdict, get_rule
from stats import ALPHA, chi_square_pvalue, exact_law

from tiny import NativeOracle as Oracle, tiny_vocab_llama

N_SAMPLES = 2_000
N_NEW = 3
PROMPT = [1, 3, 0, 2, 4, 1, 3]  # ends with "1 3", seen before: the first round is a lookup round
TARGET = tiny_vocab_llama(layers=3, batch_invariant=False)
INVARIANT = tiny_vocab_llama(layers=3)
DRAFT = tiny_vocab_llama(layers=2, seed=7, batch_invariant=False)


def _sampler(T: float = 0.0, room: int | None = None) -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=T), "argmax" if T == 0 else "multinomial", penalties=None,
                        generator=torch.Generator().manual_seed(0), room=room)


def _hybrid(**kw) -> LookupThenModel:
    return LookupThenModel(ModelDrafter(DRAFT), **{"min_ngram": 2, "max_ngram": 4, "lookup_tokens": 4, **kw})


# ----------------------------------------------------------------------------- structure


def test_lookup_round_where_the_suffix_repeats_model_round_elsewhere():
    h = _hybrid()
    ctx = torch.tensor([4, 1, 3, 0, 2, 2, 4, 1, 3])  # "1 3" occurred before, followed by 0 2 2 4
    h.prepare(ctx)
    d = h.propose(ctx, 1, _sampler(room=10))
    assert d.tokens.tolist() == [0, 2, 2, 4] and d.probs is None and d.free  # longer than γ = 1: it is free
    assert h.propose(ctx, 1, _sampler(room=2)).tokens.tolist() == [0, 2]  # never past the round's room
    assert not h.propose(ctx, 1, _sampler(room=0)).free  # no room for free drafts (a busy server): the model's
    ctx = torch.tensor([4, 1, 3, 0, 2])  # no 2-token suffix seen before: the model drafts
    h.prepare(ctx)
    d = h.propose(ctx, 3, _sampler(1.0, room=10))
    assert d.tokens.numel() == 3 and d.probs is not None and not d.free
    assert h.rounds == {"lookup": 0, "model": 1}


def test_model_cache_catches_up_after_lookup_rounds():
    h = _hybrid()
    ctx = torch.tensor([4, 1, 3, 0, 2, 2, 4, 1, 3])
    h.prepare(ctx)
    d = h.propose(ctx, 2, _sampler(room=8))
    assert d.free
    h.commit(Verdict(2, torch.tensor([0, 2, 1])))  # a lookup round: the model's cache is untouched
    assert h.model.cache.length == ctx.numel() - 1
    longer = torch.cat([ctx, torch.tensor([0, 2, 1])])  # "2 1" never occurred: a model round
    d = h.propose(longer, 2, _sampler())
    assert not d.free and d.tokens.numel() == 2
    # the draft's cache now holds the whole context (fed in one pass) + the first draft token, and
    # its next-token logits equal a fresh draft's that saw the same tokens one by one
    assert h.model.cache.length == longer.numel() + 1
    fresh = ModelDrafter(DRAFT)
    fresh.prepare(longer)
    assert fresh.propose(longer, 2, _sampler()).tokens.tolist() == d.tokens.tolist()


def test_the_model_rounds_catch_up_is_reported_and_a_lookup_rounds_is_none():
    """A model round whose draft cache lags DRAFT_CATCH_UP_SPLIT or more tokens (a lazy prefill)
    reports its catch-up pass; a lookup round reports none, whatever the model did before."""
    h = LookupThenModel(ModelDrafter(DRAFT, lazy_prefill=True), min_ngram=2, max_ngram=4, lookup_tokens=4)
    ctx = torch.tensor([(i * i) % 5 for i in range(defaults.DRAFT_CATCH_UP_SPLIT + 6)] + [4, 0])
    h.prepare(ctx)
    d = h.propose(ctx, 2, _sampler())
    assert not d.free and h.catch_up_s > 0.0
    repeat = torch.tensor([4, 1, 3, 0, 2, 2, 4, 1, 3])
    h.prepare(repeat)
    assert h.propose(repeat, 2, _sampler(room=8)).free and h.catch_up_s == 0.0


def test_free_rounds_do_not_teach_the_gamma_controller():
    class Spy(FixedGamma):
        def __init__(self) -> None:
            super().__init__(2)
            self.updates: list[int] = []

        def update(self, *, gamma, accepted, draft_s, target_s, other_s) -> None:
            self.updates.append(gamma)

    class SpiedHybrid(LookupThenModel):
        def _new_length(self):
            self.spy = Spy()
            return self.spy

    spy = Spy()
    h = SpiedHybrid(ModelDrafter(DRAFT), min_ngram=2, max_ngram=4)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    SpeculativeDecoder(INVARIANT, h, get_rule("greedy"), gamma=spy).generate(PROMPT, cfg)
    assert h.rounds["lookup"] > 0 and h.rounds["model"] > 0
    assert len(h.spy.updates) == h.rounds["lookup"]  # the lookup rounds went to the drafter's own controller
    # only the model's rounds are reported (plus undrafted rounds: the last token, γ = 0)
    assert len([g for g in spy.updates if g > 0]) == h.rounds["model"]


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("tree", [None, TreeSpec()])
def test_greedy_hybrid_equals_plain_greedy(tree):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=48)
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(PROMPT, cfg)
    h = _hybrid()
    gamma = FixedGamma(6) if tree is not None else CostGamma()
    out = SpeculativeDecoder(INVARIANT, h, get_rule("greedy"), gamma=gamma, tree=tree).generate(PROMPT, cfg)
    assert out.tokens == plain.tokens
    assert h.rounds["lookup"] > 0 and h.rounds["model"] > 0
    st = out.stats  # the stats count the lookup rounds and what they kept
    assert st.free_rounds == h.rounds["lookup"] == sum(r.free for r in out.rounds)
    assert st.free_tokens_accepted == sum(r.accepted for r in out.rounds if r.free) <= st.draft_tokens_accepted


def test_lookup_rounds_go_on_when_the_model_drafts_nothing():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=48)
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(PROMPT, cfg)
    h = _hybrid(lookup_tokens=None)
    out = SpeculativeDecoder(INVARIANT, h, get_rule("greedy"), gamma=FixedGamma(0)).generate(PROMPT, cfg)
    assert out.tokens == plain.tokens
    assert h.rounds["lookup"] > 0 and h.rounds["model"] == 0  # γ = 0: free drafts only
    assert out.stats.tokens_per_target_call > 1.0


def _samples(method: str, cfg: SamplingConfig, drafter: LookupThenModel) -> list[tuple[int, ...]]:
    dec = SpeculativeDecoder(TARGET, drafter, get_rule(method), gamma=FixedGamma(2))
    out = []
    for i in range(N_SAMPLES):
        out.append(tuple(dec.generate(PROMPT, replace(cfg, seed=i, max_new_tokens=N_NEW)).tokens))
    return out


class _Counting(LookupThenModel):
    """Counts rounds over every generation (``prepare`` resets the per-sequence counts)."""

    def __init__(self, **kw) -> None:
        super().__init__(ModelDrafter(DRAFT), min_ngram=2, max_ngram=4, lookup_tokens=3, **kw)
        self.total = {"lookup": 0, "model": 0}

    def propose(self, context, gamma, sampler):
        d = super().propose(context, gamma, sampler)
        if d.tokens.numel():
            self.total["lookup" if d.free else "model"] += 1
        return d


@pytest.mark.parametrize("method", ["token", "block"])
def test_output_law_at_t1(method):
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    drafter = _Counting()
    assert chi_square_pvalue(_samples(method, cfg, drafter), law) > ALPHA
    assert drafter.total["lookup"] > 500 and drafter.total["model"] > 500  # both sources were exercised


def test_negative_control_lookup_reported_with_a_wrong_q_fails(monkeypatch):
    def slip(self, context, tokens, sampler) -> Draft | None:
        found = self.lookup.propose(context, tokens, sampler)
        if found.tokens.numel() == 0:
            return None
        self._model_round = False
        uniform = torch.full((found.tokens.numel(), 5), 0.2)
        return replace(found, probs=uniform, free=True)  # claims the tokens were drawn uniformly

    monkeypatch.setattr(LookupThenModel, "_lookup", slip)
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    assert chi_square_pvalue(_samples("token", cfg, _Counting()), law) < ALPHA

@pytest.mark.parametrize("ceiling", [0, 1, 2, None])
def test_a_busy_servers_ceiling_for_free_drafts(ceiling):
    """A capped γ policy (a batching server's) also bounds prompt lookup's drafts: its ceiling 0
    stops them (with the model's γ 0 nothing is drafted at all), k keeps them at k tokens (a
    ceiling of 1 still drafts one); every lookup round is reported to the server; the tokens are
    plain greedy decoding's either way."""
    from specdec.gamma import CappedGamma

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=48)
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(PROMPT, cfg)
    h = _hybrid(lookup_tokens=None)
    free_rounds: list[tuple[int, int]] = []
    gamma = CappedGamma(FixedGamma(3), cap=lambda g: 0, free_cap=lambda: ceiling,
                        observe_free=lambda g, a: free_rounds.append((g, a)))
    asked = []
    propose = h.propose
    h.propose = lambda *a, **k: asked.append(1) or propose(*a, **k)  # type: ignore[method-assign]
    out = SpeculativeDecoder(INVARIANT, h, get_rule("greedy"), gamma=gamma).generate(PROMPT, cfg)
    assert out.tokens == plain.tokens and h.rounds["model"] == 0
    assert (len(asked) == 0) == (ceiling == 0)  # nothing to draft: the drafter is not even asked
    free = [r for r in out.rounds if r.free]
    assert [(r.gamma, r.accepted) for r in free] == free_rounds
    if ceiling == 0:
        assert not free and all(r.gamma == 0 for r in out.rounds)
    else:
        assert free and all(r.gamma <= (ceiling or defaults.MAX_GAMMA) for r in free)
        if ceiling is None:
            assert max(r.gamma for r in free) > 2  # uncapped lookup drafts run longer here


def test_a_capped_policy_passes_the_ceilings_on():
    from specdec.gamma import CappedGamma

    seen = []
    g = CappedGamma(FixedGamma(4), cap=lambda g: 1, free_cap=lambda: 3, observe_free=lambda *a: seen.append(a))
    assert g.next_gamma() == 1 and g.free_limit() == 3
    g.update_free(gamma=3, accepted=2, draft_s=0.0, target_s=0.0, other_s=0.0)
    assert seen == [(3, 2)]
    assert CappedGamma(FixedGamma(4), cap=lambda g: None).free_limit() is None


def test_the_server_gives_each_request_its_own_hybrid():
    from specdec.server.command import drafter_factory

    engine = SimpleNamespace(drafter=_hybrid(), draft_model=SimpleNamespace(model=DRAFT))
    make = drafter_factory(engine, draft_model=DRAFT)
    a, b = make(), make()
    assert isinstance(a, LookupThenModel) and a is not b and a.model is not b.model and a.model.model is DRAFT
    assert a.model.lazy_prefill  # a busy server's cap may keep a sequence from drafting at all


def test_lookup_length_follows_the_lookup_rounds_acceptance():
    def run(accepted_share: float) -> int:
        h = _hybrid(lookup_tokens=None)
        ctx = torch.tensor([4, 1, 3, 0, 2, 2, 4, 1, 0, 3, 3, 1, 1, 0, 2, 4, 1, 3])
        h.prepare(ctx)
        for rows in (1, 2, 3):  # model rounds' passes: the cost curve below the lookup lengths
            h.observe_pass(rows, 0.010 + 0.001 * (rows - 1))
        for _ in range(40):
            n = h.propose(ctx, 1, _sampler(room=12)).tokens.numel()
            # a pass over n + 1 positions costs 10 ms + 1 ms per extra position
            h.update_free(gamma=n, accepted=int(n * accepted_share), draft_s=0.0, target_s=0.010 + 0.001 * n, other_s=0.0)
        return h.propose(ctx, 1, _sampler(room=12)).tokens.numel()

    assert run(1.0) >= 8  # every lookup token accepted: long drafts
    assert run(0.0) == 1  # none accepted: one token (cheap, and it keeps the estimate alive)


def test_a_hybrid_around_a_self_speculative_view_spawns_per_request():
    from specdec.drafters.self_spec import LayerPlan, LayerView, SelfSpecDrafter
    from specdec.server.command import drafter_factory

    view = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 1), keep_hidden=True), share=True)
    h = LookupThenModel(view, min_ngram=2, max_ngram=4)
    make = drafter_factory(SimpleNamespace(drafter=h, draft_model=None, drafter_name="layerskip:1+lookup"))
    a, b = make(), make()
    assert isinstance(a, LookupThenModel) and isinstance(a.model, SelfSpecDrafter) and a.model is not b.model
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(PROMPT, cfg)
    out = SpeculativeDecoder(INVARIANT, h, get_rule("greedy"), gamma=FixedGamma(3)).generate(PROMPT, cfg)
    assert out.tokens == plain.tokens and h.rounds["lookup"] > 0 and h.rounds["model"] > 0


SAMPLER = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def test_a_tree_rounds_lookup_draft_has_the_lookup_length():
    ctx = torch.tensor([1, 3, 0, 2, 4, 1, 3, 0, 2, 4, 1, 3])  # "4 1 3" seen before: 0 2 4 1 3 ...
    for tokens in (1, 2, 3):
        d = LookupThenModel(ModelDrafter(DRAFT), min_ngram=2, max_ngram=4, lookup_tokens=tokens)
        d.prepare(ctx)
        draft = d.propose_tree(ctx, 16, SAMPLER, TreeSpec(), max_depth=8)
        assert draft.free and draft.tokens.tolist() == [0, 2, 4][:tokens]


@pytest.mark.parametrize("text, want", [("smollm2-135m-draft+lookup", ("smollm2-135m-draft", True)),
                                        ("tiny+LOOKUP", ("tiny", True)),
                                        (" tiny +lookup ", ("tiny", True)),
                                        ("tiny", ("tiny", False))])
def test_the_lookup_suffix_is_read_whatever_its_case_and_spacing(text, want):
    assert split_lookup(text) == want


def test_a_lookup_suffix_alone_is_a_config_error():
    with pytest.raises(ConfigError):
        split_lookup(" +lookup")


class _Stub:
    """Just enough of a model drafter for the hybrid's copies."""

    supports_trees = False

    def spawn(self, wrap=lambda m: m):
        return _Stub()

    def with_model(self, model):
        return _Stub()


def test_copies_of_a_hybrid_keep_its_lookup_settings():
    h = LookupThenModel(_Stub(), min_ngram=3, max_ngram=5, lookup_tokens=2)  # type: ignore[arg-type]
    for copy in (h.spawn(), h.with_model(object())):
        assert (copy.lookup.min_ngram, copy.lookup.max_ngram, copy.lookup_tokens) == (3, 5, 2)
        assert copy.length.next_gamma() == 2  # the fixed lookup length


def test_reset_forgets_the_last_sequences_text():
    """After ``reset`` the lookup index holds nothing of the previous sequence: a new, longer
    context whose suffix "1 3" occurred only in the old text is not looked up there."""

    class Resettable(_Stub):
        def reset(self):
            pass

    sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None, room=4)
    h = LookupThenModel(Resettable(), min_ngram=2, max_ngram=4, lookup_tokens=4)  # type: ignore[arg-type]
    old = torch.tensor([4, 1, 3, 0, 2, 2, 4, 1, 3])
    assert h.propose(old, 0, sampler).tokens.tolist() == [0, 2, 2, 4]  # a lookup round on the old text
    h.reset()
    new = torch.tensor([7] * 9 + [1, 3])
    assert h.propose(new, 0, sampler).tokens.numel() == 0


def test_the_temperature_factor_is_the_model_drafters():
    """Setting the hybrid's temperature factor sets its model drafter's (a server's per-request
    drafters read it there)."""

    model = _Stub()
    model.temperature_factor = 1.0  # type: ignore[attr-defined]
    h = LookupThenModel(model)  # type: ignore[arg-type]
    h.temperature_factor = 0.5
    assert model.temperature_factor == 0.5 and h.temperature_factor == 0.5  # type: ignore[attr-defined]


def test_a_model_rounds_pass_teaches_the_lookup_length_its_cost():
    """The decoder hands every model round's verification pass to ``observe_pass``: the lookup
    length's cost controller learns the target's cost curve from it (a pass is the target's,
    whoever drafted), so lookup lengths are weighed against measured costs."""
    h = _hybrid(lookup_tokens=None)  # the lookup length chosen by cost
    h.prepare(torch.tensor([1, 2, 3]))
    assert isinstance(h.length, CostGamma)
    h.observe_pass(3, 0.25)
    assert h.length._target_s == {3: 0.25}


REPEAT = torch.tensor([1, 3, 0, 2, 4, 1, 3, 0, 2, 4, 1, 3])  # "4 1 3" seen before: 0 2 4 1 3 ...
NOVEL = torch.tensor([4, 1, 3, 0, 2])  # no 2-token suffix seen before: a model round


class _Model:
    """A model drafter that records what the hybrid hands it."""

    supports_trees = True
    feature_taps = (1, 3)
    catch_up_s = 0.5

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prepare(self, prompt):
        self.calls.append(("prepare", prompt.tolist()))

    def reset(self):
        self.calls.append(("reset",))

    def finish(self, context):
        self.calls.append(("finish", context.tolist()))

    def bind_target(self, model, cache):
        self.calls.append(("bind", model, cache))

    def add_features(self, features):
        self.calls.append(("features", features.shape))

    def propose(self, context, gamma, sampler):
        self.calls.append(("propose", gamma))
        return Draft(tokens=torch.tensor([0] * gamma), probs=None)

    def propose_tree(self, context, budget, sampler, spec, *, max_depth):
        self.calls.append(("propose_tree", budget))
        return Draft(tokens=torch.tensor([0]), probs=None)

    def commit(self, verdict):
        self.calls.append(("commit",))


def test_a_lookup_length_of_zero_is_refused():
    """``lookup_tokens`` fixes the lookup draft's length: 0 is no length at all (a ValueError, not a
    silent one-token draft)."""
    with pytest.raises(ValueError, match="lookup_tokens"):
        LookupThenModel(_Model(), lookup_tokens=0)  # type: ignore[arg-type]
    LookupThenModel(_Model(), lookup_tokens=1)  # type: ignore[arg-type]  # the smallest allowed


def test_finish_bind_target_and_features_reach_the_model_drafter():
    """The hybrid passes on the decoder's per-sequence hooks: ``finish`` (a draft model behind a
    prefix cache keeps its rows), ``bind_target`` (early exit reads the target's cache), the
    feature taps and the features (a feature-reading drafter behind the lookup)."""
    m = _Model()
    h = LookupThenModel(m, min_ngram=2, max_ngram=4)  # type: ignore[arg-type]
    assert h.feature_taps == (1, 3)
    h.finish(torch.tensor([5, 6]))
    h.bind_target("target", "cache")
    h.add_features(torch.zeros(2, 3, 4))
    assert ("finish", [5, 6]) in m.calls
    assert ("bind", "target", "cache") in m.calls
    assert ("features", (2, 3, 4)) in m.calls


def test_a_lookup_round_after_an_uncommitted_model_round_is_still_free_of_the_model():
    """A lookup round reports no catch-up pass and does not commit into the model drafter, even when
    the round before it was the model's and was never committed."""
    m = _Model()
    h = LookupThenModel(m, min_ngram=2, max_ngram=4, lookup_tokens=2)  # type: ignore[arg-type]
    h.prepare(NOVEL)
    assert not h.propose(NOVEL, 2, _sampler(room=4)).free and h.catch_up_s == 0.5  # the model's round
    h.prepare(REPEAT)
    h._model_round = True  # as a model round left it, had it not been committed
    assert h.propose(REPEAT, 2, _sampler(room=4)).free
    assert h.catch_up_s == 0.0
    h.commit(Verdict(2, torch.tensor([0, 2, 1])))
    assert ("commit",) not in m.calls


def test_a_tree_rounds_lookup_draft_is_bounded_by_the_remaining_depth_not_the_budget():
    """In a tree round the lookup draft (a chain) is at most ``max_depth`` tokens long (what the
    decoder may still generate), however large the node budget."""
    h = LookupThenModel(_Model(), min_ngram=2, max_ngram=4, lookup_tokens=8)  # type: ignore[arg-type]
    h.prepare(REPEAT)
    draft = h.propose_tree(REPEAT, 16, _sampler(), TreeSpec(), max_depth=2)
    assert draft.free and draft.tokens.tolist() == [0, 2]


def test_a_model_tree_round_commits_into_the_model_drafter():
    """A tree round the model drafted is committed into the model drafter (its cache must drop the
    rejected nodes), and reports its catch-up pass."""
    m = _Model()
    h = LookupThenModel(m, min_ngram=2, max_ngram=4, lookup_tokens=2)  # type: ignore[arg-type]
    h.prepare(NOVEL)
    draft = h.propose_tree(NOVEL, 4, _sampler(), TreeSpec(), max_depth=3)
    assert not draft.free and h.catch_up_s == 0.5
    h.commit(Verdict(1, torch.tensor([0, 1])))
    assert ("commit",) in m.calls


def test_reset_and_prepare_reach_the_model_drafter():
    """``reset`` and ``prepare`` start a new sequence in the model drafter too, not only in the
    lookup index (a stale draft cache would draft from the previous text)."""
    m = _Model()
    h = LookupThenModel(m, min_ngram=2, max_ngram=4)  # type: ignore[arg-type]
    h.reset()
    h.prepare(NOVEL)
    assert ("reset",) in m.calls and ("prepare", NOVEL.tolist()) in m.calls


def test_a_lookup_round_needs_a_repeated_suffix_of_two_tokens_by_default():
    """By default one repeated token is not enough for a lookup round (a single token repeats too
    often to predict what follows): "… 3 1" after "1 2 …" is a model round, "… 1 2" after "1 2 3"
    a lookup round."""
    h = LookupThenModel(_Model(), lookup_tokens=2)  # type: ignore[arg-type]
    one = torch.tensor([1, 2, 3, 1])  # only the last token, 1, was seen before
    h.prepare(one)
    assert not h.propose(one, 2, _sampler(room=4)).free
    two = torch.tensor([1, 2, 3, 1, 2])  # "1 2" was seen before, followed by 3
    h.reset()
    h.prepare(two)
    draft = h.propose(two, 2, _sampler(room=4))
    assert draft.free and draft.tokens.tolist()[:1] == [3]


def test_a_new_sequence_starts_the_lookup_length_afresh():
    """The lookup length is learnt per sequence: a sequence whose lookups all failed drafts one
    lookup token; ``prepare`` for the next sequence drafts what a fresh hybrid's first lookup
    round drafts again, not the last sequence's one token."""
    fresh = _hybrid(lookup_tokens=None)
    fresh.prepare(REPEAT)
    start = fresh.propose(REPEAT, 1, _sampler(room=12)).tokens.numel()
    assert start > 1
    h = _hybrid(lookup_tokens=None)
    h.prepare(REPEAT)
    for rows in (1, 2, 3):
        h.observe_pass(rows, 0.010 + 0.001 * (rows - 1))
    for _ in range(40):
        n = h.propose(REPEAT, 1, _sampler(room=12)).tokens.numel()
        h.update_free(gamma=n, accepted=0, draft_s=0.0, target_s=0.010 + 0.001 * n, other_s=0.0)
    assert h.propose(REPEAT, 1, _sampler(room=12)).tokens.numel() == 1
    h.prepare(REPEAT)
    assert h.propose(REPEAT, 1, _sampler(room=12)).tokens.numel() == start


class _Committing:
    """A model drafter that drafts zeros and counts its commits."""

    supports_trees = False
    catch_up_s = 0.5

    def __init__(self) -> None:
        self.commits = 0

    def prepare(self, prompt):
        pass

    def reset(self):
        pass

    def propose(self, context, gamma, sampler):
        return Draft(tokens=torch.tensor([0] * gamma), probs=None)

    def commit(self, verdict):
        self.commits += 1


def test_a_round_with_nothing_drafted_after_an_uncommitted_model_round_is_not_the_models():
    """γ 0 and no lookup: the round drafts nothing, reports no catch-up pass and commits nothing
    into the model drafter, even when the round before it was the model's and never committed."""
    m = _Committing()
    h = LookupThenModel(m, min_ngram=2, max_ngram=4, lookup_tokens=2)  # type: ignore[arg-type]
    novel = torch.tensor([4, 1, 3, 0, 2])
    h.prepare(novel)
    assert h.propose(novel, 2, _sampler(room=4)).tokens.numel() == 2 and h.catch_up_s == 0.5  # the model's
    assert h.propose(novel, 0, _sampler(room=4)).tokens.numel() == 0
    assert h.catch_up_s == 0.0
    h.commit(Verdict(0, torch.tensor([1])))
    assert m.commits == 0


def test_prepare_forgets_the_last_sequences_text():
    """``prepare`` for a new sequence (no ``reset`` before it) starts the lookup index afresh: a new,
    longer prompt whose suffix "1 3" occurred only in the old text is not looked up there."""
    h = LookupThenModel(_Committing(), min_ngram=2, max_ngram=4, lookup_tokens=4)  # type: ignore[arg-type]
    old = torch.tensor([4, 1, 3, 0, 2, 2, 4, 1, 3])
    h.prepare(old)
    assert h.propose(old, 0, _sampler(room=4)).tokens.tolist() == [0, 2, 2, 4]
    new = torch.tensor([7] * 9 + [1, 3])
    h.prepare(new)
    assert h.propose(new, 0, _sampler(room=4)).tokens.numel() == 0
