"""The full decoder's output law on exact toy models, for every rule x sampling option.

Each law test draws N = 12,000 independent generations (seed = sample index) of 3 new tokens
from a 4-token order-2 toy target (64 possible outputs) and runs a chi-square goodness-of-fit
test against the exact law computed by enumeration; it fails at p < 1e-4.  The negative controls
at the bottom run the same test on the lossy shortcut rules and must fail, which shows that this
sample size detects a biased rule.
"""

from __future__ import annotations

import time

import pytest
import torch

from specdec import defaults
from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.hybrid import LookupThenModel
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError, ContextLengthError
from specdec.gamma import CostGamma, FixedGamma
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig, StopFloor
from specdec.session import TargetSession
from specdec.verify import get_rule
from stats import ALPHA, chi_square_pvalue, exact_law

N_SAMPLES = 12_000
#: the negative controls below draw half as many: a wrong rule that fails with fewer samples is the
#: stronger result.  Measured p at 3,000 / 12,000 samples (ALPHA = 1e-4): lossy-resample-p 2e-49 /
#: 1e-227, lossy-strict-residual 2e-7 / 2e-50, lossy-ratio-threshold 4e-52 / 7e-239, an unscaled q
#: reported for drafts sampled at 0.3 T 3e-106 / 0.
N_CONTROL = N_SAMPLES // 2
N_NEW = 3
PROMPT = [1, 2]
TARGET = ToyLM(4, order=2, seed=0)
DRAFT = TARGET.perturbed(1.0, seed=1)

class NoRepeat:
    """A toy grammar: no token twice in a row, and the first generated token is never 0."""
    def allowed(self, generated, vocab_size):
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[generated[-1] if generated else 0] = False
        return mask


OPTIONS = {
    "temperature": SamplingConfig(temperature=0.7),
    "top_k": SamplingConfig(temperature=1.0, top_k=2),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.75),
    "min_p": SamplingConfig(temperature=1.0, min_p=0.3),
    "repetition_penalty": SamplingConfig(temperature=1.0, repetition_penalty=1.6),
    "freq_presence": SamplingConfig(temperature=1.0, frequency_penalty=0.4, presence_penalty=0.3),
    "logit_bias": SamplingConfig(temperature=1.0, logit_bias=((0, 1.5), (2, -2.0))),
    "constraint": SamplingConfig(temperature=1.0, constraint=NoRepeat()),
}


def _samples(method: str, cfg: SamplingConfig, *, drafter=None, gamma=None, n: int = N_SAMPLES):
    dec = SpeculativeDecoder(TARGET, drafter or ModelDrafter(DRAFT), get_rule(method), gamma=gamma or FixedGamma(2))
    out = []
    for i in range(n):
        c = SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})
        out.append(tuple(dec.generate(PROMPT, c).tokens))
    return out


def test_negative_control_constraint_on_the_draft_only_is_detected():
    """The constraint applied to q but not to p: the output follows the unconstrained target."""
    cfg = OPTIONS["constraint"]
    free = SamplingConfig(temperature=1.0)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule("block"), gamma=FixedGamma(2))
    out = []
    for i in range(N_SAMPLES // 4):
        c = SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})
        session = TargetSession(TARGET, PROMPT, SamplingConfig(**{**free.__dict__, "seed": i, "max_new_tokens": N_NEW}),
                                get_rule("block"), seed=i)
        out.append(tuple(dec.generate(PROMPT, c, verifier=session).tokens))
    assert chi_square_pvalue(out, law) < ALPHA


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("method", ["token", "block", "coupled"])
def test_output_law_matches_target(method, option):
    cfg = OPTIONS[option]
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    assert chi_square_pvalue(_samples(method, cfg), law) > ALPHA


@pytest.mark.parametrize("method", ["token", "block", "coupled"])
def test_output_law_with_min_tokens(method):
    """vLLM's min_tokens through the decoder: end-of-sequence (token 0 here) is masked out of the
    first two tokens' law, composed with a grammar; the third may end the sequence.  Same N and
    threshold as the other law tests."""
    cfg = SamplingConfig(temperature=1.0, min_tokens=2, constraint=NoRepeat())
    law = exact_law(TARGET, PROMPT, SamplingConfig(temperature=1.0, constraint=StopFloor(frozenset({0}), 2, NoRepeat())), N_NEW)
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(2), eos_ids=frozenset({0}))
    out = [tuple(dec.generate(PROMPT, SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})).tokens)
           for i in range(N_SAMPLES)]
    assert chi_square_pvalue(out, law) > ALPHA


def test_output_law_with_a_grammar_after_thinking():
    """A constraint that holds only after a reasoning model's thinking (token 1 opens the block,
    2 closes it; :class:`specdec.grammar.AfterThinking` over :class:`NoRepeat`): drafts that cross
    the block's end are verified under a mask that changes inside one round.  Same N and
    threshold as the other law tests; block verification, the rule with the most state."""
    from specdec.grammar import AfterThinking

    class Spelled:
        """The same constraint written out by hand for the exact law."""

        def allowed(self, generated, vocab_size):
            if list(generated[:1]) == [1]:  # opened: free up to the close, NoRepeat on what follows it
                rest = list(generated[1:])
                return NoRepeat().allowed(rest[rest.index(2) + 1:], vocab_size) if 2 in rest else torch.ones(vocab_size, dtype=torch.bool)
            mask = NoRepeat().allowed(generated, vocab_size)
            mask[1] |= not generated  # the first token may open the block
            return mask

    cfg = SamplingConfig(temperature=1.0, constraint=AfterThinking(NoRepeat(), 1, 2, opened=False))
    law = exact_law(TARGET, PROMPT, SamplingConfig(temperature=1.0, constraint=Spelled()), N_NEW)
    assert chi_square_pvalue(_samples("block", cfg, gamma=FixedGamma(3)), law) > ALPHA


@pytest.mark.parametrize("method", ["token", "block"])
def test_output_law_with_ngram_drafter_and_auto_gamma(method):
    """A deterministic drafter (one-hot q) and a γ that changes between rounds."""
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.2)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    gamma = CostGamma(start=3)
    assert chi_square_pvalue(_samples(method, cfg, drafter=NgramDrafter(), gamma=gamma), law) > ALPHA


def test_output_law_with_a_prediction_in_front_of_the_draft_model():
    """OpenAI's Predicted Outputs: free, deterministic drafts from a fixed guess at the answer (here
    one the target often follows, and often not), the draft model where the guess has nothing.
    Same N and threshold as the other law tests; block verification, γ auto."""
    from specdec.drafters.predicted import Predicted

    cfg = SamplingConfig(temperature=1.0, top_p=0.9)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    drafter = Predicted([3, 1, 3, 2, 3], ModelDrafter(DRAFT))
    assert chi_square_pvalue(_samples("block", cfg, drafter=drafter, gamma=CostGamma(start=2)), law) > ALPHA
    assert drafter.proposed > N_SAMPLES and drafter.accepted > 0  # the prediction did draft


@pytest.mark.parametrize("method", ["lossy_resample_p", "lossy_strict_residual", "lossy_ratio_threshold"])
def test_negative_control_lossy_rules_are_detected(method):
    cfg = OPTIONS["temperature"]
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    assert chi_square_pvalue(_samples(method, cfg, n=N_CONTROL), law) < ALPHA


# ----------------------------------------------------------------------------- deterministic checks


def _plain(cfg: SamplingConfig, method: str = "greedy", prompt=PROMPT, target=TARGET):
    return SpeculativeDecoder(target, None, get_rule(method)).generate(prompt, cfg).tokens


@pytest.mark.parametrize("method", ["greedy", "token", "block", "coupled"])
@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_greedy_equals_plain_greedy(method, penalty):
    target = ToyLM(6, order=3, seed=7)
    draft = target.perturbed(0.8, seed=8)
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=penalty, max_new_tokens=40)
    for prompt in ([1], [2, 3, 4], [5, 5, 0, 1]):
        ref = _plain(cfg, prompt=prompt, target=target)
        for gamma in (1, 3, 7):
            dec = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(gamma))
            assert dec.generate(prompt, cfg).tokens == ref


@pytest.mark.parametrize("method", ["greedy", "block"])
def test_min_tokens_and_stop_token_ids_greedy_equal_plain(method):
    """Greedy decoding with min_tokens masks end-of-sequence until then and equals plain decoding
    with it; a stop token id ends the output after the token, as end-of-sequence does."""
    target = ToyLM(6, order=3, seed=7)
    draft = target.perturbed(0.8, seed=8)
    eos = frozenset({2})
    free = SamplingConfig(temperature=0.0, max_new_tokens=40)
    for prompt in ([1], [2, 3, 4], [5, 5, 0, 1]):
        plain = SpeculativeDecoder(target, None, get_rule("greedy"), eos_ids=eos)
        unfloored = plain.generate(prompt, free).tokens
        floored = plain.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=40, min_tokens=12)).tokens
        assert 2 not in floored[:12] and (len(floored) == 40 or floored[-1] == 2)
        if 2 in unfloored[:12]:
            assert floored != unfloored  # the floor changed something here
        spec = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(3), eos_ids=eos)
        assert spec.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=40, min_tokens=12)).tokens == floored
        ref = SpeculativeDecoder(target, None, get_rule("greedy")).generate(prompt, free).tokens
        stop_at = ref[5]
        res = spec.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=40, stop_token_ids=(stop_at,)))
        end = next(i for i, t in enumerate(ref) if t in (2, stop_at))  # end-of-sequence may come first
        assert res.tokens == ref[: end + 1] and res.stats.finish_reason == "eos"
    with pytest.raises(ConfigError, match="min_tokens"):  # a verifier built elsewhere would not mask the stops

        cfg = SamplingConfig(temperature=0.0, max_new_tokens=4, min_tokens=2)
        spec.generate([1], cfg, verifier=TargetSession(target, [1], cfg, get_rule(method), seed=0))


def test_coupled_equals_plain_seeded_sampling():
    """Drafter-invariance: same seed => same tokens, for any drafter and γ."""
    target = ToyLM(8, order=2, seed=11)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, repetition_penalty=1.2, max_new_tokens=30)
    drafters = [ModelDrafter(target.perturbed(0.5, seed=1)), ModelDrafter(target.perturbed(3.0, seed=2)), NgramDrafter(),
                ModelDrafter(target.perturbed(0.5, seed=1), temperature_factor=0.6)]  # a sharper draft: the same tokens
    for seed in range(10):
        c = SamplingConfig(**{**cfg.__dict__, "seed": seed})
        ref = _plain(c, "coupled", target=target)
        for drafter in drafters:
            for gamma in (2, 5):
                dec = SpeculativeDecoder(target, drafter, get_rule("coupled"), gamma=FixedGamma(gamma))
                assert dec.generate([3, 1], c).tokens == _plain(c, "coupled", prompt=[3, 1], target=target)
        assert len(ref) == 30


@pytest.mark.parametrize("method", ["token", "block", "coupled"])
@pytest.mark.parametrize("penalty", [{}, {"repetition_penalty": 1.5}, {"frequency_penalty": 0.7, "presence_penalty": 0.4}])
def test_drafting_with_the_target_itself_accepts_everything(method, penalty):
    """Also under penalties: the draft's penalty state follows every committed token (left behind,
    acceptance fell to ~0.3-0.7 with the output still exact)."""
    target = ToyLM(5, order=2, seed=4)
    dec = SpeculativeDecoder(target, ModelDrafter(target), get_rule(method), gamma=FixedGamma(4))
    res = dec.generate([0, 1], SamplingConfig(temperature=1.0, top_k=4, seed=1, max_new_tokens=50, **penalty))
    assert res.stats.acceptance_rate == 1.0 and res.stats.draft_tokens_proposed > 0


def test_same_seed_same_output():
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule("block"), gamma=FixedGamma(3))
    cfg = SamplingConfig(temperature=1.0, seed=42, max_new_tokens=40)
    assert dec.generate(PROMPT, cfg).tokens == dec.generate(PROMPT, cfg).tokens


def test_stops_and_stats():
    target = ToyLM(6, order=2, seed=5)
    dec = SpeculativeDecoder(target, ModelDrafter(target.perturbed(0.5)), get_rule("block"), gamma=FixedGamma(4), eos_ids=frozenset({5}))
    seen: list[int] = []
    res = dec.generate([1, 2], SamplingConfig(temperature=1.0, seed=3, max_new_tokens=200), on_tokens=seen.extend)
    st = res.stats
    assert seen == res.tokens
    assert st.generated_tokens == len(res.tokens) <= 200
    if st.finish_reason == "eos":
        assert res.tokens[-1] == 5 and 5 not in res.tokens[:-1]
    assert sum(r.emitted for r in res.rounds) == len(res.tokens)
    assert st.draft_tokens_accepted <= st.draft_tokens_proposed
    assert st.target_calls == len(res.rounds)
    # max tokens: never more than asked, and γ is capped so nothing is drafted past the end
    res = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=7))
    assert len(res.tokens) <= 7 and all(r.gamma <= 7 for r in res.rounds)
    # ... exactly: with the target drafting for itself (every draft kept), each round's γ drafts
    # and its own token fit in what is left (4 + 1, then 1 + 1): no draft the cut would throw away
    dec_self = SpeculativeDecoder(target, ModelDrafter(target), get_rule("greedy"), gamma=FixedGamma(4))
    res = dec_self.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=7))
    assert [(r.gamma, r.emitted) for r in res.rounds] == [(4, 5), (1, 2)] and res.stats.draft_tokens_proposed == 5
    assert res.stats.acceptance_per_position == [1.0] * 4 and res.stats.proposed_per_position == [2, 1, 1, 1]
    # a stop check that keeps 2 tokens
    dec = SpeculativeDecoder(target, ModelDrafter(target.perturbed(0.5)), get_rule("block"), gamma=FixedGamma(4))
    res = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=50), stop=lambda toks: 2 if len(toks) >= 2 else None)
    assert len(res.tokens) == 2 and res.stats.finish_reason == "stop"
    # ... inside a round that kept 4 drafts + 1 (the target drafting for itself): what was streamed
    # stops where the result does, and the round counts the 2 tokens it appended
    seen = []
    res = dec_self.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=50), on_tokens=seen.extend,
                            stop=lambda toks: 2 if len(toks) >= 2 else None)
    assert res.rounds[0].accepted == 4 and len(res.tokens) == 2 and seen == res.tokens
    assert [r.emitted for r in res.rounds] == [2] and res.stats.generated_tokens == 2


def test_plain_decoding_goes_through_the_same_loop():
    res = SpeculativeDecoder(TARGET, None, get_rule("block")).generate(PROMPT, SamplingConfig(seed=1, max_new_tokens=10))
    assert res.stats.target_calls == 10 and res.stats.tokens_per_target_call == 1.0
    assert res.stats.draft_tokens_proposed == 0


def test_bad_input():
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule("greedy"))
    with pytest.raises(ConfigError, match="temperature 0"):
        dec.generate(PROMPT, SamplingConfig(temperature=1.0))
    with pytest.raises(ConfigError, match="empty"):
        dec.generate([], SamplingConfig(temperature=0.0))
    small = ToyLM(4, seed=1)
    small.max_length = 4
    with pytest.raises(ContextLengthError):
        SpeculativeDecoder(small, None, get_rule("greedy")).generate([1, 2, 3, 0, 1], SamplingConfig(temperature=0.0))


@pytest.mark.parametrize("method", ["token", "block"])
def test_output_law_with_draft_only_truncation(method):
    """Sparse-q: the drafter samples from its own top-2 of q and reports exactly that q."""
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(2), q_top_k=2)
    samples = [tuple(dec.generate(PROMPT, SamplingConfig(temperature=1.0, seed=i, max_new_tokens=N_NEW)).tokens) for i in range(N_SAMPLES)]
    assert chi_square_pvalue(samples, law) > ALPHA


@pytest.mark.parametrize("method", ["token", "block"])
def test_output_law_with_dynamic_draft_length(method):
    """Stopping a draft at a low-confidence token (min_confidence) changes nothing in the law."""
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(3), min_confidence=0.5)
    samples = [tuple(dec.generate(PROMPT, SamplingConfig(temperature=1.0, top_k=3, seed=i, max_new_tokens=N_NEW)).tokens) for i in range(N_SAMPLES)]
    assert chi_square_pvalue(samples, law) > ALPHA
    short = dec.generate(PROMPT, SamplingConfig(temperature=1.0, top_k=3, seed=0, max_new_tokens=60)).rounds
    assert any(0 < r.gamma < 3 for r in short)  # some drafts really were cut


def test_greedy_equality_with_dynamic_draft_length():
    target = ToyLM(6, order=3, seed=7)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    ref = _plain(cfg, prompt=[1, 2], target=target)
    dec = SpeculativeDecoder(target, ModelDrafter(target.perturbed(0.8, seed=8)), get_rule("greedy"), gamma=FixedGamma(6), min_confidence=0.6)
    assert dec.generate([1, 2], cfg).tokens == ref


# ----------------------------------------------------------------------------- a draft temperature factor


class _ReportsUnscaledQ(ModelDrafter):
    """Negative control: samples at its factor x T but reports q at T itself (not the q it drew from)."""
    def propose(self, context, gamma, sampler):  # noqa: ANN001, ANN201
        from dataclasses import replace as _replace

        from specdec.drafters.base import Draft
        from specdec.sampling import process_logits

        draft = super().propose(context, gamma, sampler)
        cfg = _replace(sampler.cfg, temperature=sampler.cfg.temperature / self.temperature_factor)
        hist = context.tolist()
        rows = []
        for tok in draft.tokens.tolist():
            rows.append(process_logits(self.model.logits_for(hist).unsqueeze(0), cfg)[0])
            hist.append(tok)
        return Draft(tokens=draft.tokens, probs=torch.stack(rows))


@pytest.mark.parametrize("method, option", [("token", "temperature"), ("block", "top_p"), ("block", "repetition_penalty"),
                                            ("coupled", "temperature")])
def test_output_law_with_a_draft_temperature_factor(method, option):
    """The draft samples at 0.5 x T (a much sharper q than the request's): still the target's law."""
    cfg = OPTIONS[option]
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    samples = _samples(method, cfg, drafter=ModelDrafter(DRAFT, temperature_factor=0.5))
    assert chi_square_pvalue(samples, law) > ALPHA


def test_negative_control_a_factor_applied_to_the_draws_but_not_to_the_reported_q_is_detected():
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    samples = _samples("block", cfg, drafter=_ReportsUnscaledQ(DRAFT, temperature_factor=0.3), n=N_CONTROL)
    assert chi_square_pvalue(samples, law) < ALPHA


def test_a_draft_temperature_factor_leaves_greedy_decoding_alone():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30)
    for method in ("greedy", "block"):
        dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT, temperature_factor=0.4), get_rule(method), gamma=FixedGamma(3))
        assert dec.generate(PROMPT, cfg).tokens == _plain(cfg)


def test_the_decoder_samples_each_round_at_the_drafters_factor():
    seen = []

    class Spy(ModelDrafter):
        def propose(self, context, gamma, sampler):  # noqa: ANN001, ANN201
            seen.append(sampler.cfg.temperature)
            return super().propose(context, gamma, sampler)

    cfg = SamplingConfig(temperature=0.8, seed=0, max_new_tokens=8)
    SpeculativeDecoder(TARGET, Spy(DRAFT, temperature_factor=0.5), get_rule("block"), gamma=FixedGamma(2)).generate(PROMPT, cfg)
    assert seen and set(seen) == {0.4}


@pytest.mark.parametrize("hybrid", [False, True], ids=["model", "lookup+model"])
def test_the_gamma_controller_does_not_see_a_drafters_catch_up(hybrid):
    """A round's catch-up pass (``catch_up_s``: a lazy prefill, the backlog of rounds without
    drafting) is left out of the draft seconds the γ controller learns from, and kept in the
    round's reported draft time — for the model drafter and for prompt lookup in front of it
    (the server's default drafter), whose report of its model's catch-up ends with the round."""
    pause = 0.05

    class CatchingUp(ModelDrafter):
        def propose(self, context, gamma, sampler):
            draft = super().propose(context, gamma, sampler)
            if gamma:  # as if the round had caught up for `pause` seconds
                time.sleep(pause)
                self.catch_up_s = pause
            return draft

    class Spy(FixedGamma):
        def __init__(self) -> None:
            super().__init__(2)
            self.seen: list[tuple[int, float]] = []

        def update(self, *, gamma, accepted, draft_s, target_s, other_s):
            self.seen.append((gamma, draft_s))

    spy = Spy()
    drafter = CatchingUp(DRAFT)
    if hybrid:  # lookup finds nothing in a prompt without repeats: every round is the model's
        drafter = LookupThenModel(drafter)
    out = SpeculativeDecoder(TARGET, drafter, get_rule("greedy"), gamma=spy).generate(
        PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=8))
    drafted = [s for g, s in spy.seen if g > 0]
    model_rounds = [r for r in out.rounds if r.gamma > 0 and not r.free]
    assert drafted and len(model_rounds) == len(drafted) and all(r.draft_ms >= pause * 1e3 for r in model_rounds)
    # the pause taken off each drafted round, exactly: the controller sees the round's own draft
    # time less the catch-up (a bound on what is left, "< pause / 2", was a race with the machine:
    # a loaded CI box oversleeps and preempts inside the round, and 33 ms was measured)
    assert all(s == pytest.approx(r.draft_ms / 1e3 - pause, abs=1e-9) for s, r in zip(drafted, model_rounds))


class _CountingFloor(StopFloor):
    """A min_tokens floor that records the history length of every row it is asked about."""
    def __init__(self, *args):
        super().__init__(*args)
        self.asked: list[int] = []

    def allowed(self, generated, vocab_size):
        self.asked.append(len(generated))
        return super().allowed(generated, vocab_size)


@pytest.mark.parametrize("method", ["greedy", "block"])
def test_a_passed_min_tokens_floor_leaves_the_config(method):
    """Once n tokens exist the floor masks nothing, for every continuation: the target's session
    and the drafts stop asking it (no row after the round that crossed it), and the tokens are
    those of a floor that stays (here: the decoder's own, applied to every row)."""
    from specdec.sampling import settled

    inner = NoRepeat()
    floor = StopFloor(frozenset({0}), 3, inner)
    assert settled(floor, [1, 2]) is floor and settled(floor, [1, 2, 3]) is inner
    assert settled(StopFloor(frozenset({0}), 2, StopFloor(frozenset({1}), 3)), [5, 5, 5]) is None and settled(None, []) is None
    target = ToyLM(6, order=3, seed=7)
    draft = target.perturbed(0.8, seed=8)
    gamma = 4
    temperature = 0.0 if method == "greedy" else 1.0
    for seed in range(4):
        counting = _CountingFloor(frozenset({0}), 5)
        cfg = SamplingConfig(temperature=temperature, max_new_tokens=40, seed=seed, constraint=counting)
        dec = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(gamma))
        out = dec.generate([1, 2], cfg).tokens
        assert len(out) == 40 and 0 not in out[:5]
        assert counting.asked and max(counting.asked) <= 5 - 1 + gamma  # rows of rounds begun before the floor
        if method == "greedy":  # the decoder's own floor (min_tokens) gives the same tokens
            ref = SpeculativeDecoder(target, None, get_rule("greedy"), eos_ids=frozenset({0})).generate(
                [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=40, min_tokens=5)).tokens
            assert out[: len(ref)] == ref


class _StrictNoRepeat:
    """:class:`NoRepeat` as a real grammar engine behaves: it cannot follow a history that breaks
    it (asking is an error)."""
    def allowed(self, generated, vocab_size):
        if any(a == b for a, b in zip(generated, generated[1:])) or generated[:1] == [0]:
            raise AssertionError(f"the constraint was asked to follow a forbidden history {generated}")
        return NoRepeat().allowed(generated, vocab_size)


#: repeats itself, so prompt lookup drafts repeated tokens, which the grammar forbids
_REPEATING = [3, 3, 3, 1, 3, 3, 3, 2, 3, 3, 3]


@pytest.mark.parametrize("method", ["token", "block", "coupled"])
def test_free_drafts_that_leave_the_grammar_keep_the_law(method):
    """Prompt lookup copies text without asking the constraint, so its chain drafts may leave the
    grammar; the target's rows after the first forbidden token are never asked about (that token
    has probability 0) and the output law is the constrained target's.  Same N and threshold as
    the other law tests."""
    cfg = SamplingConfig(temperature=1.0, constraint=_StrictNoRepeat())
    law = exact_law(TARGET, _REPEATING, cfg, N_NEW)
    dec = SpeculativeDecoder(TARGET, NgramDrafter(), get_rule(method), gamma=FixedGamma(3))
    out, drafted = [], 0
    for i in range(N_SAMPLES):
        res = dec.generate(_REPEATING, SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW}))
        out.append(tuple(res.tokens))
        drafted += res.stats.draft_tokens_proposed
    assert drafted > N_SAMPLES  # lookup drafted (repeated 3s among them)
    assert chi_square_pvalue(out, law) > ALPHA


def test_free_drafts_that_leave_the_grammar_keep_greedy_exact():
    target = ToyLM(6, order=3, seed=7)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40, constraint=_StrictNoRepeat())
    for prompt in ([5, 5, 5, 1, 5, 5, 5], [2, 4, 4, 4, 2, 4, 4, 4]):
        ref = SpeculativeDecoder(target, None, get_rule("greedy")).generate(prompt, cfg).tokens
        for method in ("greedy", "block"):
            dec = SpeculativeDecoder(target, NgramDrafter(), get_rule(method), gamma=FixedGamma(4))
            res = dec.generate(prompt, cfg)
            assert res.tokens == ref and res.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_target_whose_logits_are_not_finite_is_refused_not_decoded(temperature):
    """A NaN weight (or a negative rms_norm_eps, a zero rope_theta) makes every logit NaN; greedy
    decoding then emitted token 0 and sampling noise, with no error. Plain, chain and tree rounds
    refuse it in one line; a sound model is untouched by the check."""
    from tiny import tiny_native

    from specdec.errors import ModelError

    cfg = SamplingConfig(temperature=temperature, max_new_tokens=6, seed=3)
    rule = get_rule("greedy" if temperature == 0 else "block")
    sound = tiny_native()
    assert len(SpeculativeDecoder(sound, None, rule).generate([1, 2, 3], cfg).tokens) == 6
    broken = tiny_native()
    broken.embed.fill_(float("nan"))
    for drafter, tree in ((None, None), (ModelDrafter(tiny_native(seed=1)), None), (ModelDrafter(tiny_native(seed=1)), TreeSpec(min_prob=0.0))):
        dec = SpeculativeDecoder(broken, drafter, rule, gamma=FixedGamma(3), tree=tree)
        with pytest.raises(ModelError, match="the target.s logits are not finite .NaN or infinite. at position 3:"):
            dec.generate([1, 2, 3], cfg)


GREEDY = get_rule("greedy")
#: repeats itself, so prompt lookup always finds a continuation
REPEATING = [3, 3, 1, 2, 3, 3, 1, 2, 3, 3, 1, 2]


def _small(max_length: int) -> ToyLM:
    target = ToyLM(4, order=2, seed=0)
    target.max_length = max_length
    return target


def test_the_context_last_position_takes_a_token():
    """A prompt of 3 in a context of 8 leaves room for 5 new tokens, the last one included (its
    own row is never fed), whatever max_new_tokens asks."""
    out = SpeculativeDecoder(_small(8), None, GREEDY).generate([1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=100))
    assert len(out.tokens) == 5 and out.stats.finish_reason == "length"


def test_tree_rounds_draft_no_more_nodes_than_the_context_has_rows_left():
    """Every node of a token tree takes a row of the target's cache: a round whose context holds
    c tokens of a context of L drafts at most L - c nodes (min_prob 0 fills the tree)."""
    target = _small(12)
    dec = SpeculativeDecoder(target, ModelDrafter(target.perturbed(0.3, seed=2)), GREEDY, gamma=FixedGamma(8),
                             tree=TreeSpec(min_prob=0.0))
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=100))
    assert len(out.tokens) == 10
    context = 2
    binding = 0
    for r in out.rounds:
        assert r.gamma <= 12 - context, (r, context)
        binding += r.gamma == 12 - context
        context += r.emitted
    assert binding  # the bound was reached in some round (else this test would show nothing)


def test_a_tree_is_not_drafted_for_the_last_token():
    """With one token left no draft can be kept: the round is a plain step, trees included (prompt
    lookup in front of the model would otherwise draft a token even at depth 0)."""
    for tree in (None, TreeSpec(min_prob=0.0)):
        for drafter in (ModelDrafter(DRAFT), LookupThenModel(ModelDrafter(DRAFT))):
            dec = SpeculativeDecoder(TARGET, drafter, GREEDY, gamma=FixedGamma(4), tree=tree)
            out = dec.generate(REPEATING, SamplingConfig(temperature=0.0, max_new_tokens=1))
            assert [(r.gamma, r.emitted) for r in out.rounds] == [(0, 1)]


class _Advising(TargetSession):
    """A verifier that advises a draft cap (as a busy remote server does)."""
    gamma_limit = 1


def test_a_verifiers_advised_cap_bounds_chains_not_trees():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30)
    chain = SpeculativeDecoder(TARGET, ModelDrafter(TARGET), GREEDY, gamma=FixedGamma(4))
    out = chain.generate([1, 2], cfg, verifier=_Advising(TARGET, [1, 2], cfg, GREEDY, seed=0))
    assert max(r.gamma for r in out.rounds) == 1
    tree = SpeculativeDecoder(TARGET, ModelDrafter(TARGET), GREEDY, gamma=FixedGamma(4), tree=TreeSpec(min_prob=0.0))
    out = tree.generate([1, 2], cfg, verifier=_Advising(TARGET, [1, 2], cfg, GREEDY, seed=0))
    assert max(r.gamma for r in out.rounds) == 4 and out.stats.tree_rounds > 0


class _FreeCeiling(FixedGamma):
    """A γ whose free-draft ceiling (a server's draft cap) is far above what is left."""
    def free_limit(self):
        return 50


def test_free_drafts_stay_inside_what_is_left_of_max_new_tokens():
    """A free (prompt lookup) draft is bounded by the round's limit (remaining - 1) as well as by
    the controller's ceiling: nothing is drafted that the cut at max_new_tokens would throw away."""
    for n in (3, 6):
        drafter = LookupThenModel(ModelDrafter(DRAFT), lookup_tokens=40)
        dec = SpeculativeDecoder(TARGET, drafter, GREEDY, gamma=_FreeCeiling(2))
        out = dec.generate(REPEATING, SamplingConfig(temperature=0.0, max_new_tokens=n))
        left = n
        assert any(r.free for r in out.rounds)
        for r in out.rounds:
            assert r.gamma <= left - 1, (n, out.rounds)
            left -= r.emitted


def test_a_lookup_draft_is_not_asked_for_the_last_token_of_a_tree_decoder():
    """Trees bound a round by the context's rows, not by what is left: at the last token neither
    the model nor prompt lookup drafts (a free draft there could never be kept)."""
    drafter = LookupThenModel(NgramDrafter(), lookup_tokens=4)
    assert drafter.supports_trees
    dec = SpeculativeDecoder(TARGET, drafter, GREEDY, gamma=FixedGamma(0), tree=TreeSpec(min_prob=0.0))
    out = dec.generate(REPEATING, SamplingConfig(temperature=0.0, max_new_tokens=1))
    assert [(r.gamma, r.emitted) for r in out.rounds] == [(0, 1)]


def test_lookahead_is_told_the_targets_arg_max_at_its_tree_nodes_before_the_commit():
    """A drafter that asks for them (``wants_node_argmax``: lookahead decoding) is handed the
    target's arg-max at the root and after each node of the tree just scored, before the round
    commits (its Jacobi window and n-gram pool grow from them); the tokens are plain greedy
    decoding's."""
    from specdec.drafters.lookahead import LookaheadDrafter

    events: list[tuple[str, int]] = []

    class Spy(LookaheadDrafter):
        def observe(self, node_argmax):
            events.append(("observe", node_argmax.numel()))
            super().observe(node_argmax)

        def commit(self, verdict):
            events.append(("commit", 0))
            super().commit(verdict)

    target = ToyLM(6, order=3, seed=7)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    plain = SpeculativeDecoder(target, None, GREEDY).generate([1, 2], cfg).tokens
    drafter = Spy(window=3, ngram=3, candidates=3, pool_size=8)
    out = SpeculativeDecoder(target, drafter, GREEDY, gamma=FixedGamma(16), tree=TreeSpec()).generate([1, 2], cfg)
    assert out.tokens == plain and out.stats.tree_rounds > 0
    observed = [i for i, (what, _) in enumerate(events) if what == "observe"]
    assert observed and all(events[i + 1][0] == "commit" for i in observed)
    tree_sizes = [r.gamma + 1 for r in out.rounds if r.tree]
    assert [n for what, n in events if what == "observe"] == tree_sizes[: len(observed)]


class _Alternating(FixedGamma):
    """γ 2, 0, 2, 0, ...: every other round plain."""
    def __init__(self) -> None:
        super().__init__(2)
        self.calls = 0

    def next_gamma(self) -> int:
        self.calls += 1
        return 2 if self.calls % 2 else 0


class _Recording(ModelDrafter):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.proposed = self.committed = 0

    def propose(self, context, gamma, sampler):
        self.proposed += 1
        return super().propose(context, gamma, sampler)

    def commit(self, verdict):
        self.committed += 1
        super().commit(verdict)


def test_a_drafter_commits_only_the_rounds_it_drafted():
    """``commit`` tells a drafter what the target kept of *its last draft*: rounds it was not
    asked to draft (γ 0) are not committed to it (it catches up from the context instead)."""
    drafter = _Recording(TARGET)
    out = SpeculativeDecoder(TARGET, drafter, GREEDY, gamma=_Alternating()).generate(
        [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20))
    plain_rounds = sum(1 for r in out.rounds if r.gamma == 0)
    assert plain_rounds and drafter.proposed == drafter.committed == len(out.rounds) - plain_rounds
    assert out.stats.acceptance_rate == 1.0  # the target drafting for itself


def test_timings_on_a_modelled_clock(monkeypatch):
    """On a clock that moves only while the drafter drafts (100 s a round), the round's draft
    time is the draft's and its verification overhead excludes it, the γ controller is told the
    same, and the time to first token ends with the first round (not a later one)."""
    import types

    import specdec.decoder as decoder_module

    now = [0.0]
    monkeypatch.setattr(decoder_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Slow(ModelDrafter):
        def propose(self, context, gamma, sampler):
            now[0] += 100.0
            return super().propose(context, gamma, sampler)

    class Spy(FixedGamma):
        seen: list[dict]

        def update(self, **kw):
            self.seen.append(kw)

    spy = Spy(2)
    spy.seen = []
    out = SpeculativeDecoder(TARGET, Slow(TARGET), GREEDY, gamma=spy).generate(
        [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=12))
    assert [r.gamma for r in out.rounds] == [2, 2, 2, 2]  # every round drafted (and took 100 s)
    st = out.stats
    assert st.ttft_s == pytest.approx(100.0, abs=1.0)
    assert st.wall_s == pytest.approx(400.0, abs=1.0) and st.tokens_per_s == pytest.approx(12 / st.wall_s)
    assert st.draft_s == pytest.approx(400.0, abs=1.0)
    for r in out.rounds:
        assert r.draft_ms == pytest.approx(100e3, abs=1.0) and abs(r.verify_ms) < 1e3
    assert len(spy.seen) == 4
    for kw in spy.seen:
        assert kw["draft_s"] == pytest.approx(100.0, abs=1e-3) and abs(kw["other_s"]) < 1.0


def test_cumulative_acceptance_is_over_all_rounds_so_far():
    out = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(3)).generate(
        [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=40))
    proposed = accepted = 0
    per_round = set()
    for r in out.rounds:
        proposed += r.gamma
        accepted += r.accepted
        assert r.cumulative_acceptance == pytest.approx(accepted / proposed if proposed else 0.0)
        per_round.add(r.accept_ratio)
    assert len(per_round) > 1  # the rounds differ, so a per-round ratio would show


class _SeesFree(FixedGamma):
    """Records which of its two updates each round reached."""
    def __init__(self, gamma: int) -> None:
        super().__init__(gamma)
        self.model_rounds: list[int] = []
        self.free_rounds: list[int] = []

    def update(self, *, gamma, accepted, draft_s, target_s, other_s):
        self.model_rounds.append(gamma)

    def update_free(self, *, gamma, accepted, draft_s, target_s, other_s):
        self.free_rounds.append(gamma)


class _SeesPasses(LookupThenModel):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.passes: list[int] = []
        self.free_updates: list[int] = []

    def observe_pass(self, rows, target_s):
        self.passes.append(rows)
        super().observe_pass(rows, target_s)

    def update_free(self, *, gamma, **kw):
        self.free_updates.append(gamma)
        super().update_free(gamma=gamma, **kw)


def test_free_rounds_and_model_rounds_reach_their_own_controllers():
    """A lookup round (free) is learnt by the hybrid's lookup controller and the γ controller's
    ``update_free`` (a server's cap), never by γ's ``update``; a model round by γ's ``update``, and
    its verification pass (drafted + 1 rows) by the lookup controller's cost curve."""
    gamma = _SeesFree(2)
    drafter = _SeesPasses(ModelDrafter(DRAFT))
    out = SpeculativeDecoder(TARGET, drafter, GREEDY, gamma=gamma).generate(
        [0, 1, 2, 0, 1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=40))
    free = [r.gamma for r in out.rounds if r.free]
    model = [r.gamma for r in out.rounds if not r.free]
    assert free and model
    assert gamma.free_rounds == free == drafter.free_updates
    assert gamma.model_rounds == model
    assert drafter.passes == [g + 1 for g in model]


def test_a_stop_that_cuts_a_whole_round_streams_nothing_for_it():
    """``on_tokens`` is called with the tokens a round appended, never with an empty list."""
    calls: list[list[int]] = []
    dec = SpeculativeDecoder(TARGET, None, GREEDY)
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20), on_tokens=calls.append,
                       stop=lambda toks: 1 if len(toks) >= 3 else None)
    assert out.tokens == calls[0][:1] and out.stats.finish_reason == "stop"
    assert all(calls)


def test_seed_zero_is_a_seed():
    """``seed=0`` fixes the output like any other seed (not a fresh random one)."""
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule("block"), gamma=FixedGamma(3))
    cfg = SamplingConfig(temperature=1.0, seed=0, max_new_tokens=40)
    first = dec.generate([1, 2], cfg).tokens
    assert all(dec.generate([1, 2], cfg).tokens == first for _ in range(3))


class _IdleSpy(FixedGamma):
    def __init__(self) -> None:
        super().__init__(2)
        self.idled = 0

    def start_idle(self):
        self.idled += 1


def test_only_a_drafter_that_costs_a_target_step_starts_the_controller_idle():
    spy = _IdleSpy()
    SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=spy).generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=4))
    assert spy.idled == 0

    class WholeTarget(ModelDrafter):
        whole_target = True

    SpeculativeDecoder(TARGET, WholeTarget(DRAFT), GREEDY, gamma=spy).generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=4))
    assert spy.idled == 1


class _Keeping(ToyLM):
    """A target that keeps finished sequences (as a prefix cache does): records what it is handed."""
    def __init__(self) -> None:
        super().__init__(4, order=2, seed=0)
        self.kept: list[list[int]] = []

    def keep_sequence(self, tokens, cache):
        self.kept.append(tokens.tolist())


def test_the_decoder_closes_its_own_session_and_not_a_callers():
    """The session the decoder opened is closed at the end (a prefix cache keeps the sequence); a
    verifier passed in stays the caller's to close."""
    target = _Keeping()
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=6)
    dec = SpeculativeDecoder(target, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(2))
    out = dec.generate([1, 2], cfg)
    assert target.kept == [[1, 2] + out.tokens[:-1]]  # every committed token but the last
    session = TargetSession(target, [1, 2], cfg, GREEDY, seed=0)
    dec.generate([1, 2], cfg, verifier=session)
    assert len(target.kept) == 1
    session.close()
    assert len(target.kept) == 2


def test_the_drafter_is_told_the_sequence_finished():
    seen: list[list[int]] = []

    class Finishing(ModelDrafter):
        def finish(self, context):
            seen.append(context.tolist())

    out = SpeculativeDecoder(TARGET, Finishing(DRAFT), GREEDY, gamma=FixedGamma(2)).generate(
        [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=7))
    assert seen == [[1, 2] + out.tokens]


def test_min_tokens_holds_off_the_stop_token_ids_too():
    """min_tokens floors every token that would end the sequence: end of sequence and the
    request's stop_token_ids alike."""
    ref = SpeculativeDecoder(TARGET, None, GREEDY).generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20)).tokens
    stop_at = ref[1]
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(3), eos_ids=frozenset({0}) - {stop_at})
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20, min_tokens=6, stop_token_ids=(stop_at,)))
    assert stop_at not in out.tokens[:6]


def test_a_stop_that_keeps_everything_still_ends_the_generation():
    """A stop check that returns how many tokens to keep ends generation even when it keeps them
    all (a stop string that ends exactly at the round's last token)."""
    dec = SpeculativeDecoder(TARGET, None, GREEDY)
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20), stop=lambda toks: len(toks) if len(toks) >= 3 else None)
    assert len(out.tokens) == 3 and out.stats.finish_reason == "stop"


def test_generation_stats_summarise_the_rounds():
    """The histogram of kept draft lengths runs to the longest kept; mean γ is drafted tokens per
    round; plain decoding reports γ policy "none"; free tokens are those kept from free rounds."""
    out = SpeculativeDecoder(TARGET, LookupThenModel(ModelDrafter(DRAFT)), GREEDY, gamma=FixedGamma(3)).generate(
        REPEATING, SamplingConfig(temperature=0.0, max_new_tokens=40))
    st, rounds = out.stats, out.rounds
    longest = max(r.accepted for r in rounds)
    assert st.accepted_histogram == [sum(1 for r in rounds if r.accepted == k) for k in range(longest + 1)]
    assert sum(st.accepted_histogram) == len(rounds)
    assert st.mean_gamma == pytest.approx(sum(r.gamma for r in rounds) / len(rounds))
    assert st.mean_gamma != pytest.approx(st.draft_tokens_accepted / len(rounds))  # some draft was rejected
    assert st.free_tokens_accepted == sum(r.accepted for r in rounds if r.free)
    assert 0 < st.free_tokens_accepted < st.draft_tokens_accepted  # model rounds kept drafts too
    assert st.gamma_policy == "fixed(3)"
    plain = SpeculativeDecoder(TARGET, None, GREEDY, gamma=FixedGamma(3)).generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=5))
    assert plain.stats.gamma_policy == "none" and plain.stats.accepted_histogram == [5]


def test_the_decoders_own_max_draft_bounds_every_round():
    """``max_draft`` (a server's --max-gamma) caps the tokens a round drafts, whatever γ asks,
    also with a local verifier that has no cap of its own."""
    dec = SpeculativeDecoder(TARGET, ModelDrafter(TARGET), GREEDY, gamma=FixedGamma(4), max_draft=2)
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20))
    assert max(r.gamma for r in out.rounds) == 2


class _SeedSpy(ModelDrafter):
    seeds: list[int]

    def propose(self, context, gamma, sampler):
        self.seeds.append(sampler.generator.initial_seed())
        return super().propose(context, gamma, sampler)


def test_the_drafter_samples_from_its_own_stream_seed_plus_offset():
    """The drafter's generator is seeded with seed + DRAFT_SEED_OFFSET, never the verifier's own
    seed (the same stream on both sides would correlate draft and acceptance draws)."""
    drafter = _SeedSpy(DRAFT)
    drafter.seeds = []
    SpeculativeDecoder(TARGET, drafter, get_rule("block"), gamma=FixedGamma(2)).generate(
        [1, 2], SamplingConfig(temperature=1.0, seed=7, max_new_tokens=6))
    assert drafter.seeds and set(drafter.seeds) == {7 + defaults.DRAFT_SEED_OFFSET}


class _ProbSpy(ModelDrafter):
    probs: list

    def propose(self, context, gamma, sampler):
        draft = super().propose(context, gamma, sampler)
        self.probs.append(draft.probs)
        return draft


def test_q_top_k_reaches_the_drafts_sampler():
    """``q_top_k`` (sparse-q wire mode) truncates the q the drafter samples from and reports:
    with q_top_k=1 every reported draft row has a single token of non-zero probability."""
    drafter = _ProbSpy(DRAFT)
    drafter.probs = []
    SpeculativeDecoder(TARGET, drafter, get_rule("block"), gamma=FixedGamma(3), q_top_k=1).generate(
        [1, 2], SamplingConfig(temperature=1.0, seed=3, max_new_tokens=12))
    rows = [p for p in drafter.probs if p is not None and p.numel()]
    assert rows and all(bool(((p > 0).sum(-1) == 1).all()) for p in rows)


class _NoFreeRoom(FixedGamma):
    """A γ of 0 whose free-draft ceiling (a busy server's cap) is 0 too."""
    def free_limit(self):
        return 0


def test_a_free_draft_ceiling_of_zero_asks_the_drafter_nothing():
    """With γ 0 and a free-draft ceiling of 0 there is no room for any draft: the drafter is not
    asked (no propose, no commit) and every round is a plain target step."""
    calls = []

    class Counting(LookupThenModel):
        def propose(self, context, gamma, sampler):
            calls.append(gamma)
            return super().propose(context, gamma, sampler)

    dec = SpeculativeDecoder(TARGET, Counting(ModelDrafter(DRAFT)), GREEDY, gamma=_NoFreeRoom(0))
    out = dec.generate([3, 3, 1, 2, 3, 3, 1, 2], SamplingConfig(temperature=0.0, max_new_tokens=6))
    assert calls == [] and all(r.gamma == 0 for r in out.rounds)


def test_min_confidence_reaches_the_drafts_sampler():
    """Dynamic draft length: with a confidence floor no toy draft token reaches (0.999), the
    drafter stops after its first token every round, though γ asks for 4."""
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(4), min_confidence=0.999)
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20))
    assert max(r.gamma for r in out.rounds) == 1


def test_a_verifier_without_the_drafters_feature_taps_is_refused():
    """A drafter that reads the target's hidden states (``feature_taps``) cannot run against a
    verifier that does not provide them (a remote target): a ConfigError naming that, before any
    round is drafted."""
    class Tapping(ModelDrafter):
        feature_taps = (1,)

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=4)
    session = TargetSession(TARGET, [1, 2], cfg, GREEDY, seed=0)
    with pytest.raises(ConfigError, match="hidden states"):
        SpeculativeDecoder(TARGET, Tapping(DRAFT), GREEDY, gamma=FixedGamma(2)).generate([1, 2], cfg, verifier=session)
    session.close()


def test_a_tree_spec_is_ignored_for_a_drafter_without_tree_support():
    """``tree=`` applies only to drafters that can grow trees: one without ``supports_trees``
    keeps drafting chains (and is never asked for ``propose_tree``)."""
    class ChainOnly(ModelDrafter):
        supports_trees = False

        def propose_tree(self, *a, **kw):  # pragma: no cover - must not be called
            raise AssertionError("a chain-only drafter was asked for a tree")

    dec = SpeculativeDecoder(TARGET, ChainOnly(DRAFT), GREEDY, gamma=FixedGamma(3), tree=TreeSpec(min_prob=0.0))
    assert dec.tree is None
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10))
    assert out.stats.tree_rounds == 0 and len(out.tokens) == 10


def test_a_greedy_only_rule_is_refused_at_a_temperature_even_with_a_callers_verifier():
    """The decoder checks the rule against its own config, not only the session it builds: a
    caller's verifier built for greedy decoding does not let a sampled config through."""
    session = TargetSession(TARGET, [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=4), GREEDY, seed=0)
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(2))
    with pytest.raises(ConfigError, match="temperature 0"):
        dec.generate([1, 2], SamplingConfig(temperature=1.0, max_new_tokens=4), verifier=session)
    session.close()


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    """A stop token id past the vocabulary could never end the output: a ConfigError, not a silent
    run to max_new_tokens."""
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(2))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=4, stop_token_ids=(TARGET.vocab_size,)))


def test_min_tokens_with_a_callers_verifier_is_refused():
    """min_tokens must floor the verifier's law too; a verifier passed in was built by the caller, so
    the decoder refuses rather than floor only its drafts (the message says how to do it)."""
    session = TargetSession(TARGET, [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=4), GREEDY, seed=0)
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(2), eos_ids=frozenset({0}))
    with pytest.raises(ConfigError, match="min_tokens: build the verifier from floor_stops"):
        dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=4, min_tokens=2), verifier=session)
    session.close()


def test_a_feature_reading_drafter_gets_the_prompts_features_then_every_rounds():
    """A drafter with ``feature_taps`` is handed the target's features of the prompt before the first
    round, then those of what each round committed, drafted or not: together one row per context
    position the target has fed."""
    seen: list[int] = []

    class Tapping(ModelDrafter):
        feature_taps = (1,)

        def add_features(self, features):
            seen.append(int(features.shape[0]))  # [rows, taps, hidden]

    dec = SpeculativeDecoder(TARGET, Tapping(DRAFT), GREEDY, gamma=FixedGamma(2))
    out = dec.generate([1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=7))
    assert out.rounds[-1].gamma == 0  # the premise: the last token's round drafted nothing
    assert len(seen) == 1 + len(out.rounds)
    assert seen[0] == 2  # the prompt's rows but the last (it is fed with the first round)
    assert seen[1:] == [r.emitted for r in out.rounds]  # each round's committed rows (no stop cut here)


def test_a_stop_token_id_ends_the_generation_like_end_of_sequence():
    """A request's ``stop_token_ids`` end the output at the first such token (kept as the last
    token, finish reason "eos"), with or without a drafter, though the model's own eos_ids differ."""
    ref = SpeculativeDecoder(TARGET, None, GREEDY).generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=12)).tokens
    stop_at = ref[3]
    want = ref[: ref.index(stop_at) + 1]
    for drafter in (None, ModelDrafter(DRAFT)):
        dec = SpeculativeDecoder(TARGET, drafter, GREEDY, gamma=FixedGamma(3), eos_ids=frozenset({9}))
        out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_at,)))
        assert out.tokens == want and out.stats.finish_reason == "eos"


def test_a_stop_that_cuts_back_past_the_round_streams_nothing_more():
    """A stop check may keep fewer tokens than earlier rounds already appended: the round then
    streams nothing (what was already streamed cannot be taken back) and appends nothing."""
    dec = SpeculativeDecoder(TARGET, ModelDrafter(TARGET), GREEDY, gamma=FixedGamma(4))
    seen: list[int] = []
    out = dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20), on_tokens=seen.extend,
                       stop=lambda toks: 3 if len(toks) >= 10 else None)
    assert [r.emitted for r in out.rounds] == [5, 0]  # the premise: rounds of 5, the second cut back to 3
    assert len(seen) == 5 and out.tokens == seen[:3]


def test_the_stats_report_the_verifiers_kv_peak():
    """``kv_peak_bytes`` is the target session's peak cache size, not left at 0."""
    out = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), GREEDY, gamma=FixedGamma(2)).generate(
        [1, 2], SamplingConfig(temperature=0.0, max_new_tokens=6))
    assert out.stats.kv_peak_bytes > 0


def test_the_stats_name_the_rule_drafter_and_rate():
    """The summary names what ran: the rule's lossless flag (a lossy shortcut says so), the
    drafter's class by default, and a throughput over the measured wall time however short."""
    lossy = get_rule("lossy-resample-p")
    assert not lossy.lossless  # the premise
    out = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), lossy, gamma=FixedGamma(2)).generate(
        [1, 2], SamplingConfig(temperature=1.0, seed=0, max_new_tokens=6))
    st = out.stats
    assert st.lossless is False and st.drafter == "ModelDrafter"
    assert st.wall_s > 0 and st.tokens_per_s == pytest.approx(st.generated_tokens / st.wall_s)


def test_nothing_reports_the_time_it_was_given():
    """``nothing`` (a server asked only to echo a prompt) reports the wall time it is handed."""
    st = SpeculativeDecoder(TARGET, None, GREEDY).nothing(5, wall_s=0.25).stats
    assert st.wall_s == 0.25 and st.prompt_tokens == 5 and st.generated_tokens == 0 and st.finish_reason == "length"
