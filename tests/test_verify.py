"""Verification rules: the paper's toy example, closed-form laws in float64, the contract."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.errors import ConfigError
from specdec.models import kernels
from specdec.models.toy import ToyLM
from specdec.sampling import gumbel_sample
from specdec.verify import (
    RULES,
    Verdict,
    block_plan,
    block_verify,
    coupled_verify,
    get_rule,
    greedy_verify,
    lossy_p_threshold,
    lossy_ratio_threshold,
    lossy_resample_p,
    token_plan,
    token_verify,
)
from stats import ALPHA, chi_square_pvalue

# ----------------------------------------------------------------------------- the paper's example
# Sun et al. 2024, §2: two tokens, M_b(A) = 1/3, M_s(A) = 2/3, i.i.d. positions, γ = 2.
P2 = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
Q2 = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
GAMMA2 = 2
N_TWO_TOKEN = 60_000  # SE of the mean accepted count ~0.0033; tolerance below is 5 SE


def _simulate_two_token(rule, n: int, seed: int) -> tuple[float, list[tuple[int, ...]]]:
    """Mean accepted count, and the completed outputs (X^τ, Y, Z^{γ-τ}) of Lemma 2."""
    g = torch.Generator().manual_seed(seed)
    q = Q2.expand(GAMMA2, 2)
    p = P2.expand(GAMMA2 + 1, 2)
    drafts = torch.multinomial(Q2, n * GAMMA2, replacement=True, generator=g).view(n, GAMMA2)
    fill = torch.multinomial(P2, n * GAMMA2, replacement=True, generator=g).view(n, GAMMA2).tolist()
    total, outputs = 0, []
    for i in range(n):
        v = rule(drafts[i], q, p, generator=g)
        total += v.num_accepted
        out = v.tokens.tolist()
        outputs.append(tuple(out + fill[i][: GAMMA2 + 1 - len(out)]))
    return total / n, outputs


def _iid_law(p: torch.Tensor, length: int) -> dict[tuple[int, ...], float]:
    return {
        seq: float(torch.prod(torch.tensor([p[t] for t in seq])))
        for seq in itertools.product(range(p.numel()), repeat=length)
    }


@pytest.mark.parametrize(("rule", "expected"), [(token_verify, 10 / 9), (block_verify, 11 / 9)])
def test_two_token_example_accepted_and_law(rule, expected):
    mean, outputs = _simulate_two_token(rule, N_TWO_TOKEN, seed=1)
    assert abs(mean - expected) < 5 * 0.0033, mean
    assert chi_square_pvalue(outputs, _iid_law(P2, GAMMA2 + 1)) > ALPHA


def test_two_token_example_detects_a_wrong_residual():
    """Negative control at the same sample size: resampling from p on rejection is biased."""
    _, outputs = _simulate_two_token(lossy_resample_p, N_TWO_TOKEN, seed=1)
    assert chi_square_pvalue(outputs, _iid_law(P2, GAMMA2 + 1)) < ALPHA


def _expected_accepted(plan_fn, block: bool) -> float:
    """E[τ] in closed form from a rule's plan, summed over all drafts of the two-token model."""
    total = 0.0
    for draft in itertools.product(range(2), repeat=GAMMA2):
        qx = float(torch.prod(torch.tensor([Q2[t] for t in draft])))
        plan = plan_fn(torch.tensor(draft), Q2.expand(GAMMA2, 2), P2.expand(GAMMA2 + 1, 2))
        for tau, prob in enumerate(_tau_law(plan.stop, block)):
            total += qx * prob * tau
    return total


def _tau_law(stop: torch.Tensor, block: bool) -> list[float]:
    """P(τ = i), i = 0..γ, for thresholds ``stop`` (a chain for token, a max for block)."""
    h = stop.tolist()
    gamma = len(h)
    law = []
    for tau in range(gamma + 1):
        if block:  # τ = max{i : η_i < h_i}
            prob = (h[tau - 1] if tau > 0 else 1.0)
            for j in range(tau, gamma):
                prob *= 1.0 - h[j]
        else:  # τ = number of leading acceptances
            prob = 1.0
            for j in range(tau):
                prob *= h[j]
            if tau < gamma:
                prob *= 1.0 - h[tau]
        law.append(prob)
    return law


def test_two_token_example_closed_form():
    assert _expected_accepted(token_plan, block=False) == pytest.approx(10 / 9, abs=1e-12)
    assert _expected_accepted(block_plan, block=True) == pytest.approx(11 / 9, abs=1e-12)


# ----------------------------------------------------------------------------- closed-form law


@pytest.mark.parametrize("vocab,gamma", [(3, 2), (3, 3), (4, 2)])
@pytest.mark.parametrize(("plan_fn", "block"), [(token_plan, False), (block_plan, True)])
def test_plan_reconstructs_target_law_exactly(plan_fn, block, vocab, gamma):
    """Lemma 2 of Sun et al. in float64: Σ_drafts q(x) · P(X^τ, Y, Z | x) = p^{γ+1}, to 1e-12."""
    target = ToyLM(vocab, order=2, seed=3)
    draft = target.perturbed(1.2, seed=4)
    prompt = [1, 0]
    p = lambda hist: torch.softmax(target.logits_for(prompt + list(hist)), -1)  # noqa: E731
    q = lambda hist: torch.softmax(draft.logits_for(prompt + list(hist)), -1)  # noqa: E731

    def p_seq(seq, prefix=()):
        prob, hist = 1.0, list(prefix)
        for t in seq:
            prob *= float(p(hist)[t])
            hist.append(t)
        return prob

    law: dict[tuple[int, ...], float] = {}
    for x in itertools.product(range(vocab), repeat=gamma):
        qx = p_seq([], ())  # 1.0
        for i, t in enumerate(x):
            qx *= float(q(x[:i])[t])
        q_rows = torch.stack([q(x[:i]) for i in range(gamma)])
        p_rows = torch.stack([p(x[:i]) for i in range(gamma + 1)])
        plan = plan_fn(torch.tensor(x), q_rows, p_rows)
        for tau, ptau in enumerate(_tau_law(plan.stop, block)):
            if ptau == 0.0:
                continue
            nxt = p_rows[gamma] if tau == gamma else plan.residual[tau] / plan.residual[tau].sum()
            for y in range(vocab):
                head = tuple(x[:tau]) + (y,)
                for z in itertools.product(range(vocab), repeat=gamma - tau):
                    out = head + z
                    law[out] = law.get(out, 0.0) + qx * ptau * float(nxt[y]) * p_seq(z, head)
    for seq in itertools.product(range(vocab), repeat=gamma + 1):
        assert law.get(seq, 0.0) == pytest.approx(p_seq(seq), abs=1e-12)


# ----------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_contract_shapes_and_prefix(rule):
    g = torch.Generator().manual_seed(0)
    vocab, gamma = 50, 5
    q = torch.softmax(torch.randn(gamma, vocab, generator=g), -1)
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g), -1)
    draft = torch.multinomial(q, 1, generator=g).squeeze(1)
    for _ in range(50):
        v = rule(draft, q, p, generator=g)
        assert isinstance(v, Verdict) and isinstance(v.num_accepted, int)
        assert v.tokens.dtype == torch.int64 and v.tokens.shape == (v.num_accepted + 1,)
        assert torch.equal(v.tokens[:-1], draft[: v.num_accepted])
        assert 0 <= int(v.tokens[-1]) < vocab


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_fixed_generator_is_reproducible(rule):
    q = torch.softmax(torch.randn(4, 30), -1)
    p = torch.softmax(torch.randn(5, 30), -1)
    draft = torch.tensor([1, 2, 3, 4])
    a = [rule(draft, q, p, generator=torch.Generator().manual_seed(s)).tokens.tolist() for s in range(20)]
    b = [rule(draft, q, p, generator=torch.Generator().manual_seed(s)).tokens.tolist() for s in range(20)]
    assert a == b


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_identical_distributions_accept_everything(rule):
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(6, 40, generator=g), -1)
    p = torch.cat([q, torch.softmax(torch.randn(1, 40, generator=g), -1)])
    for _ in range(200):
        draft = torch.multinomial(q, 1, generator=g).squeeze(1)
        assert rule(draft, q, p, generator=g).num_accepted == 6


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_deterministic_drafter_and_empty_draft(rule):
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    v = rule(torch.tensor([1, 2]), None, p)  # one-hot q, target agrees everywhere
    assert v.num_accepted == 2 and v.tokens.tolist() == [1, 2, 0]
    v = rule(torch.tensor([0, 2]), None, p)  # first token impossible under p
    assert v.num_accepted == 0 and v.tokens.tolist() == [1]
    v = rule(torch.empty(0, dtype=torch.long), None, p[:1])
    assert v.num_accepted == 0 and v.tokens.tolist() == [1]


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_an_empty_draft_draws_what_plain_sampling_draws(rule):
    """A round with nothing drafted takes its own short path; it must draw exactly what plain
    sampling's one categorical draw gives with the same generator state (200 seeds, 3 laws, one
    with zeros), and leave the generator where that draw leaves it."""
    from specdec.sampling import sample_categorical

    g = torch.Generator().manual_seed(5)
    laws = [torch.softmax(torch.randn(1, 500, generator=g) * 3, -1),
            torch.softmax(torch.randn(1, 7, generator=g), -1).double(),
            torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25]])]
    empty = torch.empty(0, dtype=torch.long)
    for p in laws:
        for seed in range(200):
            mine, ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            v = rule(empty, None, p, generator=mine)
            assert v.num_accepted == 0 and v.tokens.tolist() == [sample_categorical(p[0], ref)]
            assert torch.equal(torch.rand(3, generator=mine), torch.rand(3, generator=ref))
    with pytest.raises(ValueError):
        rule(empty, None, torch.ones(2, 5) / 5)


def test_greedy_verify():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert greedy_verify(torch.tensor([1, 0]), None, logits).tokens.tolist() == [1, 0, 2]
    assert greedy_verify(torch.tensor([1, 2]), None, logits).tokens.tolist() == [1, 0]
    assert greedy_verify(torch.tensor([2, 0]), None, logits).tokens.tolist() == [1]


def test_coupled_verify_emits_the_targets_own_gumbel_samples():
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(4, 20, generator=g) * 2, -1)
    positions = torch.arange(10, 14)
    own = [gumbel_sample(p[i], 7, 10 + i) for i in range(4)]
    # a draft equal to the target's own samples is fully accepted...
    v = coupled_verify(torch.tensor(own[:3]), None, p, seed=7, positions=positions)
    assert v.num_accepted == 3 and v.tokens.tolist() == own
    # ...and any draft yields a prefix of them
    for first in range(20):
        v = coupled_verify(torch.tensor([first, own[1], own[2]]), None, p, seed=7, positions=positions)
        assert v.tokens.tolist() == own[: v.num_accepted + 1]


def test_rule_registry():
    assert {"greedy", "token", "block", "coupled"} <= set(RULES)
    for name, rule in RULES.items():
        assert rule.lossless == (not name.startswith("lossy_")), name
    assert get_rule("lossy-ratio-threshold").name == "lossy_ratio_threshold"
    with pytest.raises(ConfigError, match="unknown verification method"):
        get_rule("nope")


# ----------------------------------------------------------------------------- the compiled chain rules


def _kernels():
    from specdec.models import kernels

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    return kernels


def _random_round(g: torch.Generator, gamma: int, vocab: int, kind: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Draft tokens, q [γ, V] (None: a deterministic drafter) and p [γ+1, V], float32: random laws,
    some sharp, some with zero entries (truncated), some q equal to p, some one-hot."""
    scale = (0.5, 2.0, 6.0)[kind % 3]
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * scale, -1)
    q = torch.softmax(torch.randn(gamma, vocab, generator=g) * scale, -1)
    if kind % 4 == 1:  # truncated laws: zeros in both
        p = p * (torch.rand(p.shape, generator=g) < 0.6)
        p[:, 0] += 1e-3
        p = p / p.sum(-1, keepdim=True)
        q = q * (torch.rand(q.shape, generator=g) < 0.6)
        q[:, 0] += 1e-3
        q = q / q.sum(-1, keepdim=True)
    if kind % 5 == 2:  # the draft equals the target on its rows
        q = p[:gamma].clone()
    tokens = torch.multinomial(q, 1, generator=g).squeeze(1)
    return tokens, (None if kind % 7 == 3 else q), p


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_compiled_chain_rule_gives_the_torch_rules_verdicts(rule, monkeypatch):
    """Once a model has loaded the kernels, a float32 chain's token / block verification is one
    compiled call.  On 2,400 random rounds (γ 1-6, vocabularies of 2 to 49,152 words, sharp and
    flat laws, zeros, q = p, one-hot q) with the same generator state it returns the torch rule's
    verdict — kept length, tokens, mean acceptance (a statistic, summed in another order) — and
    leaves the generator where the torch rule leaves it.  (Token verification is the same
    arithmetic; block verification sums its residual masses in float64 rather than float32, so a
    threshold may differ in its last bits: with these fixed seeds no decision lands that close.)"""
    import specdec.verify as verify_mod

    kernels = _kernels()
    g = torch.Generator().manual_seed(11)
    calls = []
    real = verify_mod._compiled_chain
    monkeypatch.setattr(verify_mod, "_compiled_chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    vocabs = (2, 3, 7, 50, 1000, 1000)
    for case in range(2400):
        # the full vocabulary once in 40 rounds: the torch rule is slow there
        vocab = 49_152 if case % 40 == 0 else vocabs[case % len(vocabs)]
        tokens, q, p = _random_round(g, 1 + case % 6, vocab, case)
        mine, ref = torch.Generator().manual_seed(case), torch.Generator().manual_seed(case)
        got = rule(tokens, q, p, generator=mine)
        with monkeypatch.context() as m:
            m.setattr(kernels, "loaded", lambda: False)
            want = rule(tokens, q, p, generator=ref)
        assert (got.num_accepted, got.tokens.tolist()) == (want.num_accepted, want.tokens.tolist()), case
        assert got.alpha_mean == pytest.approx(want.alpha_mean, rel=1e-12), case
        assert torch.equal(torch.rand(2, generator=mine, dtype=torch.float64), torch.rand(2, generator=ref, dtype=torch.float64))
    assert len(calls) == 2400  # every round took the compiled call


N_COMPILED_LAW = 40_000  # rounds; 4^4 = 256 cells of ~156 expected outputs each


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_compiled_chain_rule_law(rule):
    """The compiled rules' outputs, completed as in Lemma 2 of Sun et al. (accepted prefix, the
    next token, then fresh draws from p), follow p^{γ+1} (χ², N = 40,000, γ = 3, 4 tokens, float32
    laws with a zero); the torch fallback is not involved.  A compiled rule that drew the next
    token from p instead of the residual fails this test (checked by breaking it once)."""
    _kernels()
    p1 = torch.tensor([0.1, 0.4, 0.0, 0.5])
    q1 = torch.tensor([0.4, 0.1, 0.3, 0.2])
    gamma = 3
    p, q = p1.expand(gamma + 1, 4).contiguous(), q1.expand(gamma, 4).contiguous()
    g = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q1, N_COMPILED_LAW * gamma, replacement=True, generator=g).view(-1, gamma)
    fill = torch.multinomial(p1, N_COMPILED_LAW * gamma, replacement=True, generator=g).view(-1, gamma).tolist()
    outputs = []
    for i in range(N_COMPILED_LAW):
        out = rule(drafts[i], q, p, generator=g).tokens.tolist()
        outputs.append(tuple(out + fill[i][: gamma + 1 - len(out)]))
    law = _iid_law(p1.double(), gamma + 1)
    assert chi_square_pvalue(outputs, {k: v for k, v in law.items() if v > 0}) > ALPHA


@pytest.mark.skipif(not kernels.load(), reason="the kernels did not build here")
@pytest.mark.parametrize("block", [False, True])
def test_a_uniform_equal_to_the_acceptance_ratio_rejects(block):
    """The compiled chain rule keeps a draft token while eta_i < min(1, p_i(x_i) / q_i(x_i)): a uniform
    equal to the ratio rejects (random uniforms, as in the comparison with the torch rule, never land
    on a ratio exactly)."""
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])  # target rows for position 1 and the bonus
    q = torch.tensor([[0.5, 0.5]])
    tokens = torch.tensor([0])  # p / q = 0.5 exactly (block: h_1 = w_1 = 0.5 too)
    n, emitted, alpha = torch.ops.specdec.chain_rule(p, q, tokens, torch.tensor([0.5, 0.0], dtype=torch.float64), block)
    assert n == 0 and alpha == 0.5
    assert emitted.tolist() == [1]  # the residual max(0, p - q) = [0, 0.25]: token 1
    n, emitted, _ = torch.ops.specdec.chain_rule(p, q, tokens, torch.tensor([0.4999999, 0.0], dtype=torch.float64), block)
    assert n == 1 and emitted.tolist() == [0, 0]  # just below: accepted, the bonus from p_1


@pytest.mark.parametrize("rule", [token_verify, block_verify])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_draft_distribution_of_the_wrong_shape_is_refused(rule, dtype):
    """q must be [γ, V]: a row too many, a word too many or one row for all positions is a
    ValueError naming draft_probs (float32 rows would otherwise reach the compiled rule)."""
    p = torch.full((3, 5), 0.2, dtype=dtype)
    draft = torch.tensor([1, 2])
    for shape in ((3, 5), (2, 6), (1, 5), (2, 4)):
        with pytest.raises(ValueError, match="draft_probs"):
            rule(draft, torch.full(shape, 1 / shape[1], dtype=dtype), p, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_a_residual_that_rounds_to_zero_falls_back_to_the_rejected_positions_target(rule):
    """Rows that do not sum exactly to 1 can leave max(0, p_0 - q_0) = 0 after a rejection (here
    p_0 <= q_0 everywhere, p_0(x) / q_0(x) = 0.8).  The next token then comes from p_0 itself --
    never from another position's row (p_1 puts all its mass on token 2, which p_0 forbids).
    200 seeds, float64 rows (the torch rule); about 20% of them reject."""
    q = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    p = torch.tensor([[0.4, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    rejected = 0
    for s in range(200):
        v = rule(torch.tensor([0]), q, p, generator=torch.Generator().manual_seed(s))
        if v.num_accepted == 0:
            rejected += 1
            assert int(v.tokens[0]) in (0, 1)
        else:
            assert v.tokens.tolist() == [0, 2]
    assert 10 < rejected < 80


def test_get_rule_passes_its_parameters_on():
    """``get_rule(name, threshold=...)`` binds the parameter: with p/q = 0.5 at the first position
    the default threshold 1.0 rejects, 0.4 accepts."""
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.25, 0.75], [1.0, 0.0]], dtype=torch.float64)
    draft = torch.tensor([0])
    assert get_rule("lossy-ratio-threshold").fn(draft, q, p).num_accepted == 0
    assert get_rule("lossy-ratio-threshold", threshold=0.4).fn(draft, q, p).num_accepted == 1
    assert get_rule(" Token ").name == "token"


def test_lossy_ratio_threshold_accepts_at_the_threshold():
    """'accept deterministically while p/q >= threshold': a ratio exactly at the threshold is kept."""
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    v = lossy_ratio_threshold(torch.tensor([0, 1]), q, p, threshold=0.5)
    assert v.num_accepted == 2 and v.tokens.tolist() == [0, 1, 0]
    assert v.alpha_mean == pytest.approx(0.75)


@pytest.mark.parametrize("rule", [token_verify, block_verify])
def test_mixed_precision_laws_take_the_torch_rule_even_with_the_kernels_loaded(rule):
    """The compiled chain rule takes float32 p and q only; a float32 target with a float64 draft
    (or the reverse) runs the torch rule, which computes in float64: the verdict is the all-float64
    verdict for the same generator state (50 seeds)."""
    from specdec.models import kernels

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g) * 2, -1)  # float32
    q = torch.softmax(torch.randn(3, 6, generator=g, dtype=torch.float64) * 2, -1)
    draft = torch.tensor([1, 4, 2])
    for s in range(50):
        want = rule(draft, q, p.double(), generator=torch.Generator().manual_seed(s))
        for pp, qq in ((p, q), (p.double(), q.float())):
            if qq.dtype == torch.float32:
                want = rule(draft, qq.double(), pp, generator=torch.Generator().manual_seed(s))
            got = rule(draft, qq, pp, generator=torch.Generator().manual_seed(s))
            assert got.tokens.tolist() == want.tokens.tolist(), s


def test_coupled_verify_reads_each_scored_position_it_is_given():
    """``positions`` are the absolute positions of the scored rows, not necessarily consecutive
    (the rule must read positions[i], not positions[0] + i)."""
    from specdec.sampling import gumbel_sample
    from specdec.verify import coupled_verify

    p = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(2)) * 0.5, -1)
    positions = torch.tensor([10, 25, 40])
    own = [gumbel_sample(p[i], 7, int(positions[i])) for i in range(3)]
    v = coupled_verify(torch.tensor(own[:2]), None, p, seed=7, positions=positions)
    assert v.num_accepted == 2 and v.tokens.tolist() == own


def test_the_lossy_strict_residual_leaves_the_target_rows_untouched():
    """Even the lossy rules are pure functions of their inputs: the 'strict' residual is built on
    a copy of p_j (float64 rows, 50 seeds with rejections)."""
    from specdec.verify import lossy_strict_residual

    q = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    before = p.clone()
    for s in range(50):
        lossy_strict_residual(torch.tensor([0]), q, p, generator=torch.Generator().manual_seed(s))
    assert torch.equal(p, before)


@pytest.mark.parametrize("rule", [greedy_verify, token_verify, block_verify])
def test_a_draft_that_is_not_one_dimensional_is_refused(rule):
    """draft_tokens must be [γ]: a [1, γ] batch-shaped draft is a ValueError naming draft_tokens,
    not silently broadcast against the target rows (float64 rows: the torch rules)."""
    p = torch.full((3, 4), 0.25, dtype=torch.float64)
    with pytest.raises(ValueError, match="draft_tokens"):
        rule(torch.tensor([[1, 2]]), None, p, generator=torch.Generator().manual_seed(0))


def test_lossy_p_threshold_default_and_its_boundary():
    """'accept deterministically while p >= T_pass', T_pass = 0.3 by default: p(x) = 0.4 is kept at
    the default, p(x) = 0.3 exactly is kept too (>=), and 0.5 as a threshold rejects p(x) = 0.4."""
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    draft = torch.tensor([0])
    p = torch.tensor([[0.4, 0.6], [1.0, 0.0]], dtype=torch.float64)
    assert lossy_p_threshold(draft, q, p).tokens.tolist() == [0, 0]
    assert lossy_p_threshold(draft, q, p, threshold=0.5).num_accepted == 0
    p_at = torch.tensor([[0.3, 0.7], [1.0, 0.0]], dtype=torch.float64)
    assert lossy_p_threshold(draft, q, p_at).tokens.tolist() == [0, 0]


def test_lossy_rules_report_alpha_mean_over_every_draft_position_after_a_rejection():
    """alpha_mean is the mean of min(1, p/q) over all γ draft positions, also when the draft is
    rejected at the first position (ratios 0.5 and 1.0: 0.75, not the accepted prefix's)."""
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    v = lossy_ratio_threshold(torch.tensor([0, 1]), q, p, generator=torch.Generator().manual_seed(0))
    assert v.num_accepted == 0 and v.tokens.numel() == 1  # threshold 1.0: position 0 rejected, one token drawn
    assert v.alpha_mean == pytest.approx(0.75)


def test_rules_that_compare_probabilities_ask_for_the_draft_rows():
    """A rule that reads q must say so (the decoder asks the drafter for its rows only then; block
    verification handed q = None would treat sampled drafts as one-hot and be biased)."""
    assert {n: r.needs_draft_probs for n, r in RULES.items()} == {
        "greedy": False, "token": True, "block": True, "coupled": False,
        "lossy_resample_p": True, "lossy_strict_residual": True,
        "lossy_ratio_threshold": True, "lossy_p_threshold": True}


def test_the_torch_rules_draw_float64_uniforms_and_average_alpha_over_every_position():
    """float64 rows take the torch rules (the compiled ones take float32 rows). Token verification
    keeps the leading run of u_i < min(1, p_i(x_i) / q_i(x_i)), its u the first γ float64 uniforms of
    the generator; both rules report alpha_mean as the mean of min(1, p/q) over all γ positions
    (40 random rounds of γ 4 over 5 tokens)."""
    g = torch.Generator().manual_seed(0)
    gamma, vocab = 4, 5
    rows = torch.arange(gamma)
    for seed in range(40):
        q = torch.softmax(torch.randn(gamma, vocab, generator=g, dtype=torch.float64), -1)
        p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g, dtype=torch.float64), -1)
        draft = torch.multinomial(q, 1, generator=g).squeeze(1)
        ratio = (p[rows, draft] / q[rows, draft]).clamp(max=1.0)
        u = torch.rand(gamma, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        token = token_verify(draft, q, p, generator=torch.Generator().manual_seed(seed))
        assert token.num_accepted == int((u < ratio).long().cumprod(0).sum()), seed
        block = block_verify(draft, q, p, generator=torch.Generator().manual_seed(seed))
        for v in (token, block):
            assert v.alpha_mean == pytest.approx(float(ratio.mean()), rel=1e-12), seed
