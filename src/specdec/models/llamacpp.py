"""An experimental :class:`~specdec.models.base.LanguageModel` over llama.cpp (``llama-cpp-python``).

The GGUF file runs as shipped (quantised weights, llama.cpp's CPU kernels); specdec only needs
two things from it: the logits of every position of a block (``llama_decode`` with an output
flag on each token) and cache truncation (``llama_memory_seq_rm``).  Exactness is relative to
the model *as llama.cpp runs it*; greedy speculative = plain greedy holds bitwise only because
llama.cpp's CPU forward pass turned out to be batch-invariant for the block sizes a
verification pass uses (see NOTES.md, "llama.cpp as a backend", for what was measured and the
settings it depends on).

With more than one thread that holds only while a sequence is at most
:data:`INVARIANT_POSITIONS` long (measured: past it a block's logits differ from the
token-by-token ones by up to ~1.6, while on one thread they are equal at every length measured, so
how the attention's work is split over threads is the likely cause), so such a model's context is
capped there.

Limits of this prototype: one llama.cpp context per model, one live sequence at a time (a new
cache invalidates the previous one), CPU only.  It reaches into two private attributes of the
pinned binding version (the context and batch wrappers of ``llama_cpp.Llama``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specdec.errors import MissingPackageError, SpecdecError


#: with more than one thread, block scoring is bitwise batch-invariant while the sequence holds at
#: most this many positions (llama-cpp-python 0.3.36, CPU, flash attention on; NOTES.md)
INVARIANT_POSITIONS = 256


@dataclass(frozen=True)
class LlamaCppConfig:
    """How the llama.cpp context is created (the defaults are the settings measured invariant)."""

    n_ctx: int = 4096
    n_threads: int | None = None  # None: torch's thread count
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = True  # measured: without it, block scoring is not batch-invariant


class LlamaCppCache:
    """Sequence 0 of the model's llama.cpp context; valid until the model makes a newer cache."""

    def __init__(self, model: "LlamaCppLM", epoch: int) -> None:
        self.model = model
        self.epoch = epoch
        self.length = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.model._check(self)
        if length < self.length:
            self.model._remove(length)
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.length * self.model.kv_bytes_per_token


class LlamaCppLM:
    """A GGUF model run by llama.cpp; ``forward`` scores a block of tokens in one ``llama_decode``."""

    def __init__(self, path: str | Path, cfg: LlamaCppConfig = LlamaCppConfig()) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise MissingPackageError("the llama.cpp backend needs llama-cpp-python: pip install 'specdec[llamacpp]'") from None
        self._lib = llama_cpp
        threads = cfg.n_threads or torch.get_num_threads()
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch, n_threads=threads,
            n_threads_batch=threads, flash_attn=cfg.flash_attn, logits_all=True, verbose=False,
        )
        self.cfg = cfg
        self.vocab_size = int(self.llm.n_vocab())
        self.max_length = int(self.llm.n_ctx())
        self.threads = threads
        #: whether the thread count capped the context (past the cap a block's logits are not the
        #: token-by-token ones: module docstring)
        self.capped = threads > 1 and self.max_length > INVARIANT_POSITIONS
        if self.capped:
            self.max_length = INVARIANT_POSITIONS
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "llama")
        layers = int(meta.get(f"{arch}.block_count", 0))
        heads = int(meta.get(f"{arch}.attention.head_count", 1))
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.embedding_length", 0)) // heads  # unless the file names the sizes
        key_dim = int(meta.get(f"{arch}.attention.key_length", head_dim))  # Gemma-3: 256, not 640 / 4
        value_dim = int(meta.get(f"{arch}.attention.value_length", key_dim))
        self.kv_bytes_per_token = layers * kv_heads * (key_dim + value_dim) * 2  # K and V in float16
        self._epoch = 0
        self._memory = llama_cpp.llama_get_memory(self.llm.ctx)

    def new_cache(self, max_length: int | None = None) -> LlamaCppCache:
        if max_length is not None and max_length > self.max_length:
            raise SpecdecError(f"this llama.cpp context holds {self.max_length} positions, {max_length} were asked for")
        self._epoch += 1
        self._remove(0)
        return LlamaCppCache(self, self._epoch)

    def forward(self, tokens: Tensor, cache: LlamaCppCache, *, last_only: bool = False) -> Tensor:
        self._check(cache)
        ids = [int(t) for t in tokens.reshape(-1)]
        n = len(ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if cache.length + n > self.max_length:
            if self.capped:
                raise SpecdecError(
                    f"the sequence would pass {INVARIANT_POSITIONS} positions, beyond which llama.cpp on {self.threads} "
                    "threads scores a block of tokens differently from one token at a time, so speculative decoding "
                    "on it would not be exact; use LlamaCppConfig(n_threads=1) for longer sequences")
            raise SpecdecError(f"the sequence would exceed the llama.cpp context of {self.max_length} positions")
        step = self.cfg.n_batch
        out: list[Tensor] = []
        for i in range(0, n, step):
            chunk = ids[i : i + step]
            want_all = not last_only
            self.llm._batch.set_batch(batch=chunk, n_past=cache.length, logits_all=want_all)
            self.llm._ctx.decode(self.llm._batch)
            cache.length += len(chunk)
            if want_all or i + step >= n:
                rows = len(chunk) if want_all else 1
                ptr = self._lib.llama_get_logits(self.llm.ctx)
                logits = np.ctypeslib.as_array(ptr, shape=(rows, self.vocab_size))
                out.append(torch.from_numpy(logits.copy()))  # [rows, V]
        return torch.cat(out) if not last_only else out[-1]  # [n, V] or [1, V]

    def _remove(self, start: int) -> None:
        if not self._lib.llama_memory_seq_rm(self._memory, 0, start, -1):
            raise SpecdecError("llama.cpp refused to remove cache positions")

    def _check(self, cache: LlamaCppCache) -> None:
        if cache.model is not self or cache.epoch != self._epoch:
            raise SpecdecError("this llama.cpp cache was superseded by a newer one (one sequence at a time)")


def load_llamacpp(path: str | Path, cfg: LlamaCppConfig = LlamaCppConfig()) -> Any:
    """A :class:`LlamaCppLM` for the GGUF at ``path``."""
    return LlamaCppLM(path, cfg)
