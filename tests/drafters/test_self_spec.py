"""Self-speculative drafters (views of the target) on a tiny random native model.

The law tests draw N = 6,000 independent generations (seed = sample index) of 3 new tokens from a
5-token, 3-layer random Llama (125 possible outputs), drafted by the target itself (token
verification: one attention and one MLP sub-layer skipped; block verification: early exit after
one layer), and run a chi-square goodness-of-fit test against the exact law (the target's own
next-token distributions, enumerated); they fail at p < 1e-4.  The negative control runs the same
test with a lossy rule on the same drafter, on a quarter of the samples, and must fail.  Cache sharing is checked
bitwise (it changes no logit, so it cannot change the law) on a batch-invariant copy.
"""

from __future__ import annotations

import re

import pytest
import torch

from specdec import defaults
from specdec.decoder import SpeculativeDecoder
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.self_spec import LayerPlan, LayerView, SelfSpecDrafter, SwiftDrafter, build, load_plan, param_shares, parse_name
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig
from specdec.session import TargetSession
from specdec.verify import get_rule
from stats import ALPHA, chi_square_pvalue, exact_law
from tiny import NativeOracle as Oracle, tiny_vocab_llama as tiny_native

N_SAMPLES = 6_000
N_NEW = 3
PROMPT = [1, 3, 0]


TARGET = tiny_native(layers=3, batch_invariant=False)  # the fast path: law tests draw many samples
INVARIANT = tiny_native(layers=3)  # for the bitwise cache-sharing checks
SKIP = LayerPlan.skipping(3, {1}, {2})
#: a tied head (the embedding): a view can draft over a reduced vocabulary of its rows
TIED = tiny_native(layers=3, batch_invariant=False, tied=True)
TIED_INVARIANT = tiny_native(layers=3, tied=True)
KEEP = torch.tensor([0, 2, 4])  # the reduced draft vocabulary: 3 of the 5 tokens


def _samples(method: str, cfg: SamplingConfig, drafter, n: int = N_SAMPLES, target=TARGET) -> list[tuple[int, ...]]:
    dec = SpeculativeDecoder(target, drafter, get_rule(method), gamma=FixedGamma(2))
    return [tuple(dec.generate(PROMPT, SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})).tokens)
            for i in range(n)]


def test_output_law_with_layer_skipping_drafter_token_verification():
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    drafter = SelfSpecDrafter(LayerView(TARGET, SKIP))
    assert chi_square_pvalue(_samples("token", cfg, drafter), law) > ALPHA


def test_output_law_with_early_exit_drafter_block_verification():
    cfg = SamplingConfig(temperature=0.8)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    drafter = SelfSpecDrafter(LayerView(TARGET, LayerPlan.early_exit(3, 1), keep_hidden=True), share=True)
    assert not drafter.share  # a fast-path target never shares (not bitwise)
    assert chi_square_pvalue(_samples("block", cfg, drafter), law) > ALPHA


def test_output_law_with_a_view_over_a_reduced_vocabulary_token_verification():
    """The view drafts over 3 of the 5 tokens (its compact rows, q reported over all 5)."""
    cfg = SamplingConfig(temperature=0.9)
    law = exact_law(Oracle(TIED), PROMPT, cfg, N_NEW)
    drafter = SelfSpecDrafter(LayerView(TIED, SKIP, reduced=TIED.reduced_head(KEEP)))
    assert drafter.view.vocab_ids is not None
    assert chi_square_pvalue(_samples("token", cfg, drafter, target=TIED), law) > ALPHA


def test_negative_control_lossy_rule_with_the_same_drafter_fails():
    """A quarter of the law tests' samples (N = 1,500) is ample to catch this rule (p ~ 1e-35 at
    2,000 samples): failing at fewer samples, it fails at N = 6,000 too."""
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    law = exact_law(Oracle(TARGET), PROMPT, cfg, N_NEW)
    drafter = SelfSpecDrafter(LayerView(TARGET, SKIP))
    assert chi_square_pvalue(_samples("lossy_resample_p", cfg, drafter, n=N_SAMPLES // 4), law) < ALPHA


# ----------------------------------------------------------------------------- deterministic checks


@pytest.mark.parametrize("model", [TARGET, INVARIANT])
def test_full_plan_is_bitwise_the_target(model):
    x = torch.tensor([1, 4, 2, 0, 3, 3, 1])
    view = LayerView(model, LayerPlan.early_exit(3, 3))
    assert torch.equal(view.forward(x, view.new_cache()), model.forward(x, model.new_cache()))


def test_a_short_view_cache_grows_and_keeps_keys_residuals_and_tokens(monkeypatch):
    """A drafter's cache starts short and grows (allocating a model's whole context per prompt
    cost up to a second): feeding in pieces through growth equals one full-size cache bitwise."""
    view = LayerView(tiny_native(layers=3, max_length=512), LayerPlan.early_exit(3, 2), keep_hidden=True)
    x = torch.randint(0, 5, (100,), generator=torch.Generator().manual_seed(0))
    full = view.new_cache(256)
    short = view.new_cache(256, initial_length=4)
    assert short.capacity == 64 and full.capacity == 256  # whole 64-position blocks
    want = view.forward(x, full)
    got = torch.cat([view.forward(x[:3], short), view.forward(x[3:4], short), view.forward(x[4:], short)])
    assert short.capacity > 64  # grew with 4 positions filled
    assert torch.equal(got, want)
    n = x.numel()
    assert torch.equal(short.tokens[:n], full.tokens[:n]) and torch.equal(short.resid[:n], full.resid[:n])
    assert torch.equal(short.k[:, :, :n], full.k[:, :, :n])
    monkeypatch.setattr(defaults, "DRAFT_KV_INITIAL_LENGTH", 4)
    drafter = SelfSpecDrafter(view)
    drafter.prepare(x)
    assert drafter.cache.capacity == 128 < view.max_length == 512  # sized to the prompt (+ 4, whole blocks), not the whole context


def test_view_shares_weights_and_caches_only_its_layers():
    view = LayerView(TARGET, LayerPlan.skipping(3, {0}, set()))
    assert view.target is TARGET  # a view, not a copy
    assert view.new_cache(32).k.shape[0] == 2  # attention runs in layers 1 and 2 only
    drafter = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True)
    drafter.prepare(torch.tensor(PROMPT))
    per_position = 2 * 2 * 1 * 8 * 4 + 16 * 4 + 8  # 2 layers of K and V (1 head of 8 floats), residual, token id
    assert drafter.extra_bytes() == per_position * (len(PROMPT) - 1)
    skipped = LayerView(TARGET, LayerPlan.skipping(3, {0, 1}, {0}))
    assert [s[0] for s in skipped.plan.steps] == [1, 2]  # layer 0 runs nothing


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)])
def test_cache_sharing_gives_bitwise_the_plain_verification_pass(cfg):
    drafter = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True)
    shared = TargetSession(INVARIANT, PROMPT, cfg, get_rule("greedy" if cfg.greedy else "token"), seed=0)
    plain = TargetSession(INVARIANT, PROMPT, cfg, get_rule("greedy" if cfg.greedy else "token"), seed=0)
    drafter.prepare(torch.tensor(PROMPT))
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        sampler = DraftSampler(cfg, "multinomial", penalties=None, generator=gen)
        draft = drafter.propose(shared.context, 3, sampler)
        assert draft.reuse is not None
        feed = torch.cat([shared.context[-1:], draft.tokens])
        base = shared.cache.length
        a = draft.reuse.forward(INVARIANT, feed, shared.cache)
        b = INVARIANT.forward(feed, plain.cache)
        assert torch.equal(a, b)
        assert torch.equal(shared.cache.k[:, :, : base + feed.numel()], plain.cache.k[:, :, : base + feed.numel()])
        # keep both sessions on the same committed prefix (accept one draft token, then a bonus)
        v = get_rule("greedy").fn(draft.tokens, None, b)
        for s in (shared, plain):
            s.cache.truncate(base + 1 + v.num_accepted)
            s._ctx[s._n : s._n + v.tokens.numel()] = v.tokens
            s._n += v.tokens.numel()
        drafter.commit(v)


def test_greedy_equals_plain_for_every_family():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    plain = SpeculativeDecoder(TARGET, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
    plain_inv = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
    for model, drafter, ref in (
        (TARGET, SelfSpecDrafter(LayerView(TARGET, SKIP)), plain),
        (INVARIANT, SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True), plain_inv),
    ):
        out = SpeculativeDecoder(model, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(PROMPT, cfg)
        assert out.tokens == ref


class _CountingView(LayerView):
    rows = 0

    def forward(self, tokens, cache, *, last_only=False):
        type(self).rows += tokens.numel()
        return super().forward(tokens, cache, last_only=last_only)


def test_early_exit_takes_committed_keys_from_the_targets_cache():
    """Bound to the target's cache (the decoder does it for a local target), an early-exit view
    runs its layers only for the rows it drafts from — never over the prompt or over tokens
    committed in rounds without drafting — and copies the committed keys/values of layers < K;
    those are bitwise what the view computes itself over the same tokens, so the drafts are the
    ones the unbound view proposes and greedy output is plain greedy output."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=24)
    prompt = [1, 3, 0, 2, 4, 1, 1, 3, 2, 0, 4, 2]
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(prompt, cfg)
    drafter = SelfSpecDrafter(_CountingView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True)
    gammas = iter([0, 0, 3, 0, 0, 0, 2] + [1] * 40)  # rounds without drafting between drafting ones

    class Script(FixedGamma):
        def next_gamma(self):
            return next(gammas)

    _CountingView.rows = 0
    out = SpeculativeDecoder(INVARIANT, drafter, get_rule("greedy"), gamma=Script(0)).generate(prompt, cfg)
    assert out.tokens == plain.tokens and out.stats.draft_tokens_proposed > 0
    drafted = [r for r in out.rounds if r.gamma > 0]
    # one forward of the last context token per drafting round, plus the γ - 1 drafted tokens fed
    assert _CountingView.rows == sum(r.gamma for r in drafted)
    cache = drafter.cache
    n = cache.length
    committed = torch.tensor(prompt + out.tokens)[:n]
    own = drafter.view.new_cache(64)
    drafter.view._layers(committed, own)
    assert torch.equal(cache.k[:, :, :n], own.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], own.v[:, :, :n])
    assert torch.equal(cache.tokens[:n], committed)


def test_a_view_of_the_whole_target_is_not_drafted_from_under_gamma_auto():
    """A skip set that came out empty makes the view the target itself: a drafted token costs a
    target step, so γ auto starts backed off (its first probe is 128 rounds away) and the view
    never prefills; 40 tokens are plain decoding.  A fixed γ still drafts, exactly."""
    from specdec.gamma import CostGamma

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    plain = SpeculativeDecoder(TARGET, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
    whole = SelfSpecDrafter(_CountingView(TARGET, LayerPlan.skipping(3, set(), set())))
    assert whole.whole_target and not SelfSpecDrafter(LayerView(TARGET, SKIP)).whole_target
    _CountingView.rows = 0
    out = SpeculativeDecoder(TARGET, whole, get_rule("greedy"), gamma=CostGamma()).generate(PROMPT, cfg)
    assert out.tokens == plain and out.stats.draft_tokens_proposed == 0 and _CountingView.rows == 0
    fixed = SpeculativeDecoder(TARGET, whole, get_rule("greedy"), gamma=FixedGamma(2)).generate(PROMPT, cfg)
    assert fixed.tokens == plain and fixed.stats.draft_tokens_proposed > 0


def test_swift_adapts_its_skip_set_and_stays_exact():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    plain = SpeculativeDecoder(TARGET, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
    drafter = SwiftDrafter(TARGET, LayerPlan.skipping(3, {0, 1, 2}, {0, 1, 2}), every=2, window=6, tries=4, budget=None)
    out = SpeculativeDecoder(TARGET, drafter, get_rule("greedy"), gamma=FixedGamma(2)).generate(PROMPT, cfg)
    assert out.tokens == plain
    assert drafter.switches >= 1  # a draft that skips everything is a poor one: it moved


def test_swift_rescores_ever_more_rarely_while_its_set_holds():
    """Each scoring runs 1 + tries passes over the window: the interval doubles while the set
    holds (capped at every x max_backoff, carried into the next sequence) and falls back to
    ``every`` after a switch."""
    drafter = SwiftDrafter(TARGET, SKIP, every=2, window=4, tries=1, max_backoff=4, budget=None)
    switch_at: set[int] = set()
    drafter._speedup = lambda plan, context: 1.0 + (plan != SKIP and drafter.scorings in switch_at)  # type: ignore[method-assign]
    context = torch.tensor([1, 3, 0, 4, 2, 2, 1])
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "multinomial", penalties=None, generator=torch.Generator())
    drafter.prepare(context)
    seen = []
    for r in range(1, 31):
        drafter.propose(context, 0, sampler)  # (the rounds count; nothing drafted)
        seen.append(drafter.scorings)
    rounds = [r for r in range(1, 31) if seen[r - 1] > (seen[r - 2] if r > 1 else 0)]
    assert rounds == [2, 6, 14, 22, 30] and drafter.switches == 0  # intervals 2, 4, 8, then the cap 8
    drafter.reset()  # a new sequence keeps the interval
    for _ in range(7):
        drafter.propose(context, 0, sampler)  # (the rounds count; nothing drafted)
    assert drafter.scorings == 5
    switch_at.add(6)
    drafter.propose(context, 0, sampler)  # the 8th round: a scoring that switches
    assert drafter.scorings == 6 and drafter.switches == 1
    for _ in range(2):
        drafter.propose(context, 0, sampler)  # (the rounds count; nothing drafted)
    assert drafter.scorings == 7  # every 2 rounds again


class _Clock:
    """A time source the test moves by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _budget_run(budget: float | None, monkeypatch) -> tuple[SwiftDrafter, list[tuple[int, float, float]]]:
    """A SWIFT drafter over 400 rounds of 0.1 s of decoding each, nothing drafted in the first 100
    and one token (0.01 s) a round after them, a scoring costing 0.5 s, its clock moved by hand;
    returns it and (scorings, scoring time, time seen) after every round."""
    clock = _Clock()
    drafter = SwiftDrafter(TARGET, SKIP, every=2, window=4, tries=1, max_backoff=4, budget=budget, clock=clock)

    def speedup(plan, context):
        clock.t += 0.25  # each of the 1 + tries sets scored: 0.5 s a scoring
        return 1.0

    def draft(self, context, gamma, sampler):
        clock.t += 0.01 * gamma
        return Draft(tokens=torch.zeros(gamma, dtype=torch.long), probs=None)

    drafter._speedup = speedup  # type: ignore[method-assign]
    monkeypatch.setattr(SelfSpecDrafter, "propose", draft)
    context = torch.tensor([1, 3, 0, 4, 2, 2, 1])
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "multinomial", penalties=None, generator=torch.Generator())
    trace = []
    for r in range(400):
        if r % 100 == 0:
            drafter.reset()  # a new sequence: the gap before it (10 s here) is not decoding time
            clock.t += 10.0
        drafter.propose(context, 0 if r < 100 else 1, sampler)
        trace.append((drafter.scorings, drafter.scoring_s, drafter.seen_s))
        clock.t += 0.1
    return drafter, trace


def test_swift_keeps_its_scorings_within_its_time_budget(monkeypatch):
    """A scoring costs at most ``budget`` of the decoding time seen since the last one (gaps
    between sequences excluded, the last scoring's own time too), the first waiting for a
    measured draft step to bound its cost: no burst of scorings spends time banked while none
    could run.  Within that SWIFT still scores.  400 rounds of a hand-moved clock; without the
    budget the same run spends more than that share on scoring (the control)."""
    drafter, trace = _budget_run(0.25, monkeypatch)
    assert all(scoring <= 0.25 * seen + 1e-9 for _, scoring, seen in trace)
    at = [r for r in range(1, 400) if trace[r][0] > trace[r - 1][0]]  # the rounds that scored
    # the first waited for a draft step (round 100) to bound its cost by 2 x 3 x 0.01 s
    assert at[0] == 101
    # then each one for 0.5 s / 0.25 of decoding after the last: ~18 rounds of 0.11 s
    seen = [trace[r][2] for r in at]  # when each was decided (its own time counts from the next call)
    assert all(b - a - 0.5 >= 2.0 - 1e-9 for a, b in zip(seen, seen[1:]))
    assert 14 <= len(at) <= 18
    assert drafter.seen_s <= 400 * 0.11 + drafter.scoring_s  # the 10 s before each sequence left out
    free, trace = _budget_run(None, monkeypatch)
    assert free.scorings > drafter.scorings and trace[-1][1] > 0.25 * trace[-1][2]


@pytest.mark.parametrize("budget", [-0.1, float("nan")])
def test_swift_refuses_a_scoring_budget_that_is_no_share(budget):
    with pytest.raises(ConfigError, match="scoring budget"):
        SwiftDrafter(TARGET, SKIP, budget=budget)


def test_swift_moving_to_a_set_with_other_attention_layers_copies_those_layers_keys():
    """A switch that skips an attention layer changes which of the target's layers the view's
    cache holds: after it, the committed positions hold the new set's layers (the first version
    kept the old map and crashed on the smaller cache).  Greedy output stays plain greedy's."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30)
    plain = SpeculativeDecoder(TARGET, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
    drafter = SwiftDrafter(TARGET, LayerPlan.skipping(3, set(), set()), every=2, window=6, tries=4, budget=None)
    wanted = LayerPlan.skipping(3, {1}, set())
    drafter._neighbour = lambda plan: wanted  # type: ignore[method-assign]
    drafter._speedup = lambda plan, context: 2.0 if plan == wanted else 1.0  # type: ignore[method-assign]
    out = SpeculativeDecoder(TARGET, drafter, get_rule("greedy"), gamma=FixedGamma(2)).generate(PROMPT, cfg)
    assert out.tokens == plain and drafter.switches == 1 and drafter.view.plan == wanted
    target_cache, view_cache = drafter._target_cache, drafter.cache  # bound by the decoder
    synced = drafter._synced
    assert synced > len(PROMPT) and view_cache.k.shape[0] == 2
    for slot, layer in enumerate((0, 2)):
        assert torch.equal(view_cache.k[slot, :, :synced], target_cache.k[layer, :, :synced])
        assert torch.equal(view_cache.v[slot, :, :synced], target_cache.v[layer, :, :synced])


@pytest.mark.parametrize("model", [TARGET, INVARIANT], ids=["fast", "invariant"])
@pytest.mark.parametrize("plan", [SKIP, LayerPlan.early_exit(3, 2), LayerPlan.skipping(3, {0, 1, 2}, {1})])
def test_a_pass_as_drafted_scores_each_row_as_the_view_drafts_it(model, plan):
    """``run_layers(as_drafted=True)``: every row of one pass gets the logits the view bound to the
    target's cache computes when it drafts from that row (the target's keys before it, its own at
    it), to rounding; the cache it reads is left as it was."""
    seq = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0, 3, 4])  # [L]
    n, start = seq.numel(), 3
    cache = model.new_cache(n)
    model.forward(seq, cache)
    before = (cache.k.clone(), cache.v.clone())
    with torch.inference_mode():
        x = model.run_layers(model.embed_tokens(seq[start:-1]), cache, plan.steps, start=start, as_drafted=True)
        got = model.head(x)  # [n - 1 - start, V]
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1])
    view = LayerView(model, plan)
    for t in range(start, n - 1):
        own = view.new_cache(n)
        own.reserve(t)
        for slot, layer in enumerate(plan.attention_layers):  # the target's keys at committed positions
            own.k[slot, :, :t] = cache.k[layer, :, :t]
            own.v[slot, :, :t] = cache.v[layer, :, :t]
        want = view.forward(seq[t : t + 1], own)[0]  # [V]
        assert torch.allclose(got[t - start], want, atol=1e-5, rtol=1e-5), t


def test_swift_scores_a_set_over_the_targets_cache():
    """SWIFT's score of a skip set is the agreement of the rows drafted over the target's keys
    (one pass as drafted) with the committed tokens; without the target's cache (a view whose
    target is another process's or a server's batch) it scores over the window alone."""
    seq = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0, 3, 4, 0, 1])  # [L]
    cache = TARGET.new_cache(seq.numel())
    TARGET.forward(seq[:-1], cache)  # every position committed but the pending last token
    drafter = SwiftDrafter(TARGET, SKIP, window=8)
    drafter.bind_target(TARGET, cache)
    plan = LayerPlan.skipping(3, {2}, {2})
    start = seq.numel() - 8
    with torch.inference_mode():
        rows = TARGET.head(TARGET.run_layers(TARGET.embed_tokens(seq[start:-1]), cache, plan.steps, start=start,
                                             as_drafted=True))
    want = float((rows.argmax(-1) == seq[start + 1 :]).float().mean())
    assert drafter._agreement(plan, seq) == want
    alone = SwiftDrafter(TARGET, SKIP, window=8)  # unbound: the window's own pass from position 0
    view = LayerView(TARGET, plan)
    own = view.forward(seq[start:], view.new_cache(8))[:-1]
    assert alone._agreement(plan, seq) == float((own.argmax(-1) == seq[start + 1 :]).float().mean())
    assert alone._agreement(plan, seq) != want  # 2 of 7 rows against 4 of 7 here: the context matters


class _RecordingDrafter(SelfSpecDrafter):
    drafted: list[int] = []

    def propose(self, context, gamma, sampler):
        draft = super().propose(context, gamma, sampler)
        self.drafted += draft.tokens.tolist()
        return draft


def test_a_view_over_a_reduced_vocabulary_drafts_from_those_rows_alone():
    """A tied float head cut to 3 of 5 rows: the view's compact rows are the whole view's logits at
    those tokens (to the packing's rounding), scattered rows are -inf elsewhere, drafts come from
    those tokens alone and greedy output stays plain greedy's; SWIFT scores and costs a set with
    the reduced head.  An untied float head, packed away, has no reduced form (None: all tokens)."""
    reduced = TIED.reduced_head(KEEP)
    assert reduced is not None and reduced.share == 3 / 5 and TARGET.reduced_head(KEEP) is None
    whole, cut = LayerView(TIED, SKIP), LayerView(TIED, SKIP, reduced=reduced)
    seq = torch.tensor([1, 3, 0, 4, 2, 2, 1])
    full = whole.forward(seq, whole.new_cache(8))  # [7, 5]
    compact = cut.forward(seq, cut.new_cache(8), compact=True)  # [7, 3]
    assert compact.shape == (7, 3) and torch.allclose(compact, full[:, KEEP], atol=1e-5, rtol=1e-5)
    scattered = cut.forward(seq, cut.new_cache(8))
    assert torch.equal(scattered[:, KEEP], compact) and bool(torch.isinf(scattered[:, [1, 3]]).all())
    assert cut.vocab_ids is KEEP or torch.equal(cut.vocab_ids, KEEP)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30)
    plain = SpeculativeDecoder(TIED, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
    assert set(plain) - set(KEEP.tolist())  # the target says tokens the view can never draft
    _RecordingDrafter.drafted = []
    drafter = _RecordingDrafter(cut)
    out = SpeculativeDecoder(TIED, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(PROMPT, cfg)
    assert out.tokens == plain and out.stats.draft_tokens_proposed > 0
    assert _RecordingDrafter.drafted and set(_RecordingDrafter.drafted) <= set(KEEP.tolist())
    assert reduced.nbytes == 3 * 16 * 4 + 3 * 8  # float32 rows and their ids
    assert drafter.extra_bytes() == reduced.nbytes + drafter.cache.used_bytes()
    swift = SwiftDrafter(TIED, SKIP, reduced=reduced)
    assert swift._cost[2] == pytest.approx(SwiftDrafter(TIED, SKIP)._cost[2] * 3 / 5)
    with torch.inference_mode():
        rows = cut.logits(TIED.run_layers(TIED.embed_tokens(seq[:-1]), cut.new_cache(8), SKIP.steps, start=0,
                                          slots=cut._slots), compact=True)
    unbound = SwiftDrafter(TIED, SKIP, window=7, reduced=reduced)
    assert unbound._agreement(SKIP, seq) == float((KEEP[rows.argmax(-1)] == seq[1:]).float().mean())


def test_every_family_over_a_reduced_vocabulary_keeps_greedy_output_exact():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=24)
    for model in (TIED, TIED_INVARIANT):
        plain = SpeculativeDecoder(model, None, get_rule("greedy")).generate(PROMPT, cfg).tokens
        for name in ("layerskip:2", "swift"):
            drafter, _ = build(name, model, "tiny", vocab=KEEP)
            assert drafter.view.vocab_ids is not None and torch.equal(drafter.view.vocab_ids, KEEP)
            if name == "swift":
                drafter.every, drafter.window = 2, 6
            out = SpeculativeDecoder(model, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(PROMPT, cfg)
            assert out.tokens == plain, (name, model.batch_invariant)
            assert out.stats.draft_tokens_proposed > 0


def test_names_and_bad_input(tmp_path):
    assert parse_name("layerskip:12") == ("layerskip", "12")
    assert parse_name("Self-Skip") == ("self-skip", "")
    assert parse_name("smollm2-135m-draft") is None
    d, label = build("layerskip:2", INVARIANT, "tiny")
    assert label == "layerskip:2" and d.share
    for bad in ("layerskip:0", "layerskip:3", "layerskip:x"):
        with pytest.raises(ConfigError):
            build(bad, TARGET, "tiny")
    with pytest.raises(ConfigError, match="no searched skip set"):
        build("self-skip", TARGET, "tiny")
    with pytest.raises(ConfigError, match="native backend"):
        build("layerskip:2", ToyLM(4), "toy")
    path = tmp_path / "s.json"
    path.write_text('{"plan": {"n_layers": 3, "skip_attn": [1], "skip_mlp": [2]}}')
    assert load_plan(path) == LayerPlan.skipping(3, {1}, {2})
    d, label = build(f"self-skip:{path}", TARGET, "tiny")
    assert d.view.plan.skip_attn == {1} and label == "self-skip:s.json"
    with pytest.raises(ConfigError):
        load_plan(tmp_path / "missing.json")
    path.write_text('{"n_layers": 3, "skip_attn": [7]}')
    with pytest.raises(ConfigError, match="0..2"):
        load_plan(path)
    # a missing count read "KeyError: 'n_layers'"; a fractional index was cut to a whole one
    for text, says in (('{}', "it has no 'n_layers'"), ('{"plan": []}', "expected a JSON object, got list"),
                       ('{"n_layers": 3, "skip_attn": [1.7]}', "each index in skip_attn must be a whole number, got 1.7"),
                       ('{"n_layers": 3, "skip_mlp": 1}', "skip_mlp must be a list of layer indices, got 1"),
                       ('{"n_layers": "3"}', 'n_layers must be a whole number, got "3"'),
                       ('{"n_layers": 3, "exit_after": true}', "exit_after must be a whole number, got true")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape("not a layer plan: " + says)):
            load_plan(path)
    path.write_text('{"n_layers": 30}')
    with pytest.raises(ConfigError, match="30 layers"):
        build(f"self-skip:{path}", TARGET, "tiny")


def test_server_spawns_a_fresh_serialised_view_per_request():
    from types import SimpleNamespace

    from specdec.server.command import drafter_factory
    from specdec.server.sessions import SerializedModel

    for name in ("layerskip:2", "swift"):
        drafter, _ = build(name, INVARIANT, "tiny")
        make = drafter_factory(SimpleNamespace(drafter=drafter, draft_model=None))
        a, b = make(), make()
        assert a is not b and type(a) is type(drafter)
        assert isinstance(a.model, SerializedModel) and a.view.target is INVARIANT


def test_a_served_view_prefills_lazily_on_a_short_cache_and_drafts_the_same_tokens():
    """A request's view (``spawn``) runs nothing before its first drafting round (a request that
    stays backed off never pays the view's prefill), its cache starts short through the server's
    wrapper (a whole-context cache per request cost a 2-core server a third of its time with
    ``layerskip:24``), and it drafts what the engine's view drafts after a prefill."""
    from specdec.server.sessions import serialized

    prompt = torch.tensor(PROMPT + [1, 2, 3])
    cfg = SamplingConfig(temperature=0.0)
    target = tiny_native(layers=3, max_length=4096)
    # SWIFT twice: as built (no skip set shipped for the tiny model: the whole target, which never
    # prefills anyway) and on a skip set of its own, whose view would
    drafters = [build(name, target, "tiny")[0] for name in ("layerskip:2", "swift")]
    drafters.append(SwiftDrafter(target, LayerPlan.skipping(3, {1}, set())))
    for drafter in drafters:
        served = drafter.spawn(serialized)
        served.prepare(prompt)
        assert served.cache.length == 0 and served.cache.capacity < target.max_length // 8
        drafter.prepare(prompt)
        assert drafter.cache.length == (0 if drafter.whole_target else prompt.numel() - 1)
        for gamma in (0, 3):
            got = served.propose(prompt, gamma, DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(0)))
            want = drafter.propose(prompt, gamma, DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(0)))
            assert torch.equal(got.tokens, want.tokens) and got.tokens.numel() == gamma


def test_a_served_early_exit_view_copies_the_targets_keys_through_the_servers_wrapper():
    """Early exit on a server: bound to the request's target session through the server's wrapper,
    the view copies the committed positions' keys and values of layers < K from the target's cache
    instead of running its layers over them, drafts what the engine's view drafts, and its drafts
    are verified by the wrapper's own pass (the shared layers reused only by the bare target)."""
    from specdec.server.sessions import serialized

    target = tiny_native(layers=3, max_length=4096)
    drafter, _ = build("layerskip:2", target, "tiny")
    served = drafter.spawn(serialized)
    wrapper = serialized(target, initial_length=16)
    cfg = SamplingConfig(temperature=0.0)
    session = TargetSession(wrapper, PROMPT + [1, 2, 3], cfg, get_rule("greedy"), seed=0)
    served.bind_target(wrapper, session.cache)
    served.prepare(session.context)
    assert served.cache.length == 0
    sampler = DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(0))
    rows, run_layers = [], target.run_layers
    target.run_layers = lambda x, *a, **k: rows.append(x.shape[0]) or run_layers(x, *a, **k)
    try:
        draft = served.propose(session.context, 3, sampler)
    finally:
        del target.run_layers
    assert rows == [1, 1, 1]  # the last context token and two drafted ones: nothing run over the prompt
    n = session.context.numel() - 1  # committed positions copied; the last context token is the view's own row
    assert torch.equal(served.cache.k[:, :, :n], session.cache.k[:2, :, :n])
    drafter.prepare(session.context)
    want = drafter.propose(session.context, 3, DraftSampler(cfg, "multinomial", penalties=None,
                                                            generator=torch.Generator().manual_seed(0)))
    assert torch.equal(draft.tokens, want.tokens)
    feed = torch.cat([session.context[-1:], draft.tokens])
    assert draft.reuse is not None and draft.reuse.forward(wrapper, feed, session.cache) is None


def test_the_servers_fresh_drafters_keep_the_temperature_factor():
    from types import SimpleNamespace

    from specdec.drafters import ModelDrafter
    from specdec.drafters.hybrid import LookupThenModel
    from specdec.server.command import drafter_factory

    view, _ = build("layerskip:2", INVARIANT, "tiny")
    view.temperature_factor = 0.7
    model = LookupThenModel(ModelDrafter(INVARIANT, temperature_factor=0.6))
    for engine, want in ((SimpleNamespace(drafter=view, draft_model=None), 0.7),
                         (SimpleNamespace(drafter=LookupThenModel(view), draft_model=None), 0.7),
                         (SimpleNamespace(drafter=model, draft_model=SimpleNamespace(model=INVARIANT)), 0.6)):
        fresh = drafter_factory(engine)()
        assert fresh is not engine.drafter and fresh.temperature_factor == want
    plain = SimpleNamespace(drafter=ModelDrafter(INVARIANT), draft_model=SimpleNamespace(model=INVARIANT))
    assert drafter_factory(plain)().temperature_factor == 1.0


FULL = LayerPlan.skipping(3, set(), set())


def _greedy_context(n: int) -> torch.Tensor:  # [3 + n]: the prompt and the target's greedy continuation
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=n)
    out = SpeculativeDecoder(TARGET, None, get_rule("greedy")).generate([1, 3, 0], cfg)
    return torch.tensor([1, 3, 0] + out.tokens)


def test_agreement_is_the_share_of_window_rows_whose_argmax_is_the_next_token():
    """Unbound (no target cache), a set is scored over the last ``window`` tokens alone: for a plan
    that skips nothing that is the target's arg-max after each of the window's first w - 1
    tokens against the token that follows it."""
    ctx = _greedy_context(4)  # a prompt, the target's continuation, then mixed tokens
    ctx = torch.cat([ctx, torch.tensor([2, 0, 3, 1, 2, 4, 0, 3, 1, 1])])
    w = 10
    drafter = SwiftDrafter(TARGET, SKIP, window=w, budget=None)
    recent = ctx[-w:]
    with torch.inference_mode():
        top = TARGET.forward(recent[:-1], TARGET.new_cache(32)).argmax(-1)  # [w - 1]
    want = float((top == recent[1:]).float().mean())
    assert 0.0 < want < 1.0
    assert drafter._agreement(FULL, ctx) == want


def test_the_speedup_charges_each_skipped_sub_layer_its_own_cost():
    """At equal agreement, skipping the dearer sub-layer (by parameter count) is the faster set."""
    drafter = SwiftDrafter(TARGET, SKIP, budget=None)
    drafter._agreement = lambda plan, context: 0.99  # type: ignore[method-assign]
    attn, mlp, _ = param_shares(TARGET.cfg)
    assert attn != mlp
    no_attn = drafter._speedup(LayerPlan.skipping(3, {0, 1, 2}, set()), torch.zeros(1))
    no_mlp = drafter._speedup(LayerPlan.skipping(3, set(), {0, 1, 2}), torch.zeros(1))
    assert no_attn > 1.0 and no_mlp > 1.0 and (no_mlp > no_attn) == (mlp > attn)


def test_a_neighbour_toggles_exactly_one_attention_or_mlp_sub_layer():
    drafter = SwiftDrafter(TARGET, SKIP, seed=3, budget=None)
    kinds = set()
    for _ in range(40):
        n = drafter._neighbour(SKIP)
        da, dm = n.skip_attn ^ SKIP.skip_attn, n.skip_mlp ^ SKIP.skip_mlp
        assert len(da) + len(dm) == 1
        kinds.add("attn" if da else "mlp")
    assert kinds == {"attn", "mlp"}


def _argmax() -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def _shared_round():
    """One greedy round of an early-exit drafter sharing its layers < 2: its 3-token draft (with the
    shared layers), the session it drafted for, and a plain session over the same context."""
    cfg = SamplingConfig(temperature=0.0)
    drafter = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True)
    session = TargetSession(INVARIANT, PROMPT + [2, 4], cfg, get_rule("greedy"), seed=0)
    plain = TargetSession(INVARIANT, PROMPT + [2, 4], cfg, get_rule("greedy"), seed=0)
    drafter.prepare(session.context)
    draft = drafter.propose(session.context, 3, _argmax())
    assert draft.reuse is not None and draft.tokens.numel() == 3
    return draft, session, plain


def test_shared_layers_are_not_reused_for_tokens_the_draft_did_not_feed():
    """Cache sharing reuses the draft's rows only for the tokens it fed: a verification pass over
    other tokens (the draft's first token replaced) gets None (the caller runs its plain pass)
    or exactly the plain pass's logits, never logits built on the draft's rows of other tokens."""
    draft, session, plain = _shared_round()
    other = draft.tokens.clone()
    other[0] = (int(other[0]) + 1) % 5
    feed = torch.cat([session.context[-1:], other])
    got = draft.reuse.forward(INVARIANT, feed, session.cache)
    want = INVARIANT.forward(feed, plain.cache)
    assert got is None or torch.equal(got, want)


def test_a_target_cache_holding_the_last_context_token_leaves_it_to_the_view():
    """Bound to a target cache that already holds every context position (the last one too), the
    view copies only up to the last context token and runs that one itself, whose logits drafting
    needs: it drafts what the unbound view drafts over the same (early-exit) layers."""
    ctx = torch.tensor(PROMPT + [2, 4, 1, 1])
    cache = INVARIANT.new_cache(32)
    INVARIANT.forward(ctx, cache)  # all of the context, its last token included
    plan = LayerPlan.early_exit(3, 2)
    bound = SelfSpecDrafter(LayerView(INVARIANT, plan))
    bound.bind_target(INVARIANT, cache)
    bound.prepare(ctx)
    unbound = SelfSpecDrafter(LayerView(INVARIANT, plan))
    unbound.prepare(ctx)
    got, want = bound.propose(ctx, 3, _argmax()), unbound.propose(ctx, 3, _argmax())
    assert torch.equal(got.tokens, want.tokens) and got.tokens.numel() == 3
    assert bound.cache.length == ctx.numel() + 2


def test_a_view_takes_no_keys_from_another_models_cache():
    """``bind_target`` binds only the view's own target (or a wrapper whose ``inner`` is it): a
    cache of another model (other weights) is ignored, and the view drafts what the unbound view
    drafts instead of copying that model's keys and values."""
    other = tiny_native(layers=3, seed=7)
    ctx = torch.tensor(PROMPT + [2, 4, 1, 1])
    cache = other.new_cache(32)
    other.forward(ctx[:-1], cache)
    bound = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2)))
    bound.bind_target(other, cache)
    bound.prepare(ctx)
    unbound = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2)))
    unbound.prepare(ctx)
    assert torch.equal(bound.cache.k[:, :, :6], unbound.cache.k[:, :, :6])
    assert torch.equal(bound.propose(ctx, 3, _argmax()).tokens, unbound.propose(ctx, 3, _argmax()).tokens)


def test_swift_scores_over_the_window_alone_when_the_targets_cache_lacks_it():
    """SWIFT scores a set over the target's keys only where the target's cache holds the window's
    positions; bound to a cache that holds only the first few tokens, it scores as an unbound
    drafter does (over a cache of the window alone), not over keys the target never computed."""
    seq = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0, 3, 4, 0, 1])  # [L]
    cache = TARGET.new_cache(seq.numel())
    TARGET.forward(seq[:3], cache)  # only 3 of the 11 committed positions
    plan = LayerPlan.skipping(3, {2}, {2})
    bound = SwiftDrafter(TARGET, SKIP, window=8, budget=None)
    bound.bind_target(TARGET, cache)
    alone = SwiftDrafter(TARGET, SKIP, window=8, budget=None)
    assert bound._agreement(plan, seq) == alone._agreement(plan, seq)


def _switching(drafter: SwiftDrafter, wanted: LayerPlan) -> SwiftDrafter:
    """Make every scoring move to ``wanted`` (as test_swift_adapts_its_skip_set_and_stays_exact)."""
    drafter._neighbour = lambda plan: wanted  # type: ignore[method-assign]
    drafter._speedup = lambda plan, context: 2.0 if plan == wanted else 1.0  # type: ignore[method-assign]
    return drafter


def test_swift_moving_to_another_set_keeps_drafting_over_the_reduced_vocabulary():
    """A SWIFT drafter over a reduced draft vocabulary keeps it when it moves to another skip set:
    the new view's drafts come from those rows alone."""
    reduced = TIED.reduced_head(KEEP)
    wanted = LayerPlan.skipping(3, {1}, set())
    d = _switching(SwiftDrafter(TIED, SKIP, every=1, window=4, reduced=reduced, budget=None), wanted)
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0])
    d.prepare(ctx)
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                           generator=torch.Generator().manual_seed(0))
    draft = d.propose(ctx, 4, sampler)
    assert d.switches == 1 and d.view.plan == wanted
    assert d.view.reduced is reduced
    assert set(draft.tokens.tolist()) <= set(KEEP.tolist())


def test_a_served_swift_drafter_stays_wrapped_after_moving_to_another_set():
    """A request's SWIFT drafter (``spawn(wrap)``: the server's serialised view) drafts through
    the wrapper also after it moves to another skip set, never through the bare view."""
    from specdec.server.sessions import SerializedModel, serialized

    wanted = LayerPlan.skipping(3, {1}, set())
    served = _switching(SwiftDrafter(TARGET, SKIP, every=1, window=4, budget=None).spawn(serialized), wanted)
    assert isinstance(served.model, SerializedModel)
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0])
    served.prepare(ctx)
    served.propose(ctx, 2, _argmax())
    assert served.switches == 1 and served.view.plan == wanted
    assert isinstance(served.model, SerializedModel)


def test_a_target_that_is_not_batch_invariant_gets_no_shared_layers():
    """Cache sharing is bitwise only on a batch-invariant target: over a fast-attention target an
    early-exit view asked to share drafts without ``reuse`` (the verifier runs its plain pass)."""
    ctx = torch.tensor(PROMPT + [2, 4])
    for target, shares in ((TARGET, False), (INVARIANT, True)):
        d = SelfSpecDrafter(LayerView(target, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True)
        d.prepare(ctx)
        draft = d.propose(ctx, 2, _argmax())
        assert draft.tokens.numel() == 2 and (draft.reuse is not None) == shares


def test_cache_sharing_refuses_any_skipped_sub_layer():
    """Sharing needs a pure early-exit plan: a skipped MLP is refused like a skipped attention."""

    for plan in (LayerPlan.skipping(3, {1}, set()), LayerPlan.skipping(3, set(), {1})):
        with pytest.raises(ConfigError, match="pure early-exit"):
            SelfSpecDrafter(LayerView(INVARIANT, plan, keep_hidden=True), share=True)


def test_neighbours_reach_every_attention_and_mlp_sub_layer():
    """Each of the 2 x n_layers sub-layers can be toggled: 300 seeded draws of a neighbour of a
    3-layer plan hit all 6 (attention 0..2 and MLP 0..2, the MLP of layer 0 included)."""
    d = SwiftDrafter(TARGET, SKIP, seed=1, budget=None)
    seen = set()
    for _ in range(300):
        n = d._neighbour(SKIP)
        seen |= {("attn", i) for i in n.skip_attn ^ SKIP.skip_attn} | {("mlp", i) for i in n.skip_mlp ^ SKIP.skip_mlp}
    assert seen == {(kind, i) for kind in ("attn", "mlp") for i in range(3)}


def test_a_built_early_exit_view_hands_its_layers_to_the_verification_pass():
    """``layerskip:K`` is built to share: its drafts carry layers the verification pass really
    reuses (logits, not None), bitwise the plain pass's, on a batch-invariant target."""
    drafter, _ = build("layerskip:2", INVARIANT, "tiny")
    cfg = SamplingConfig(temperature=0.0)
    session = TargetSession(INVARIANT, PROMPT + [2, 4], cfg, get_rule("greedy"), seed=0)
    plain = TargetSession(INVARIANT, PROMPT + [2, 4], cfg, get_rule("greedy"), seed=0)
    drafter.prepare(session.context)
    draft = drafter.propose(session.context, 3, _argmax())
    feed = torch.cat([session.context[-1:], draft.tokens])
    got = draft.reuse.forward(INVARIANT, feed, session.cache)
    assert got is not None and torch.equal(got, INVARIANT.forward(feed, plain.cache))


def _neighbours(drafter: SwiftDrafter, n: int = 12) -> list[LayerPlan]:
    return [drafter._neighbour(SKIP) for _ in range(n)]


def test_a_spawned_swift_drafter_keeps_the_seed_it_was_built_with():
    """SWIFT's neighbours are "seeded, so runs are reproducible": a request's fresh copy (``spawn``,
    what the server hands each request) must draw the neighbours the drafter it copies was seeded
    for, not restart at seed 0 whatever ``seed`` was given.  (12 draws of 6 possible neighbours:
    two seeds giving the same 12 is odd 6**-12; checked below that seeds 0 and 5 differ here.)"""
    seeded = SwiftDrafter(TARGET, SKIP, seed=5, budget=None)
    want = _neighbours(SwiftDrafter(TARGET, SKIP, seed=5, budget=None))
    assert want != _neighbours(SwiftDrafter(TARGET, SKIP, seed=0, budget=None))  # the seed matters here
    assert _neighbours(seeded.spawn()) == want


def test_a_skipped_index_must_name_one_of_the_targets_layers():
    """A skip set names layers 0 .. n-1: index n (one past the last) is refused as a one-line
    ConfigError, in either group, not silently ignored by the plan's steps."""
    for attn, mlp in (({3}, set()), (set(), {3})):
        with pytest.raises(ConfigError, match="0..2"):
            LayerPlan.skipping(3, attn, mlp)
    assert LayerPlan.skipping(3, {2}, {2}).steps == ((0, True, True), (1, True, True))


def test_a_layer_plan_file_names_its_index_lists_as_lists(tmp_path):
    """A skip set's ``skip_attn`` / ``skip_mlp`` must be JSON lists: a string or an object there is
    refused with the message naming the key (not read character by character or key by key)."""
    path = tmp_path / "s.json"
    for value in ('"12"', '{"1": 0}'):
        path.write_text('{"n_layers": 3, "skip_attn": %s}' % value)
        with pytest.raises(ConfigError, match="skip_attn must be a list of layer indices"):
            load_plan(path)


def test_a_skip_set_file_that_is_not_json_is_a_config_error(tmp_path):
    """Malformed JSON in a skip-set file is a one-line ConfigError naming the file, not a traceback."""
    path = tmp_path / "broken.json"
    path.write_text('{"n_layers": 3,')
    with pytest.raises(ConfigError, match="cannot read skip-set file"):
        load_plan(path)


def _swift(**kw):
    return SwiftDrafter(tiny_native(layers=3, batch_invariant=False), LayerPlan.skipping(3, {1}, {2}), **kw)


def test_swift_affords_a_scoring_exactly_up_to_its_budget():
    """Before the first scoring its cost is bounded by (1 + tries) passes of window - 1 one-row
    draft steps, and it runs when that is at most ``budget`` of the decoding time seen (the
    boundary included); with no draft step measured there is no bound and no scoring.  Values
    chosen to be exact in binary floating point: cost 2 x 2 x 0.25 = 1.0, budget 0.5."""
    d = _swift(tries=1, window=3, budget=0.5)
    d.seen_s = 100.0
    assert not d._affordable()  # no draft step measured yet
    d._step_s = 0.25
    d.seen_s = 2.0
    assert d._affordable()  # 1.0 <= 0.5 x 2.0: at the budget is within it
    d.seen_s = 1.999
    assert not d._affordable()
    d._scoring_cost, d._scored_at, d.seen_s = 0.5, 1.0, 2.0  # after one: its measured cost, since then
    assert d._affordable()
    d.seen_s = 1.99
    assert not d._affordable()


def test_a_spawned_swift_drafter_keeps_every_setting():
    """A server's per-request copy scores and budgets as the drafter it was spawned from."""
    d = _swift(every=5, window=9, tries=2, max_backoff=3, budget=0.125, seed=7)
    s = d.spawn()
    assert (s.every, s.window, s.tries, s.max_backoff, s.budget, s.seed) == (5, 9, 2, 3, 0.125, 7)
    assert s.view.plan == d.view.plan and s.view.reduced is d.view.reduced
    assert _swift(budget=None).spawn().budget is None


def test_swift_scores_only_once_the_context_is_longer_than_its_window():
    """A scoring needs ``window`` committed tokens plus the one before them: with a context of
    exactly ``window`` tokens it does not score (it would score one row fewer than promised)."""
    d = _swift(every=1, window=7, tries=1, budget=None)
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1])
    d.prepare(ctx)
    for _ in range(3):
        d.propose(ctx, 0, sampler)
    assert d.scorings == 0
    longer = torch.cat([ctx, torch.tensor([0])])
    d.propose(longer, 0, sampler)
    assert d.scorings == 1


def test_a_verification_pass_over_rows_the_draft_fed_runs_no_lower_layer(monkeypatch):
    """SharedLayers reuses the draft's layers < k for EVERY row the draft fed: verifying exactly
    those rows (the last context token and the draft's first γ - 1 tokens) runs only layers >= k,
    over all of them, and gives bitwise the plain pass's logits; the one row the draft did not feed
    (its last token) is the only one that goes through layers < k."""
    draft, session, plain = _shared_round()
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = INVARIANT.run_layers

    def spy(x, cache, steps, **kw):
        calls.append((x.shape[0], tuple(li for li, _, _ in steps)))
        return real(x, cache, steps, **kw)

    fed = torch.cat([session.context[-1:], draft.tokens[:-1]])  # the 3 rows the draft ran itself
    monkeypatch.setattr(INVARIANT, "run_layers", spy)
    got = draft.reuse.forward(INVARIANT, fed, session.cache)
    monkeypatch.undo()
    assert calls == [(3, (2,))]  # layers >= 2 only, for all 3 rows; none of layers 0, 1
    assert got is not None and torch.equal(got, INVARIANT.forward(fed, plain.cache))
    # the whole feed: exactly the draft's unfed last token runs layers < k
    session.cache.truncate(session.cache.length - 3)
    plain.cache.truncate(plain.cache.length - 3)
    calls.clear()
    feed = torch.cat([session.context[-1:], draft.tokens])
    monkeypatch.setattr(INVARIANT, "run_layers", spy)
    got = draft.reuse.forward(INVARIANT, feed, session.cache)
    monkeypatch.undo()
    assert calls == [(1, (0, 1)), (4, (2,))]
    assert torch.equal(got, INVARIANT.forward(feed, plain.cache))


def _bound_early_exit(ctx: torch.Tensor) -> SelfSpecDrafter:
    cache = INVARIANT.new_cache(32)
    INVARIANT.forward(ctx[:-1], cache)  # the target's cache: every committed position but the last
    drafter = SelfSpecDrafter(LayerView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True)
    drafter.bind_target(INVARIANT, cache)
    drafter.prepare(ctx)
    return drafter


def test_a_round_that_drafts_nothing_copies_no_keys_into_the_view():
    """Bound to the target's cache, the view copies committed keys/values only in a round that
    drafts (γ > 0): rounds at γ = 0 leave its cache empty (a request that never drafts holds no
    copy of the target's keys: extra_bytes stays 0), and the first drafting round copies them."""
    ctx = torch.tensor(PROMPT + [2, 4, 1, 1])
    drafter = _bound_early_exit(ctx)
    for _ in range(3):
        assert drafter.propose(ctx, 0, _argmax()).tokens.numel() == 0
    assert drafter.cache.length == 0 and drafter.extra_bytes() == 0
    draft = drafter.propose(ctx, 2, _argmax())
    assert draft.tokens.numel() == 2 and drafter.cache.length == ctx.numel() + 1


def test_an_empty_draft_carries_no_shared_layers():
    """A sharing early-exit drafter hands the verifier layers to reuse only with drafted tokens:
    a round at γ = 0 (nothing drafted) gives a Draft whose ``reuse`` is None, so the verifier runs
    its plain one-token pass instead of consulting the view's cache."""
    ctx = torch.tensor(PROMPT + [2, 4, 1, 1])
    drafter = _bound_early_exit(ctx)
    assert drafter.propose(ctx, 2, _argmax()).reuse is not None
    empty = drafter.propose(ctx, 0, _argmax())
    assert empty.tokens.numel() == 0 and empty.reuse is None


def test_swift_scores_over_the_targets_cache_when_it_holds_just_the_keys_the_window_needs():
    """The window's rows (the last ``window`` committed tokens but the last) are scored over the
    target's keys before each row's position: a target cache of L - 2 positions already holds all
    of them, so SWIFT scores over it — the same score as over a cache of L - 1 positions, not the
    window-alone score an unbound drafter gets (they differ on this sequence)."""
    seq = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0, 3, 4, 0, 1])  # [L]
    plan = LayerPlan.skipping(3, {2}, {2})
    scores = []
    for held in (seq.numel() - 1, seq.numel() - 2):
        cache = TARGET.new_cache(seq.numel())
        TARGET.forward(seq[:held], cache)
        bound = SwiftDrafter(TARGET, SKIP, window=8, budget=None)
        bound.bind_target(TARGET, cache)
        scores.append(bound._agreement(plan, seq))
    alone = SwiftDrafter(TARGET, SKIP, window=8, budget=None)._agreement(plan, seq)
    assert scores[0] == scores[1] != alone


def _swift_switching_once(**kw):
    """A SWIFT drafter (every 3 rounds, 1 try) whose first scoring moves it to another set and
    whose later ones keep it; ``kw``: more settings (a clock)."""
    wanted = LayerPlan.skipping(3, {1}, set())
    d = SwiftDrafter(TARGET, SKIP, every=3, window=4, tries=1, max_backoff=4, budget=None, **kw)
    d._neighbour = lambda plan: wanted  # type: ignore[method-assign]
    d._speedup = lambda plan, context: 2.0 if plan == wanted and d.scorings == 1 else 1.0  # type: ignore[method-assign]
    return d


def test_after_a_switch_swift_counts_the_switching_round_into_the_next_interval():
    """A scoring that switches sets the interval back to ``every`` with the switching round as its
    first round: with every = 3, scorings at rounds 3 (switch), 5 (keeps: the interval doubles
    to 6) and 11 — over 12 rounds of a single sequence."""
    d = _swift_switching_once()
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0])
    d.prepare(ctx)
    at = []
    for r in range(1, 13):
        before = d.scorings
        d.propose(ctx, 0, _argmax())  # the rounds count; nothing drafted
        if d.scorings > before:
            at.append(r)
    assert at == [3, 5, 11] and d.switches == 1


def test_a_switch_does_not_drop_the_gap_to_the_next_call_from_the_decoding_time_seen():
    """Moving to another set rebuilds the draft cache (a reset) but the sequence goes on: the time
    from the switching call to the next is decoding time seen like any other gap — 6 calls 0.1 s
    apart (the clock moved by hand; the third switches) see 0.5 s."""
    clock = _Clock()
    d = _swift_switching_once(clock=clock)
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0])
    d.prepare(ctx)
    for _ in range(6):
        d.propose(ctx, 0, _argmax())
        clock.t += 0.1
    assert d.switches == 1
    assert abs(d.seen_s - 0.5) < 1e-9


def test_shared_layers_give_the_targets_features_for_their_own_tap_alone():
    """A target-aware drafter's verification pass through SharedLayers (taps == (k,)): logits and
    features [n, 2, D] (the stream after k layers, the final hidden state after the final norm)
    bitwise those of the target's own ``forward_features``; any other taps (another layer, or k
    with a second one) get None, so the caller runs its plain pass."""
    draft, session, plain = _shared_round()
    feed = torch.cat([session.context[-1:], draft.tokens])
    for taps in ((1,), (3,), (2, 1)):
        assert draft.reuse.forward_features(INVARIANT, feed, session.cache, taps) is None
    got = draft.reuse.forward_features(INVARIANT, feed, session.cache, (2,))
    want = INVARIANT.forward_features(feed, plain.cache, (2,))
    assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_swift_bounds_its_first_scoring_by_the_cheapest_draft_step_measured(monkeypatch):
    """Before its first scoring SWIFT bounds the cost by the cheapest one-token draft step seen so
    far: a cheap round (0.01 s a token) then a dear one (0.1 s a token) leave the bound at
    (1 + tries) x (window - 1) x 0.01 s, not at the last step's 0.1 s."""
    clock = _Clock()
    d = SwiftDrafter(TARGET, SKIP, every=1000, window=4, tries=1, budget=0.5, clock=clock)
    costs = iter([0.01, 0.1])

    def draft(self, context, gamma, sampler):
        clock.t += next(costs) * gamma
        return Draft(tokens=torch.zeros(gamma, dtype=torch.long), probs=None)

    monkeypatch.setattr(SelfSpecDrafter, "propose", draft)
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0])
    for _ in range(2):
        d.propose(ctx, 2, _argmax())
    assert abs(d._step_s - 0.01) < 1e-9
    bound = (1 + 1) * (4 - 1) * 0.01  # 0.06 s: affordable once 0.12 s of decoding is seen
    d.seen_s = d._scored_at + bound / 0.5
    assert d._affordable()


def test_a_skip_set_view_holds_the_targets_keys_for_committed_positions_in_every_sequence():
    """A skip-set view bound to the target's cache (the decoder binds it) replaces the keys/values
    it computed itself by the target's once committed — in a second sequence too, whose 1-token
    prompt leaves nothing to copy in its first round: what the last sequence copied is forgotten
    at the new sequence, so every synced position of the view's cache holds the target's keys of
    the layers whose attention the view runs (0 and 2 here), not the view's own."""

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10)
    drafter = SelfSpecDrafter(LayerView(INVARIANT, SKIP))
    dec = SpeculativeDecoder(INVARIANT, drafter, get_rule("greedy"), gamma=FixedGamma(2))
    dec.generate([1, 3, 0, 2, 4, 1, 1, 3, 2, 0, 4, 2], cfg)  # a long first sequence: many synced positions
    out = dec.generate([3], cfg)
    committed = torch.tensor([3] + out.tokens)
    ref = INVARIANT.new_cache(64)
    INVARIANT.forward(committed, ref)
    s = drafter._synced
    assert 2 <= s <= committed.numel()
    layers = torch.tensor(SKIP.attention_layers)
    assert torch.equal(drafter.cache.k[:, :, :s], ref.k[:, :, :s].index_select(0, layers))
    assert torch.equal(drafter.cache.v[:, :, :s], ref.v[:, :, :s].index_select(0, layers))


def test_a_view_that_skips_only_mlp_sub_layers_is_not_the_whole_target():
    """``whole_target`` (drafting cannot pay; no prefill up front) is only the view running every
    sub-layer: a skipped MLP alone, or a skipped attention alone, or an early exit makes it cheaper."""
    assert SelfSpecDrafter(LayerView(TARGET, LayerPlan.skipping(3, set(), set()))).whole_target
    for plan in (LayerPlan.skipping(3, set(), {1}), LayerPlan.skipping(3, {1}, set()), LayerPlan.early_exit(3, 2)):
        assert not SelfSpecDrafter(LayerView(TARGET, plan)).whole_target, plan


def test_a_view_caches_bytes_count_its_keys_values_residuals_and_token_ids():
    """``nbytes`` (what memory accounting reads) is the keys/values buffer plus the residual rows
    and the int64 token id kept at every slot of the capacity; ``bytes_per_position`` the same per
    position."""
    view = LayerView(INVARIANT, LayerPlan.early_exit(3, 2), keep_hidden=True)
    cache = view.new_cache(16)
    kv = cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
    resid = cache.resid.numel() * cache.resid.element_size()
    assert cache.nbytes == kv + resid + 8 * cache.capacity
    plain = LayerView(INVARIANT, LayerPlan.early_exit(3, 2)).new_cache(16)  # no residual rows
    assert plain.resid is None
    assert plain.nbytes == plain.k.numel() * plain.k.element_size() * 2 + 8 * plain.capacity




def test_an_early_exit_after_no_layer_is_refused(tmp_path):
    """An early exit runs layers 0 .. K-1 with K in 1 .. n_layers: K = 0 (a "draft" of the
    embedding straight into the head) is refused, built directly or read from a skip-set file."""
    with pytest.raises(ConfigError, match="early exit must be after 1 to 3 layers, got 0"):
        LayerPlan(3, 0)
    path = tmp_path / "s.json"
    path.write_text('{"n_layers": 3, "exit_after": 0}')
    with pytest.raises(ConfigError, match="got 0"):
        load_plan(path)


def test_a_negative_skipped_index_is_refused(tmp_path):
    """Skipped sub-layers name layers 0 .. n-1: a negative index (Python's "from the end") is
    refused as a one-line ConfigError, not silently ignored by the plan's steps."""
    for attn, mlp in (({-1}, set()), (set(), {-1})):
        with pytest.raises(ConfigError, match=r"0\.\.2"):
            LayerPlan.skipping(3, attn, mlp)
    path = tmp_path / "s.json"
    path.write_text('{"n_layers": 3, "skip_mlp": [-1]}')
    with pytest.raises(ConfigError, match=r"0\.\.2, got \[-1\]"):
        load_plan(path)


def test_a_views_cache_holds_keys_in_the_targets_kv_dtype_and_sharing_stays_bitwise():
    """A target whose caches hold float16 keys/values (``set_kv_dtype``): the view's cache holds
    its keys/values in float16 too (its residual rows in the target's float32), so the layers it
    shares with the verification pass are the rounded ones the target's own pass computes —
    the shared pass's logits are bitwise the plain pass's."""

    target = tiny_native(layers=3)
    target.set_kv_dtype(torch.float16)
    view = LayerView(target, LayerPlan.early_exit(3, 2), keep_hidden=True)
    cache = view.new_cache(16)
    assert cache.k.dtype == torch.float16 and cache.v.dtype == torch.float16 and cache.resid.dtype == torch.float32
    drafter = SelfSpecDrafter(view, share=True)
    cfg = SamplingConfig(temperature=0.0)
    prompt = [1, 3, 0, 2, 4]
    session = TargetSession(target, prompt, cfg, get_rule("greedy"), seed=0)
    plain = TargetSession(target, prompt, cfg, get_rule("greedy"), seed=0)
    drafter.prepare(session.context)
    draft = drafter.propose(session.context, 3, _argmax())
    feed = torch.cat([session.context[-1:], draft.tokens])
    got = draft.reuse.forward(target, feed, session.cache)
    assert got is not None and torch.equal(got, target.forward(feed, plain.cache))


def test_shared_layers_of_a_view_without_residual_rows_are_not_reused():
    """Cache sharing needs the residual stream the view kept (``keep_hidden``): a sharing
    early-exit drafter whose view keeps none hands the verifier layers that give None (the caller
    runs its plain pass), not a crash on the missing rows."""

    target = tiny_native(layers=3)
    drafter = SelfSpecDrafter(LayerView(target, LayerPlan.early_exit(3, 2)), share=True)
    cfg = SamplingConfig(temperature=0.0)
    session = TargetSession(target, [1, 3, 0, 2, 4], cfg, get_rule("greedy"), seed=0)
    drafter.prepare(session.context)
    draft = drafter.propose(session.context, 2, _argmax())
    assert draft.reuse is not None and draft.tokens.numel() == 2
    feed = torch.cat([session.context[-1:], draft.tokens])
    assert draft.reuse.forward(target, feed, session.cache) is None
    assert draft.reuse.forward_features(target, feed, session.cache, (2,)) is None


def test_the_cost_model_counts_a_llama_layers_matrices():
    """``param_shares``: one attention sub-layer reads q, k, v and o ((2 x heads + 2 x kv heads)
    x head_dim x width), one MLP sub-layer gate, up and down (3 x width x intermediate), the head
    vocab x width (times the share of its rows a reduced vocabulary computes); each over the
    weights a whole step reads; on the tiny target (width 16, 2 heads, 1 kv head of 8, MLP 32, 5 tokens)."""

    attn = (2 * 2 + 2 * 1) * 8 * 16  # q [16, 16], k [8, 16], v [8, 16], o [16, 16]
    mlp = 3 * 16 * 32  # gate [32, 16], up [32, 16], down [16, 32]
    head = 5 * 16
    total = 3 * (attn + mlp) + head
    got = param_shares(TARGET.cfg, head_share=0.6)
    assert got == pytest.approx((attn / total, mlp / total, head * 0.6 / total), rel=1e-12)


def test_swift_scores_over_the_window_alone_when_the_targets_cache_is_three_short():
    """The window's last row (position L - 2) is scored over the target's keys at positions
    0 .. L - 3: a target cache holding L - 2 positions has them, one holding only L - 3 lacks
    one; then SWIFT scores as an unbound drafter does, not over a key the target never wrote."""
    seq = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0, 3, 4, 0, 1])  # [L]
    plan = LayerPlan.skipping(3, {2}, {2})
    cache = TARGET.new_cache(seq.numel())
    TARGET.forward(seq[: seq.numel() - 3], cache)
    bound = SwiftDrafter(TARGET, SKIP, window=8, budget=None)
    bound.bind_target(TARGET, cache)
    alone = SwiftDrafter(TARGET, SKIP, window=8, budget=None)
    assert bound._agreement(plan, seq) == alone._agreement(plan, seq)


def test_a_spawned_swift_drafter_keeps_its_time_source():
    """``clock`` is SWIFT's time source ("tests pass their own"): a server's per-request copy
    (``spawn``) measures decoding time with it too — 2 calls 5 s apart on a hand-moved clock
    see 5 s, whatever the wall clock did."""
    clock = _Clock()
    spawned = SwiftDrafter(TARGET, SKIP, every=1000, window=4, budget=None, clock=clock).spawn()
    ctx = torch.tensor([1, 3, 0, 4, 2])
    spawned.prepare(ctx)
    spawned.propose(ctx, 0, _argmax())
    clock.t += 5.0
    spawned.propose(ctx, 0, _argmax())
    assert spawned.seen_s == 5.0


def test_a_bound_view_remembers_how_far_it_holds_the_targets_keys():
    """Bound to the target's cache, a drafting round copies the committed positions' keys up to
    the last context token and records that (``_synced``): the next round copies only the
    positions committed since, not the whole context again (a cost linear in the context per
    round)."""
    target = tiny_native(layers=3)
    ctx = torch.tensor([1, 3, 0, 2, 4, 1, 1])
    cache = target.new_cache(32)
    target.forward(ctx[:-1], cache)
    drafter = SelfSpecDrafter(LayerView(target, LayerPlan.early_exit(3, 2), keep_hidden=True))
    drafter.bind_target(target, cache)
    drafter.prepare(ctx)
    drafter.propose(ctx, 2, _argmax())
    assert drafter._synced == ctx.numel() - 1
    drafter.cache.truncate(ctx.numel())  # the round's drafts rejected: its own row of the last token kept
    longer = torch.cat([ctx, torch.tensor([3, 0])])
    target.forward(longer[ctx.numel() - 1 : -1], cache)  # the target committed two more positions
    before = drafter.cache.k[:, :, : ctx.numel() - 1].clone()
    cache.k[:, :, : ctx.numel() - 1] = 0.0  # earlier positions: a re-copy would be visible
    drafter.propose(longer, 2, _argmax())
    assert drafter._synced == longer.numel() - 1
    assert torch.equal(drafter.cache.k[:, :, : ctx.numel() - 1], before)


def test_every_set_swift_tries_is_a_neighbour_of_its_current_set():
    """A scoring tries ``tries`` random neighbours of the CURRENT set (one sub-layer added or
    removed), even when an earlier try scored better: with each try scoring above the last (so
    the best moves at every try), all 4 sets tried differ from the starting set by one toggle."""
    d = SwiftDrafter(TARGET, SKIP, every=1, window=4, tries=4, budget=None, seed=0)
    scored: list[LayerPlan] = []

    def speedup(plan, context):
        scored.append(plan)
        return float(len(scored))  # every try beats the best so far

    d._speedup = speedup  # type: ignore[method-assign]
    ctx = torch.tensor([1, 3, 0, 4, 2, 2])
    d.prepare(ctx)
    d.propose(ctx, 0, _argmax())
    assert d.scorings == 1 and len(scored) == 5 and scored[0] == SKIP
    for trial in scored[1:]:
        assert len(trial.skip_attn ^ SKIP.skip_attn) + len(trial.skip_mlp ^ SKIP.skip_mlp) == 1, trial
    assert d.view.plan == scored[-1]  # it moved to the best-scoring try


def test_a_skip_set_file_holding_a_json_list_is_a_one_line_config_error(tmp_path):
    """A skip-set file must hold a JSON object (the plan, or ``{"plan": ...}``): a top-level list
    is refused naming the file, not an AttributeError traceback."""
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a skip-set file"):
        load_plan(path)


def test_a_skip_set_file_path_may_start_with_the_home_folder(tmp_path, monkeypatch):
    """``self-skip:~/s.json``: the path is expanded like a shell would."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "s.json").write_text('{"n_layers": 3, "skip_attn": [1]}')
    assert load_plan("~/s.json") == LayerPlan.skipping(3, {1}, set())


def test_a_built_skip_set_view_drafts_over_the_reduced_vocabulary(tmp_path):
    """``build(..., vocab=...)``: a searched skip set (``self-skip:FILE``) drafts over the reduced
    vocabulary's rows like ``layerskip:K`` and ``swift`` do, where the target's head can be cut."""
    tied = tiny_native(layers=3, batch_invariant=False, tied=True)
    keep = torch.tensor([0, 2, 4])
    path = tmp_path / "s.json"
    path.write_text('{"n_layers": 3, "skip_attn": [1], "skip_mlp": [2]}')
    drafter, _ = build(f"self-skip:{path}", tied, "tiny", vocab=keep)
    assert drafter.view.vocab_ids is not None and torch.equal(drafter.view.vocab_ids, keep)
    ctx = torch.tensor([1, 3, 0, 1, 3])
    drafter.prepare(ctx)
    draft = drafter.propose(ctx, 4, _argmax())
    assert draft.tokens.numel() == 4 and set(draft.tokens.tolist()) <= {0, 2, 4}


def test_a_new_sequence_starts_swifts_round_count_afresh():
    """The rounds until the next scoring count within a sequence (the interval itself is carried
    over): 3 rounds of one sequence and 3 of the next, with a scoring due every 4, score nothing."""
    d = SwiftDrafter(TARGET, SKIP, every=4, window=4, tries=1, budget=None)
    d._speedup = lambda plan, context: 1.0  # type: ignore[method-assign]
    ctx = torch.tensor([1, 3, 0, 4, 2, 2])
    for _ in range(2):
        d.prepare(ctx)
        for _ in range(3):
            d.propose(ctx, 0, _argmax())
    assert d.scorings == 0
    d.propose(ctx, 0, _argmax())  # the 4th round of this sequence
    assert d.scorings == 1


def test_a_views_drafter_holds_to_the_max_length_asked_for():
    """``SelfSpecDrafter(view, max_length=...)``: the draft cache holds at most that many
    positions; a longer context gets no draft (a plain round), as for any model drafter."""
    d = SelfSpecDrafter(LayerView(TARGET, SKIP), max_length=8)
    assert d.room == 8
    ctx = torch.tensor([1, 3, 0, 4, 2, 2, 1, 0, 3, 4])
    d.prepare(ctx)
    assert d.propose(ctx, 2, _argmax()).tokens.numel() == 0


@pytest.mark.parametrize("seed", range(6))
def test_swift_scores_each_window_row_at_its_own_position_over_the_targets_cache(seed):
    """Bound to the target's cache, each window row is scored at its own absolute position (the
    target's keys before it, rotary at it): the score is exactly the share of rows, run as drafted
    from ``L - window``, whose arg-max is the next committed token (6 seeded 16-token sequences,
    several plans each)."""
    seq = torch.randint(0, 5, (16,), generator=torch.Generator().manual_seed(seed))
    cache = TARGET.new_cache(seq.numel())
    TARGET.forward(seq[:-1], cache)
    drafter = SwiftDrafter(TARGET, SKIP, window=10, budget=None)
    drafter.bind_target(TARGET, cache)
    start = seq.numel() - 10
    for plan in (SKIP, LayerPlan.skipping(3, {2}, {2}), LayerPlan.skipping(3, {0}, {1}), LayerPlan.early_exit(3, 1)):
        with torch.inference_mode():
            rows = TARGET.head(TARGET.run_layers(TARGET.embed_tokens(seq[start:-1]), cache, plan.steps, start=start,
                                                 as_drafted=True))
        assert drafter._agreement(plan, seq) == float((rows.argmax(-1) == seq[start + 1 :]).float().mean()), plan
