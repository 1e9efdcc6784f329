"""Exact toy language models: the test oracle.

A :class:`ToyLM` is an order-``k`` Markov model over a tiny vocabulary whose logits come from a
seeded random table.  Its next-token law is known in closed form for every context, so tests can
enumerate every output sequence and compare the decoder's empirical output law with the exact
one.  :meth:`ToyLM.perturbed` makes a correlated "draft" model (acceptance well below 1, well
above 0), the regime where a wrong verification rule shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.tree import paths


@dataclass
class ToyCache:
    """The toy model's "cache" is simply the token history."""

    tokens: list[int]
    length: int = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        del self.tokens[length:]
        self.length = length

    def compact(self, keep: Tensor, start: int) -> None:  # keep: [m] int64 ascending, >= start
        """Keep positions ``keep`` at ``start, start+1, ...`` (one path of a token tree)."""
        kept = [self.tokens[k] for k in keep.tolist()]
        self.tokens[start:] = kept
        self.length = len(self.tokens)

    @property
    def nbytes(self) -> int:
        return 8 * len(self.tokens)


class ToyLM:
    """Order-``order`` Markov LM: logits depend on the last ``order`` tokens only."""

    def __init__(self, vocab_size: int = 4, *, order: int = 1, seed: int = 0, scale: float = 1.5,
                 table: Tensor | None = None, dtype: torch.dtype = torch.float64) -> None:
        self.vocab_size = vocab_size
        self.order = order
        self.max_length = 1 << 20
        self.dtype = dtype
        if table is None:
            gen = torch.Generator().manual_seed(seed)
            # one row per context (vocab_size + 1 symbols per slot: the extra one is "no token")
            table = torch.randn((vocab_size + 1) ** order, vocab_size, generator=gen, dtype=dtype) * scale
        self.table = table  # [(V+1)^order, V]
        self.calls = 0
        #: width of the toy "hidden states" (:meth:`forward_features`) and token embeddings
        self.hidden_size = 16
        self._feature_tables: dict[int, Tensor] = {}
        self._embed: Tensor | None = None
        self._rows: list[int] = []  # Markov-state rows of the last forward's positions

    def perturbed(self, strength: float = 0.7, *, seed: int = 1) -> "ToyLM":
        """A related model: the same table plus seeded noise of the given strength."""
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn(self.table.shape, generator=gen, dtype=self.dtype) * strength
        return ToyLM(self.vocab_size, order=self.order, table=self.table + noise, dtype=self.dtype)

    def _row(self, history: list[int]) -> int:
        idx = 0
        for i in range(self.order):
            pos = len(history) - self.order + i
            sym = history[pos] + 1 if pos >= 0 else 0
            idx = idx * (self.vocab_size + 1) + sym
        return idx

    def logits_for(self, history: list[int]) -> Tensor:  # -> [V]
        """Next-token logits after ``history`` (the exact law, for oracles)."""
        return self.table[self._row(history)]

    def new_cache(self, max_length: int | None = None) -> ToyCache:
        return ToyCache(tokens=[])

    def forward(self, tokens: Tensor, cache: ToyCache, *, last_only: bool = False) -> Tensor:
        self.calls += 1
        rows = []
        for t in tokens.tolist():
            cache.tokens.append(int(t))
            rows.append(self._row(cache.tokens))
        cache.length = len(cache.tokens)
        self._rows = rows
        out = self.table[torch.tensor(rows)]  # [n, V]
        return out[-1:] if last_only else out

    def forward_tree(self, tokens: Tensor, parents: Tensor, cache: ToyCache, *, prefix: int | None = None) -> Tensor:  # -> [n, V]
        """Each node scored after the cached prefix plus its own path (tree attention's law);
        ``prefix`` and ``parents`` as in :meth:`NativeCausalLM.forward_tree`."""
        self.calls += 1
        s = cache.length if prefix is None else prefix
        before = cache.tokens[:s]
        toks, rows = cache.tokens[s:] + tokens.tolist(), []
        for p in paths(parents)[len(toks) - tokens.numel() :]:
            rows.append(self._row(before + [toks[i] for i in p]))
        cache.tokens.extend(tokens.tolist())
        cache.length = len(cache.tokens)
        self._rows = rows
        return self.table[torch.tensor(rows, dtype=torch.long)]

    # ------------------------------------------------------------------ toy features
    # Target-aware drafters read "hidden states"; here a feature is a seeded random vector per
    # Markov state (so it is a function of the context, as a real hidden state is), one per
    # requested tap plus the "final" row, and the embeddings are a seeded random table.

    @property
    def embed(self) -> Tensor:  # [V, D] float32
        if self._embed is None:
            gen = torch.Generator().manual_seed(4242)
            self._embed = torch.randn(self.vocab_size, self.hidden_size, generator=gen)
        return self._embed

    def _features(self, rows: list[int], width: int) -> Tensor:  # -> [n, width, D] float32
        table = self._feature_tables.get(width)
        if table is None:
            gen = torch.Generator().manual_seed(777 + width)
            table = torch.randn(self.table.shape[0], width, self.hidden_size, generator=gen)
            self._feature_tables[width] = table
        return table[torch.tensor(rows, dtype=torch.long)]

    def forward_features(self, tokens: Tensor, cache: ToyCache, taps: tuple[int, ...], *, last_only: bool = False,
                         parents: Tensor | None = None, prefix: int | None = None) -> tuple[Tensor, Tensor]:
        """Logits as :meth:`forward` / :meth:`forward_tree` and toy features ``[n, len(taps)+1, D]``."""
        if parents is not None:
            logits = self.forward_tree(tokens, parents, cache, prefix=prefix)
        else:
            logits = self.forward(tokens, cache, last_only=last_only)
        return logits, self._features(self._rows, len(taps) + 1)
