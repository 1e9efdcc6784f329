"""LlamaCppLM's own bookkeeping, without llama-cpp-python: a fake ``llama_cpp`` module stands in.

tests/models/test_llamacpp.py runs the real binding and skips wherever the ``llamacpp`` extra is
not installed, so the wrapper's logic (what it passes to ``Llama``, the thread cap, chunking by
``n_batch``, ``last_only``, cache lengths, truncation, superseded caches, its errors) would go
unchecked there.  The fake keeps one sequence of tokens like llama.cpp's KV cache: its logits
depend on the whole history, ``decode`` refuses positions that do not continue the sequence (as
llama.cpp refuses inconsistent positions) and batches larger than ``n_batch``, and its logits
buffer is reused by every decode (as llama.cpp's is).
"""

from __future__ import annotations

import ctypes
import sys
import types

import pytest
import torch

from specdec.errors import SpecdecError

V = 11
META = {"general.architecture": "llama", "llama.block_count": "2", "llama.attention.head_count": "4",
        "llama.attention.head_count_kv": "2", "llama.embedding_length": "64"}


def oracle(history: list[int]) -> torch.Tensor:  # [V] float32: the fake model's logits after history
    h = 7
    for t in history:
        h = (h * 131 + t + 1) % 100003
    return torch.tensor([((h * 31 + v * 17) % 97) / 8.0 for v in range(V)], dtype=torch.float32)


class _Batch:
    def set_batch(self, batch, n_past, logits_all):
        self.tokens, self.n_past, self.logits_all = list(batch), n_past, logits_all


class _Ctx:
    def __init__(self, llm):
        self.llm = llm

    def decode(self, batch):
        llm = self.llm
        if batch.n_past != len(llm.seq):
            raise RuntimeError(f"inconsistent positions: batch at {batch.n_past}, sequence holds {len(llm.seq)}")
        if len(batch.tokens) > llm.kw["n_batch"]:
            raise RuntimeError("n_tokens > n_batch")
        rows = []
        for t in batch.tokens:
            llm.seq.append(t)
            rows.append(oracle(llm.seq))
        rows = rows if batch.logits_all else rows[-1:]  # llama.cpp: the last token always has an output
        flat = torch.stack(rows).reshape(-1)
        for i, x in enumerate(flat.tolist()):
            llm.buf[i] = x  # one buffer, overwritten by every decode
        llm.decodes.append(len(batch.tokens))


class FakeLlama:
    def __init__(self, **kw):
        self.kw = kw
        self.seq: list[int] = []
        self.decodes: list[int] = []
        self.refuse_rm = False
        self.metadata = dict(META)
        self.ctx = types.SimpleNamespace(llm=self)
        self._batch = _Batch()
        self._ctx = _Ctx(self)
        self.buf = (ctypes.c_float * (kw["n_ctx"] * V))()

    def n_vocab(self):
        return V

    def n_ctx(self):
        return self.kw["n_ctx"]


def _seq_rm(memory, seq_id, p0, p1):
    llm = memory.llm
    assert seq_id == 0 and p1 == -1
    if llm.refuse_rm:
        return False
    del llm.seq[p0:]
    return True


@pytest.fixture
def fake(monkeypatch):
    mod = types.ModuleType("llama_cpp")
    mod.Llama = FakeLlama
    mod.llama_get_memory = lambda ctx: ctx
    mod.llama_memory_seq_rm = _seq_rm
    mod.llama_get_logits = lambda ctx: ctypes.cast(ctx.llm.buf, ctypes.POINTER(ctypes.c_float))
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    return mod


def _lm(**cfg):
    from specdec.models.llamacpp import LlamaCppConfig, LlamaCppLM

    return LlamaCppLM("model.gguf", LlamaCppConfig(**{"n_threads": 1, **cfg}))


def _want(history: list[int], block: list[int]) -> torch.Tensor:  # [len(block), V]
    return torch.stack([oracle(history + block[: i + 1]) for i in range(len(block))])


def test_every_setting_reaches_llama_cpp(fake):
    """The context is created with the config's settings, every position's logits kept, and the
    batch threads equal to the decoding threads."""
    lm = _lm(n_ctx=300, n_threads=3, n_batch=64, n_ubatch=32, flash_attn=False)
    kw = lm.llm.kw
    assert (kw["model_path"], kw["n_ctx"], kw["n_batch"], kw["n_ubatch"]) == ("model.gguf", 300, 64, 32)
    assert (kw["n_threads"], kw["n_threads_batch"], kw["flash_attn"], kw["logits_all"]) == (3, 3, False, True)
    assert _lm().llm.kw["flash_attn"] is True  # the default measured invariant


def test_the_thread_count_caps_the_context_only_past_invariant_positions(fake, monkeypatch):
    from specdec.models.llamacpp import INVARIANT_POSITIONS

    one = _lm(n_ctx=1024)
    assert (one.threads, one.capped, one.max_length) == (1, False, 1024)
    two = _lm(n_ctx=1024, n_threads=2)
    assert (two.capped, two.max_length) == (True, INVARIANT_POSITIONS)
    small = _lm(n_ctx=INVARIANT_POSITIONS, n_threads=2)  # the context is no longer than the cap: nothing capped
    assert (small.capped, small.max_length) == (False, INVARIANT_POSITIONS)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    default = _lm(n_ctx=1024, n_threads=None)  # None: torch's thread count
    assert default.threads == 5 and default.llm.kw["n_threads"] == 5 and default.capped


def test_kv_bytes_follow_the_gguf_metadata(fake):
    """2 (K, V) x layers x kv heads x head size x 2 bytes: 2 x 2 x 2 x (64 / 4) x 2 = 256 a position."""
    lm = _lm()
    assert lm.kv_bytes_per_token == 256
    cache = lm.new_cache()
    lm.forward(torch.tensor([1, 2, 3]), cache)
    assert cache.length == 3 and cache.nbytes == 3 * 256


@pytest.mark.parametrize("sizes, per_token", [({"key_length": "24"}, 2 * 2 * (24 + 24) * 2),
                                              ({"key_length": "24", "value_length": "40"}, 2 * 2 * (24 + 40) * 2)])
def test_kv_bytes_take_the_head_sizes_a_gguf_names(fake, monkeypatch, sizes, per_token):
    """A GGUF that names its key / value head sizes (Gemma-3's 256 is not its 640 wide embedding over
    4 heads) is sized by them: layers x kv heads x (key + value size) x 2 bytes; a value size not
    given is the key size."""
    for key, value in sizes.items():
        monkeypatch.setitem(META, f"llama.attention.{key}", value)
    assert _lm().kv_bytes_per_token == per_token


def test_a_block_is_scored_as_the_model_scores_each_position(fake):
    lm = _lm()
    cache = lm.new_cache()
    first = lm.forward(torch.tensor([3, 1, 4]), cache)
    assert first.shape == (3, V) and torch.equal(first, _want([], [3, 1, 4]))
    second = lm.forward(torch.tensor([[1, 5]]), cache)
    assert torch.equal(second, _want([3, 1, 4], [1, 5]))
    # the first result is a copy: the next decode, which reuses llama.cpp's buffer, leaves it alone
    assert torch.equal(first, _want([], [3, 1, 4]))
    last = lm.forward(torch.tensor([9, 2]), cache, last_only=True)
    assert last.shape == (1, V) and torch.equal(last[0], oracle([3, 1, 4, 1, 5, 9, 2]))
    assert cache.length == 7


@pytest.mark.parametrize("last_only", [False, True])
def test_a_block_longer_than_n_batch_goes_in_pieces(fake, last_only):
    """n_batch 4, a block of 10: decodes of 4, 4 and 2 at consecutive positions, with all rows (or
    the block's last one) as one call would give them."""
    lm = _lm(n_batch=4)
    cache = lm.new_cache()
    lm.forward(torch.tensor([2]), cache)
    block = [5, 0, 7, 7, 1, 3, 8, 2, 6, 4]
    out = lm.forward(torch.tensor(block), cache, last_only=last_only)
    assert lm.llm.decodes == [1, 4, 4, 2] and cache.length == 11
    want = _want([2], block)
    assert torch.equal(out, want[-1:] if last_only else want)
    # a block that fills its last piece exactly: 8 tokens, decodes of 4 and 4
    out = lm.forward(torch.tensor(block[:8]), cache, last_only=last_only)
    assert lm.llm.decodes[-2:] == [4, 4] and cache.length == 19
    want = _want([2] + block, block[:8])
    assert torch.equal(out, want[-1:] if last_only else want)


def test_truncation_rolls_the_cache_back_and_checks_its_bounds(fake):
    lm = _lm()
    cache = lm.new_cache()
    lm.forward(torch.tensor([1, 2, 3, 4, 5]), cache)
    cache.truncate(5)  # to its own length: nothing removed
    assert cache.length == 5 and lm.llm.seq == [1, 2, 3, 4, 5]
    cache.truncate(2)
    assert cache.length == 2 and lm.llm.seq == [1, 2] and cache.nbytes == 2 * lm.kv_bytes_per_token
    assert torch.equal(lm.forward(torch.tensor([9]), cache), _want([1, 2], [9]))
    for bad in (-1, 4):
        with pytest.raises(ValueError):
            cache.truncate(bad)
    assert cache.length == 3


def test_a_refused_removal_is_an_error(fake):
    lm = _lm()
    cache = lm.new_cache()
    lm.forward(torch.tensor([1, 2, 3]), cache)
    lm.llm.refuse_rm = True
    with pytest.raises(SpecdecError, match="refused"):
        cache.truncate(1)


def test_a_new_cache_empties_the_sequence_and_supersedes_the_old_one(fake):
    lm = _lm()
    old = lm.new_cache()
    lm.forward(torch.tensor([1, 2, 3]), old)
    new = lm.new_cache()
    assert new.length == 0 and lm.llm.seq == []
    assert torch.equal(lm.forward(torch.tensor([4]), new), _want([], [4]))
    with pytest.raises(SpecdecError, match="superseded"):
        lm.forward(torch.tensor([5]), old)
    with pytest.raises(SpecdecError, match="superseded"):
        old.truncate(1)
    other = _lm()
    other.new_cache()
    other.new_cache()  # at the same epoch as `new`
    with pytest.raises(SpecdecError, match="superseded"):  # another model's cache is never this one's
        other.forward(torch.tensor([5]), new)


def test_new_cache_and_forward_refuse_more_positions_than_the_context(fake):
    lm = _lm(n_ctx=8)
    assert lm.new_cache(8).length == 0  # exactly the context: fine
    with pytest.raises(SpecdecError, match="holds 8 positions, 9 were asked for"):
        lm.new_cache(9)
    cache = lm.new_cache()
    lm.forward(torch.tensor([1, 2, 3, 4, 5]), cache)
    lm.forward(torch.tensor([6, 7, 8]), cache)  # fills the context exactly
    assert cache.length == 8
    with pytest.raises(SpecdecError, match="exceed the llama.cpp context of 8 positions"):
        lm.forward(torch.tensor([9]), cache)
    assert cache.length == 8
    for last_only in (False, True):
        with pytest.raises(ValueError, match="at least one token"):
            lm.forward(torch.tensor([], dtype=torch.long), lm.new_cache(), last_only=last_only)


def test_past_the_thread_cap_the_error_says_why_and_what_to_do(fake):
    from specdec.models.llamacpp import INVARIANT_POSITIONS

    lm = _lm(n_ctx=1024, n_threads=2)
    cache = lm.new_cache()
    lm.forward(torch.arange(INVARIANT_POSITIONS) % V, cache, last_only=True)
    with pytest.raises(SpecdecError, match="would pass 256 positions.*2 threads.*not be exact.*n_threads=1"):
        lm.forward(torch.tensor([1]), cache)


def test_the_default_thread_count_reaches_the_batch_threads_too(fake, monkeypatch):
    """With n_threads None both llama.cpp thread counts are torch's, not None."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    kw = _lm(n_threads=None).llm.kw
    assert (kw["n_threads"], kw["n_threads_batch"]) == (3, 3)


def test_a_gguf_without_a_kv_head_count_has_as_many_kv_heads_as_heads(fake, monkeypatch):
    """No head_count_kv (plain multi-head attention): 4 kv heads of 64 / 4 = 16 over 2 layers,
    2 x 4 x (16 + 16) x 2 bytes = 512 a position."""
    monkeypatch.delitem(META, "llama.attention.head_count_kv")
    assert _lm().kv_bytes_per_token == 2 * 4 * (16 + 16) * 2


def test_kv_bytes_read_the_keys_of_the_files_own_architecture(fake, monkeypatch):
    """A qwen2 GGUF names its sizes under ``qwen2.``: 3 layers x 1 kv head x (32 + 32) x 2 bytes."""
    for key in list(META):
        monkeypatch.delitem(META, key)
    for key, value in {"general.architecture": "qwen2", "qwen2.block_count": "3", "qwen2.attention.head_count": "2",
                       "qwen2.attention.head_count_kv": "1", "qwen2.embedding_length": "64"}.items():
        monkeypatch.setitem(META, key, value)
    assert _lm().kv_bytes_per_token == 3 * 1 * (32 + 32) * 2
