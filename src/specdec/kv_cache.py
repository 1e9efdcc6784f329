"""Key/value caches with O(1) truncation to an absolute length.

Speculative decoding appends γ+1 positions per round and then rolls back the rejected ones.
The cache is one preallocated buffer per side; rolling back is moving a length counter, never
copying or freeing memory.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Static per-sequence cache: ``k`` and ``v`` are ``[layers, kv_heads, max_length, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layers, n_kv_heads, max_length, head_dim)
        self.k: Tensor = torch.zeros(shape, dtype=dtype, device=device)  # [Lyr, Hkv, T, d]
        self.v: Tensor = torch.zeros(shape, dtype=dtype, device=device)  # [Lyr, Hkv, T, d]
        self.max_length = max_length
        self.length = 0
        self.peak_length = 0

    def reserve(self, n: int) -> int:
        """Claim ``n`` new positions; returns the first one.  Raises if the buffer is full."""
        start = self.length
        if start + n > self.max_length:
            raise ValueError(f"KV cache full: {start} + {n} > {self.max_length} positions")
        self.length = start + n
        self.peak_length = max(self.peak_length, self.length)
        return start

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
        self.k[:, :, start : start + m] = self.k[:, :, keep]
        self.v[:, :, start : start + m] = self.v[:, :, keep]
        self.length = start + m

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers."""
        return self.k.numel() * self.k.element_size() * 2

    def used_bytes(self, length: int | None = None) -> int:
        """Bytes that ``length`` positions (default: the peak) occupy."""
        per_position = self.nbytes // self.max_length
        return per_position * (self.peak_length if length is None else length)
