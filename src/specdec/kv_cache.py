"""Key/value caches with O(1) truncation to an absolute length.

Speculative decoding appends γ+1 positions per round and then rolls back the rejected ones.
The cache is one buffer per side; rolling back is moving a length counter, never copying or
freeing memory.  A cache may start smaller than its maximum length (``initial_length``) and grow
on demand in steps, so a server holding many sessions pays for the positions they use, not for
the whole context window each.
"""

from __future__ import annotations

import torch
from torch import Tensor


#: buffers are allocated in whole blocks of this many positions.  It is also the key-block width of
#: the native model's exact attention (``models/native.py``), which reads every query's keys up to
#: the end of its block: allocating whole blocks keeps that read inside the buffer.
GROW_STEP = 64


def cache_length(max_length: int | None, limit: int) -> int:
    """The positions a new cache holds: ``max_length`` (None: the model's whole ``limit``), never
    past ``limit``.  0 or fewer is refused: a cache with no position could not hold the prompt."""
    if max_length is None:
        return limit
    if max_length < 1:
        raise ValueError(f"a cache needs at least one position, not max_length {max_length}")
    return min(max_length, limit)


def _blocks(n: int) -> int:
    """``n`` rounded up to whole :data:`GROW_STEP` blocks."""
    return -(-n // GROW_STEP) * GROW_STEP


class KVCache:
    """Per-sequence cache: ``k`` and ``v`` are ``[layers, kv_heads, capacity, head_dim]``.

    ``capacity`` starts at ``initial_length`` (default: ``max_length``, one static buffer) and
    grows by at least half of itself when a reservation needs more, never past ``max_length``.
    Allocations are whole :data:`GROW_STEP` blocks, so ``capacity`` may exceed ``max_length`` by
    less than a block (those positions are never reserved; they stay zero).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        initial_length: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        capacity = _blocks(max_length if initial_length is None else max(1, min(initial_length, max_length)))
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype, device=device)  # [Lyr, Hkv, C, d]
        self.v: Tensor = torch.zeros(shape, dtype=dtype, device=device)  # [Lyr, Hkv, C, d]
        self.max_length = max_length
        self.length = 0
        self.peak_length = 0
        #: leading positions a prefix cache copied in instead of a prefill computing them
        self.restored = 0

    @property
    def capacity(self) -> int:
        """Positions allocated now (whole blocks; < ``max_length`` + :data:`GROW_STEP`)."""
        return self.k.shape[2]

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position takes (keys and values of every layer)."""
        n_layers, n_kv_heads, _, head_dim = self.k.shape
        return 2 * n_layers * n_kv_heads * head_dim * self.k.element_size()

    def _grown_capacity(self, needed: int) -> int:
        cap = self.capacity
        if needed <= cap:
            return cap
        return min(_blocks(max(needed, cap + cap // 2)), _blocks(self.max_length))

    def growth_bytes(self, n: int) -> int:
        """Bytes a reservation of ``n`` more positions would add to the allocation (0 if none)."""
        needed = self.length + n
        if needed > self.max_length:
            return 0
        return (self._grown_capacity(needed) - self.capacity) * self.bytes_per_position

    def reserve(self, n: int) -> int:
        """Claim ``n`` new positions; returns the first one.  Grows the buffers or raises when full."""
        start = self.length
        if start + n > self.max_length:
            raise ValueError(f"KV cache full: {start} + {n} > {self.max_length} positions")
        if start + n > self.capacity:
            # a pass under inference mode may grow the cache; buffers made there would be inference
            # tensors, which in-place writes outside it (compact after a tree round, a view's catch-up
            # copies) refuse: keep them ordinary tensors
            with torch.inference_mode(False):
                self._grow(self._grown_capacity(start + n))
        self.length = start + n
        self.peak_length = max(self.peak_length, self.length)
        return start

    def _grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` positions, keeping the ``length`` valid ones (amortised O(1))."""
        shape = (*self.k.shape[:2], capacity, self.k.shape[3])
        k = self.k.new_zeros(shape)  # [Lyr, Hkv, C', d]
        v = self.v.new_zeros(shape)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def truncate(self, length: int) -> None:
        """Forget every position at or after ``length`` (absolute).  O(1)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def compact(self, keep: Tensor, start: int) -> None:  # keep: [m] int64 absolute positions
        """Keep positions ``keep`` (ascending, all >= start) at ``start, start+1, ...``.

        For tree drafts: after verification only one root-to-leaf path survives.
        """
        m = keep.numel()
        # index_select, not self.k[:, :, keep]: advanced indexing runs a parallel kernel, measured
        # at 15-25 us and, when the other core was busy, up to 18 ms (it waits for that core);
        # index_select is a serial 4-8 us copy here (SmolLM2-sized caches, 2-core CPU).  Under
        # inference mode, so that buffers made inside it (a cache created there) take the write too
        with torch.inference_mode():
            self.k[:, :, start : start + m] = self.k.index_select(2, keep)
            self.v[:, :, start : start + m] = self.v.index_select(2, keep)
        self.length = start + m

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers now."""
        return self.k.numel() * self.k.element_size() * 2

    def used_bytes(self, length: int | None = None) -> int:
        """Bytes that ``length`` positions (default: the peak) occupy."""
        return self.bytes_per_position * (self.peak_length if length is None else length)
