import pytest

from specdec.bench import theory


def test_expected_tokens_and_speedup_formulas():
    # Leviathan et al. eq. 1 at a few points, and its limits
    assert theory.expected_tokens(0.0, 5) == 1.0
    assert theory.expected_tokens(1.0, 5) == 6.0
    assert theory.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert theory.speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)


def test_optimal_gamma():
    assert theory.optimal_gamma(0.0, 0.1) == 0  # nothing is ever accepted: don't speculate
    assert theory.optimal_gamma(0.9, 0.0, max_gamma=16) == 16  # free drafting: draft as far as allowed
    g = theory.optimal_gamma(0.8, 0.05)
    assert theory.speedup(0.8, g, 0.05) >= max(theory.speedup(0.8, k, 0.05) for k in range(17)) - 1e-12


def test_best_chain_speedup_with_a_growing_verification_pass():
    """The γ that maximises E(α, γ) / (γ c + 1 + slope γ), found by hand at a few points."""
    # α 0.78, c 0.61 (a self-speculative view on two cores): γ 1 gives 1.78 / 1.73, γ 2 2.3884 / 2.46
    best, g = theory.best_chain_speedup(0.78, 0.61)
    assert g == 1 and best == pytest.approx(1.78 / 1.73)
    # a draft that never agrees: no drafting (×1, γ 0), or with no floor the least bad γ >= 1
    assert theory.best_chain_speedup(0.0, 0.3) == (1.0, 0)
    best, g = theory.best_chain_speedup(0.0, 0.3, floor=False)
    assert g == 1 and best == pytest.approx(1 / 1.42)
    # free drafting, perfect acceptance and free verification rows: γ as far as allowed
    best, g = theory.best_chain_speedup(1.0, 0.0, verify_slope=0.0, max_gamma=5)
    assert (best, g) == (6.0, 5)
    # α 0.9, c 0.05, slope 0.12: γ 7 (5.6953 / 2.19 = 2.6006) beats γ 6 (2.5827) and γ 8 (2.5957)
    best, g = theory.best_chain_speedup(0.9, 0.05)
    assert g == 7 and best == pytest.approx(2.6006, abs=1e-4)
    brute = max((theory.expected_tokens(0.9, k) / (k * 0.05 + 1 + 0.12 * k), k) for k in range(1, 9))
    assert (best, g) == pytest.approx(brute)
    # a γ that only breaks even (every γ gives exactly ×1 here) is not worth drafting for
    assert theory.best_chain_speedup(0.0, 0.0, verify_slope=0.0) == (1.0, 0)


def test_alpha_inverts_expected_tokens():
    for alpha in (0.1, 0.5, 0.77, 0.95):
        e = theory.expected_tokens(alpha, 6)
        assert theory.alpha_from_block_efficiency(e, 6) == pytest.approx(alpha, abs=1e-8)


def test_ideal_and_overhead():
    assert theory.expected_tokens_from_profile([0.8, 0.6, 0.3]) == pytest.approx(2.7)
    ideal = theory.ideal_tokens_per_s(2.7, 3, 0.001, 0.02)
    assert ideal == pytest.approx(2.7 / 0.023)
    assert theory.overhead_share(0.9 * ideal, ideal) == pytest.approx(0.1)
    # a run with no measured time (nothing drafted or verified) has no ideal, and no overhead
    assert theory.ideal_tokens_per_s(1.0, 0, 0.0, 0.0) == 0.0 and theory.overhead_share(5.0, 0.0) == 0.0


def test_optimal_gamma_does_not_speculate_when_every_gamma_only_breaks_even():
    """α = 0 and free drafting: every γ gives exactly ×1 (E = 1, cost 1), so γ = 0 (do not
    speculate), as best_chain_speedup decides a break-even γ; the smallest γ wins a tie."""
    assert all(theory.speedup(0.0, g, 0.0) == 1.0 for g in range(17))
    assert theory.optimal_gamma(0.0, 0.0) == 0


def test_alpha_of_gamma_zero_is_exactly_zero():
    """No drafted tokens: no acceptance to infer, α is 0.0 exactly (not a bisection's residue)."""
    assert theory.alpha_from_block_efficiency(1.0, 0) == 0.0
    assert theory.alpha_from_block_efficiency(3.0, 0) == 0.0


def test_alpha_reaches_one_when_every_draft_is_accepted():
    """E = γ + 1 (all drafts accepted) inverts to α = 1; α close to 1 is recovered too."""
    assert theory.alpha_from_block_efficiency(7.0, 6) == pytest.approx(1.0, abs=1e-8)
    e = theory.expected_tokens(0.995, 6)
    assert theory.alpha_from_block_efficiency(e, 6) == pytest.approx(0.995, abs=1e-8)


def test_optimal_gamma_searches_up_to_16_by_default():
    """The documented default range is [0, 16]: free drafting at α 0.9 drafts 16 tokens."""
    assert theory.optimal_gamma(0.9, 0.0) == 16


def test_best_chain_speedup_searches_up_to_gamma_8_by_default():
    """The self-speculative drafter ranks skip sets with the default range γ in [1, 8]: perfect
    acceptance with free drafting and free verification rows drafts 8 tokens (×9), no fewer."""
    assert theory.best_chain_speedup(1.0, 0.0, verify_slope=0.0) == (9.0, 8)


def test_a_non_positive_time_or_ideal_gives_no_ideal_and_no_overhead():
    """The guards are "> 0", not "!= 0": a negative time (a clock stepped back) or a negative ideal
    gives 0.0, never a negative rate or an overhead above 100%."""
    assert theory.ideal_tokens_per_s(2.0, 1, 0.0, -0.01) == 0.0
    assert theory.overhead_share(5.0, -1.0) == 0.0
