"""Inference helpers for the draft heads of :mod:`specdec.heads.modules`: a growable KV cache for
one head decoder layer, one layer step over new rows (chain or tree attention), the feature row
layout (draft-vocabulary logits reach the target's vocabulary through ``models.base.full_vocab``).

The maths is the modules' own (``project`` / ``attend`` / ``finish`` of their layers, the same
rotary tables); only the bookkeeping of incremental decoding lives here.  Row ``t`` of a head
layer sits at rotary position ``t``, as in training.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.heads.modules import DecoderLayer, HeadConfig, rope_tables


class LayerCache:
    """Keys/values of one head decoder layer, ``[Hkv, T, d]``, grown on demand, O(1) truncate."""

    def __init__(self, cfg: HeadConfig, capacity: int = 256) -> None:
        self.cfg = cfg
        self.k = torch.zeros(cfg.n_kv_heads, capacity, cfg.head_dim)
        self.v = torch.zeros(cfg.n_kv_heads, capacity, cfg.head_dim)
        self.length = 0
        self._cos, self._sin = rope_tables(torch.arange(capacity), cfg.head_dim, cfg.rope_theta)  # [T, d]

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [n] -> cos, sin [n, d]
        """Rotary tables at ``positions`` (elementwise the same values as ``rope_tables``)."""
        top = int(positions.max()) + 1
        if top > self._cos.shape[0]:
            self._cos, self._sin = rope_tables(torch.arange(max(top, 2 * self._cos.shape[0])), self.cfg.head_dim,
                                               self.cfg.rope_theta)
        return self._cos[positions], self._sin[positions]

    def reserve(self, n: int) -> int:
        """Room for ``n`` more rows; returns the first new slot."""
        start = self.length
        need = start + n
        if need > self.k.shape[1]:
            size = max(need, 2 * self.k.shape[1])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.zeros(old.shape[0], size, old.shape[2])
                new[:, :start] = old[:, :start]
                setattr(self, name, new)
        self.length = need
        return start

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def run_layer(
    layer: DecoderLayer,
    cfg: HeadConfig,
    attn_in: Tensor,  # [n, in] the attention input of the new rows
    resid: Tensor,  # [n, D] their residual
    positions: Tensor,  # [n] int64 rotary positions
    cache: LayerCache,
    *,
    mask: Tensor | None = None,  # [n, S] bool over the cache after appending (S = cache.length + n); None = causal
) -> Tensor:  # -> [n, D] the layer's output
    """Append the new rows' keys/values to ``cache`` and run the layer for them."""
    n = attn_in.shape[0]
    cos, sin = cache.rope(positions)  # [n, d]
    q, k, v = layer.attn.project(attn_in[None], cos, sin)  # [1, H, n, d], [1, Hkv, n, d] x2
    start = cache.reserve(n)
    end = start + n
    cache.k[:, start:end] = k[0]
    cache.v[:, start:end] = v[0]
    if mask is None and n > 1:
        mask = torch.arange(end)[None, :] <= (start + torch.arange(n))[:, None]  # [n, S] causal
    out = layer.attn.attend(q, cache.k[None, :, :end], cache.v[None, :, :end], mask)  # [1, n, D]
    return layer.finish(resid[None], out)[0]


def input_rows(cfg: HeadConfig) -> tuple[tuple[int, ...], list[int]]:
    """The target taps a head needs, and where each of its ``cfg.inputs`` rows comes from.

    ``cfg.inputs`` indexes the stored rows ``(cfg.taps..., final)``; a drafter asks the target
    only for the taps those name.  Returns ``(taps, source)``: ``source[i]`` is the row of the
    received features ``(taps..., final)`` that input ``i`` reads.
    """
    width = len(cfg.taps) + 1
    wanted: list[int] = []
    for idx in cfg.inputs:
        i = idx % width
        if i < len(cfg.taps) and cfg.taps[i] not in wanted:
            wanted.append(cfg.taps[i])
    source = []
    for idx in cfg.inputs:
        i = idx % width
        source.append(wanted.index(cfg.taps[i]) if i < len(cfg.taps) else len(wanted))
    return tuple(wanted), source


def stored_layout(cfg: HeadConfig, feats: Tensor, source: list[int]) -> Tensor:  # [n, R', D] -> [1, n, R, D]
    """Received features placed where ``cfg.inputs`` reads them in the stored layout (other rows 0),
    so the module's own ``fuse`` sees exactly what it saw in training."""
    n, _, d = feats.shape
    out = torch.zeros(1, n, len(cfg.taps) + 1, d, dtype=torch.float32)
    width = len(cfg.taps) + 1
    for idx, src in zip(cfg.inputs, source):
        out[0, :, idx % width] = feats[:, src].float()
    return out


