"""Exact attention (``native._attend_rows``): rows computed together are bitwise rows computed alone."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.kv_cache import GROW_STEP, KVCache
from specdec.models.native import ATTENTION_BLOCK, _attend_rows


def _case(rng: random.Random, hq: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    start = rng.randint(0, 300)
    n = rng.randint(1, 80)  # up to two block boundaries crossed
    capacity = -(-(start + n) // ATTENTION_BLOCK) * ATTENTION_BLOCK
    k = torch.randn(hk, capacity + ATTENTION_BLOCK, d)  # a wider buffer, as a cache is
    v = torch.randn_like(k)
    q = torch.randn(n, hq + hk, d)[:, :hq] * d**-0.5  # a strided view, as the models pass it
    return q, k, v, start


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (12, 2, 128), (4, 2, 16), (8, 8, 32)])
def test_rows_together_equal_rows_alone(hq: int, hk: int, d: int) -> None:
    """40 random (start, n) per head layout: every row of one call is bitwise the row computed by
    itself at its own position — what single-token decoding computes for that position."""
    rng = random.Random(hq * 1000 + d)
    torch.manual_seed(hq + d)
    for _ in range(40):
        q, k, v, start = _case(rng, hq, hk, d)
        together = _attend_rows(q, k, v, start)  # [n, H d]
        alone = torch.cat([_attend_rows(q[j : j + 1], k, v, start + j) for j in range(q.shape[0])])
        assert torch.equal(together, alone), (start, q.shape[0])


def test_values_are_causal_attention() -> None:
    """The masked block tail changes nothing but the bits: each row is softmax(q k^T) v over
    its own keys 0..p (float64 reference, 30 random cases)."""
    rng = random.Random(7)
    torch.manual_seed(7)
    for _ in range(30):
        q, k, v, start = _case(rng, 9, 3, 64)
        out = _attend_rows(q, k, v, start).view(q.shape[0], 9, 64)
        for j in range(q.shape[0]):
            keys = k[:, : start + j + 1].double().repeat_interleave(3, 0)  # [H, T, d]
            vals = v[:, : start + j + 1].double().repeat_interleave(3, 0)
            w = torch.softmax(torch.einsum("hd,htd->ht", q[j].double(), keys), -1)
            ref = torch.einsum("ht,htd->hd", w, vals)
            torch.testing.assert_close(out[j].double(), ref, rtol=1e-5, atol=1e-5)


def test_unblocked_product_is_not_exact() -> None:
    """Why the blocks: one product over exactly the keys each call needs ([0, end) for a group,
    [0, p] alone) differs in the last bits from row to row (the reduction over keys is blocked by
    length) — the negative control showing the bitwise check above can fail."""
    torch.manual_seed(0)
    k, v = torch.randn(3, 800, 64), torch.randn(3, 800, 64)
    differs = 0
    for start in range(300, 700, 20):
        n = 12
        q = torch.randn(n, 9, 64) * 0.125
        qg = q.view(n, 3, 3, 64).transpose(0, 1).reshape(3, n * 3, 64)
        end = start + n
        s = torch.bmm(qg, k[:, :end].transpose(1, 2)).view(3, n, 3, end)
        s = s + torch.full((n, end), float("-inf")).triu_(start + 1).view(1, n, 1, end)
        out = torch.bmm(torch.softmax(s.view(3, n * 3, end), -1), v[:, :end]).view(3, n, 3, 64).transpose(0, 1)
        alone = torch.stack([torch.bmm(torch.softmax(torch.bmm(q[j].view(3, 3, 64), k[:, : start + j + 1].transpose(1, 2)), -1),
                                       v[:, : start + j + 1]) for j in range(n)])
        differs += not torch.equal(out, alone)
    assert differs > 0


def test_cache_buffers_are_whole_blocks() -> None:
    assert ATTENTION_BLOCK == GROW_STEP
    for initial, maximum in [(None, 100), (5, 100), (64, 64), (None, 8192), (70, 130)]:
        cache = KVCache(2, 1, 4, maximum, initial_length=initial)
        assert cache.capacity % ATTENTION_BLOCK == 0 and cache.capacity < maximum + ATTENTION_BLOCK
        cache.reserve(maximum)
        assert cache.capacity % ATTENTION_BLOCK == 0
        with pytest.raises(ValueError):
            cache.reserve(1)  # max_length still holds, whatever was allocated


def test_a_short_buffer_is_refused() -> None:
    q = torch.randn(1, 4, 8)
    k = torch.randn(2, 40, 8)
    with pytest.raises(ValueError, match="whole blocks"):
        _attend_rows(q, k, k, 10)
