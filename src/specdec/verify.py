"""Verification rules: pure functions of the draft, the two distributions and the randomness.

Indexing convention for a round with draft length γ (0-based):

* ``draft_tokens[i]`` was sampled from ``draft_probs[i]``            (``q_i``, rows 0..γ-1);
* ``target_probs[i]`` is the target's distribution at that position   (``p_i``, rows 0..γ);
  ``target_probs[γ]`` is the distribution of the bonus token.

Every rule returns a :class:`Verdict`: the accepted draft prefix followed by exactly one
recovered-or-bonus token.  Randomness comes in as a ``torch.Generator`` (or, for coupled
verification, as explicit Gumbel noise); no rule touches a global RNG.

Lossless rules: :func:`greedy_verify`, :func:`token_verify` (Leviathan et al. 2023, Alg. 1;
Chen et al. 2023), :func:`block_verify` (Sun et al. 2024, "Block Verification Accelerates
Speculative Decoding", Alg. 2) and :func:`coupled_verify` (seeded Gumbel-max coupling).
Common engineering shortcuts are kept as ``lossy_*`` rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal, Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.errors import ConfigError
from specdec.sampling import argmax_last, gumbel_sample, sample_categorical


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft block."""

    num_accepted: int
    tokens: Tensor  # [num_accepted + 1] int64: accepted prefix + recovered-or-bonus token
    #: mean over draft positions of alpha_i = min(1, p_i(x_i) / q_i(x_i)) (alpha_mean);
    #: None for rules that do not compare probabilities (greedy, coupled)
    alpha_mean: float | None = None
    #: token trees: the accepted node indices (root level first); None for a chain
    path: tuple[int, ...] | None = None


def _as_probs(draft_probs: Tensor | None, draft_tokens: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
    """The draft distribution ``q`` [γ, V]; a deterministic drafter's ``q`` is one-hot."""
    if draft_probs is not None:
        return draft_probs
    return torch.nn.functional.one_hot(draft_tokens, vocab).to(dtype)


def _check_shapes(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> int:
    gamma = draft_tokens.numel()
    if draft_tokens.dim() != 1 or target_probs.dim() != 2 or target_probs.shape[0] != gamma + 1:
        raise ValueError(
            f"expected draft_tokens [γ] and target_probs [γ+1, V]; got {tuple(draft_tokens.shape)}"
            f" and {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (gamma, target_probs.shape[1]):
        raise ValueError(f"expected draft_probs [γ, V]; got {tuple(draft_probs.shape)}")
    return gamma


def _leading_true(mask: Tensor) -> int:  # mask: [γ] bool -> length of its all-True prefix
    return int(mask.to(torch.int64).cumprod(0).sum()) if mask.numel() else 0


def _sample_row(weights: Tensor, generator: torch.Generator | None) -> Tensor:  # [V] -> [1]
    return torch.tensor([sample_categorical(weights, generator)], dtype=torch.long)


def _undrafted(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
               generator: torch.Generator | None) -> Verdict:
    """A round with nothing drafted (plain decoding; a round the γ controller left empty): one draw
    from ``p_0`` -- what the general path draws, since it draws no uniforms for γ = 0 and then
    samples ``p_γ`` -- without its dozen empty-tensor ops (over a 49,152-word row: block 0.19 ->
    0.09 ms a round, token 0.14 -> 0.09 ms; ``benchmarks/empty-draft-round``)."""
    _check_shapes(draft_tokens, draft_probs, target_probs)
    return Verdict(num_accepted=0, tokens=_sample_row(target_probs[0], generator))


def _finish(draft_tokens: Tensor, n: int, last: Tensor, alpha: Tensor | None = None) -> Verdict:
    mean = float(alpha.mean()) if alpha is not None and alpha.numel() else None
    return Verdict(num_accepted=n, tokens=torch.cat([draft_tokens[:n], last.reshape(1)]), alpha_mean=mean)


def _compiled(target_probs: Tensor, draft_probs: Tensor | None) -> bool:
    """Whether a chain's token / block verification runs as one compiled call here: a model
    loaded the kernels in this process and both laws are float32 (as processed rows are; mixed
    precisions would make the torch rule compute in float64)."""
    from specdec.models import kernels

    return (kernels.loaded() and target_probs.dtype == torch.float32
            and (draft_probs is None or draft_probs.dtype == torch.float32))


def _compiled_chain(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                    generator: torch.Generator | None, *, block: bool) -> Verdict:
    """:func:`token_verify` / :func:`block_verify` in one compiled call (``csrc/rules.cpp``).

    The randomness is what the torch version draws (γ uniforms for the rule, then one for the next
    token: one call, the same numbers), and every step is the torch version's own arithmetic,
    except that block verification sums each residual's mass in float64 where the torch version
    sums in float32 (a threshold may differ in its last bits) and the mean acceptance (a
    statistic) is summed in order.  Tested against the torch rules verdict for verdict."""
    gamma = _check_shapes(draft_tokens, draft_probs, target_probs)
    q = _as_probs(draft_probs, draft_tokens, target_probs.shape[1], target_probs.dtype)
    uniforms = torch.rand(gamma + 1, generator=generator, dtype=torch.float64)  # [γ+1]: η_1..η_γ, then the draw's
    n, emitted, alpha_mean = torch.ops.specdec.chain_rule(
        target_probs.contiguous(), q.contiguous(), draft_tokens.contiguous(), uniforms, block)
    return Verdict(num_accepted=n, tokens=emitted, alpha_mean=alpha_mean)


def greedy_verify(
    draft_tokens: Tensor,  # [γ] int64
    draft_probs: Tensor | None,  # unused: greedy needs only the target's arg-max
    target_probs: Tensor,  # [γ+1, V] probabilities or (penalised) logits: only the arg-max is used
    *,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Accept draft tokens while they equal the target's arg-max; emit the target's arg-max next."""
    _check_shapes(draft_tokens, None, target_probs)
    best = argmax_last(target_probs)  # [γ+1]
    n = _leading_true(best[:-1] == draft_tokens)
    return Verdict(num_accepted=n, tokens=best[: n + 1].clone())


@dataclass(frozen=True)
class Plan:
    """The deterministic half of a verification rule, before any randomness is drawn.

    ``stop[i]`` for i = 1..γ (index i-1) is the rule's acceptance threshold at draft position i
    (token verification: ``min(1, p/q)``, a chain; block verification: ``h_i``, where the kept
    prefix is the *last* position whose uniform falls below it); ``residual[i]`` for i = 0..γ-1
    is the unnormalised distribution of the next token when exactly i draft tokens are kept.
    """

    stop: Tensor  # [γ] float64
    residual: Tensor  # [γ, V]
    alpha: Tensor  # [γ] float64: min(1, p_i(x_i) / q_i(x_i)), for statistics


def token_plan(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> Plan:
    """Leviathan et al. 2023: thresholds ``min(1, p_i(x_i)/q_i(x_i))``, residuals ``max(0, p_i - q_i)``."""
    gamma = _check_shapes(draft_tokens, draft_probs, target_probs)
    q = _as_probs(draft_probs, draft_tokens, target_probs.shape[1], target_probs.dtype)
    rows = torch.arange(gamma)
    ratio = target_probs[rows, draft_tokens].double() / q[rows, draft_tokens].double()
    alpha = ratio.clamp(max=1.0)
    return Plan(stop=alpha, residual=(target_probs[:gamma] - q).clamp_min(0.0), alpha=alpha)


def block_plan(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor) -> Plan:
    """Sun et al. 2024, Algorithm 2: ``w_0 = 1``, ``w_i = min(1, w_{i-1} p(x_i)/q(x_i))``,
    residual ``r_i = max(0, w_i p_i - q_i)``, thresholds ``h_i = |r_i| / (|r_i| + 1 - w_i)``
    for i < γ and ``h_γ = w_γ``.  (0/0, which needs p_i = q_i and w_i = 1, is taken as 0.)
    """
    gamma = _check_shapes(draft_tokens, draft_probs, target_probs)
    q = _as_probs(draft_probs, draft_tokens, target_probs.shape[1], target_probs.dtype)
    rows = torch.arange(gamma)
    ratio = target_probs[rows, draft_tokens].double() / q[rows, draft_tokens].double()
    ratios = ratio.tolist()
    weights = [1.0]
    for r in ratios:  # the recursion is sequential; γ scalars, one host sync
        weights.append(min(weights[-1] * r, 1.0))
    w = torch.tensor(weights, dtype=torch.float64)  # [γ+1]: w_0..w_γ
    residual = (w[:gamma].to(target_probs.dtype).unsqueeze(1) * target_probs[:gamma] - q).clamp_min(0.0)
    mass = residual.sum(-1).double()  # [γ]
    denom = mass[1:] + (1.0 - w[1:gamma])
    h_mid = torch.where(denom > 0, mass[1:] / denom.clamp_min(1e-300), torch.zeros_like(denom))
    stop = torch.cat([h_mid, w[gamma:]]) if gamma else torch.empty(0, dtype=torch.float64)
    return Plan(stop=stop, residual=residual, alpha=ratio.clamp(max=1.0))


def _next_token(plan: Plan, n: int, target_probs: Tensor, generator: torch.Generator | None) -> Tensor:
    gamma = plan.stop.numel()
    if n == gamma:
        return _sample_row(target_probs[gamma], generator)
    row = plan.residual[n]
    if not bool(row.sum() > 0):  # unreachable in exact arithmetic; guards against rounding
        row = target_probs[n]
    return _sample_row(row, generator)


def token_verify(
    draft_tokens: Tensor,  # [γ] int64
    draft_probs: Tensor | None,  # [γ, V] q actually sampled from; None => deterministic drafter
    target_probs: Tensor,  # [γ+1, V]
    *,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Token verification (Leviathan et al. 2023; Algorithm 1 of Sun et al. 2024).

    Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))`` until the first rejection at
    ``j``; then sample from the residual ``norm(max(0, p_j - q_j))`` over the whole vocabulary
    (not the often-quoted ``p - 1[v=y_j] q_j``).  If all γ are accepted, the bonus comes from ``p_γ``.
    """
    if draft_tokens.numel() == 0:
        return _undrafted(draft_tokens, draft_probs, target_probs, generator)
    if _compiled(target_probs, draft_probs):
        return _compiled_chain(draft_tokens, draft_probs, target_probs, generator, block=False)
    plan = token_plan(draft_tokens, draft_probs, target_probs)
    u = torch.rand(plan.stop.numel(), generator=generator, dtype=torch.float64)
    n = _leading_true(u < plan.stop)
    return _finish(draft_tokens, n, _next_token(plan, n, target_probs, generator), plan.alpha)


def block_verify(
    draft_tokens: Tensor,  # [γ] int64
    draft_probs: Tensor | None,  # [γ, V]; None => deterministic drafter (one-hot q)
    target_probs: Tensor,  # [γ+1, V]
    *,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Block verification (Sun et al. 2024, Algorithm 2); optimal among single-draft verifiers.

    Draw ``η_1..η_γ ~ U(0, 1)``; keep ``τ = max{i : η_i < h_i}`` draft tokens (0 if none); the
    next token comes from ``p_γ`` if ``τ = γ``, else from ``norm(r_τ)`` (see :func:`block_plan`;
    for ``τ = 0`` this is the token-verification residual).
    """
    if draft_tokens.numel() == 0:
        return _undrafted(draft_tokens, draft_probs, target_probs, generator)
    if _compiled(target_probs, draft_probs):
        return _compiled_chain(draft_tokens, draft_probs, target_probs, generator, block=True)
    plan = block_plan(draft_tokens, draft_probs, target_probs)
    eta = torch.rand(plan.stop.numel(), generator=generator, dtype=torch.float64)
    hits = (eta < plan.stop).nonzero()
    tau = int(hits[-1]) + 1 if hits.numel() else 0
    return _finish(draft_tokens, tau, _next_token(plan, tau, target_probs, generator), plan.alpha)


def coupled_verify(
    draft_tokens: Tensor,  # [γ] int64, drafted as gumbel_sample(q_i, seed, position_i)
    draft_probs: Tensor | None,  # unused
    target_probs: Tensor,  # [γ+1, V]
    *,
    seed: int,
    positions: Tensor,  # [γ+1] absolute positions of the γ+1 scored tokens
    generator: torch.Generator | None = None,
) -> Verdict:
    """Seeded Gumbel-max coupling: the target's own sample at absolute position ``t`` is
    ``argmax_v log p_t(v) + G(seed, t, v)``; accept draft tokens while they equal it.

    The emitted tokens are, by construction, the tokens plain decoding with the same seed would
    sample (Gumbel-max trick), whatever the drafter and γ: the rule is drafter-invariant.  The
    noise is a pure function of (seed, position, token id), so "randomness as an argument" here
    means the key.
    """
    gamma = _check_shapes(draft_tokens, None, target_probs)
    drafted = draft_tokens.tolist()
    pos = positions.tolist()
    out: list[int] = []
    for i in range(gamma + 1):
        own = gumbel_sample(target_probs[i], seed, pos[i])
        out.append(own)
        if i == gamma or own != drafted[i]:
            break
    return Verdict(num_accepted=len(out) - 1, tokens=torch.tensor(out, dtype=torch.int64))


# ----------------------------------------------------------------------------- lossy shortcuts


def _lossy_accept_then_p(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    accept: Callable[[Tensor, Tensor, Tensor], Tensor],
    residual: Callable[[Tensor, int, Tensor, Tensor], Tensor],
    generator: torch.Generator | None,
) -> Verdict:
    gamma = _check_shapes(draft_tokens, draft_probs, target_probs)
    q = _as_probs(draft_probs, draft_tokens, target_probs.shape[1], target_probs.dtype)
    rows = torch.arange(gamma)
    p_x = target_probs[rows, draft_tokens].double()
    q_x = q[rows, draft_tokens].double()
    u = torch.rand(gamma, generator=generator, dtype=torch.float64)
    n = _leading_true(accept(p_x, q_x, u))
    if n == gamma:
        return _finish(draft_tokens, n, _sample_row(target_probs[gamma], generator), (p_x / q_x).clamp(max=1.0))
    weights = residual(target_probs[n], int(draft_tokens[n]), q_x[n], target_probs)
    return _finish(draft_tokens, n, _sample_row(weights, generator), (p_x / q_x).clamp(max=1.0))


def _resample_from_p(p_row: Tensor, token: int, q_tok: Tensor, _: Tensor) -> Tensor:
    return p_row


def _guide_residual(p_row: Tensor, token: int, q_tok: Tensor, _: Tensor) -> Tensor:
    """The often-quoted 'strict' residual p(v) - 1[v = y_j] q_j.  It is NOT the correct residual."""
    weights = p_row.clone()
    weights[token] = (weights[token] - q_tok.to(weights.dtype)).clamp_min(0.0)
    return weights if bool(weights.sum() > 0) else p_row


def lossy_resample_p(draft_tokens, draft_probs, target_probs, *, generator=None) -> Verdict:
    """A common 'engineering shortcut': accept w.p. min(1, p/q), on rejection sample from p."""
    return _lossy_accept_then_p(
        draft_tokens, draft_probs, target_probs, lambda p, q, u: u * q < p, _resample_from_p, generator
    )


def lossy_strict_residual(draft_tokens, draft_probs, target_probs, *, generator=None) -> Verdict:
    """The often-quoted 'strict unbiased' rule: its residual p - 1[v=y_j] q_j is biased."""
    return _lossy_accept_then_p(
        draft_tokens, draft_probs, target_probs, lambda p, q, u: u * q < p, _guide_residual, generator
    )


def lossy_ratio_threshold(
    draft_tokens, draft_probs, target_probs, *, generator=None, threshold: float = 1.0
) -> Verdict:
    """A common cloud-side shortcut: accept deterministically while p/q >= threshold."""
    return _lossy_accept_then_p(
        draft_tokens,
        draft_probs,
        target_probs,
        lambda p, q, u: p >= threshold * q,
        _resample_from_p,
        generator,
    )


def lossy_p_threshold(
    draft_tokens, draft_probs, target_probs, *, generator=None, threshold: float = 0.3
) -> Verdict:
    """A variant of it: accept deterministically while p >= T_pass."""
    return _lossy_accept_then_p(
        draft_tokens, draft_probs, target_probs, lambda p, q, u: p >= threshold, _resample_from_p, generator
    )


# ----------------------------------------------------------------------------- registry


class VerifyFn(Protocol):
    def __call__(
        self, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, **kwargs: object
    ) -> Verdict: ...


DraftSampling = Literal["argmax", "multinomial", "gumbel"]


@dataclass(frozen=True)
class Rule:
    """A verification rule and what it asks of the rest of the engine."""

    name: str
    fn: VerifyFn
    lossless: bool
    #: how the drafter must sample at temperature > 0 so that the rule's guarantee holds
    draft_sampling: DraftSampling
    #: whether the rule reads the full draft distribution q (token/block) or not
    needs_draft_probs: bool
    #: greedy reads only the arg-max of the penalised logits; the others need probabilities
    needs_target_probs: bool = True
    greedy_only: bool = False


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule("greedy", greedy_verify, True, "argmax", False, needs_target_probs=False, greedy_only=True),
        Rule("token", token_verify, True, "multinomial", True),
        Rule("block", block_verify, True, "multinomial", True),
        Rule("coupled", coupled_verify, True, "gumbel", False),
        Rule("lossy_resample_p", lossy_resample_p, False, "multinomial", True),
        Rule("lossy_strict_residual", lossy_strict_residual, False, "multinomial", True),
        Rule("lossy_ratio_threshold", lossy_ratio_threshold, False, "multinomial", True),
        Rule("lossy_p_threshold", lossy_p_threshold, False, "multinomial", True),
    )
}


if tuple(RULES) != defaults.VERIFICATION_METHODS:  # the command line lists the rules from defaults
    raise AssertionError(f"verification rules {tuple(RULES)} differ from defaults.VERIFICATION_METHODS")


def get_rule(name: str, **params: float) -> Rule:
    """Look a rule up by name (``lossy-ratio-threshold`` and ``lossy_ratio_threshold`` both work)."""
    key = name.strip().lower().replace("-", "_")
    if key not in RULES:
        raise ConfigError(f"unknown verification method {name!r}; choose from: {', '.join(method_names())}")
    rule = RULES[key]
    if params:
        rule = Rule(**{**rule.__dict__, "fn": partial(rule.fn, **params)})
    return rule


def method_names() -> list[str]:
    """The rules' names as the command line spells them (``lossy-resample-p``)."""
    return [name.replace("_", "-") for name in defaults.VERIFICATION_METHODS]
