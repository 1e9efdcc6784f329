"""Exact laws of toy decoders and a chi-square goodness-of-fit helper."""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from scipy import stats as sps

from specdec.models.toy import ToyLM
from specdec.sampling import PenaltyState, SamplingConfig, process_logits

#: per-test false-alarm probability of the goodness-of-fit tests
ALPHA = 1e-4


def exact_law(target: ToyLM, prompt: list[int], cfg: SamplingConfig, n_new: int) -> dict[tuple[int, ...], float]:
    """P(first ``n_new`` generated tokens = s) under plain target sampling with ``cfg``."""
    law: dict[tuple[int, ...], float] = {}
    vocab = target.vocab_size

    def walk(seq: list[int], prob: float) -> None:
        if prob == 0.0:
            return
        if len(seq) == n_new:
            law[tuple(seq)] = law.get(tuple(seq), 0.0) + prob
            return
        state = PenaltyState.start(torch.tensor(prompt), vocab) if cfg.needs_state else None
        if state is not None and seq:
            state.append(torch.tensor(seq))
        logits = target.logits_for(prompt + seq).unsqueeze(0)
        probs = process_logits(logits, cfg, state)[0].double()
        for tok in range(vocab):
            walk(seq + [tok], prob * float(probs[tok]))

    walk([], 1.0)
    return law


def chi_square_pvalue(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of ``samples`` to ``law``; cells with expected count < 5 are pooled.

    A sample outside the law's support gives p = 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(s not in law for s in counts):
        return 0.0
    observed, expected = [], []
    pool_o, pool_e = 0.0, 0.0
    for key, prob in law.items():
        e = prob * n
        if e < 5:
            pool_o += counts.get(key, 0)
            pool_e += e
        else:
            observed.append(counts.get(key, 0))
            expected.append(e)
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    if len(observed) < 2:
        return 1.0
    total_e = sum(expected)
    expected = [e * n / total_e for e in expected]
    return float(sps.chisquare(observed, expected).pvalue)


def all_sequences(vocab: int, length: int):
    return itertools.product(range(vocab), repeat=length)
