"""Exact attention: rows computed together are bitwise rows computed alone.

Two implementations, each tested for that property: the blocked ATen computation
(``native._attend_rows_aten``) and the compiled kernel (``torch.ops.specdec.attend``), which a
process uses instead wherever it builds.  The kernel also reads a tree node's path in place:
bitwise the row that decoding the path token by token computes.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.kv_cache import GROW_STEP, KVCache
from specdec.models import kernels
from specdec.models.native import ATTENTION_BLOCK, _attend_rows_aten

needs_kernel = pytest.mark.skipif(not kernels.load(), reason="the attention kernel needs a C++ compiler")


def _kernel(q, k, v, start):
    return torch.ops.specdec.attend(q, k, v, start, None)


IMPLS = [pytest.param(_attend_rows_aten, id="aten"), pytest.param(_kernel, id="kernel", marks=needs_kernel)]


def _case(rng: random.Random, hq: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    start = rng.randint(0, 300)
    n = rng.randint(1, 80)  # up to two block boundaries crossed
    capacity = -(-(start + n) // ATTENTION_BLOCK) * ATTENTION_BLOCK
    k = torch.randn(hk, capacity + ATTENTION_BLOCK, d)  # a wider buffer, as a cache is
    v = torch.randn_like(k)
    q = torch.randn(n, hq + hk, d)[:, :hq] * d**-0.5  # a strided view, as the models pass it
    return q, k, v, start


@pytest.mark.parametrize("attend", IMPLS)
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (12, 2, 128), (4, 2, 16), (8, 8, 32), (6, 2, 24), (4, 1, 256)])
def test_rows_together_equal_rows_alone(attend, hq: int, hk: int, d: int) -> None:
    """40 random (start, n) per head layout: every row of one call is bitwise the row computed by
    itself at its own position — what single-token decoding computes for that position."""
    rng = random.Random(hq * 1000 + d)
    torch.manual_seed(hq + d)
    for _ in range(40):
        q, k, v, start = _case(rng, hq, hk, d)
        together = attend(q, k, v, start)  # [n, H d]
        alone = torch.cat([attend(q[j : j + 1], k, v, start + j) for j in range(q.shape[0])])
        assert torch.equal(together, alone), (start, q.shape[0])


@pytest.mark.parametrize("attend", IMPLS)
def test_values_are_causal_attention(attend) -> None:
    """Each row is softmax(q k^T) v over its own keys 0..p (float64 reference, 30 random cases;
    both implementations to float32 accuracy)."""
    rng = random.Random(7)
    torch.manual_seed(7)
    for _ in range(30):
        q, k, v, start = _case(rng, 9, 3, 64)
        out = attend(q, k, v, start).view(q.shape[0], 9, 64)
        for j in range(q.shape[0]):
            keys = k[:, : start + j + 1].double().repeat_interleave(3, 0)  # [H, T, d]
            vals = v[:, : start + j + 1].double().repeat_interleave(3, 0)
            w = torch.softmax(torch.einsum("hd,htd->ht", q[j].double(), keys), -1)
            ref = torch.einsum("ht,htd->hd", w, vals)
            torch.testing.assert_close(out[j].double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_reads_a_tree_nodes_path_in_place() -> None:
    """A node over the prefix [0, P) plus its path's slots scattered in the tree region is bitwise
    the row at position P + depth of a cache holding that path right after the prefix (how
    decoding the path token by token lays it out); paths of every length in one call."""
    torch.manual_seed(3)
    hq, hk, d, prefix = 9, 3, 64, 70
    region = torch.randn(hk, 12, d), torch.randn(hk, 12, d)
    k = torch.cat([torch.randn(hk, prefix, d), region[0], torch.zeros(hk, 20, d)], 1)
    v = torch.cat([torch.randn(hk, prefix, d), region[1], torch.zeros(hk, 20, d)], 1)
    paths = [[0], [0, 3], [1, 4, 7], [0, 3, 5, 9, 11], [2]]  # region node indices, root first
    q = torch.randn(len(paths), hq, d) * 0.125
    table = torch.full((len(paths), 5), -1, dtype=torch.long)
    for r, p in enumerate(paths):
        table[r, : len(p)] = torch.tensor(p) + prefix
    got = torch.ops.specdec.attend(q, k, v, prefix, table)
    for r, p in enumerate(paths):
        ks = torch.cat([k[:, :prefix], region[0][:, p], torch.zeros(hk, 8, d)], 1)
        vs = torch.cat([v[:, :prefix], region[1][:, p], torch.zeros(hk, 8, d)], 1)
        want = torch.ops.specdec.attend(q[r : r + 1], ks, vs, prefix + len(p) - 1, None)
        assert torch.equal(got[r : r + 1], want), p


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [40, 17, 9, 3, 1])
@pytest.mark.parametrize("hq,hk,d", [(12, 2, 128), (9, 3, 64)])
def test_kernel_bits_do_not_depend_on_threads(rows: int, threads: int, hq: int, hk: int, d: int) -> None:
    """The threads take equal shares of the (KV head, row, query head) units, so a share can
    begin or end inside a row (SmolLM2's 9 query heads over 3 KV heads, 1 or 9 rows on two
    threads) and a run of rows is cut into chunks; every row is bitwise what one thread computes."""
    torch.manual_seed(5)
    q, k, v = torch.randn(40, hq, d) * 0.1, torch.randn(hk, 900, d), torch.randn(hk, 900, d)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.specdec.attend(q[:rows], k, v, 800, None)
        torch.set_num_threads(threads)
        many = torch.ops.specdec.attend(q[:rows], k, v, 800, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (12, 2, 128), (4, 4, 40)])
def test_batched_sequences_equal_each_alone(threads: int, hq: int, hk: int, d: int) -> None:
    """``attend_batch`` (a batching server's pass: several sequences, each against its own cache,
    in one parallel region) gives every sequence's rows bitwise what ``attend`` gives them alone:
    12 sequences of 0-20 rows at different cache lengths, sizes that put thread shares' edges
    inside sequences and rows, on 1-3 threads."""
    rng = random.Random(7 + threads + d)
    torch.manual_seed(11 + d)
    sizes = [rng.choice([0, 1, 1, 1, 2, 3, 9, 20]) for _ in range(12)]
    starts = [rng.randint(0, 200) for _ in sizes]
    ks = [torch.randn(hk, s + n + 30, d) for s, n in zip(starts, sizes)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(sum(sizes), hq + hk, d)[:, :hq] * d**-0.5  # a strided view, as the layer loop holds it
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = torch.ops.specdec.attend_batch(q, ks, vs, starts, sizes)
        parts, row = [], 0
        for k, v, s, n in zip(ks, vs, starts, sizes):
            if n:
                parts.append(torch.ops.specdec.attend(q[row : row + n], k, v, s, None))
            row += n
    finally:
        torch.set_num_threads(before)
    assert together.shape == (sum(sizes), hq * d)
    assert torch.equal(together, torch.cat(parts))


@needs_kernel
def test_batched_kernel_refuses_bad_inputs() -> None:
    q, k = torch.randn(4, 4, 8), torch.randn(2, 40, 8)
    with pytest.raises(RuntimeError, match="rows beyond the cache"):
        torch.ops.specdec.attend_batch(q, [k, k], [k, k], [10, 38], [1, 3])
    with pytest.raises(RuntimeError, match="add up"):
        torch.ops.specdec.attend_batch(q, [k], [k], [10], [3])
    with pytest.raises(RuntimeError, match="one k, v, start and size"):
        torch.ops.specdec.attend_batch(q, [k, k], [k], [10, 10], [2, 2])
    with pytest.raises(RuntimeError, match="one layout"):
        torch.ops.specdec.attend_batch(q, [k], [k.transpose(0, 1).contiguous().transpose(0, 1)], [10], [4])


@needs_kernel
def test_kernel_refuses_bad_inputs() -> None:
    q, k = torch.randn(3, 4, 8), torch.randn(2, 40, 8)
    with pytest.raises(RuntimeError, match="rows beyond the cache"):
        torch.ops.specdec.attend(q, k, k, 38, None)
    with pytest.raises(RuntimeError, match="path slot beyond"):
        torch.ops.specdec.attend(q, k, k, 10, torch.tensor([[11], [40], [-1]]))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specdec.attend(q.double(), k.double(), k.double(), 10, None)
    with pytest.raises(RuntimeError, match="head layout"):
        torch.ops.specdec.attend(torch.randn(1, 3, 8), k, k, 10, None)


def test_unblocked_product_is_not_exact() -> None:
    """Why the ATen computation uses blocks: one product over exactly the keys each call needs
    ([0, end) for a group, [0, p] alone) differs in the last bits from row to row (the reduction
    over keys is blocked by length) — the negative control showing the bitwise check above can fail."""
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
        _attend_rows_aten(q, k, k, 10)
