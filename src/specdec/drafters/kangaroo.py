"""Kangaroo (Liu et al. 2024, *Kangaroo: Lossless Self-Speculative Decoding via Double Early
Exiting*): the target's first ``k`` layers, a small trained adapter, and the target's own LM head.

* **Shallow sub-network**: layers ``0 .. k-1`` of the target, run with the target's own
  operations on the draft's cache (as ``layerskip:k``); their keys/values and the residual
  stream leaving layer ``k-1`` are bitwise what the verification pass computes, so the
  verification pass reuses them (:class:`~specdec.drafters.self_spec.SharedLayers`).
* **Adapter** (Kangaroo §3.1): RMSNorm → one multi-head attention block (its own, trained; its
  keys/values live in one extra layer of the draft cache) → residual add → a learned per-channel
  scale, then the target's final norm and LM head.  Its output projection starts at zero, so an
  untrained adapter *is* ``layerskip:k``.  Trained by :mod:`specdec.train.kangaroo`.
* **Early stopping of the draft** (Kangaroo's second early exit): drafting stops after a token the
  draft gives less than ``stop_below`` probability (top-1 for arg-max drafting, q(x) when
  sampling).  It only decides how many tokens are proposed, so it cannot change the output law.

The adapter's weights are the only memory beyond the target besides the draft cache (see
:meth:`KangarooDrafter.extra_bytes`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.catalog import ADAPTERS_DIR, adapter_targets, check_shipped
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.self_spec import LayerPlan, LayerView, SelfSpecDrafter, ViewCache
from specdec.errors import ConfigError
from specdec.kv_cache import cache_length


@dataclass(frozen=True)
class AdapterConfig:
    """Shape of a Kangaroo adapter for a target with these dimensions, exiting after ``exit_after`` layers."""

    exit_after: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    n_layers: int  # the target's layer count (a file is refused for another target)

    @classmethod
    def for_target(cls, cfg: Any, exit_after: int) -> "AdapterConfig":
        """The adapter for a :class:`~specdec.models.native.NativeConfig` target: its attention layout."""
        if not 1 <= exit_after < cfg.n_layers:
            raise ConfigError(f"kangaroo needs 1 <= layers < {cfg.n_layers} (the target's layers), got {exit_after}")
        return cls(exit_after, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, float(cfg.rope_theta),
                   float(cfg.rms_eps), cfg.n_layers)


class Adapter(nn.Module):
    """RMSNorm → causal multi-head attention (grouped-query, rotary) → residual → channel scale.

    One module serves training (:meth:`forward` on padded batches) and drafting (:meth:`step` on
    a cache slot), with the same operations, so what was trained is what drafts.
    """

    def __init__(self, cfg: AdapterConfig, *, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        d, h, hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.in_norm = nn.Parameter(torch.ones(cfg.hidden_size))  # [D]
        self.qkv = nn.Parameter(torch.randn((h + 2 * hk) * d, cfg.hidden_size, generator=gen) * 0.02)  # [(H + 2 Hkv) d, D]
        self.out = nn.Parameter(torch.zeros(cfg.hidden_size, h * d))  # [D, H d]; zero: starts as early exit
        self.out_scale = nn.Parameter(torch.ones(cfg.hidden_size))  # [D]
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [d/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:  # x: [..., T, h, d]; positions: [T]
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq)  # [T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
        cos, sin = emb.cos().unsqueeze(-2).to(x.dtype), emb.sin().unsqueeze(-2).to(x.dtype)  # [T, 1, d]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # x: [..., T, D]
        cfg = self.cfg
        h, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * self.in_norm
        qkv = xn @ self.qkv.T  # [..., T, (H + 2 Hkv) d]
        q = self._rope(qkv[..., : h * d].unflatten(-1, (h, d)), positions)  # [..., T, H, d]
        k = self._rope(qkv[..., h * d : (h + hk) * d].unflatten(-1, (hk, d)), positions)  # [..., T, Hkv, d]
        v = qkv[..., (h + hk) * d :].unflatten(-1, (hk, d))  # [..., T, Hkv, d]
        return q, k, v

    def _finish(self, x: Tensor, attn: Tensor) -> Tensor:  # attn: [..., T, H d] -> [..., T, D]
        return (x + attn @ self.out.T) * self.out_scale

    def forward(self, x: Tensor) -> Tensor:  # x: [B, T, D] residual stream after layer k -> [B, T, D]
        """Training: causal attention within each (right-padded) sequence, positions from 0."""
        b, t, _ = x.shape
        q, k, v = self._project(x, torch.arange(t))
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=True)  # [B, H, T, d]
        return self._finish(x, attn.transpose(1, 2).reshape(b, t, -1))

    def step(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, start: int) -> Tensor:  # x: [n, D] -> [n, D]
        """Drafting: rows at positions ``start .. start + n`` against the cached keys/values
        ``k_cache`` / ``v_cache`` [Hkv, T, d] (the rows' own keys are written there first)."""
        n = x.shape[0]
        end = start + n
        q = self.store(x, k_cache, v_cache, start)
        mask = torch.full((n, end), -math.inf, dtype=x.dtype).triu_(start + 1) if n > 1 else None  # [n, T]
        # a float16 cache (``--kv-dtype float16``) widened for this draft-only layer
        attn = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_cache[:, :end].to(q.dtype).unsqueeze(0),
                                              v_cache[:, :end].to(q.dtype).unsqueeze(0), attn_mask=mask, enable_gqa=True)
        return self._finish(x, attn[0].transpose(0, 1).reshape(n, -1))  # [n, D]

    def store(self, x: Tensor, k_cache: Tensor, v_cache: Tensor, start: int) -> Tensor:  # x: [n, D] -> q [n, H, d]
        """Write the keys/values of rows at positions ``start .. start + n`` into ``k_cache`` /
        ``v_cache`` [Hkv, T, d]; returns the rows' queries."""
        q, k, v = self._project(x, torch.arange(start, start + x.shape[0]))
        k_cache[:, start : start + x.shape[0]] = k.transpose(0, 1)
        v_cache[:, start : start + x.shape[0]] = v.transpose(0, 1)
        return q

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


# ----------------------------------------------------------------------------- files


def save_adapter(adapter: Adapter, path: str | Path, *, card: dict[str, Any] | None = None) -> None:
    """Weights as float16 safetensors; the config and a training card in the file's metadata."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in adapter.state_dict().items()}
    meta = {"format": "specdec-kangaroo-adapter", "config": json.dumps(asdict(adapter.cfg)),
            "card": json.dumps(card or {})}
    save_file(tensors, str(path), metadata=meta)


def load_adapter(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Adapter, dict[str, Any]]:
    """An adapter file written by :func:`save_adapter`, and its training card."""
    from safetensors import SafetensorError, safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"kangaroo adapter file {str(p)!r} does not exist")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != "specdec-kangaroo-adapter":
            raise ValueError("not written by `specdec train kangaroo`")
        cfg = AdapterConfig(**json.loads(meta["config"]))
        card = json.loads(meta.get("card", "{}"))
        if not isinstance(card, dict):
            raise ValueError("its card is not a JSON object")
        adapter = Adapter(cfg)
        adapter.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()})
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        detail = " ".join(str(exc).split())  # one line (a state_dict mismatch lists its tensors on lines of their own)
        raise ConfigError(f"cannot read kangaroo adapter {str(p)!r}: {detail}") from None
    adapter.to(dtype).eval().requires_grad_(False)
    return adapter, card


shipped_targets = adapter_targets


# ----------------------------------------------------------------------------- the draft


class KangarooView(LayerView):
    """The target's first ``k`` layers + the adapter + the target's final norm and LM head.

    Its cache holds the ``k`` shallow layers' keys/values (slots ``0 .. k-1``, shareable with the
    verification pass), the adapter's keys/values (slot ``k``) and the residual stream leaving
    layer ``k-1`` (what cache sharing hands to layer ``k``).
    """

    def __init__(self, target: Any, adapter: Adapter, *, reduced: Any = None) -> None:
        cfg = adapter.cfg
        tcfg = getattr(target, "cfg", None)
        if tcfg is not None and (tcfg.n_layers, tcfg.hidden_size, tcfg.n_heads, tcfg.n_kv_heads, tcfg.head_dim) != (
                cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim):
            raise ConfigError("this kangaroo adapter was trained for a target of another shape")
        super().__init__(target, LayerPlan.early_exit(cfg.n_layers, cfg.exit_after), keep_hidden=True, reduced=reduced)
        self.adapter = adapter.to(target.dtype)

    def new_cache(self, max_length: int | None = None, *, initial_length: int | None = None) -> ViewCache:
        cfg = self.target.cfg
        length = cache_length(max_length, self.max_length)
        return ViewCache(self.plan.exit_after + 1, cfg.n_kv_heads, cfg.head_dim, length, dtype=self.target.dtype,
                         hidden_size=cfg.hidden_size, initial_length=initial_length, kv_dtype=self.target.kv_dtype)

    def forward(self, tokens: Tensor, cache: ViewCache, *, last_only: bool = False, compact: bool = False
                ) -> Tensor:  # [n] -> [n|1, V], or [n|1, Vd] with ``compact``
        with torch.inference_mode():
            x, start = self._layers(tokens, cache)
            k = self.plan.exit_after
            y = self.adapter.step(x, cache.k[k], cache.v[k], start)  # [n, D]
            return self.logits(y[-1:] if last_only else y, compact=compact)


class KangarooDrafter(SelfSpecDrafter):
    """A :class:`~specdec.drafters.self_spec.SelfSpecDrafter` over a :class:`KangarooView` that
    stops a draft early when its confidence falls below ``stop_below`` (never below the
    decoder's own ``min_confidence``).

    **Feature tap.**  It asks the verifier for the residual stream after the target's first K
    layers at every committed position (``feature_taps = (K,)``; the verification pass computes
    it anyway, and a pass that reuses the draft's shallow layers hands it over too, see
    :meth:`SharedLayers.forward_features`).  With the target's cache bound
    (:meth:`bind_target`) the view then never runs its K layers over tokens it did not draft --
    the prompt, and every token committed while it was not drafting: it copies their shallow
    keys/values from the target's cache and computes only the adapter's keys/values from the
    tapped residuals.  Without the features (inside a lookup hybrid, in the server) it catches
    up by running its layers, as before.
    """

    def __init__(self, view: KangarooView, *, stop_below: float, share: bool = True) -> None:
        super().__init__(view, share=share)
        if not 0.0 <= stop_below < 1.0:
            raise ConfigError(f"the kangaroo stopping threshold must be in [0, 1), got {stop_below}")
        self.stop_below = stop_below
        #: only where the target's pass can reuse the draft's layers (the batching server and a
        #: wrapped view get no features, see :meth:`spawn`)
        self.feature_taps: tuple[int, ...] | None = (view.plan.exit_after,) if self.share else None
        self._tapped: list[tuple[int, Tensor]] = []  # (first position, residual rows [k, D]) not yet in the cache
        self._tapped_end = 0  # positions 0 .. _tapped_end - 1 have had their features delivered

    def bind_target(self, model: Any, cache: Any) -> None:
        """The target's cache, read only when the features come too (see the class docstring)."""
        self._target_cache = cache if self.feature_taps is not None and model is self.view.target else None

    def reset(self, expected: int = 0) -> None:
        super().reset(expected)
        self._tapped, self._tapped_end = [], 0

    def add_features(self, features: Tensor) -> None:  # [k, 2, D]: (residual after K layers, final hidden)
        if features is None or features.shape[0] == 0:
            return
        self._tapped.append((self._tapped_end, features[:, 0]))
        self._tapped_end += features.shape[0]

    def _copy_committed(self, context: Tensor) -> None:  # context: [L]
        """Positions the view lacks below the last context token, from the target: shallow
        keys/values from its cache, the adapter's from the tapped residuals.  Stops where either
        runs out (the view's own forward feeds the rest)."""
        source, cache = self._target_cache, self.cache
        if source is None or cache is None:
            return
        have = cache.length
        upto = min(source.length, context.numel() - 1, self._tapped_end)
        self._tapped = [(a, r) for a, r in self._tapped if a + r.shape[0] > have]  # older rows are in the cache
        if upto <= have or not self._tapped or self._tapped[0][0] > have:
            return
        rows = torch.cat([r for _, r in self._tapped])[have - self._tapped[0][0] : upto - self._tapped[0][0]]  # [n, D]
        k = self.view.plan.exit_after
        cache.reserve(upto - have)
        cache.k[:k, :, have:upto] = source.k[:k, :, have:upto]  # [K, Hkv, n, d]
        cache.v[:k, :, have:upto] = source.v[:k, :, have:upto]
        cache.tokens[have:upto] = context[have:upto]
        if cache.resid is not None:
            cache.resid[have:upto] = rows
        with torch.inference_mode():
            self.view.adapter.store(rows.to(self.view.target.dtype), cache.k[k], cache.v[k], have)  # type: ignore[attr-defined]

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        sampler.min_confidence = max(sampler.min_confidence, self.stop_below)
        return super().propose(context, gamma, sampler)

    def spawn(self, wrap: Callable[[Any], Any] = lambda m: m) -> "KangarooDrafter":
        fresh = KangarooDrafter(self.view, stop_below=self.stop_below, share=self.share)  # type: ignore[arg-type]
        fresh.model = wrap(self.view)
        fresh.lazy_prefill = True  # the first round that drafts feeds the context: none for a request that never does
        fresh.feature_taps = None  # a server's batched passes hand out no features
        return fresh

    def extra_bytes(self) -> int:
        """Memory beyond the target: the adapter's weights and the draft cache's used positions."""
        return self.view.adapter.nbytes + super().extra_bytes()  # type: ignore[attr-defined]


def build(arg: str, target: Any, target_name: str, *, stop_below: float, reduced: Any = None
          ) -> tuple[KangarooDrafter, str]:
    """``kangaroo`` (the adapter shipped for ``target_name``) or ``kangaroo:FILE``; ``reduced``: the
    target's head over a reduced draft vocabulary to draft through (see :class:`LayerView`)."""
    if arg:
        path, label = Path(arg), f"kangaroo:{Path(arg).name}"
    else:
        check_shipped("kangaroo", target_name)
        path, label = ADAPTERS_DIR / f"{target_name}.safetensors", "kangaroo"  # check_shipped found it there
    adapter, _ = load_adapter(path, dtype=target.dtype)
    return KangarooDrafter(KangarooView(target, adapter, reduced=reduced), stop_below=stop_below), label
