"""Draft temperature calibration (``specdec train calibrate``): the factor f at which a draft's q,
sampled at f x the temperature, overlaps the target's p the most.

A draft token x ~ q is accepted by token verification with probability ``sum_x min(p(x), q(x))``
at its position (Leviathan et al. 2023), and block verification keeps at least as much.  A
small draft distilled from its target is usually less sure than the target (its logits are
flatter), so a sharper q (f < 1) overlaps p more; any f is lossless, because the rules receive
the q the tokens were drawn from.  The overlap is measured teacher-forced on the target's own
continuations of built-in training prompts (none of the benchmark's), sampled at each
temperature, and the factor with the highest mean over the temperatures is chosen.

Coupled verification (the default with a seed) accepts a draft token only where the draft's
keyed Gumbel-max draw from q and the target's from p pick the same token, which happens less
often than ``sum min(p, q)``; asked for (``coupled=True``, ~2.4x slower), that agreement is
recorded beside the overlap for every factor (:func:`coupled_agreement`), to see what the chosen
factor gives that rule too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specdec.defaults import CALIBRATION_FACTORS as FACTORS


def overlap(target_logits: Tensor, draft_logits: Tensor, temperature: float, factor: float) -> Tensor:
    """``sum_x min(p(x), q(x))`` per position ([N, V], [N, V] -> [N]) with ``p = softmax(target / T)``
    and ``q = softmax(draft / (f T))``: a draft token's acceptance probability under token
    verification there.  Draft logits of ``-inf`` (a reduced draft vocabulary) get q = 0."""
    if temperature <= 0 or factor <= 0:
        raise ValueError("the temperature and the factor must be positive")
    p = torch.softmax(target_logits.float() / temperature, -1)
    q = torch.softmax(draft_logits.float() / (temperature * factor), -1)
    return torch.minimum(p, q).sum(-1)


def coupled_agreement(target_logits: Tensor, draft_logits: Tensor, temperature: float, factor: float) -> Tensor:
    """``P(argmax_v log p(v) + G_v == argmax_v log q(v) + G_v)`` per position, the Gumbel noise G
    shared ([N, V], [N, V] -> [N], float64), ``p`` and ``q`` as in :func:`overlap`: how often a
    coupled draft token is accepted there.  Exactly, not by sampling: with the exponential race
    (E_v i.i.d. Exp(1), the winner minimises E_v / p_v) both pick x when every other E_v exceeds
    E_x · max(p_v / p_x, q_v / q_x), which integrates to ``sum_x 1 / sum_v max(p_v / p_x, q_v / q_x)``;
    sorting by p_v / q_v makes each inner sum a prefix sum of p plus a suffix sum of q."""
    return coupled_agreements(target_logits, draft_logits, temperature, [factor])[0]


def coupled_agreements(target_logits: Tensor, draft_logits: Tensor, temperature: float,
                       factors: Sequence[float]) -> Tensor:
    """:func:`coupled_agreement` at each of ``factors`` ([N, V], [N, V] -> [F, N]); what does not
    depend on the factor (the target's side, the columns the draft can draw) is worked out once."""
    if temperature <= 0 or any(f <= 0 for f in factors):
        raise ValueError("the temperature and the factor must be positive")
    lt = target_logits.double() / temperature
    # columns no row's q reaches (a reduced draft vocabulary) rank first in every row (p / q = inf):
    # only their p mass matters, added to every prefix, so they are left out of the sort
    drawn = torch.isfinite(draft_logits).any(0)  # [V]
    lse = torch.logsumexp(lt, -1, keepdim=True)  # [N, 1]
    first = torch.exp(torch.logsumexp(lt[:, ~drawn], -1, keepdim=True) - lse)  # [N, 1] (0 where every column is drawn)
    lt = lt[:, drawn]
    p = torch.exp(lt - lse)  # [N, V'] the target's law over the kept columns
    p_none = torch.isneginf(lt)
    draft = draft_logits.double()[:, drawn]
    tiny = torch.finfo(torch.float64).tiny
    out = []
    for factor in factors:
        ld = draft / (temperature * factor)
        q = torch.softmax(ld, -1)
        # p / q in order without dividing: log p - log q differs from lt - ld by a constant per row
        key = torch.where(p_none, -torch.inf, lt - ld)  # q = 0 -> +inf; p = 0 -> -inf (never both drawn)
        order = torch.argsort(key, dim=-1, descending=True)  # ties: either term is the same there
        ps, qs = torch.gather(p, -1, order), torch.gather(q, -1, order)  # [N, V']
        both = (ps > 0) & (qs > 0)
        # over v ranked at or above x (p_v / q_v >= p_x / q_x) the p term is the larger, below it the q term
        above = (ps.cumsum(-1) + first) / ps.clamp_min(tiny)
        below = (qs.sum(-1, keepdim=True) - qs.cumsum(-1)) / qs.clamp_min(tiny)
        out.append(torch.where(both, 1.0 / torch.where(both, above + below, 1.0), 0.0).sum(-1))
    return torch.stack(out)  # [F, N]


@dataclass(frozen=True)
class Calibration:
    """Mean overlap per temperature and factor, and the factor chosen."""

    factor: float  # the best mean over the temperatures
    temperatures: tuple[float, ...]
    factors: tuple[float, ...]
    mean_overlap: dict[str, list[float]]  # str(T) -> one mean per factor
    positions: dict[str, int]  # str(T) -> positions scored
    sequences: int
    mean_coupled_agreement: dict[str, list[float]] | None = None  # str(T) -> one mean per factor (not used to choose)

    def to_json(self) -> dict[str, Any]:
        out = {"temperature_factor": self.factor, "temperatures": list(self.temperatures), "factors": list(self.factors),
               "mean_overlap": self.mean_overlap, "positions": self.positions, "sequences": self.sequences}
        if self.mean_coupled_agreement is not None:
            out["mean_coupled_agreement"] = self.mean_coupled_agreement
        return out


def choose(temperatures: Sequence[float], factors: Sequence[float], sums: Tensor, counts: Sequence[int]) -> Calibration:
    """A :class:`Calibration` from per-(temperature, factor) overlap sums ``sums`` [len(T), len(F)]
    over ``counts[i]`` positions at temperature i; ties go to the factor nearest 1."""
    if any(c < 1 for c in counts):
        raise ValueError("every temperature needs at least one scored position")
    means = sums.double() / torch.tensor(counts, dtype=torch.float64).unsqueeze(1)  # [T, F]
    score = means.mean(0)  # [F]
    best = max(range(len(factors)), key=lambda i: (round(float(score[i]), 12), -abs(factors[i] - 1.0)))
    return Calibration(
        factor=float(factors[best]), temperatures=tuple(float(t) for t in temperatures), factors=tuple(float(f) for f in factors),
        mean_overlap={f"{t:g}": [round(float(x), 6) for x in means[i]] for i, t in enumerate(temperatures)},
        positions={f"{t:g}": int(counts[i]) for i, t in enumerate(temperatures)}, sequences=0,
    )


def calibrate(target: Any, draft: Any, sequences: Sequence[tuple[Tensor, int, int]], temperatures: Sequence[float],
              factors: Sequence[float] = FACTORS, progress: Callable[[int], None] | None = None, *,
              coupled: bool = False) -> Calibration:
    """Score ``sequences`` — ``(tokens [L], first continuation position, index into temperatures)``,
    each sampled from the target at that temperature — teacher-forced through both models (each a
    :class:`~specdec.models.base.LanguageModel`) and choose the factor (see :func:`choose`)."""
    sums = torch.zeros(len(temperatures), len(factors), dtype=torch.float64)
    agree = torch.zeros(len(temperatures), len(factors), dtype=torch.float64)
    counts = [0] * len(temperatures)
    with torch.inference_mode():
        for seq, start, ti in sequences:
            if seq.numel() <= start:
                if progress:
                    progress(1)
                continue
            lt = target.forward(seq, target.new_cache(seq.numel()))[start - 1 : -1]  # [n, V]
            ld = draft.forward(seq, draft.new_cache(seq.numel()))[start - 1 : -1]  # [n, V]
            for fi, f in enumerate(factors):
                sums[ti, fi] += float(overlap(lt, ld, temperatures[ti], f).double().sum())
            if coupled:
                agree[ti] += coupled_agreements(lt, ld, temperatures[ti], factors).sum(-1)
            counts[ti] += lt.shape[0]
            if progress:
                progress(1)
    chosen = choose(temperatures, factors, sums, counts)
    table = {t: [round(float(x) / counts[i], 6) for x in agree[i]] for i, t in enumerate(chosen.mean_overlap)} if coupled else None
    return replace(chosen, sequences=len(sequences), mean_coupled_agreement=table)
