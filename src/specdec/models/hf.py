"""Hugging Face backend: any ``AutoModelForCausalLM`` behind the :class:`LanguageModel` seam.

Slower than the native path (framework overhead per call) but covers every architecture
transformers knows.  Truncation uses ``DynamicCache.crop``, which is O(1) in memory moves.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


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

    @classmethod
    def from_folder(cls, folder: str, *, dtype: torch.dtype = torch.float32, local_files_only: bool = False) -> "HFCausalLM":
        """``folder``: a local folder or a hub id (``local_files_only``: the hub's local cache only)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=local_files_only))

    def new_cache(self, max_length: int | None = None) -> HFCache:
        from transformers import DynamicCache

        return HFCache(cache=DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: HFCache, *, last_only: bool = False) -> Tensor:
        n = tokens.numel()
        positions = torch.arange(cache.length, cache.length + n, device=self.device)
        out = self.model(
            input_ids=tokens.to(self.device).unsqueeze(0),
            **{self._cache_arg: cache.cache},
            use_cache=True,
            cache_position=positions,
            logits_to_keep=1 if last_only else 0,
        )
        cache.length += n
        return out.logits[0].float().cpu()
