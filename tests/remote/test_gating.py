"""Gating: the signals, the rule triggers, and that shaping drafts keeps decoding exact."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter
from specdec.drafters.base import Draft
from specdec.drafters.hybrid import LookupThenModel
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.models.registry import DATA_DIR
from specdec.models.toy import ToyLM
from specdec.remote.gating import (
    Gate,
    GateConfig,
    GatedDrafter,
    RuleTriggers,
    TokenSignals,
    _GateSampler,
    calibrate_nll,
    has_dropout,
    is_hard,
    mc_dropout_variance,
    token_frequency,
    uncertainty,
)
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule

TARGET = ToyLM(6, order=2, seed=21)
DRAFT = TARGET.perturbed(1.0, seed=22)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))


def test_uncertainty_signals():
    nll, entropy, margin = uncertainty(torch.zeros(4), 2)  # uniform over 4 tokens
    assert nll == pytest.approx(2.0) and entropy == pytest.approx(2.0) and margin == pytest.approx(0.0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    nll, entropy, margin = uncertainty(logits, 1)
    assert nll == pytest.approx(-math.log2(0.2), rel=1e-5)
    assert entropy == pytest.approx(-(0.7 * math.log2(0.7) + 0.2 * math.log2(0.2) + 0.1 * math.log2(0.1)), rel=1e-5)
    assert margin == pytest.approx(0.5, rel=1e-5)
    assert calibrate_nll([1.0, 2.0, 3.0, 4.0, 5.0], 0.8) == pytest.approx(4.2)


def _fired(triggers: RuleTriggers, tokenizer, text: str) -> dict[str, tuple[str, ...]]:
    prefix, out = "", {}
    for tok in tokenizer.encode(text, add_special_tokens=False):
        fired = triggers.check(prefix, tok)
        if fired:
            out[triggers.text(tok)] = fired
        prefix += triggers.text(tok)
    return out


def test_rule_triggers(tokenizer):
    fired = _fired(RuleTriggers(tokenizer), tokenizer, "It costs $25 on March 3 and Alice met Bob in Paris. The end")
    assert "amount" in fired[" $"] and {"number", "amount"} <= set(fired["2"])
    assert "date" in fired[" March"] and "number" in fired["3"]
    assert fired[" Alice"] == ("name",) and fired[" Paris"] == ("name",)
    assert " The" not in fired and " costs" not in fired and " end" not in fired  # sentence start, plain words
    assert "amount" in _fired(RuleTriggers(tokenizer), tokenizer, "a fee of 30%")["%"]
    assert "date" in _fired(RuleTriggers(tokenizer), tokenizer, "due 2024-05-01")["1"]
    only_numbers = RuleTriggers(tokenizer, rules=frozenset({"number"}))
    assert set(_fired(only_numbers, tokenizer, "Alice paid $5")) == {"5"}


def test_rare_tokens_by_frequency(tokenizer, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 20)
    counts = token_frequency(corpus, tokenizer=tokenizer, vocab_size=len(tokenizer))
    the = tokenizer.encode(" the", add_special_tokens=False)[0]
    assert counts[the] >= 20
    triggers = RuleTriggers(None, rules=frozenset({"rare"}), frequency=counts, rare_max_count=0)
    assert triggers.check("", the) == () and triggers.check("", 12345) == ("rare",)
    table = tmp_path / "freq.json"
    table.write_text(json.dumps({"3": 10, "4": 1}))
    counts = token_frequency(table, tokenizer=None, vocab_size=8)
    assert counts.tolist() == [0, 0, 0, 10, 1, 0, 0, 0]
    with pytest.raises(ConfigError, match="not a file"):
        token_frequency(tmp_path / "missing.json", tokenizer=None, vocab_size=8)


def _decode(drafter, cfg: SamplingConfig, method: str, gamma: int = 5) -> tuple[list[int], object]:
    dec = SpeculativeDecoder(TARGET, drafter, get_rule(method), gamma=FixedGamma(gamma))
    res = dec.generate([1, 2], cfg)
    return res.tokens, res.stats


@pytest.mark.parametrize("method, temperature", [("greedy", 0.0), ("coupled", 1.0), ("block", 1.0)])
def test_shaping_stops_drafting_at_a_hard_token_and_stays_exact(method, temperature):
    cfg = SamplingConfig(temperature=temperature, seed=4, max_new_tokens=60)
    gate = Gate(GateConfig(policy="shape", t_entropy_bits=1.6, t_margin=0.2))
    draft = TARGET.perturbed(1.0, seed=22)  # a private copy: count its forward passes
    gated, gstats = _decode(GatedDrafter(ModelDrafter(draft), gate), cfg, method)
    gated_calls = draft.calls
    draft.calls = 0
    plain, pstats = _decode(ModelDrafter(draft), cfg, method)
    summary = gate.summary()
    assert summary["early_stops"] > 0 and summary["hard_tokens"] > 0 and summary["lossless"]
    assert gstats.mean_gamma < pstats.mean_gamma
    if method != "block":  # greedy and coupled: the very same tokens as plain decoding
        assert gated == plain == _decode(None, cfg, method)[0]
    else:  # block: exact in law (any draft length is), so only the length is comparable here
        assert len(gated) == len(plain) == 60
    # the draft model really stops at the hard token: one forward pass per drafted token (plus the
    # prompt prefill), none spent on positions the gate cut
    assert gated_calls == 1 + gstats.draft_tokens_proposed


def test_local_commit_decision():
    cfg = GateConfig(policy="lossy-local-commit", t_entropy_bits=None, t_margin=0.3, rules=frozenset(), max_local_rounds=2, r_hard=0.3)
    gate = Gate(cfg)
    drafter = GatedDrafter(ModelDrafter(DRAFT), gate)
    from specdec.drafters.base import DraftSampler

    ctx = torch.tensor([1, 2])
    drafter.prepare(ctx)
    decisions = []
    for _ in range(6):
        draft = drafter.propose(ctx, 4, DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None))
        decisions.append((gate.last.escalate, gate.local_commit(draft)))
        drafter.inner.cache.truncate(1)
    for escalate, local in decisions:
        assert not (escalate and local)  # a block the gate escalates never stays local
    assert sum(local for _, local in decisions[:3]) <= 2  # at most max_local_rounds in a row
    assert GateConfig().lossless and not cfg.lossless
    with pytest.raises(ConfigError, match="unknown gate rules"):
        GateConfig(rules=frozenset({"weather"}))
    # a NaN threshold compared false with everything: no token was ever hard, in silence
    for bad in ({"t_entropy_bits": float("nan")}, {"t_entropy_bits": -1.0}, {"t_margin": 1.5}, {"t_margin": float("nan")},
                {"t_nll_bits": float("inf")}, {"t_mc_var": -0.1}, {"rare_max_count": -1}, {"r_hard": float("nan")}):
        with pytest.raises(ConfigError, match="must be"):
            GateConfig(**bad)
    GateConfig(t_entropy_bits=0.0, t_margin=1.0, t_nll_bits=12.0, t_mc_var=0.0)  # the bounds themselves are fine


def test_mc_dropout_only_where_the_draft_has_dropout():
    assert not has_dropout(DRAFT)
    gate = Gate(GateConfig(t_mc_var=0.01), draft_model=DRAFT)
    assert gate.mc_status == "unavailable"
    assert Gate(GateConfig(), draft_model=DRAFT).mc_status == "off"
    from transformers import AutoModelForCausalLM

    from specdec.models.hf import HFCausalLM

    folder = str(DATA_DIR / "smollm2-135m-draft")
    torch.manual_seed(0)  # dropout masks come from the global RNG inside transformers
    model = HFCausalLM(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attention_dropout=0.3))
    assert has_dropout(model)
    ctx, toks = torch.tensor([1, 504, 3458, 28]), torch.tensor([411, 253])
    var = mc_dropout_variance(model, ctx, toks, passes=4)
    assert var is not None and var.shape == (2,) and bool((var >= 0).all()) and float(var.sum()) > 0
    assert not model.model.training  # back in eval mode
    assert Gate(GateConfig(t_mc_var=0.01), draft_model=model).mc_status == "on"


def _signals(hard: list[bool], triggers: tuple[str, ...] = ()) -> list[TokenSignals]:
    return [TokenSignals(1.0, 1.0, 0.5, None, triggers, h) for h in hard]


def test_a_small_margin_is_hard_and_a_large_one_is_not():
    cfg = GateConfig(t_entropy_bits=None, t_margin=0.2)
    assert is_hard(cfg, 0.0, 0.0, 0.1, None) and not is_hard(cfg, 0.0, 0.0, 0.5, None)


def test_shape_never_cuts_below_min_draft():
    gate = Gate(GateConfig(policy="shape", min_draft=3))
    out = gate.finish_block(torch.tensor([1, 2]), Draft(tokens=torch.arange(5), probs=None), _signals([True] * 5), 5)
    assert out.tokens.tolist() == [0, 1, 2] and gate.last.stopped_early


def test_a_hard_ratio_equal_to_r_hard_stays_local_and_the_streak_is_bounded():
    gate = Gate(GateConfig(policy="lossy-local-commit", r_hard=0.25, max_local_rounds=2, rules=frozenset()))
    commits = []
    for _ in range(4):
        draft = gate.finish_block(torch.tensor([1, 2]), Draft(tokens=torch.arange(4), probs=None), _signals([True, False, False, False]), 4)
        assert gate.last.hard_ratio == 0.25 and not gate.last.escalate  # escalates only above R_hard
        commits.append(gate.local_commit(draft))
    assert commits == [True, True, False, True]  # at most max_local_rounds local blocks in a row
    gate.finish_block(torch.tensor([1, 2]), Draft(tokens=torch.arange(4), probs=None), _signals([True, True, False, False]), 4)
    assert gate.last.escalate


def test_only_the_block_just_gated_may_stay_local():
    gate = Gate(GateConfig(policy="lossy-local-commit", rules=frozenset()))
    gate.finish_block(torch.tensor([1, 2]), Draft(tokens=torch.tensor([3, 4]), probs=None), _signals([False, False]), 2)
    assert not gate.last.escalate
    assert not gate.local_commit(Draft(tokens=torch.tensor([3, 5]), probs=None))  # not what the gate judged
    assert gate.local_commit(Draft(tokens=torch.tensor([3, 4]), probs=None))


class _WordTokenizer:
    """decode(ids) joins a fixed word list; encode splits on '|' (enough for the text rules)."""

    def __init__(self, words=(" the", " Alice", ".", "5", " paid")):
        self.words = list(words)

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.split("|") if t]


#: a word list for the amount rules: a currency sign, a space, a digit, words
MONEY = ("$", " ", "5", " the", "Alice", " percent", " paid", ".")


def test_a_signal_exactly_at_its_threshold_is_not_hard():
    """hard means nll > T_nll, H > T_H, margin < T_margin, var > T_var: the thresholds themselves are easy."""
    cfg = GateConfig(t_nll_bits=3.0, t_entropy_bits=2.0, t_margin=0.25, t_mc_var=0.5)
    assert not is_hard(cfg, 3.0, 2.0, 0.25, 0.5)
    assert is_hard(cfg, 3.5, 2.0, 0.25, 0.5)
    assert is_hard(cfg, 3.0, 2.5, 0.25, 0.5)
    assert is_hard(cfg, 3.0, 2.0, 0.125, 0.5)
    assert is_hard(cfg, 3.0, 2.0, 0.25, 0.75) and not is_hard(cfg, 3.0, 2.0, 0.25, 0.25)


def test_a_sure_token_has_margin_one_and_zero_entropy():
    """One token in the vocabulary (or every other one at -inf): no doubt at all, finite numbers."""
    nll, entropy, margin = uncertainty(torch.tensor([3.0]), 0)
    assert (nll, entropy, margin) == (0.0, 0.0, 1.0)
    nll, entropy, margin = uncertainty(torch.tensor([0.0, -math.inf, -math.inf]), 0)
    assert nll == 0.0 and entropy == 0.0 and margin == pytest.approx(1.0)
    assert not is_hard(GateConfig(), nll, entropy, margin, None)


def test_shape_cuts_right_after_the_first_hard_token_and_cuts_q_alike():
    gate = Gate(GateConfig(policy="shape"))
    probs = torch.full((4, 3), 1 / 3)
    out = gate.finish_block(torch.tensor([1]), Draft(tokens=torch.tensor([0, 1, 2, 0]), probs=probs),
                            _signals([False, True, False, False]), 4)
    assert out.tokens.tolist() == [0, 1]  # the hard token itself is kept
    assert out.probs is not None and out.probs.shape == (2, 3)
    assert gate.last.stopped_early and gate.last.hard_ratio == 0.5


def test_a_block_without_signals_always_escalates_and_is_not_an_early_stop():
    """A deterministic drafter gives no signals: nothing to judge, so the cloud is asked, and a short
    draft is not counted as the gate's early stop."""
    gate = Gate(GateConfig(policy="lossy-local-commit", rules=frozenset()))
    draft = gate.finish_block(torch.tensor([1]), Draft(tokens=torch.tensor([3, 4]), probs=None), [], 5)
    assert gate.last.escalate and not gate.last.stopped_early
    assert gate.summary()["early_stops"] == 0 and gate.summary()["escalations"] == 1
    assert not gate.local_commit(draft)


def test_a_fired_rule_escalates_even_when_no_token_is_hard():
    gate = Gate(GateConfig(policy="lossy-local-commit", r_hard=1.0))
    draft = gate.finish_block(torch.tensor([1]), Draft(tokens=torch.tensor([3, 4]), probs=None),
                              _signals([False, False], triggers=("number",)), 2)
    assert gate.last.escalate and gate.last.triggered == ("number",)
    assert not gate.local_commit(draft)


def test_gate_stats_count_local_commits_and_the_mean_hard_ratio():
    gate = Gate(GateConfig(policy="lossy-local-commit", r_hard=0.5, rules=frozenset()))
    assert gate.summary()["cloud_call_ratio"] == 1.0 and gate.summary()["mean_hard_ratio"] == 0.0  # no rounds yet
    draft = gate.finish_block(torch.tensor([1]), Draft(tokens=torch.arange(4), probs=None),
                              _signals([True, False, False, False]), 4)
    assert gate.local_commit(draft)
    s = gate.summary()
    assert s["local_commits"] == 1 and s["cloud_call_ratio"] == 0.0
    assert s["mean_hard_ratio"] == 0.25 and s["hard_tokens"] == 1 and s["rounds"] == 1 and s["gated_tokens"] == 4
    gate.finish_block(torch.tensor([1]), Draft(tokens=torch.arange(3), probs=None), _signals([True, True, False]), 3)
    s = gate.summary()
    assert s["gated_tokens"] == 7 and s["hard_tokens"] == 3 and s["rounds"] == 2
    gate.finish_block(torch.tensor([1]), Draft(tokens=torch.arange(2), probs=None), [], 2)  # nothing to judge
    assert gate.summary()["gated_tokens"] == 7 and gate.summary()["rounds"] == 3


def test_the_draft_sampler_stops_at_the_first_hard_token_once_min_draft_is_reached():
    def inner(logits, position):
        return 0, None

    uniform = torch.zeros(1, 4)  # margin 0: hard
    spy = _GateSampler(inner, Gate(GateConfig(policy="shape", min_draft=1)), "")
    spy(uniform, 0)
    assert spy.stop_requested
    spy = _GateSampler(inner, Gate(GateConfig(policy="shape", min_draft=2)), "")
    spy(uniform, 0)
    assert not spy.stop_requested
    spy(uniform, 1)
    assert spy.stop_requested


def test_the_draft_sampler_carries_the_text_so_far_into_the_rules():
    """' Alice' after ' the' (drafted in the same block) is a name inside a sentence."""
    tokens = iter([0, 1])

    def inner(logits, position):
        return next(tokens), None

    gate = Gate(GateConfig(policy="shape", t_entropy_bits=None, t_margin=None),
                triggers=RuleTriggers(_WordTokenizer(), rules=frozenset({"name"})))
    spy = _GateSampler(inner, gate, "")
    sure = torch.tensor([[9.0, 0.0, 0.0, 0.0, 0.0]])
    spy(sure, 0)
    spy(sure, 1)
    assert [s.triggers for s in spy.signals] == [(), ("name",)]


def test_the_draft_sampler_carries_more_than_the_last_few_characters():
    """The text carried between drafted tokens keeps its last 64 characters: ' Alice' after ' the'
    and a run of eight spaces is still a name inside a sentence (the rule looks back past the
    spaces), not the start of a text."""
    tokens = iter([0, 1, 2])

    def inner(logits, position):
        return next(tokens), None

    gate = Gate(GateConfig(policy="shape", t_entropy_bits=None, t_margin=None),
                triggers=RuleTriggers(_WordTokenizer((" the", " " * 8, " Alice")), rules=frozenset({"name"})))
    spy = _GateSampler(inner, gate, "")
    sure = torch.tensor([[9.0, 0.0, 0.0]])
    for position in range(3):
        spy(sure, position)
    assert [s.triggers for s in spy.signals] == [(), (), ("name",)]


def test_an_amount_after_a_currency_sign_a_few_characters_back():
    triggers = RuleTriggers(_WordTokenizer(), rules=frozenset({"amount"}))
    assert triggers.check("it costs $ ", 3) == ("amount",)  # '5' after '$ '
    assert triggers.check("it costs  ", 3) == ()


def test_a_token_past_the_frequency_table_is_rare():
    triggers = RuleTriggers(None, rules=frozenset({"rare"}), frequency=torch.tensor([5, 5]), rare_max_count=0)
    assert triggers.check("", 1) == () and triggers.check("", 2) == ("rare",) and triggers.check("", 7) == ("rare",)


def test_a_json_frequency_table_ignores_ids_past_the_vocabulary(tmp_path):
    table = tmp_path / "freq.json"
    table.write_text(json.dumps({"1": 3, "4": 9, "5": 2}))
    assert token_frequency(table, tokenizer=None, vocab_size=4).tolist() == [0, 3, 0, 0]


@pytest.mark.parametrize("bad", [{"min_draft": 0}, {"mc_passes": 1}, {"max_local_rounds": 0}, {"r_hard": 1.5}, {"r_hard": -0.1}])
def test_out_of_range_gate_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        GateConfig(**bad)


class _Out:
    def __init__(self, logits):
        self.logits = logits


class _DropoutAtOnePosition(torch.nn.Module):
    """logits [1, L, V]: constant everywhere but at position ``noisy``, where dropout shakes them."""

    def __init__(self, vocab: int, noisy: int) -> None:
        super().__init__()
        self.vocab, self.noisy = vocab, noisy
        self.drop = torch.nn.Dropout(0.5)
        self.config = SimpleNamespace(attention_dropout=0.0)

    def forward(self, input_ids):
        n = input_ids.shape[1]
        logits = torch.zeros(1, n, self.vocab)
        logits[0, self.noisy] = self.drop(torch.arange(self.vocab, dtype=torch.float32))
        return _Out(logits)


def test_mc_dropout_reads_the_position_that_predicts_each_drafted_token():
    """context [L] then tokens [γ]: tokens[0] is predicted at position L-1 (the last context token)."""
    torch.manual_seed(0)
    model = SimpleNamespace(model=_DropoutAtOnePosition(vocab=4, noisy=2))  # context of 3: position 2
    assert has_dropout(model)
    var = mc_dropout_variance(model, torch.tensor([1, 2, 3]), torch.tensor([3]), passes=16)
    assert var is not None and var.shape == (1,) and float(var[0]) > 0
    model.model.noisy = 3  # the position after tokens[0]: not read for a one-token draft
    assert float(mc_dropout_variance(model, torch.tensor([1, 2, 3]), torch.tensor([3]), passes=16)[0]) == 0.0


def test_a_zero_dropout_rate_in_the_config_is_no_dropout():
    module = torch.nn.Linear(2, 2)
    module.config = SimpleNamespace(attention_dropout=0.0, hidden_dropout=0, dropout=0.0)
    assert not has_dropout(SimpleNamespace(model=module))
    module.config = SimpleNamespace(attention_dropout=0.1)
    assert has_dropout(SimpleNamespace(model=module))


def test_policy_off_leaves_the_inner_drafter_and_the_stats_alone():
    seen = []

    class _Inner:
        def propose(self, context, gamma, sampler):
            seen.append(sampler)
            return Draft(tokens=torch.tensor([1, 2]), probs=None)

    gate = Gate(GateConfig(policy="off"))
    sampler = object()
    draft = GatedDrafter(_Inner(), gate).propose(torch.tensor([0]), 2, sampler)  # type: ignore[arg-type]
    assert draft.tokens.tolist() == [1, 2] and seen == [sampler]
    assert gate.summary()["rounds"] == 0 and gate.last is None


SMALL_TARGET = ToyLM(4, order=2, seed=0)
SMALL_DRAFT = SMALL_TARGET.perturbed(1.0, seed=1)


def test_a_gated_hybrid_drafter_decodes_like_the_plain_one():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the lookup half drafts
    cfg = SamplingConfig(temperature=0.0, seed=0, max_new_tokens=30)
    plain = SpeculativeDecoder(SMALL_TARGET, LookupThenModel(ModelDrafter(SMALL_DRAFT)), get_rule("greedy"), gamma=FixedGamma(3))
    gated = SpeculativeDecoder(SMALL_TARGET, GatedDrafter(LookupThenModel(ModelDrafter(SMALL_DRAFT)), Gate(GateConfig(policy="shape"))),
                               get_rule("greedy"), gamma=FixedGamma(3))
    assert gated.generate(prompt, cfg).tokens == plain.generate(prompt, cfg).tokens


def test_a_gated_drafter_hands_on_hooks_but_not_trees_or_ungated_copies():
    """The gate forwards what the decoder asks of a drafter (a hybrid's update_free, the
    temperature factor), never a tree pass it could not judge, nor a copy that would draft ungated."""
    gated = GatedDrafter(LookupThenModel(ModelDrafter(SMALL_DRAFT)), Gate(GateConfig(policy="shape")))
    assert callable(gated.update_free) and gated.temperature_factor == gated.inner.temperature_factor
    for name in ("supports_trees", "propose_tree", "spawn", "with_model"):
        assert hasattr(gated.inner, name) and not hasattr(gated, name), name


def test_the_closed_ends_of_the_gate_settings_are_accepted():
    """R_hard in [0, 1] is a closed range: 0 (never keep a block with a hard token) is a valid setting."""
    assert GateConfig(r_hard=0.0).r_hard == 0.0
    GateConfig(r_hard=1.0)
    GateConfig(rare_max_count=0, min_draft=1, mc_passes=2, max_local_rounds=1)


def test_calibrate_nll_takes_the_quantile_it_is_given():
    assert calibrate_nll([0.0, 1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.0)
    assert calibrate_nll([0.0, 1.0, 2.0, 3.0, 4.0], 1.0) == pytest.approx(4.0)


class _Alternating(torch.nn.Module):
    """A 'dropout' model whose logits alternate between two fixed rows pass by pass (deterministic)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.config = SimpleNamespace()
        self.n = 0

    def forward(self, input_ids):
        row = torch.tensor([0.0, 0.0]) if self.n % 2 == 0 else torch.tensor([0.0, 100.0])  # q(1) = 0.5 or ~1
        self.n += 1
        return SimpleNamespace(logits=row.expand(1, input_ids.shape[1], 2).clone())


def test_mc_dropout_variance_is_the_unbiased_sample_variance_and_restores_the_mode():
    """Two passes with q(x) = 0.5 and 1.0: the (n-1) sample variance is 0.125; the module's
    train / eval mode is what it was before."""
    module = _Alternating().eval()
    var = mc_dropout_variance(SimpleNamespace(model=module), torch.tensor([0, 1]), torch.tensor([1]), passes=2)
    assert var is not None and float(var[0]) == pytest.approx(0.125)
    assert not module.training
    module.train()
    mc_dropout_variance(SimpleNamespace(model=module), torch.tensor([0, 1]), torch.tensor([1]), passes=2)
    assert module.training


def test_an_amount_word_after_a_number_and_a_space():
    """'5 ' then 'percent': the number before the word counts even with a space after it."""
    triggers = RuleTriggers(_WordTokenizer(MONEY), rules=frozenset({"amount"}))
    assert triggers.check("it is 5 ", 5) == ("amount",)
    assert triggers.check("it is a ", 5) == ()


def test_a_currency_sign_before_a_word_without_digits_is_no_amount():
    """A currency sign a few characters back fires only for a token with digits."""
    triggers = RuleTriggers(_WordTokenizer(MONEY), rules=frozenset({"amount"}))
    assert triggers.check("a $ ", 2) == ("amount",)
    assert triggers.check("a $ ", 3) == ()


def test_a_name_after_a_space_in_the_prefix_fires():
    """'Alice' (no leading space) after 'met ' is a word start inside a sentence; after 'met' it is not."""
    triggers = RuleTriggers(_WordTokenizer(MONEY), rules=frozenset({"name"}))
    assert triggers.check("we met ", 4) == ("name",)
    assert triggers.check("we met", 4) == ()


def test_a_text_corpus_frequency_table_skips_ids_past_the_vocabulary(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("1|2|2|9|")
    assert token_frequency(corpus, tokenizer=_WordTokenizer(MONEY), vocab_size=4).tolist() == [0, 1, 2, 0]


def test_the_lossy_policy_drafts_the_whole_block_through_hard_tokens():
    """Only ``shape`` stops the drafter at a hard token; ``lossy-local-commit`` drafts the whole block."""
    def inner(logits, position):
        return 0, None

    uniform = torch.zeros(1, 4)  # margin 0: hard
    spy = _GateSampler(inner, Gate(GateConfig(policy="lossy-local-commit")), "")
    spy(uniform, 0)
    assert spy.signals[0].hard and not spy.stop_requested


class _Recording:
    """An inner drafter that drafts token 2 ('5') once, through the sampler it is given."""

    def propose(self, context, gamma, sampler):
        token, _ = sampler(torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), 0)
        return Draft(tokens=torch.tensor([token]), probs=None)


def test_the_gated_drafter_reads_the_last_context_tokens_as_text():
    """The rules see the context's last ``context_tokens`` tokens: '$', ' ' then a drafted '5' is an amount."""
    gate = Gate(GateConfig(policy="shape", t_entropy_bits=None, t_margin=None),
                triggers=RuleTriggers(_WordTokenizer(MONEY), rules=frozenset({"amount"})))
    drafter = GatedDrafter(_Recording(), gate)

    def sampler(logits, position):
        return int(logits.argmax()), None

    drafter.propose(torch.tensor([3, 0, 1]), 1, sampler)
    assert gate.last.triggered == ("amount",)


def test_a_fresh_gate_reports_every_round_as_a_cloud_call():
    summary = Gate(GateConfig()).summary()
    assert summary["rounds"] == 0 and summary["cloud_call_ratio"] == 1.0 and summary["mean_hard_ratio"] == 0.0


def test_a_full_length_draft_is_not_an_early_stop():
    gate = Gate(GateConfig(policy="shape"))
    gate.finish_block(torch.tensor([1]), Draft(tokens=torch.tensor([0, 1]), probs=None),
                      [TokenSignals(0.1, 0.1, 0.9, None, (), False)] * 2, 2)
    assert not gate.last.stopped_early and gate.summary()["early_stops"] == 0


def test_an_early_stop_is_counted_in_the_summary():
    """A draft the shape policy cut short of the requested γ counts as one early stop in the stats."""
    gate = Gate(GateConfig(policy="shape"))
    gate.finish_block(torch.tensor([1]), Draft(tokens=torch.arange(4), probs=None), _signals([False, True, False, False]), 4)
    gate.finish_block(torch.tensor([1]), Draft(tokens=torch.arange(4), probs=None), _signals([False] * 4), 4)
    assert gate.summary()["early_stops"] == 1 and gate.summary()["rounds"] == 2


def test_signals_past_the_returned_draft_are_not_judged():
    """A drafter may sample more tokens than it returns (it stopped at an end token, say): only the
    signals of the tokens in the draft count towards the hard ratio and the escalation."""
    gate = Gate(GateConfig(policy="lossy-local-commit", r_hard=0.0, rules=frozenset()))
    draft = gate.finish_block(torch.tensor([1]), Draft(tokens=torch.tensor([3, 4]), probs=None),
                              _signals([False, False, True, True]), 4)
    assert gate.last.hard_ratio == 0.0 and not gate.last.escalate and len(gate.last.signals) == 2
    assert gate.summary()["gated_tokens"] == 2 and gate.summary()["hard_tokens"] == 0
    assert gate.local_commit(draft)


def test_a_dropout_layer_with_rate_zero_is_no_dropout():
    """torch.nn.Dropout(p=0.0) changes nothing: MC dropout would measure a variance of 0 for the price
    of its passes, so the draft counts as having no dropout."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
    assert not has_dropout(SimpleNamespace(model=module))
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    assert has_dropout(SimpleNamespace(model=module))


def test_a_hidden_dropout_rate_in_the_config_is_dropout():
    """Every dropout field the docstring's families use counts, hidden_dropout (e.g. Falcon's) too."""
    module = torch.nn.Linear(2, 2)
    module.config = SimpleNamespace(hidden_dropout=0.1)
    assert has_dropout(SimpleNamespace(model=module))


class _Words:
    def __init__(self, words):
        self.words = list(words)

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def test_a_capitalised_word_after_a_colon_or_semicolon_starts_a_sentence():
    """'Note: Alice' and 'done; Alice' start a new clause: no name rule there, unlike 'met Alice'."""
    triggers = RuleTriggers(_Words([" Alice"]), rules=frozenset({"name"}))
    assert triggers.check("Note:", 0) == ()
    assert triggers.check("done;", 0) == ()
    assert triggers.check("met", 0) == ("name",)


def test_a_capitalised_word_after_a_full_stop_and_spaces_is_no_name():
    """The sentence end is read before the trailing spaces of the prefix ('end.  ' + 'Alice')."""
    triggers = RuleTriggers(_Words(["Alice"]), rules=frozenset({"name"}))
    assert triggers.check("The end.  ", 0) == ()
    assert triggers.check("met  ", 0) == ("name",)
