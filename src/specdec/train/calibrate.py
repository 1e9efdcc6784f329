"""Draft temperature calibration (``specdec train calibrate``): the factor f at which a draft's q,
sampled at f x the temperature, overlaps the target's p the most.

A draft token x ~ q is accepted by token verification with probability ``sum_x min(p(x), q(x))``
at its position (Leviathan et al. 2023), and block verification keeps at least as much.  A
small draft distilled from its target is usually less sure than the target (its logits are
flatter), so a sharper q (f < 1) overlaps p more; any f is lossless, because the rules receive
the q the tokens were drawn from.  The overlap is measured teacher-forced on the target's own
continuations of built-in training prompts (none of the benchmark's), sampled at each
temperature, and the factor with the highest mean over the temperatures is chosen.
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


@dataclass(frozen=True)
class Calibration:
    """Mean overlap per temperature and factor, and the factor chosen."""

    factor: float  # the best mean over the temperatures
    temperatures: tuple[float, ...]
    factors: tuple[float, ...]
    mean_overlap: dict[str, list[float]]  # str(T) -> one mean per factor
    positions: dict[str, int]  # str(T) -> positions scored
    sequences: int

    def to_json(self) -> dict[str, Any]:
        return {"temperature_factor": self.factor, "temperatures": list(self.temperatures), "factors": list(self.factors),
                "mean_overlap": self.mean_overlap, "positions": self.positions, "sequences": self.sequences}


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
              factors: Sequence[float] = FACTORS, progress: Callable[[int], None] | None = None) -> Calibration:
    """Score ``sequences`` — ``(tokens [L], first continuation position, index into temperatures)``,
    each sampled from the target at that temperature — teacher-forced through both models (each a
    :class:`~specdec.models.base.LanguageModel`) and choose the factor (see :func:`choose`)."""
    sums = torch.zeros(len(temperatures), len(factors), dtype=torch.float64)
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
            counts[ti] += lt.shape[0]
            if progress:
                progress(1)
    return replace(choose(temperatures, factors, sums, counts), sequences=len(sequences))
