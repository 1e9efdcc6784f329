"""A token-embedding table held as int8 blocks, where that is exactly the float32 table.

A GGUF ships its token embeddings quantised (SmolLM2's and Gemma 3's as Q8_0: blocks of 32 int8
values with one float16 scale each); converted to a Hugging Face folder they become a float32
table four times that size, of which a pass reads one row a token.  Each value of such a table is
an int8 times its block's scale, and the product is exact in float32 (a float16 scale has an
11-bit significand, an int8 at most 7 bits).  :func:`exact_blocks` finds those blocks again — the
scale is the block's largest magnitude over 127, as the Q8_0 quantiser's largest value is ±127 —
and keeps them only if every value comes back bit for bit (the sign of a zero included), so the
rows :class:`BlockTable` returns are the float32 table's rows exactly; any other table (a float
model's, or one shipped in other blocks) stays as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: values per block (Q8_0's)
BLOCK = 32
#: rows compared at a time when looking for the blocks (bounds the temporaries at ~4 MB of floats a row block)
_CHUNK_ROWS = 4096


class BlockTable:
    """A ``[V, D]`` float32 table as int8 values and one float32 scale per block of 32 columns.

    Reads as the table does where a model reads it: ``index_select(0, ids)`` and ``table[ids]``
    give float32 rows (each bitwise the float table's: see the module), ``shape`` and ``dtype``
    are the float table's."""

    def __init__(self, values: Tensor, scales: Tensor) -> None:
        if values.dtype != torch.int8 or values.dim() != 2 or values.shape[1] % BLOCK:
            raise ValueError("a block table needs int8 values [V, D] with D a multiple of 32")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (values.shape[0], values.shape[1] // BLOCK):
            raise ValueError("a block table needs one float32 scale per block of 32 values")
        self.values = values  # [V, D] int8
        self.scales = scales  # [V, D / 32] float32
        self.shape = torch.Size(values.shape)
        self.dtype = torch.float32

    def index_select(self, dim: int, index: Tensor) -> Tensor:  # index: [n] -> [n, D] float32
        if dim != 0:
            raise ValueError("a block table is read by rows")
        n = index.numel()
        q = self.values.index_select(0, index).view(n, -1, BLOCK)  # [n, D / 32, 32]
        s = self.scales.index_select(0, index).unsqueeze(-1)  # [n, D / 32, 1]
        return (q.float() * s).view(n, self.shape[1])

    def __getitem__(self, index: object) -> Tensor:  # ids [...] -> [..., D]
        ids = torch.as_tensor(index, dtype=torch.long)
        return self.index_select(0, ids.reshape(-1)).view(*ids.shape, self.shape[1])

    def float(self) -> Tensor:
        """The whole float32 table (a copy: for the few users that need it as one tensor)."""
        return self.index_select(0, torch.arange(self.shape[0]))

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * 4

    def state(self) -> dict[str, Tensor]:
        return {"values": self.values, "scales": self.scales}


def exact_blocks(table: Tensor) -> BlockTable | None:
    """``table`` [V, D] float32 as a :class:`BlockTable` that returns it bit for bit, or None where
    its values are not int8 multiples of one scale per block of 32 (found from the first rows on,
    so a table that is not one costs little)."""
    if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] % BLOCK or table.shape[0] == 0:
        return None
    v, d = table.shape
    values = torch.empty(v, d, dtype=torch.int8)
    scales = torch.empty(v, d // BLOCK, dtype=torch.float32)
    with torch.inference_mode():
        for start in range(0, v, _CHUNK_ROWS):
            rows = table[start : start + _CHUNK_ROWS].reshape(-1, d // BLOCK, BLOCK)  # [n, D / 32, 32]
            scale = rows.abs().amax(-1, keepdim=True) / 127  # [n, D / 32, 1]
            q = torch.where(scale > 0, rows / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0).round_().to(torch.int8)
            # compared as the table will compute them (int8 -> float32, times the scale), bit for bit
            if not torch.equal((q.float() * scale).view(torch.int32), rows.view(torch.int32)):
                return None
            values[start : start + rows.shape[0]] = q.view(rows.shape[0], d)
            scales[start : start + rows.shape[0]] = scale.squeeze(-1)
    return BlockTable(values, scales)


__all__ = ["BLOCK", "BlockTable", "exact_blocks"]
