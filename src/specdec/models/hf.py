"""Hugging Face backend: any ``AutoModelForCausalLM`` behind the :class:`LanguageModel` seam.

Slower than the native path (framework overhead per call) but covers every architecture
transformers knows.  Truncation uses ``DynamicCache.crop``, which is O(1) in memory moves.
Token trees are scored with a custom 4-D attention mask (each node sees the cached prefix and its
own path, at position prefix + depth), on models whose every layer attends to the whole context:
a sliding-window layer would need a mask of its own, which transformers takes only one of.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdec.tree import ancestor_mask, depths


@dataclass
class HFCache:
    cache: Any  # transformers DynamicCache
    length: int = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if length < self.length:
            # a negative argument means "remove this many" in every transformers version
            self.cache.crop(length - self.length)
        self.length = length

    def compact(self, keep: Tensor, start: int) -> None:  # keep: [m] int64 ascending positions >= start
        """Keep positions ``keep`` at ``start, start+1, ...`` (one path of a token tree), in every layer."""
        if keep.numel() and (int(keep.min()) < start or int(keep.max()) >= self.length):
            raise ValueError(f"cannot keep positions {keep.tolist()} of a cache of length {self.length} from {start}")
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            idx = keep.to(layer.keys.device)
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., idx, :]], dim=-2)  # [B, H, T', d]
            layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., idx, :]], dim=-2)
        self.length = start + keep.numel()

    @property
    def nbytes(self) -> int:
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total


class HFCausalLM:
    """Wraps a loaded ``transformers`` causal LM (batch size 1)."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        #: the forward's name for the KV cache: ``cache`` from transformers 5.x (which warns that
        #: ``past_key_values`` goes in 5.40), ``past_key_values`` before
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        if full_attention(cfg):  # token trees (one mask for every layer); absent: drafters and sessions keep to chains
            self.forward_tree = self._forward_tree

    @classmethod
    def from_folder(cls, folder: str, *, dtype: torch.dtype = torch.float32, local_files_only: bool = False) -> "HFCausalLM":
        """``folder``: a local folder or a hub id (``local_files_only``: the hub's local cache only)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=local_files_only))

    def new_cache(self, max_length: int | None = None) -> HFCache:
        from transformers import DynamicCache

        return HFCache(cache=DynamicCache(config=self.model.config))

    def _call(self, tokens: Tensor, cache: HFCache, **extra: Any) -> Tensor:  # tokens: [n] -> [n | 1, V]
        """One transformers pass of ``tokens`` after the cache (its slots advance by n); ``extra``:
        the model's own arguments (a mask, positions, logits_to_keep)."""
        end = cache.length + tokens.numel()
        out = self.model(
            input_ids=tokens.to(self.device).unsqueeze(0),
            **{self._cache_arg: cache.cache},
            use_cache=True,
            cache_position=torch.arange(cache.length, end, device=self.device),
            **extra,
        )
        cache.length = end
        return out.logits[0].float().cpu()

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: HFCache, *, last_only: bool = False) -> Tensor:
        return self._call(tokens, cache, logits_to_keep=1 if last_only else 0)

    @torch.inference_mode()
    def _forward_tree(self, tokens: Tensor, parents: Tensor, cache: HFCache, *, prefix: int | None = None) -> Tensor:
        """Logits ``[n, V]`` of a token tree in one pass: ``tokens`` [n], ``parents`` over the tree
        region ``[prefix, cache.length + n)`` (default ``prefix``: the cache's length; -1: a child
        of the cached prefix), as :meth:`specdec.models.native.NativeCausalLM.forward_tree`.  Keys
        land in node order; keep one path afterwards with ``cache.compact``.  Each node's row is its
        path scored token by token, up to float rounding (transformers' passes are not
        batch-invariant)."""
        n, end = tokens.numel(), cache.length + tokens.numel()
        start = cache.length if prefix is None else prefix
        m = end - start
        if parents.numel() != m or not 0 <= start <= cache.length:
            raise ValueError(f"expected {m} tree parents for the region [{start}, {end}); got {parents.numel()}")
        sees = ancestor_mask(parents)[m - n :]  # [n, m]: each new node's region path
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros((n, end), dtype=dtype)  # [n, T] additive: 0 attends
        mask[:, start:] = torch.where(sees, 0.0, torch.finfo(dtype).min)
        positions = (start + depths(parents)[m - n :]).to(self.device)  # [n]: prefix + depth
        return self._call(tokens, cache, attention_mask=mask[None, None].to(self.device),  # [1, 1, n, T]
                          position_ids=positions.unsqueeze(0))


def full_attention(config: Any) -> bool:
    """Whether every layer of ``config``'s model attends to the whole context (no sliding window),
    so one tree mask serves them all."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None:
        return all(kind == "full_attention" for kind in kinds)
    return getattr(cfg, "sliding_window", None) is None or getattr(cfg, "use_sliding_window", True) is False
