"""The fed draft: the small draft model reading the target's features (``specdec train online --fed``).

Its input at position ``r`` is the token's embedding plus a projection of the target's features
at position ``r - 1`` (each tap divided by its RMS, concatenated, scaled to unit norm), where the
target has computed them, and a learned null vector where it has not: row 0, and every drafted
row.  The target computes features for every committed position but the newest (the bonus or
corrected token, which the next verification pass feeds), so every committed row has its
features and no drafted row does — what training's streams reproduce (see
:func:`specdec.train.online.fed_streams`).

It is a :class:`ModelDrafter` (chains, trees, a reduced draft vocabulary, every rule) and a
feature drafter (the verifier computes its taps in the passes it runs anyway).  Two differences:
the prompt is not prefilled before its features arrive (the first round feeds it with them), and
a round's drafted rows are all dropped on commit, accepted ones too, since they were computed
without features; the next round feeds the accepted tokens again with theirs (one multi-row
pass with the round's bonus token).  Over the wire the edge has no target features, so a fed
draft is refused there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from specdec.drafters.model import ModelDrafter
from specdec.errors import ConfigError
from specdec.models.base import LanguageModel
from specdec.verify import Verdict

#: the block of a fed draft's config.json (``train online`` writes it)
CONFIG_KEY = "specdec_fed"
PROJ, NULL = "fed.proj.weight", "fed.null"


def fed_config(folder: Path | None) -> dict | None:
    """The ``specdec_fed`` block of a model folder's config.json: {"taps", "target_hidden", "steps"}, or None."""
    if folder is None or not (folder / "config.json").is_file():
        return None
    return json.loads((folder / "config.json").read_text()).get(CONFIG_KEY)


def fed_input(feats: Tensor) -> Tensor:  # [n, K, D] taps + final state -> [n, K D]
    """Each feature row divided by its RMS, all concatenated and scaled to unit norm (training's layout)."""
    f = feats.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2) / math.sqrt(f.shape[-2] * f.shape[-1])


def load_projection(folder: Path) -> tuple[Tensor, Tensor]:  # -> proj [D, K Dt], null [D], float32
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.get_tensor(PROJ).float(), f.get_tensor(NULL).float()


class FedDrafter(ModelDrafter):
    """A draft model whose committed rows read the target's features (see the module docstring)."""

    def __init__(self, model: LanguageModel, proj: Tensor, null: Tensor, taps: tuple[int, ...], *,
                 max_length: int | None = None, temperature_factor: float = 1.0) -> None:
        super().__init__(model, max_length=max_length, temperature_factor=temperature_factor, lazy_prefill=True)
        self.proj = proj  # [D, K Dt]
        self.null = null  # [D]
        #: the target's taps this drafter reads (then its final hidden state)
        self.feature_taps = tuple(taps)
        self._pf = torch.empty(0, proj.shape[0])  # projected features of positions 0 .. n_feats - 1 (and room): [cap, D]
        self._n_feats = 0

    def with_model(self, model: LanguageModel) -> "FedDrafter":
        return FedDrafter(model, self.proj, self.null, self.feature_taps, max_length=self.max_length,
                          temperature_factor=self.temperature_factor)

    def spawn(self, wrap: Callable[[Any], Any] = lambda m: m) -> "FedDrafter":
        """A fresh drafter (per-request state) over the same draft model, wrapped by ``wrap``."""
        return self.with_model(wrap(self.model))

    def reset(self, expected: int = 0) -> None:
        super().reset(expected)
        self._pf = torch.empty(expected, self.proj.shape[0])
        self._n_feats = 0

    def prepare(self, prompt: Tensor) -> None:  # the prompt's rows wait for their features
        self.reset(prompt.numel())

    def add_features(self, features: Tensor) -> None:  # [k, K, Dt]
        if features is None or features.shape[0] == 0:
            return
        if features.shape[1] * features.shape[2] != self.proj.shape[1]:
            raise ConfigError(f"this fed draft reads {self.proj.shape[1]} feature values a position; the target hands "
                              f"{features.shape[1]} x {features.shape[2]}: it was trained for another target")
        k, n = int(features.shape[0]), self._n_feats
        if n + k > self._pf.shape[0]:  # grown by doubling: a round appends a few rows, never copies them all
            grown = torch.empty(max(2 * self._pf.shape[0], n + k, 64), self._pf.shape[1])
            grown[:n] = self._pf[:n]
            self._pf = grown
        self._pf[n : n + k] = fed_input(features) @ self.proj.T  # [k, D]
        self._n_feats = n + k

    def _extra(self, start: int, n: int) -> Tensor:  # -> [n, D] what rows start .. start + n - 1 add
        """Row r reads position r - 1's projected features where they have arrived, else the null vector."""
        rows = self.null.expand(n, -1).clone()
        lo, hi = max(start, 1), min(start + n, self._n_feats + 1)  # rows with features: 1 .. n_feats
        if hi > lo:
            rows[lo - start : hi - start] = self._pf[lo - 1 : hi - 1]
        return rows

    def _forward(self, tokens: Tensor, **kw: bool) -> Tensor:
        assert self.cache is not None
        return self.model.forward(tokens, self.cache, extra=self._extra(self.cache.length, tokens.numel()), **kw)

    def _forward_tree(self, tokens: Tensor, parents: Tensor, *, prefix: int, **kw: bool) -> Tensor:
        assert self.cache is not None  # every tree node is a drafted row
        return self.model.forward_tree(tokens, parents, self.cache, prefix=prefix,
                                       extra=self.null.expand(tokens.numel(), -1), **kw)

    def commit(self, verdict: Verdict) -> None:
        """Drop every drafted row: accepted ones are fed again next round, with their features."""
        if self.cache is not None:
            self.cache.truncate(min(self._round_start, self.cache.length))
        self._slots = None

    def extra_bytes(self) -> int:
        return (self.proj.numel() + self.null.numel()) * 4
