"""Small pieces the training commands share (torch-free, so a bare GPU machine can import them)."""

from __future__ import annotations

import math
import random
from typing import Sequence


def split(n: int, every: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices): every ``every``-th sequence is held out."""
    held = [i for i in range(n) if i % every == every - 1]
    return [i for i in range(n) if i % every != every - 1], held


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The learning-rate factor at ``step``: linear warm-up over ``warmup`` steps, then a cosine
    to zero at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def length_batches(lengths: Sequence[int], index: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Groups of the sequences ``index`` (their ``lengths``) of similar length, about ``batch_tokens``
    padded tokens each, in an order shuffled by ``rng``."""
    order = sorted(index, key=lambda i: (lengths[i], rng.random()))
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups
