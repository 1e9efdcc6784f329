"""Speed-up theory (Leviathan et al. 2023, §3; the seeds' formulas) and the engine's ideal.

With i.i.d. acceptance α and cost ratio c = (draft step time) / (target step time):

* expected tokens per target call  E(α, γ) = (1 − α^(γ+1)) / (1 − α)            (eq. 1)
* expected speed-up                 S(α, γ, c) = E / (γ c + 1)                   (Thm 3.8)

Real acceptance is not i.i.d. and verifying γ+1 tokens does not cost exactly one target step, so
the engine's *ideal* for a measured run uses its measured per-position acceptance and measured
costs: ideal tokens/s = E[tokens per round] / (γ · t_draft + t_verify(γ+1)).  The overhead share
is how far the measured rate falls below that ideal (sampling, verification, Python, prefill).
"""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(α, γ) = (1 − α^(γ+1)) / (1 − α); γ + 1 at α = 1."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al.'s expected wall-time improvement factor E / (γc + 1)."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 16) -> int:
    """The γ in [0, max_gamma] that maximises :func:`speedup` (0 = do not speculate)."""
    return max(range(max_gamma + 1), key=lambda g: speedup(alpha, g, c))


def best_chain_speedup(alpha: float, c: float, *, verify_slope: float = 0.12, max_gamma: int = 8,
                       floor: bool = True) -> tuple[float, int]:
    """``max_γ E(α, γ) / (γ c + 1 + verify_slope · γ)`` and its γ: :func:`speedup` with a verification
    pass that grows linearly with the rows it checks (what a CPU's pass does), what a self-speculative
    drafter's cost model ranks skip sets by.  ``floor``: γ = 0 (no drafting, ×1) is a choice too;
    without it the best γ >= 1 is returned even when it loses (< 1)."""
    best, best_g = (1.0, 0) if floor else (float("-inf"), 1)
    for g in range(1, max_gamma + 1):
        s = expected_tokens(alpha, g) / (g * c + 1.0 + verify_slope * g)
        if s > best:
            best, best_g = s, g
    return best, best_g


def alpha_from_block_efficiency(tokens_per_call: float, gamma: int, tol: float = 1e-10) -> float:
    """The i.i.d. α whose E(α, γ) equals a measured tokens-per-call (bisection)."""
    if gamma <= 0:
        return 0.0
    target = min(max(tokens_per_call, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_tokens_from_profile(accept_at_least: list[float]) -> float:
    """E[tokens per round] = 1 + Σ_k P(accepted ≥ k) for a measured per-position profile."""
    return 1.0 + sum(accept_at_least)


def ideal_tokens_per_s(tokens_per_round: float, gamma: float, draft_step_s: float, verify_s: float) -> float:
    """The engine's ceiling for a run: tokens per round over (γ draft steps + one verification)."""
    seconds = gamma * draft_step_s + verify_s
    return tokens_per_round / seconds if seconds > 0 else 0.0


def overhead_share(measured: float, ideal: float) -> float:
    """1 − measured / ideal (0 = the engine adds nothing on top of the model calls)."""
    return 1.0 - measured / ideal if ideal > 0 else 0.0
