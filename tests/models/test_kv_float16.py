"""A float16 key/value cache (``--kv-dtype float16``): half the bytes, and still exact.

Keys and values are rounded to float16 once, when a pass writes them (round to nearest, ties to
even, in the fused C++ loop as in torch's ``copy_``); the attention kernel widens each one back to
float32 exactly as it reads it.  So attention over a float16 cache is bitwise attention over a
float32 cache holding the rounded values, and a model over such caches keeps every exactness
property of the float32 one: a block of rows is bitwise the rows scored one by one, a tree node is
bitwise its path, a batched pass is bitwise each sequence alone.  The target it makes is a slightly
different one (its keys and values rounded); speculative decoding is exact relative to it.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.models import kernels
from specdec.models.native import NativeCausalLM
from tiny import make_tiny, tiny_native

pytestmark = pytest.mark.skipif(not kernels.load(), reason="a float16 cache needs the compiled attention kernel")


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (12, 2, 128), (6, 2, 48), (4, 4, 40), (4, 1, 256)])
def test_attention_over_a_float16_cache_is_attention_over_its_values_widened(hq: int, hk: int, d: int) -> None:
    """20 random (start, rows) per head layout, and a tree's paths: the kernel over float16 keys and
    values is bitwise the kernel over float32 buffers holding the same (rounded) values, and rows
    together are bitwise rows alone.  Head sizes 64 / 128 / 256 take the vector paths, 48 and 40
    the generic path with a feature tail."""
    rng = random.Random(hq * 100 + d)
    torch.manual_seed(d)
    for case in range(20):
        # from 32 rows a call widens the keys and values it sees once, up front: rows alone read
        # them as float16, so "together = alone" compares the two ways too
        start, n = rng.randint(0, 200), (rng.randint(1, 20) if case % 4 else rng.randint(32, 48))
        k, v = torch.randn(hk, start + n + 40, d) * 3, torch.randn(hk, start + n + 40, d)
        q = torch.randn(n, hq + hk, d)[:, :hq] * d**-0.5  # a strided view, as the models pass it
        kh, vh = k.half(), v.half()
        got = torch.ops.specdec.attend(q, kh, vh, start, None)
        assert torch.equal(got, torch.ops.specdec.attend(q, kh.float(), vh.float(), start, None))
        alone = torch.cat([torch.ops.specdec.attend(q[j : j + 1], kh, vh, start + j, None) for j in range(n)])
        assert torch.equal(got, alone)
    paths = torch.tensor([[60, -1, -1], [60, 61, -1], [60, 62, -1], [60, 61, 63]])
    k, v = torch.randn(hk, 140, d), torch.randn(hk, 140, d)
    q = torch.randn(4, hq, d) * d**-0.5
    assert torch.equal(torch.ops.specdec.attend(q, k.half(), v.half(), 60, paths),
                       torch.ops.specdec.attend(q, _widened(k), _widened(v), 60, paths))
    # a 40-node tree (widened up front, up to its highest slot) against each node alone
    parents = [-1] + [rng.randrange(j) for j in range(1, 40)]
    table = torch.full((40, 40), -1, dtype=torch.long)
    for j in range(40):
        path, p = [], j
        while p >= 0:
            path.append(60 + p)
            p = parents[p]
        table[j, : len(path)] = torch.tensor(path[::-1])
    q = torch.randn(40, hq, d) * d**-0.5
    got = torch.ops.specdec.attend(q, k.half(), v.half(), 60, table)
    assert torch.equal(got, torch.ops.specdec.attend(q, _widened(k), _widened(v), 60, table))
    alone = torch.cat([torch.ops.specdec.attend(q[j : j + 1], k.half(), v.half(), 60, table[j : j + 1]) for j in range(40)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batched_call_over_float16_caches_is_each_sequence_alone(threads: int) -> None:
    """``attend_batch`` over 8 float16 caches of 0-9 rows each: bitwise ``attend`` per sequence,
    and bitwise the same call over the widened float32 caches."""
    rng = random.Random(3 + threads)
    torch.manual_seed(4)
    hq, hk, d = 9, 3, 64
    sizes = [rng.choice([0, 1, 1, 2, 9]) for _ in range(8)]
    starts = [rng.randint(0, 150) for _ in sizes]
    ks = [torch.randn(hk, s + n + 10, d).half() for s, n in zip(starts, sizes)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(sum(sizes), hq, d) * 0.125
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = torch.ops.specdec.attend_batch(q, ks, vs, starts, sizes)
        widened = torch.ops.specdec.attend_batch(q, [k.float() for k in ks], [v.float() for v in vs], starts, sizes)
        parts, row = [], 0
        for k, v, s, n in zip(ks, vs, starts, sizes):
            if n:
                parts.append(torch.ops.specdec.attend(q[row : row + n], k, v, s, None))
            row += n
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, widened) and torch.equal(together, torch.cat(parts))


def test_the_kernel_refuses_keys_and_values_of_different_dtypes() -> None:
    q, k = torch.randn(1, 4, 8), torch.randn(2, 40, 8)
    with pytest.raises(RuntimeError, match="float32 or both float16"):
        torch.ops.specdec.attend(q, k.half(), k, 10, None)
    with pytest.raises(RuntimeError, match="float32 or both float16"):
        torch.ops.specdec.attend(q, k.bfloat16(), k.bfloat16(), 10, None)
    with pytest.raises(RuntimeError, match="one layout and dtype"):
        torch.ops.specdec.attend_batch(q, [k.half()], [k], [10], [1])


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral-window", "gemma3"])
def folder(request, tmp_path_factory):
    kind = request.param
    if kind == "mistral-window":
        return make_tiny(tmp_path_factory.mktemp(kind), model_type="mistral", window=6, layers=3)
    return make_tiny(tmp_path_factory.mktemp(kind), model_type=kind, layers=2)


def _half_model(folder, quant=None) -> NativeCausalLM:
    if quant == "q4" and not kernels.q4_available():
        pytest.skip("the 4-bit target needs the kernel library")
    model = NativeCausalLM.from_folder(folder, batch_invariant=True, quant=quant)
    model.set_kv_dtype(torch.float16)
    return model


@pytest.mark.parametrize("quant", [None, "q4"])
def test_a_float16_cache_model_scores_a_block_as_its_rows_one_by_one(folder, quant) -> None:
    """A 40-token prompt (a pass that widens its keys and values up front), then 9 tokens in one
    pass against the same 9 one at a time (past the Mistral model's 6-token window): the logits
    and the whole cache are bitwise equal, and the
    cache is float16.  Layer 0's keys and values are the float32 model's rounded to float16 (the
    fused loop rounds as torch does); the logits differ from the float32 model's (a different
    target) but stay close."""
    model = _half_model(folder, quant)
    ids = torch.randint(0, 49152, (49,), generator=torch.Generator().manual_seed(2))
    block, steps = model.new_cache(64), model.new_cache(64)
    prompt = model.forward(ids[:40], block)
    assert torch.equal(prompt[-1], torch.cat([model.forward(ids[i : i + 1], steps) for i in range(40)])[-1])
    assert block.k.dtype == torch.float16 and block.v.dtype == torch.float16
    got = model.forward(ids[40:], block)
    want = torch.cat([model.forward(ids[i : i + 1], steps) for i in range(40, 49)])
    assert torch.equal(got, want)
    assert torch.equal(block.k[:, :, :49], steps.k[:, :, :49]) and torch.equal(block.v[:, :, :49], steps.v[:, :, :49])
    full = NativeCausalLM.from_folder(folder, batch_invariant=True, quant=quant)
    ref_cache = full.new_cache(64)
    ref = full.forward(ids, ref_cache)
    assert ref_cache.k.dtype == torch.float32
    assert torch.equal(block.k[0, :, :49], ref_cache.k[0, :, :49].half())
    assert torch.equal(block.v[0, :, :49], ref_cache.v[0, :, :49].half())
    assert not torch.equal(got, ref[40:])
    assert torch.allclose(got, ref[40:], atol=2e-2, rtol=0)


def test_a_float16_cache_tree_node_is_its_path_scored_token_by_token(folder) -> None:
    """A 6-node tree after a 20-token prompt: each node's logits are bitwise those of its path
    decoded token by token over a float16 cache."""
    model = _half_model(folder)
    g = torch.Generator().manual_seed(8)
    prompt, nodes = torch.randint(0, 49152, (20,), generator=g), torch.randint(0, 49152, (6,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    cache = model.new_cache(64)
    model.forward(prompt, cache)
    tree = model.forward_tree(nodes, parents, cache)
    for j in range(6):
        path, p = [], j
        while p >= 0:
            path.append(p)
            p = int(parents[p])
        path.reverse()
        alone = model.new_cache(64)
        model.forward(prompt, alone)
        rows = torch.cat([model.forward(nodes[i : i + 1], alone) for i in path])
        assert torch.equal(tree[j], rows[-1]), path


def test_a_batched_pass_over_float16_caches_is_each_sequence_alone(folder) -> None:
    """Three sequences at different lengths in one ``forward_batch``: each one's logits and cache
    bitwise its own ``forward``."""
    model = _half_model(folder)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 49152, (n,), generator=g) for n in (5, 17, 11)]
    news = [torch.randint(0, 49152, (n,), generator=g) for n in (1, 4, 2)]
    batched, solo = [model.new_cache(64) for _ in prompts], [model.new_cache(64) for _ in prompts]
    for p, a, b in zip(prompts, batched, solo):
        model.forward(p, a)
        model.forward(p, b)
    out = model.forward_batch([(t, c, False) for t, c in zip(news, batched)])
    for t, a, b, got in zip(news, batched, solo, out):
        assert torch.equal(got, model.forward(t, b))
        assert torch.equal(a.k[:, :, : a.length], b.k[:, :, : b.length])


def test_set_kv_dtype_refuses_what_it_cannot_keep_exact(tmp_path) -> None:
    folder = make_tiny(tmp_path / "m")
    with pytest.raises(ValueError, match="exact attention"):
        NativeCausalLM.from_folder(folder, batch_invariant=False).set_kv_dtype(torch.float16)
    with pytest.raises(ValueError, match="float32, int8 or q4 target"):
        NativeCausalLM.from_folder(folder, dtype=torch.bfloat16, batch_invariant=True).set_kv_dtype(torch.float16)
    with pytest.raises(ValueError, match="not supported"):
        NativeCausalLM.from_folder(folder, batch_invariant=True).set_kv_dtype(torch.bfloat16)
    model = NativeCausalLM.from_folder(folder, batch_invariant=True)
    model.set_kv_dtype(torch.float16)
    model.set_kv_dtype(None)  # back to the model's own
    assert model.new_cache(8).k.dtype == torch.float32


def test_naming_the_models_own_dtype_goes_back_to_it():
    """set_kv_dtype(the model's own dtype) is accepted as None is: the caches made next hold it."""
    model = tiny_native()
    model.set_kv_dtype(torch.float16)
    assert model.new_cache(8).k.dtype == torch.float16
    model.set_kv_dtype(torch.float32)
    assert model.kv_dtype is None and model.new_cache(8).k.dtype == torch.float32
