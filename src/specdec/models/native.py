"""Native Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 decoder: plain tensors, a static KV cache, no
framework overhead.

This is the fast path for the model families the registry ships (SmolLM2 is Llama, the
Qwen2.5-Coder pair is Qwen2, Gemma-3-270M is Gemma 3's text model).  It reads a Hugging Face folder
(``config.json`` + ``*.safetensors``) and reproduces ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Gemma3ForCausalLM`` (checked against them in ``tests/models/test_native.py`` and
``test_windowed.py``), sliding-window layers included.  Structure follows gpt-fast's model.py in
spirit: one function per block, fused QKV and gate/up projections, and the cache as a preallocated
buffer.  The compiled loops (models/scripted.py, csrc/layers.cpp) run the Llama layout; Gemma 3's
layer (output norms, a tanh-GELU gate, two rotary bases) runs on the fused call where a quantised
model's pass takes it, and in the Python layer loop otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec import defaults
from specdec.errors import ConfigError
from specdec.kv_cache import KVCache, cache_length
from specdec.models.base import full_vocab
from specdec.models import calibration_cache, kernels, quantised_cache
from specdec.models.linear import (
    Int8Linear,
    Linear,
    Q4Blocks,
    Q4Linear,
    Q6Blocks,
    W8A8Linear,
    W8A8OneDNNLinear,
    int8_kernel as resolve_int8_kernel,
    quantize_q4_1,
)
from specdec.models.quantize import RangeRecorder, calibration_ids, calibration_source, smoothing
from specdec.models.scripted import ATTENTION_BLOCK, ScriptedLayers, compiled_layers
from specdec.models.scripted import BLOCK_MASK as _BLOCK_MASK

from specdec.tree import attention_schedule, check_order, is_chain
from specdec.tree import paths as tree_paths

AnyLinear = Linear | W8A8Linear | W8A8OneDNNLinear | Q4Linear

SUPPORTED = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text")
#: GGUF architectures whose files convert to a model of :data:`SUPPORTED` (a Gemma 3 GGUF's text model)
GGUF_SUPPORTED = ("llama", "qwen2", "mistral", "qwen3", "gemma3")


@dataclass(frozen=True)
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    max_length: int
    tie_embeddings: bool
    attention_bias: bool
    #: Qwen3's RMS norm of each query and key head (over head_dim, a weight per layer) before the rotation
    qk_norm: bool = False
    #: the sliding window of the layers that have one (a query at position p sees keys p - W + 1 .. p),
    #: None where every layer sees the whole context
    sliding_window: int | None = None
    #: per layer, whether it is a sliding-window layer (empty: none is)
    windowed: tuple[bool, ...] = ()
    #: Gemma 3's layout: RMS norms of the attention and MLP outputs before each residual add, a
    #: tanh-GELU gate, norm weights stored as offsets from one (gain = 1 + w), token embeddings
    #: scaled by sqrt(hidden_size), a query scale of query_pre_attn_scalar^-1/2, and the sliding
    #: layers' own rotary base (:attr:`local_rope_theta`)
    gemma: bool = False
    #: the attention scale (None: 1 / sqrt(head_dim))
    query_scale: float | None = None
    #: the rotary base of the sliding-window layers where it differs from :attr:`rope_theta`
    local_rope_theta: float | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "NativeConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED:
            raise ConfigError(f"native backend supports {SUPPORTED}, not {model_type!r}; use --backend hf")
        for key in ("rope_parameters", "rope_scaling"):
            if cfg.get(key) is not None and not isinstance(cfg[key], dict):
                raise ConfigError(f"config.json: {key} must be an object, got {cfg[key]!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        gemma = model_type == "gemma3_text"
        local_theta = None
        if gemma:  # rotary parameters by layer kind ({"full_attention": {...}, "sliding_attention": {...}})
            by_kind = rope if rope and all(isinstance(v, dict) or v is None for v in rope.values()) else {}
            full, local = by_kind.get("full_attention") or {}, by_kind.get("sliding_attention") or {}
            for part in (full, local):
                if part.get("rope_type", part.get("type", "default")) not in ("default", None):
                    raise ConfigError(f"rope scaling {part.get('rope_type', part.get('type'))!r} is not supported by the native backend")
            if not by_kind and rope:
                raise ConfigError("rope scaling is not supported by the native backend for Gemma 3")
            theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
            local_theta = _number("rope_local_base_freq", local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)),
                                  positive=True)
            for name in ("final_logit_softcapping", "attn_logit_softcapping"):
                if cfg.get(name) is not None:
                    raise ConfigError(f"{name} is not supported by the native backend; use --backend hf")
            if cfg.get("use_bidirectional_attention"):
                raise ConfigError("bidirectional attention is not supported by the native backend; use --backend hf")
            if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
                raise ConfigError(f"activation {cfg.get('hidden_activation')!r} is not supported by the native backend")
        else:
            if cfg.get("hidden_act", "silu") != "silu":
                raise ConfigError(f"activation {cfg.get('hidden_act')!r} is not supported by the native backend; use --backend hf")
            rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
            if rope_type not in ("default", None):
                raise ConfigError(f"rope scaling {rope_type!r} is not supported by the native backend")
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)) if rope else cfg.get("rope_theta", 10000.0)
        theta = _number("rope_theta", theta, positive=True)
        # transformers' biases: Qwen2's query / key / value always, Mistral's none; Llama's, Qwen3's and
        # Gemma 3's ``attention_bias`` puts one on the output projection too, Llama's ``mlp_bias`` on its
        # MLP, which these layers do not compute
        if model_type in ("llama", "qwen3", "gemma3_text") and cfg.get("attention_bias"):
            raise ConfigError("attention_bias (a bias on the attention's output projection too) is not supported by the"
                              " native backend; use --backend hf")
        if model_type == "llama" and cfg.get("mlp_bias"):
            raise ConfigError("mlp_bias is not supported by the native backend; use --backend hf")
        hidden, heads = _count(cfg, "hidden_size"), _count(cfg, "num_attention_heads")
        kv_heads = _count(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        fixed_head_dim = QWEN3_HEAD_DIM if model_type == "qwen3" else GEMMA3_HEAD_DIM if gemma else None
        if cfg.get("head_dim") is None and fixed_head_dim is None and hidden % heads:
            raise ConfigError(f"config.json: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})"
                              " where head_dim is not given")
        head_dim = _count(cfg, "head_dim", fixed_head_dim or hidden // heads)
        if head_dim % 2:
            raise ConfigError(f"config.json: head_dim must be even (the rotary embedding turns pairs), got {head_dim}")
        n_layers = _count(cfg, "num_hidden_layers")
        window, windowed = layer_windows(cfg)
        return cls(
            model_type=model_type,
            vocab_size=_count(cfg, "vocab_size"),
            hidden_size=hidden,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_count(cfg, "intermediate_size"),
            rms_eps=_number("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6), positive=False),
            rope_theta=theta,
            max_length=context_length(cfg),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),  # (transformers' default: Gemma 3 ties)
            attention_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=window,
            windowed=windowed,
            gemma=gemma,
            query_scale=(_number("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", 256), positive=True) ** -0.5
                         if gemma else None),
            local_rope_theta=local_theta if local_theta is not None and local_theta != theta else None,
        )


def _count(cfg: dict, key: str, default: Any = None, *, least: int = 1) -> int:
    """``cfg[key]`` (``default`` where it is absent or null) as a whole number of at least
    ``least``, or a one-line error naming the field (a bool is not a count)."""
    value = cfg.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"config.json: {key} must be a whole number, at least {least}; got {value!r}")
    return value


def _number(key: str, value: Any, *, positive: bool) -> float:
    """``value`` (the config field ``key``) as a finite float, above zero where ``positive``, else
    at least zero; or a one-line error naming the field."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer past float's range
        number = math.inf
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ConfigError(f"config.json: {key} must be a finite number {'above' if positive else 'of at least'} 0; got {value!r}")
    return number


@dataclass
class _Layer:
    """One decoder layer, with each RMSNorm's weight folded into the linear layer it feeds
    (``rms_norm(x) * g @ W.T == (1/rms(x)) * (x @ (W * g).T)``) and the attention scale
    ``1/sqrt(head_dim)`` folded into the query rows: fewer ops per step, same function."""

    qkv: AnyLinear  # D -> (H + 2 Hkv) d; input norm folded in, q rows pre-scaled
    out: AnyLinear  # H d -> D
    gate_up: AnyLinear  # D -> 2 I; post-attention norm folded in
    down: AnyLinear  # I -> D
    #: Qwen3's per-head norms' weights [d] (the query's times the attention scale, which then is
    #: not in the query rows: the norm would undo it); None for the other layouts
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    #: a sliding-window layer's window (a query at position p sees keys p - W + 1 .. p), else None
    window: int | None = None
    #: Gemma 3's norms of the attention and MLP outputs: their gains [D] (1 + w), else None
    post_attn: Tensor | None = None
    post_mlp: Tensor | None = None
    #: the rotary table the layer's queries and keys turn by: 0 the model's, 1 the sliding layers' own
    rope: int = 0


def context_length(cfg: dict) -> int:
    """The longest context the native backend runs the model of config ``cfg``: its
    ``max_position_embeddings`` (sliding-window layers included: see :func:`layer_windows`)."""
    return _count(cfg, "max_position_embeddings", 2048)


#: a config key of specdec's own (Hugging Face ignores it): a sliding window over every layer. The
#: shipped SmolLM2 draft carries it because it was distilled on sequences of a few hundred tokens:
#: past ~512 positions its agreement with the target fell from ~0.42 to 0.10 over full attention,
#: and stays ~0.43 with a 512-position window (RoPE sees only the distances it was trained on).
#: A drafter's attention never touches exactness.
OWN_WINDOW_KEY = "specdec_attention_window"


#: transformers' head sizes for a Qwen3 / Gemma 3 config without ``head_dim`` (the other model types
#: divide the hidden size among the heads)
QWEN3_HEAD_DIM, GEMMA3_HEAD_DIM = 128, 256

#: transformers' default for a Qwen2 / Qwen3 config without ``max_window_layers``: the layers from
#: the 29th on slide (none in a model of 28 layers or fewer).
QWEN_MAX_WINDOW_LAYERS = 28


def layer_windows(cfg: dict) -> tuple[int | None, tuple[bool, ...]]:
    """(window, per layer whether it is a sliding-window layer) for a Hugging Face config dict:
    :data:`OWN_WINDOW_KEY` where it is set; else as transformers reads it: the config's ``layer_types`` where it lists them; else Mistral windows
    every layer when ``sliding_window`` is set, Qwen2 / Qwen3 the layers from ``max_window_layers``
    on when ``use_sliding_window`` is true too.  ``(None, ())`` where no layer has a window."""
    n = _count(cfg, "num_hidden_layers")
    own = cfg.get(OWN_WINDOW_KEY)
    if own is not None:  # specdec's own key: every layer attends to its last ``own`` positions
        if not isinstance(own, int) or isinstance(own, bool) or own < 1:
            raise ConfigError(f"{OWN_WINDOW_KEY} must be a whole number of positions, at least 1; got {own!r}")
        return own, (True,) * n
    kind = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if kind in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None  # (their configs carry a window the model does not use unless asked)
    kinds = cfg.get("layer_types")
    if window is None or kind == "llama":  # (a Llama's attention has no window, whatever its config says)
        return None, ()
    if kinds is not None:
        other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if other:
            raise ConfigError(f"the native backend runs full and sliding-window attention layers, not {', '.join(other)};"
                              " use --backend hf")
        windowed = tuple(t == "sliding_attention" for t in kinds)
    elif kind in ("qwen2", "qwen3"):
        first = _count(cfg, "max_window_layers", QWEN_MAX_WINDOW_LAYERS, least=0)
        windowed = tuple(i >= first for i in range(n))
    else:  # Mistral: every layer
        windowed = (True,) * n
    if not any(windowed):
        return None, ()
    return _count(cfg, "sliding_window"), windowed  # (at least one position)


def _rope_tables(theta: float, head_dim: int, length: int) -> tuple[Tensor, Tensor]:
    """cos/sin ``[length, head_dim]`` of rotary base ``theta`` in Hugging Face's rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
    return emb.cos(), emb.sin()


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q: [H, d]; k, v: [Hkv, T, d] -> [1, H d]
    """Attention of one (pre-scaled) query position over ``T`` cached positions with
    ``scaled_dot_product_attention`` (low-precision drafts: CPU bmm is slow in bfloat16)."""
    return F.scaled_dot_product_attention(
        q.view(1, -1, 1, q.shape[-1]), k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True, scale=1.0
    ).view(1, -1)


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:  # q: [n, H, d]; k, v: [Hkv, C, d] -> [n, H d]
    """Exact (batch-invariant) attention of ``n`` consecutive query positions ``start .. start+n-1``
    over a cache buffer (query ``p`` sees keys ``0 .. p``; ``q`` pre-scaled): the compiled kernel
    for float32 rows where this process uses it (:func:`kernels.attention_kernel`: each row's
    reductions ordered by its own keys, so the same bits alone or with others, at a third of the
    cost), else :func:`_attend_rows_aten`.  A process never mixes the two (their bits differ)."""
    if q.dtype == torch.float32 and kernels.attention_kernel():
        return torch.ops.specdec.attend(q, k, v, start, None)
    return _attend_rows_aten(q, k, v, start)


def _attend_rows_aten(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:  # q: [n, H, d]; k, v: [Hkv, C, d] -> [n, H d]
    """Exact (batch-invariant) attention of ``n`` consecutive query positions ``start .. start+n-1``
    over a cache buffer; query ``p`` sees keys ``0 .. p`` (``q`` pre-scaled).

    The canonical computation of one query, whatever else runs with it: with ``B`` =
    :data:`ATTENTION_BLOCK` and ``P`` = ``p + 1`` rounded up to whole blocks, the scores against keys
    ``[0, P)`` (one matrix product per key/value head over its ``G = H / Hkv`` query heads), the
    keys past ``p`` masked with −inf inside the last block, a softmax over the ``P`` columns and
    the product with values ``[0, P)``.  Every reduction therefore has a length fixed by the query's
    own position, and each query runs alone with the shapes single-token decoding uses.  (Queries
    sharing a block used to run as one product of ``m·G`` rows; that is bitwise the solo rows only
    for some head layouts — measured on a Sapphire Rapids: not for G = 2 at d = 64 or G = 2-5 at
    d = 128 — so it was dropped: the compiled kernel is the fast path.)  Low-precision caches take
    ``_attend`` per row.
    """
    n, hq, d = q.shape
    hk = k.shape[0]
    if q.dtype != torch.float32:
        return torch.cat([_attend(q[j], k[:, : start + j + 1], v[:, : start + j + 1]) for j in range(n)])
    g = hq // hk
    block = ATTENTION_BLOCK
    outs: list[Tensor] = []
    for j in range(n):
        length = start + j + 1  # keys seen by row j
        padded = -(-length // block) * block
        if padded > k.shape[1]:
            raise ValueError(f"the cache holds {k.shape[1]} positions; exact attention reads {padded} (allocate whole blocks)")
        r0 = length - 1 - (padded - block)  # the row's mask row
        scores = torch.bmm(q[j].view(hk, g, d), k[:, :padded].transpose(1, 2))  # [Hkv, G, P]
        if r0 < block - 1:
            scores.narrow(2, padded - block, block).add_(_BLOCK_MASK[r0])
        outs.append(torch.bmm(torch.softmax(scores, -1), v[:, :padded]).view(1, hq * d))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_seen(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q: [1, H, d]; k, v: [Hkv, m, d] -> [1, H d]
    """Attention of one (pre-scaled) query row over exactly the ``m`` keys it sees, in position
    order (its own last), computed as :func:`_attend_rows` computes a row at position ``m - 1``
    over a cache holding those keys from slot 0: the bits depend on the keys' values alone, not on
    where they lie, so a row past a sliding window (its keys a slice of the cache) and a tree node
    (its keys gathered from the prefix and its path) get what that function gives the same keys."""
    m = k.shape[1]
    if q.dtype == torch.float32 and kernels.attention_kernel():
        return torch.ops.specdec.attend(q, k, v, m - 1, None)
    if q.dtype != torch.float32:
        return _attend(q[0], k, v)
    padded = -(-m // ATTENTION_BLOCK) * ATTENTION_BLOCK  # the aten rows read whole blocks
    kb = k.new_zeros(k.shape[0], padded, k.shape[2])  # [Hkv, P, d]
    vb = v.new_zeros(v.shape[0], padded, v.shape[2])
    kb[:, :m], vb[:, :m] = k, v
    return _attend_rows_aten(q, kb, vb, m - 1)


def _attend_rows_windowed(q: Tensor, k: Tensor, v: Tensor, start: int, window: int | None
                          ) -> Tensor:  # q: [n, H, d]; k, v: [Hkv, C, d] -> [n, H d]
    """:func:`_attend_rows` for a layer with a sliding window ``window`` (None: none): a row at a
    position below the window sees every earlier key, as a full-attention row does; a row at
    position ``p >= window`` sees keys ``p - window + 1 .. p`` alone (:func:`_attend_seen`).
    Which function a row takes depends on its position only, so each row is bitwise the same in
    any pass, as without a window."""
    n = q.shape[0]
    inside = n if window is None else max(0, min(n, window - start))  # rows at positions < window
    if inside == n:
        return _attend_rows(q, k, v, start)
    outs = [_attend_rows(q[:inside], k, v, start)] if inside else []
    for j in range(inside, n):
        lo = start + j - window + 1
        outs.append(_attend_seen(q[j : j + 1], k[:, lo : start + j + 1], v[:, lo : start + j + 1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _window_mask(mask: Tensor, positions: Tensor, window: int, key_positions: Tensor | None = None
                 ) -> Tensor:  # mask: [n, T]; positions: [n] -> [n, T]
    """An additive attention mask with each row's keys before its sliding window masked too: keys
    at positions below ``position - window + 1``.  ``key_positions`` [T]: each cache slot's
    position (a token tree's region holds its nodes at their depths), default the slot itself."""
    keys = torch.arange(mask.shape[1]) if key_positions is None else key_positions
    early = keys.unsqueeze(0) < (positions.unsqueeze(1) - window + 1)  # [n, T]
    return mask.masked_fill(early, -math.inf)


def _rows(x: Tensor, rows: list[int]) -> Tensor:  # x: [n, ...] -> [len(rows), ...]
    """``x[rows]`` (a slice for one row; index_select, not advanced indexing: see ``hidden``)."""
    return x[rows[0] : rows[0] + 1] if len(rows) == 1 else x.index_select(0, torch.tensor(rows, dtype=torch.long))


def _head_norm(x: Tensor, gain: Tensor, eps: Tensor) -> Tensor:  # x: [n, h, d]; gain: [d] -> [n, h, d]
    """RMS norm of each head's vector (Qwen3's query and key norms): ``x / sqrt(mean(x^2) + eps) * gain``,
    the inverse RMS computed as the layer norms' is (a vector norm, one multiply-add, rsqrt), which
    the compiled loops (``scripted._head_norm``, csrc/layers.cpp) reproduce bit for bit."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [n, h, 1]
    return x * torch.rsqrt(torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1])) * gain


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x: [n, h, d]; cos/sin: [n, 1, d]
    """Rotary embedding in rotate-half layout: ``x cos + rotate_half(x) sin``, with
    ``rotate_half(x) sin == roll(x, d/2) * sin'`` where ``sin'`` has its first half negated
    (``sin`` here is that signed table): three ops instead of seven."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@dataclass(frozen=True)
class _TreeLayout:
    """Where a token tree's nodes sit and what each one sees (tree attention, SpecInfer §4.2)."""

    start: int  # first cache slot of the tree region
    end: int  # one past the last node's slot
    positions: Tensor  # [n] int64 absolute positions: start + depth
    #: exact attention's visiting order (see :func:`specdec.tree.attention_schedule`):
    #: per step (node j among the scored ones, its path length, (slot, node) writes)
    schedule: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    mask: Tensor | None  # [n, end] additive: 0 for the cached prefix and the node's ancestors-or-self
    visit_perm: Tensor | None  # [n] exact mode: node j's row among the rows in visiting order
    #: exact mode with the attention kernel: node j's ancestors-or-self as absolute cache slots in
    #: path order, -1 padded [n, max depth + 1] (it reads them in place after the prefix [0, start))
    paths: Tensor | None = None
    #: (``windowed`` only: a pass with rows past a sliding window) node j's ancestors-or-self as
    #: absolute cache slots, root first, and [end] each slot's position (itself below the region, the
    #: node's depth past ``start`` in it)
    node_slots: tuple[tuple[int, ...], ...] = ()
    slot_positions: Tensor | None = None

    @classmethod
    def build(
        cls, parents: Tensor, start: int, end: int, dtype: torch.dtype, prefix: int | None = None, *, exact: bool = True,
        windowed: bool = False,
    ) -> "_TreeLayout":
        """``parents`` covers the tree region ``[prefix, end)`` (default: just the new nodes);
        the last ``end - start`` entries are the nodes being scored now.  ``exact``: the schedule
        of per-node attention (batch-invariant models), else the mask of one masked call;
        ``windowed``: the nodes' slots and positions too, which sliding-window layers read."""
        s = start if prefix is None else prefix
        n, m = end - start, end - s
        if parents.numel() != m:
            raise ValueError(f"expected {m} tree parents for the region [{s}, {end}); got {parents.numel()}")
        check_order(parents)
        mask = perm = paths = None
        schedule: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...] = ()
        region = tree_paths(parents)  # each region node's path, root first
        scored = region[m - n :]  # the scored nodes'
        if exact and dtype == torch.float32 and kernels.attention_kernel():
            width = max(len(p) for p in scored)  # path order = ascending slot (parents precede children)
            paths = torch.tensor([[s + k for k in p] + [-1] * (width - len(p)) for p in scored], dtype=torch.long)
        elif exact:
            schedule = tuple((j, length, tuple(w)) for j, length, w in attention_schedule(parents, n))
            perm = torch.empty(n, dtype=torch.long)
            perm[torch.tensor([j for j, _, _ in schedule], dtype=torch.long)] = torch.arange(n)
        else:  # 0 for the cached prefix and each node's path, -inf for the rest of the region
            mask = torch.zeros((n, end), dtype=dtype)
            mask[:, s:] = -math.inf
            mask[[j for j, p in enumerate(scored) for _ in p], [s + k for p in scored for k in p]] = 0.0
        positions = torch.tensor([s + len(p) - 1 for p in scored], dtype=torch.long)  # start + depth
        if not windowed:
            return cls(s, end, positions, schedule, mask, perm, paths)
        slot_positions = torch.arange(end)
        slot_positions[s:] = torch.tensor([s + len(p) - 1 for p in region], dtype=torch.long)
        node_slots = tuple(tuple(s + k for k in p) for p in scored)
        return cls(s, end, positions, schedule, mask, perm, paths, node_slots, slot_positions)

    def scripted_steps(self) -> tuple[list[list[int]], Tensor]:
        """The schedule flattened for the TorchScript loop: per step ``[j, attended length,
        slot, node, slot, node, ...]`` (absolute slots, region node offsets), and the [n]
        permutation putting the visited rows back in node order."""
        s = self.start
        steps = [[j, s + length, *(x for k, v in writes for x in (s + k, v))] for j, length, writes in self.schedule]
        return steps, self.visit_perm

    def attend_invariant(self, q: Tensor, cache: KVCache, li: int) -> Tensor:  # q: [n, H, d] -> [n, H d]
        """One query row per node against ``cache[:start] + its path``, laid out contiguously in
        the cache exactly as token-by-token decoding of that path would have it, so each row is
        bitwise the sequential result (:func:`_attend_rows` gives a row the same bits alone or
        with others).  Nodes are visited depth-first, so each usually writes one key/value pair
        (its own); a run of visits that each extend the previous path by one node (a chain down
        the tree) is scored as consecutive positions in one call.  The region is restored in
        node order afterwards.
        """
        s, m = self.start, self.end - self.start
        k_cache, v_cache = cache.k[li], cache.v[li]  # [Hkv, T, d]
        if self.paths is not None:  # the kernel reads each node's path in place
            return torch.ops.specdec.attend(q, k_cache, v_cache, s, self.paths)
        k_new = k_cache[:, s : s + m].clone()  # [Hkv, m, d] the whole tree region
        v_new = v_cache[:, s : s + m].clone()
        outs: list[Tensor] = []
        run: list[int] = []  # visited rows whose paths extend one another by one node each
        first = 0  # the run's first path length
        moved = False
        for j, length, writes in self.schedule:
            extends = bool(run) and length == first + len(run) and all(slot == length - 1 for slot, _ in writes)
            if run and not extends:  # score the run before this visit rewrites what it saw
                outs.append(_attend_rows(_rows(q, run), k_cache, v_cache, s + first - 1))
                run = []
            if not run:
                first = length
            for slot, node in writes:
                k_cache[:, s + slot] = k_new[:, node]
                v_cache[:, s + slot] = v_new[:, node]
                moved = True
            run.append(j)
        outs.append(_attend_rows(_rows(q, run), k_cache, v_cache, s + first - 1))
        if moved:
            k_cache[:, s : s + m] = k_new
            v_cache[:, s : s + m] = v_new
        rows = outs[0] if len(outs) == 1 else torch.cat(outs)  # [n, H d] in visiting order
        return rows.index_select(0, self.visit_perm)

    def attend_windowed(self, q: Tensor, cache: KVCache, li: int, window: int) -> Tensor:  # q: [n, H, d] -> [n, H d]
        """:meth:`attend_invariant` for a sliding-window layer: node j over the keys its path would
        see decoded token by token -- the last ``window`` of the prefix and its path -- gathered
        in position order (:func:`_attend_seen`, bitwise :func:`_attend_rows_windowed`'s row)."""
        k_cache, v_cache = cache.k[li], cache.v[li]  # [Hkv, T, d]
        outs = []
        for j, path in enumerate(self.node_slots):
            lo = max(0, self.start + len(path) - window)  # the first position node j sees
            slots = torch.cat([torch.arange(min(lo, self.start), self.start), torch.tensor(path[max(0, lo - self.start):])])  # [m]
            outs.append(_attend_seen(q[j : j + 1], k_cache.index_select(1, slots), v_cache.index_select(1, slots)))
        return torch.cat(outs)  # [n, H d]



#: the linear layers of each decoder layer, in the order they run
LAYER_LINEARS = ("qkv", "out", "gate_up", "down")


def _linear_shapes(cfg: NativeConfig, head_rows: int) -> dict[str, tuple[int, int]]:
    """Every linear layer's (outputs, inputs) by name (``layers.I.NAME``, ``lm_head``), from the config."""
    d, q, kv, inter = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    one = {"qkv": (q + 2 * kv, d), "out": (d, q), "gate_up": (2 * inter, d), "down": (d, inter)}
    return {**{f"layers.{i}.{name}": one[name] for i in range(cfg.n_layers) for name in LAYER_LINEARS},
            "lm_head": (head_rows, d)}


def _layer_kernel(requested: str, shapes: dict[str, tuple[int, int]]) -> str:
    """The int8 kernel ``requested`` resolves to for layers of these ``shapes`` (the head's aside:
    auto weighs the layer matrices; small ones run on fbgemm, see linear.WIDE_AUTO_ROWS)."""
    return resolve_int8_kernel(requested, [shape for name, shape in shapes.items() if name != "lm_head"])


def _cache_parts(cfg: NativeConfig, sources: list[Path], calibration: str, *, dtype: torch.dtype,
                 batch_invariant: bool, int8_head: bool, quant: str, int8_kernel: str, q4_blocks: list[str],
                 vocab_subset: Tensor | None) -> dict:
    """What a quantised model's calibration ranges and quantised layers depend on besides the code
    (the key of :mod:`specdec.models.calibration_cache` and :mod:`specdec.models.quantised_cache`);
    ``calibration``: a digest of the calibration ids, or of what they are computed from."""
    return {
        "files": calibration_cache.file_identity(sources), "calibration": calibration,
        "config": dataclasses.asdict(cfg), "dtype": str(dtype), "batch_invariant": batch_invariant,
        "int8_head": int8_head, "quant": quant, "int8_kernel": int8_kernel, "q4_blocks": sorted(q4_blocks),
        "vocab_subset": None if vocab_subset is None else calibration_cache.tensor_digest(vocab_subset),
    }


def saved_model_weights(cfg: NativeConfig, files: list[Path]) -> dict[str, Tensor]:
    """The float weights a saved quantised model does not hold, read from the safetensors ``files``:
    the embedding, Qwen3's and Gemma 3's query and key head norms and Gemma 3's output norms (tiny;
    the saved layers are linear ones)."""
    names = ["model.embed_tokens.weight"]
    if cfg.qk_norm:
        names += [f"model.layers.{i}.self_attn.{x}_norm.weight" for i in range(cfg.n_layers) for x in "qk"]
    if cfg.gemma:
        names += [f"model.layers.{i}.{x}.weight" for i in range(cfg.n_layers)
                  for x in ("post_attention_layernorm", "post_feedforward_layernorm")]
    return {name: _read_tensor(files, name) for name in names}


def _read_tensor(files: list[Path], name: str) -> Tensor:
    """One tensor from whichever of the safetensors ``files`` holds it, without reading the others."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():
                return sf.get_tensor(name)
    raise KeyError(name)


#: a decoder layer's weight matrices (``model.layers.I.NAME.weight``), as a checkpoint names them
_LAYER_MATRICES = tuple(f"self_attn.{x}_proj" for x in "qkvo") + tuple(f"mlp.{x}_proj" for x in ("gate", "up", "down"))


class _HeadRows(NamedTuple):
    """A quantised model's LM head before it is quantised: its rows [V, D] and the final norm's
    weight [D] that scales their columns, kept apart so the [V, D] product is never made whole
    (the head is not run in float: only its input's range is recorded; see W8A8Linear.scaled_rows)."""

    rows: Tensor
    gain: Tensor
    bias: None = None


@dataclass(frozen=True, eq=False)
class ReducedHead:
    """A target's final norm + LM head over a reduced draft vocabulary (target ids ``ids``, sorted),
    what :meth:`NativeCausalLM.reduced_head` builds: a draft proposes those tokens only, which no
    verification rule needs for exactness (every other token gets draft probability 0)."""

    ids: Tensor  # [Vd] long, sorted target ids of the rows
    rows: "Q4Linear | W8A8Linear | Linear" = dataclasses.field(repr=False)
    target: "NativeCausalLM" = dataclasses.field(repr=False)

    def logits(self, x: Tensor, *, compact: bool = False) -> Tensor:  # [n, D] residual stream -> [n, Vd | V]
        """The rows as they are with ``compact`` (columns in the order of :attr:`ids`), else
        scattered over the target's vocabulary (``-inf`` elsewhere)."""
        out = self.rows(self.target.final_norm(x)).float()
        return out if compact else full_vocab(out, self.ids, self.target.vocab_size)

    @property
    def share(self) -> float:
        """The reduced head's rows over the whole head's (its share of the head's cost)."""
        return self.ids.numel() / self.target.vocab_size

    @property
    def nbytes(self) -> int:
        """Memory beyond the target's: the rows' copy (the 4-bit or int8 packing, or float32 rows) and the ids."""
        return int(self.rows.nbytes + self.ids.numel() * self.ids.element_size())


class _LayerByLayer:
    """A quantised model built one layer at a time.  Each new layer's float (range-recording)
    linears get their input ranges — read from the calibration cache, or measured by carrying the
    calibration text's residual stream through that layer with the operations of a forward pass —
    and are quantised before the next layer is made; the LM head's recorder gets the final
    normalised stream without running the head.  A model so built holds one float layer at a
    time (the int8 Qwen2.5-Coder-1.5B held all 28 for one calibration pass: 6.5 GB), and is bit
    for bit the model a whole calibration pass over the float layers gives (tested)."""

    def __init__(self, model: "NativeCausalLM", ranges: dict[str, Tensor] | None, cache_name: str | None) -> None:
        self.model = model
        self.ranges = ranges  # read from the cache: nothing to measure
        self.cache_name = cache_name  # where measured ranges go (None: cache off, or no key)
        self.measured: dict[str, Tensor] = {}
        self.x: Tensor | None = None  # [n, D] the calibration text's residual stream after the layers settled so far
        self.cache: KVCache | None = None

    @classmethod
    def start(cls, model: "NativeCausalLM", calibration: Tensor | None, cache_parts: dict | None,
              shapes: dict[str, tuple[int, int]]) -> "_LayerByLayer":
        """``calibration``: token ids [n] (none, or one token: no ranges, no smoothing);
        ``cache_parts``: the key's parts besides the code; ``shapes``: every linear's (out, in)."""
        ids = calibration[: model.max_length] if calibration is not None and calibration.numel() > 1 else None
        if ids is None:
            return cls(model, None, None)
        name = calibration_cache.key(cache_parts) if cache_parts is not None else None
        ranges = None
        if name is not None:  # every linear's range for int8; only the head's for q4 (its layers are 4-bit blocks)
            wanted = {k: (shape[1],) for k, shape in shapes.items() if model.quant == "int8" or k == "lm_head"}
            ranges = calibration_cache.load(name, wanted)
        build = cls(model, ranges, name)
        if ranges is None:
            build.begin_pass(ids)
        return build

    def begin_pass(self, ids: Tensor) -> None:  # ids: [n] int64
        """Start measuring: the calibration text's embedding, and a cache for its keys and values."""
        n = ids.numel()
        self.cache = self.model.new_cache(n)
        self.cache.reserve(n)
        self.x = self.model._embed_rows(ids)  # [n, D]

    def settle_layer(self, i: int) -> None:
        """Layer ``i`` (just built): its ranges read or measured, then its float linears quantised."""
        m, layer = self.model, self.model.layers[i]
        recorders = {n: getattr(layer, n) for n in LAYER_LINEARS if isinstance(getattr(layer, n), RangeRecorder)}
        if self.x is not None:  # every layer runs, 4-bit ones too: the head's input comes from all of them
            assert self.cache is not None and m.scripted is None
            self.x = m.run_layers(self.x, self.cache, [(i, True, True)], start=0)
        for n, rec in recorders.items():
            self._settle(f"layers.{i}.{n}", rec)
            setattr(layer, n, self._quantised(rec))

    def settle_head(self) -> None:
        """The LM head (built last): its range, its quantisation, and the ranges stored when measured."""
        m = self.model
        rec = m.lm_head
        if not isinstance(rec, RangeRecorder):  # a head as shipped: nothing to measure
            assert isinstance(rec, Q4Linear) and self.x is None
            return
        if self.x is not None:
            rec.record(self.x * m._inv_rms(self.x))  # [n, D]: what forward hands the head
        self._settle("lm_head", rec)
        m.lm_head = self._quantised(rec)
        if self.cache_name is not None and self.x is not None:
            calibration_cache.save(self.cache_name, self.measured)
        self.x = self.cache = None

    def _settle(self, name: str, rec: RangeRecorder) -> None:
        if self.ranges is not None:
            rec.absmax = self.ranges[name]
        elif self.x is not None:
            self.measured[name] = rec.absmax

    def _quantised(self, rec: RangeRecorder) -> W8A8Linear | W8A8OneDNNLinear:
        kernel = self.model.int8_kernel
        if isinstance(rec.inner, _HeadRows):
            rows, gain = rec.inner.rows, rec.inner.gain
            smooth = smoothing(rec.absmax, rows, column_gain=gain)
            if kernel == "onednn":
                return W8A8OneDNNLinear(rows * gain, smooth=smooth)
            return W8A8Linear.scaled_rows(rows, gain, smooth=smooth, wide=kernel == "mixed")
        weight = rec.inner.weight  # [out, in] float, unpacked
        if kernel == "onednn":
            return W8A8OneDNNLinear(weight, rec.bias, smooth=smoothing(rec.absmax, weight))
        return W8A8Linear(weight, rec.bias, smooth=smoothing(rec.absmax, weight), wide=kernel == "mixed")


def _check_layer_count(cfg: NativeConfig, names: list[str], *, complete: bool) -> None:
    """Refuse weights (or a GGUF's blocks) of layers past the config's count, which would be dropped
    without a word, and, where ``names`` are the whole model's (``complete``), a last layer missing."""
    held = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()]
    last = max(held, default=-1)
    if last >= cfg.n_layers or (complete and held and last < cfg.n_layers - 1):
        raise ConfigError(f"config.json declares {cfg.n_layers} layers but the weights hold layers 0..{last}")


class NativeCausalLM:
    """A Llama-family causal LM implementing :class:`specdec.models.base.LanguageModel`."""

    def __init__(
        self,
        cfg: NativeConfig,
        weights: dict[str, Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        int8_head: bool = False,
        vocab_subset: Tensor | None = None,
        quant: str | None = None,
        calibration: Tensor | None = None,
        int8_kernel: str = "auto",
        q4_blocks: dict[str, Q4Blocks | Q6Blocks] | None = None,
        sources: list[Path] | None = None,
        quantised: dict[str, Tensor] | None = None,
    ) -> None:
        """``quant="int8"``: every linear layer and the LM head as :class:`W8A8Linear`, smoothed
        with input ranges measured on ``calibration`` token ids [n] (no smoothing without);
        ``int8_kernel``: fbgemm | onednn | mixed | auto (see :func:`specdec.models.linear.int8_kernel`).
        ``quant="q4"``: every layer matrix as :class:`Q4Linear` — the 4-bit (and Q6_K) blocks in
        ``q4_blocks`` (by weight name: a GGUF's as shipped) where given, else quantised from the
        float weight — and the LM head likewise where ``q4_blocks`` holds an untied target's
        (``lm_head.weight``), else as the int8 target's.  ``sources``: the files ``weights`` (and ``q4_blocks``)
        were read from, which lets the calibration's ranges be kept on disk for later starts
        (:mod:`specdec.models.calibration_cache`).  ``quantised`` (``quant="int8"`` or ``"q4"``): the
        quantised layers as :meth:`quantised_state` gave them, which then stand for every weight but
        the embedding and Qwen3's head norms (``weights`` holds those alone, :func:`saved_model_weights`),
        with ``int8_kernel`` already resolved; no calibration runs (:mod:`specdec.models.quantised_cache`)."""
        if quant not in (None, "int8", "q4"):
            raise ConfigError(f"unknown quantisation {quant!r}; the native backend offers int8 and q4")
        _check_layer_count(cfg, [*weights, *(q4_blocks or {})], complete=quantised is None)
        self.cfg = cfg
        #: "int8": every linear layer and the LM head as W8A8Linear (int8 weights per output
        #: channel, int8 activations per row, exact int32 accumulation; batch-invariant)
        self.quant = quant
        #: score multi-token inputs one query row at a time with exactly the shapes single-token
        #: decoding uses, so that row i is bitwise what plain decoding computes (the linear layers
        #: are batch-invariant already); costs 5-10% on a 5-9-token verification pass
        self.batch_invariant = batch_invariant
        self.vocab_size = cfg.vocab_size
        self.max_length = cfg.max_length
        self.dtype = dtype
        #: the caches' dtype where it is not ``dtype`` (:meth:`set_kv_dtype`)
        self.kv_dtype: torch.dtype | None = None

        mode = "invariant" if batch_invariant else "fast"

        def linear(weight: Tensor, bias: Tensor | None = None) -> Linear | W8A8Linear:
            if quant is not None:  # float first: calibrated, then quantised (see _LayerByLayer)
                return RangeRecorder(Linear(weight, bias, pack=False))
            return Linear(weight, bias, mode=mode)

        blocks = q4_blocks or {}

        def q4(names: list[str], bias: Tensor | None = None, gain: Tensor | None = None,
               col: Tensor | None = None) -> Q4Linear:
            """The matrices ``names`` stacked along the outputs, as 4-bit blocks: the given ones
            as they are, the others quantised from float32 (norm gain and query scale stay out
            of the blocks: ``gain`` scales the input, ``col`` the output)."""
            parts = [blocks.pop(n) if n in blocks else quantize_q4_1(weights[n].float()) for n in names]
            # Q6_K blocks run as shipped where they are the last columns, after whole groups of 32
            # 4-bit ones (a value or down projection); anywhere else they are quantised to 4 bits
            tail = len(parts)
            while tail > 0 and isinstance(parts[tail - 1], Q6Blocks):
                tail -= 1
            if sum(p.shape[0] for p in parts[:tail]) % 32:
                tail = len(parts)
            parts = [quantize_q4_1(weights[n].float()) if isinstance(p, Q6Blocks) and i < tail else p
                     for i, (n, p) in enumerate(zip(names, parts))]
            k = weights[names[0]].shape[1]
            for n in names:
                weights.pop(n)
            return Q4Linear(Q4Blocks.cat(parts[:tail]) if tail else None, bias, gain=gain, col=col, in_features=k,
                            blocks6=Q6Blocks.cat(parts[tail:]) if tail < len(parts) else None)

        # tensors are popped as they are packed, so a large model's raw weights are freed layer by
        # layer instead of doubling the peak memory (the dict passed in is consumed)
        def w(name: str) -> Tensor:
            return weights.pop(name).to(dtype)

        def b(name: str) -> Tensor | None:
            return weights.pop(name).to(dtype) if name in weights else None

        def gain(name: str) -> Tensor:  # a norm's gain (Gemma stores it as an offset from one)
            return w(name) + 1.0 if cfg.gemma else w(name)

        self.embed = w("model.embed_tokens.weight")  # [V, D]
        #: Gemma's scale of the token embeddings (sqrt(hidden_size), rounded to the model's dtype as
        #: transformers rounds it); None for the other layouts
        self._embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype) if cfg.gemma else None
        self._eps = torch.tensor([cfg.rms_eps], dtype=dtype)
        #: the rotary tables [T, d] (sin signed for _rotate) and the sliding-window layers' own
        #: (Gemma 3; None where they share the model's), for the first T positions: grown on demand
        #: (:meth:`_rope_rows`), since a context of 10^5-10^6 positions would cost 10^8 bytes up front
        self._cos, self._sin, self._local_rope = self._rope(min(cfg.max_length, defaults.ROPE_TABLE_INITIAL))
        self._q_size = cfg.n_heads * cfg.head_dim
        self._kv_size = cfg.n_kv_heads * cfg.head_dim
        #: the layer loop compiled with TorchScript (bitwise the same ops; see models/scripted.py),
        #: used for single positions and per-row (batch-invariant) attention; None = Python loop
        #: (and while the layers are built: a calibration runs them one at a time in Python)
        self.scripted: ScriptedLayers | None = None
        #: int8_head (drafts only: never for a target, whose logits define the output law): the LM
        #: head, by far the largest matrix of a small draft, as a dynamically quantised int8 matmul
        #: vocab_subset (drafts only, like int8_head): the LM head's rows for these target ids alone
        #: (a draft vocabulary of the most frequent tokens, sorted); every other logit is -inf, so
        #: the draft never proposes those tokens — a proposal rule, never the output law
        self._subset = None if vocab_subset is None else vocab_subset.long()
        if self._subset is not None and not 0 <= int(self._subset.min()) <= int(self._subset.max()) < cfg.vocab_size:
            raise ConfigError(f"a draft vocabulary's ids must lie in 0..{cfg.vocab_size - 1}")
        head_rows = cfg.vocab_size if vocab_subset is None else vocab_subset.numel()
        #: the int8 kernel the linear layers run on ("fbgemm" | "onednn" | "mixed"), None when not quantised
        self.int8_kernel = None
        q_scale = cfg.query_scale if cfg.query_scale is not None else 1.0 / math.sqrt(cfg.head_dim)  # exact for head_dim 64
        self.layers: list[_Layer] = []
        build: _LayerByLayer | None = None
        #: an untied LM head from the GGUF's own blocks (a target's, q4: Qwen2.5-Coder's Q6_K head),
        #: run by the 4-bit product as shipped instead of re-quantised to int8
        shipped_head = (quant == "q4" and self._subset is None and not cfg.tie_embeddings and "lm_head.weight" in weights
                        and isinstance(blocks.get("lm_head.weight"), (Q4Blocks, Q6Blocks)))
        # per layer, the norms no linear layer takes in: Qwen3's and Gemma 3's per-head ones (the
        # attention scale goes into the query norm's gain instead of the query rows) and Gemma 3's
        # output norms
        extras: list[dict[str, Any]] = [{} for _ in range(cfg.n_layers)]
        for i, extra in enumerate(extras):
            p = f"model.layers.{i}."
            if cfg.qk_norm:
                extra.update(q_norm=gain(p + "self_attn.q_norm.weight") * q_scale, k_norm=gain(p + "self_attn.k_norm.weight"))
            if cfg.gemma:
                extra.update(post_attn=gain(p + "post_attention_layernorm.weight"),
                             post_mlp=gain(p + "post_feedforward_layernorm.weight"))
            if cfg.local_rope_theta is not None and cfg.windowed and cfg.windowed[i]:
                extra.update(rope=1)
        if cfg.qk_norm:
            q_scale = 1.0
        if quantised is not None:
            if quant not in ("int8", "q4") or int8_kernel not in ("fbgemm", "mixed"):
                raise ConfigError("a saved model needs quant='int8' or 'q4' and its resolved int8 kernel (fbgemm or mixed)")
            self.int8_kernel = int8_kernel
            shapes = _linear_shapes(cfg, head_rows)

            by_layer: dict[str, dict[str, Tensor]] = {}  # LAYER -> FIELD -> tensor
            for key, t in quantised.items():
                layer_name, _, field = key.rpartition(".")
                by_layer.setdefault(layer_name, {})[field] = t

            def stored(name: str) -> W8A8Linear | Q4Linear:
                fields = by_layer[name]
                if quantised_cache.kind(fields) == "q4":
                    return Q4Linear.from_state(fields, *shapes[name])
                return W8A8Linear.from_state(fields, shapes[name][1], wide=int8_kernel == "mixed")

            for i in range(cfg.n_layers):
                self.layers.append(_Layer(**{name: stored(f"layers.{i}.{name}") for name in LAYER_LINEARS}, **extras[i]))
        elif quant is not None:
            shapes = _linear_shapes(cfg, head_rows)
            self.int8_kernel = _layer_kernel(int8_kernel, shapes)
            if shipped_head:
                calibration = None  # the 4-bit layers and a head as shipped take no ranges
            cache_parts = None
            if sources is not None and calibration is not None:  # what the ranges depend on besides the code
                # (a GGUF's blocks that are no layer matrix would stay unused: part of the key as before)
                used = {f"model.layers.{i}.{m}.weight" for i in range(cfg.n_layers) for m in _LAYER_MATRICES}
                cache_parts = _cache_parts(cfg, sources, calibration_cache.tensor_digest(calibration), dtype=dtype, batch_invariant=batch_invariant,
                                           int8_head=int8_head, quant=quant, int8_kernel=self.int8_kernel,
                                           q4_blocks=[n for n in blocks if n not in used], vocab_subset=vocab_subset)
            build = _LayerByLayer.start(self, calibration, cache_parts, shapes)
        for i in range(cfg.n_layers if quantised is None else 0):  # (a saved model's layers: built above)
            p = f"model.layers.{i}."
            # the norms feeding the attention and the MLP ([D]; Llama's post-attention norm is the MLP's
            # input norm, Gemma's normalises the attention's output: see extras)
            attn_g = gain(p + "input_layernorm.weight")
            mlp_g = gain(p + ("pre_feedforward_layernorm.weight" if cfg.gemma else "post_attention_layernorm.weight"))
            biases = [b(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            qkv_b = torch.cat([biases[0] * q_scale, *biases[1:]]) if all(x is not None for x in biases) else None
            if quant == "q4":
                q_col = torch.cat([torch.full((cfg.n_heads * cfg.head_dim,), q_scale), torch.ones(2 * cfg.n_kv_heads * cfg.head_dim)])
                self.layers.append(
                    _Layer(
                        qkv=q4([p + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_b, attn_g, q_col),
                        out=q4([p + "self_attn.o_proj.weight"]),
                        gate_up=q4([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], None, mlp_g),
                        down=q4([p + "mlp.down_proj.weight"]),
                        **extras[i],
                    )
                )
            else:
                # folded in place (the same products, element by element, as folding before the
                # concatenation): one float copy of each matrix instead of three
                qkv_w = torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"])  # [(H + 2 Hkv) d, D]
                qkv_w[: self._q_size].mul_(q_scale)
                gate_up_w = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])  # [2 I, D]
                self.layers.append(
                    _Layer(
                        qkv=linear(qkv_w.mul_(attn_g), qkv_b),
                        out=linear(w(p + "self_attn.o_proj.weight")),
                        gate_up=linear(gate_up_w.mul_(mlp_g)),
                        down=linear(w(p + "mlp.down_proj.weight")),
                        **extras[i],
                    )
                )
            if build is not None:  # its ranges measured (or read), then quantised: one float layer at a time
                build.settle_layer(i)
        final_g = gain("model.norm.weight") if quantised is None else None  # [D]
        #: the final norm's weight where the LM head is the float embedding it was folded into (a
        #: tied float head: what :meth:`reduced_head` rebuilds rows from), else None
        self._tied_gain = final_g if quant is None and self._subset is None and (
            cfg.tie_embeddings or "lm_head.weight" not in weights) else None
        head = self.embed if cfg.tie_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
        if quantised is not None:
            self.lm_head = stored("lm_head")
        elif shipped_head:
            hb = blocks.pop("lm_head.weight")
            self.lm_head = Q4Linear(hb if isinstance(hb, Q4Blocks) else None, gain=final_g, in_features=cfg.hidden_size,
                                    blocks6=hb if isinstance(hb, Q6Blocks) else None)
        else:
            rows = head if self._subset is None else head[self._subset]
            if quant is not None:
                # quantised with the layers (calibrated, smoothed), int8_head or not: an Int8Linear was
                # built here for such drafts and thrown away (5 s for Qwen2.5-Coder-0.5B)
                self.lm_head = RangeRecorder(_HeadRows(rows, final_g))
            else:
                self.lm_head = Int8Linear(rows * final_g) if int8_head else linear(rows * final_g)
        if build is not None:
            build.settle_head()
        for layer, windowed in zip(self.layers, cfg.windowed):
            layer.window = cfg.sliding_window if windowed else None
        if os.environ.get("SPECDEC_SCRIPTED", "1") != "0" and compiled_layers() is not None:
            self.scripted = ScriptedLayers(self.layers)
            if cfg.gemma and self.scripted.fused is None:
                # Gemma 3's layer runs on the fused call alone (the TorchScript loop is Llama's):
                # a float32 Gemma runs this module's Python loop throughout
                self.scripted = None

    def quantised_state(self) -> dict[str, Tensor] | None:
        """A quantised model's layers as tensors, ``LAYER.FIELD`` (``layers.I.NAME``, ``lm_head``; the
        fields of :meth:`W8A8Linear.state` and :meth:`Q4Linear.state`), from which the constructor's
        ``quantised`` rebuilds them bit for bit; None unless every layer is an int8 (W8A8) or 4-bit
        layer with its kernel's packing."""
        if self.quant not in ("int8", "q4") or self.int8_kernel not in ("fbgemm", "mixed"):
            return None
        layers = {f"layers.{i}.{name}": getattr(layer, name) for i, layer in enumerate(self.layers) for name in LAYER_LINEARS}
        out: dict[str, Tensor] = {}
        for name, lin in {**layers, "lm_head": self.lm_head}.items():
            state = lin.state() if isinstance(lin, (W8A8Linear, Q4Linear)) else None
            if state is None:
                return None
            out.update({f"{name}.{field}": t for field, t in state.items()})
        return out

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_folder(
        cls,
        folder: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        int8_head: bool = False,
        quant: str | None = None,
        int8_kernel: str = "auto",
        gguf: str | Path | None = None,
        vocab_subset: Tensor | None = None,
    ) -> "NativeCausalLM":
        """``gguf`` (``quant="q4"``): the GGUF file the folder was converted from, whose 4-bit
        layer matrices are then used as shipped (see :mod:`specdec.models.gguf_blocks`)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = NativeConfig.from_hf(json.loads((folder / "config.json").read_text()))
        files = sorted(folder.glob("*.safetensors"))
        gguf_files = [Path(gguf)] if quant == "q4" and gguf is not None else []
        # a quantised model built before from the same files, options and code: its layers are read
        # from disk instead of made (the float weights are then never read but for the embedding,
        # nor a GGUF's blocks, nor the calibration text tokenised)
        entry = None
        source = calibration_source(folder) if quant is not None and quantised_cache.cache_dir() is not None else None
        if source is not None:
            head_rows = cfg.vocab_size if vocab_subset is None else vocab_subset.numel()
            shapes = _linear_shapes(cfg, head_rows)
            kernel = _layer_kernel(int8_kernel, shapes)
            parts = _cache_parts(cfg, [folder / "config.json", *files, *gguf_files], source, dtype=dtype,
                                 batch_invariant=batch_invariant, int8_head=int8_head, quant=quant,
                                 int8_kernel=kernel, q4_blocks=[], vocab_subset=vocab_subset)
            entry = calibration_cache.digest({**parts, "entry": quantised_cache.FORMAT})
            state = quantised_cache.load(entry, shapes) if kernel in ("fbgemm", "mixed") else None
            if state is not None:
                return cls(cfg, saved_model_weights(cfg, files), dtype=dtype, batch_invariant=batch_invariant, int8_head=int8_head, quant=quant,
                           int8_kernel=kernel, vocab_subset=vocab_subset, quantised=state)
        weights: dict[str, Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        calibration = calibration_ids(folder) if quant is not None else None
        blocks = None
        if gguf_files:
            from specdec.models.gguf_blocks import read_q4_blocks

            blocks = read_q4_blocks(gguf, cfg.n_heads, cfg.n_kv_heads, q6=quant == "q4")
        sources = [folder / "config.json", *files, *gguf_files]
        model = cls(cfg, weights, dtype=dtype, batch_invariant=batch_invariant, int8_head=int8_head, quant=quant,
                    calibration=calibration, int8_kernel=kernel if source is not None else int8_kernel,
                    q4_blocks=blocks, vocab_subset=vocab_subset, sources=sources)
        if entry is not None:
            state = model.quantised_state()
            if state is not None:
                quantised_cache.save(entry, state)
        return model

    # ------------------------------------------------------------------ LanguageModel

    def new_cache(self, max_length: int | None = None, *, initial_length: int | None = None) -> KVCache:
        """A cache for up to ``max_length`` positions; ``initial_length`` allocates fewer and grows on demand."""
        length = cache_length(max_length, self.max_length)
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, length,
                       initial_length=initial_length, dtype=self.kv_dtype or self.dtype)

    def set_kv_dtype(self, dtype: torch.dtype | None) -> None:
        """Hold the keys and values of caches made from now on in ``dtype`` (None: the model's
        own).  ``torch.float16`` needs a float32, batch-invariant model on the compiled attention
        kernel, which widens each cached value back to float32 exactly as it reads it: every pass
        then computes on the rounded values, so a row's bits are still the same alone or in a
        block (the rounding happens once, when the row's keys and values are written)."""
        if dtype in (None, self.dtype):
            self.kv_dtype = None
            return
        if dtype != torch.float16:
            raise ValueError(f"a key/value cache in {dtype} is not supported (float16, or the model's own dtype)")
        if self.dtype != torch.float32 or not self.batch_invariant or not kernels.attention_kernel():
            raise ValueError("a float16 key/value cache needs a float32, int8 or q4 target with exact attention on"
                             " specdec's compiled kernel (not --fast-attention, not SPECDEC_ATTENTION=0)")
        self.kv_dtype = dtype

    def _past_window(self, end: int) -> bool:
        """Whether a pass writing slots up to ``end`` may hold a row past a sliding window (a row at
        position ``window`` or later).  Below it a windowed layer sees every earlier key, as the
        compiled loops compute it; past it only the fused call (steps, chain, exact tree and
        batched passes, layer subsets) and the Python layer loop (everything else) window the
        attention."""
        window = self.cfg.sliding_window
        return window is not None and end > window

    def _embed_rows(self, tokens: Tensor) -> Tensor:  # tokens: [n] -> [n, D]
        """The token embeddings the first layer receives (Gemma's scale applied).  index_select, not
        embed[tokens]: advanced indexing's parallel kernel was measured at 0.3-4.5 ms for 17 rows
        while the other core was busy (it waits for it), 3 us this way."""
        x = self.embed.index_select(0, tokens.reshape(-1))
        return x if self._embed_scale is None else x * self._embed_scale

    def _rope(self, length: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """The rotary tables of the first ``length`` positions (each row's bits do not depend on
        ``length``: a longer table's first rows are a shorter one's)."""
        cfg, dtype = self.cfg, self.dtype

        def signed(theta: float) -> tuple[Tensor, Tensor]:
            cos, sin = _rope_tables(theta, cfg.head_dim, length)
            sin[:, : cfg.head_dim // 2] *= -1  # signed for _rotate
            return cos.to(dtype), sin.to(dtype)

        cos, sin = signed(cfg.rope_theta)
        return cos, sin, signed(cfg.local_rope_theta) if cfg.local_rope_theta is not None else None

    def _rope_rows(self, end: int) -> None:
        """Make the rotary tables cover positions ``< end`` (doubling, up to the context), or a
        ValueError past the model's context."""
        if end <= self._cos.shape[0]:
            return
        if end > self.max_length:
            raise ValueError(f"position {end} is past the model's context of {self.max_length}")
        self._cos, self._sin, self._local_rope = self._rope(min(self.max_length, max(end, 2 * self._cos.shape[0])))

    def _local_rows(self, index: Tensor | slice) -> tuple[Tensor, Tensor] | None:  # -> cos/sin [n, 1, d] each
        """The sliding-window layers' own rotary rows at positions ``index`` (Gemma 3), else None."""
        if self._local_rope is None:
            return None
        cos, sin = self._local_rope
        return cos[index].unsqueeze(1), sin[index].unsqueeze(1)

    def _mlp(self, layer: _Layer, x: Tensor) -> Tensor:  # x: [n, D] residual stream -> [n, D] after the MLP's add
        """The MLP sub-layer and its residual add: SwiGLU (tanh-GELU gate and output norm for Gemma 3)."""
        gate, up = layer.gate_up.scaled(x, self._inv_rms(x)).chunk(2, dim=-1)
        if layer.post_mlp is None:
            return x + layer.down(F.silu(gate) * up)
        h = layer.down(F.gelu(gate, approximate="tanh") * up)
        return x + h * self._inv_rms(h) * layer.post_mlp

    def _attn_out(self, layer: _Layer, attn: Tensor) -> Tensor:  # attn: [n, H d] -> [n, D] what the residual adds
        """The attention sub-layer's output projection (and Gemma 3's norm of it)."""
        h = layer.out(attn)
        return h if layer.post_attn is None else h * self._inv_rms(h) * layer.post_attn

    def _inv_rms(self, x: Tensor) -> Tensor:  # x: [n, D] -> [n, 1] = 1 / sqrt(mean(x^2) + eps)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.rsqrt(torch.addcmul(self._eps, norm, norm, value=1.0 / self.cfg.hidden_size))

    @property
    def proposal_vocab(self) -> int:
        """How many tokens this model can give a finite logit: its draft vocabulary's size, else all."""
        return self.vocab_size if self._subset is None else int(self._subset.numel())

    def _logits(self, h: Tensor, compact: bool = False) -> Tensor:  # [n, D] LM head inputs -> [n, V] float32
        """``compact``: a reduced draft vocabulary's rows as they are ([n, Vd], columns in the order
        of :attr:`vocab_ids`) instead of scattered into the target's vocabulary."""
        out = self.lm_head(h).float()
        return out if self._subset is None or compact else full_vocab(out, self._subset, self.vocab_size)

    @property
    def vocab_ids(self) -> Tensor | None:
        """Target token ids of the LM head's rows (sorted) for a reduced draft vocabulary, else None."""
        return self._subset

    @torch.inference_mode()
    def hidden(
        self, tokens: Tensor, cache: KVCache, *, parents: Tensor | None = None, prefix: int | None = None,
        taps: dict[int, Tensor] | None = None, extra: Tensor | None = None,
    ) -> Tensor:  # tokens: [n] -> [n, D]
        """The LM head's input for the new positions: the final hidden states divided by their
        RMS (the final norm's weight is folded into the head).

        ``taps`` (target-aware drafters: EAGLE, Medusa, MTP): a dict whose keys are layer counts
        k in 0..L; each value is set to the residual stream after the first k layers ([n, D];
        k = 0 is the embedding, Hugging Face's ``hidden_states[k]``).  The compiled layer loop
        records them too (bitwise the Python loop's values).

        ``parents`` [n] (a token tree, see :mod:`specdec.tree`): node j sits at position
        ``start + depth(j)`` and attends to the cache and its own ancestors only.

        ``extra`` [n, D]: added to the token embeddings (a fed draft's projected target features,
        see :mod:`specdec.drafters.fed`).

        A pass that fails (a tree's parents that do not fit, an interrupted pass) leaves the cache
        as it found it.
        """
        start = cache.length
        try:
            return self._hidden(tokens, cache, parents, prefix, taps, extra)
        except BaseException:
            cache.length = min(cache.length, start)  # forget what the failed pass reserved
            raise

    def _hidden(self, tokens: Tensor, cache: KVCache, parents: Tensor | None, prefix: int | None,
                taps: dict[int, Tensor] | None, extra: Tensor | None) -> Tensor:  # tokens: [n] -> [n, D]
        """:meth:`hidden`'s pass (which undoes its reservation where it fails)."""
        cfg = self.cfg
        n = tokens.numel()
        if parents is None and self.batch_invariant and n > defaults.PROMPT_PASS_CHUNK:
            return self._hidden_in_pieces(tokens, cache, taps, extra)
        start = cache.reserve(n)
        end = start + n
        self._rope_rows(end)
        past = self._past_window(end)  # some row past a sliding window
        x = self._embed_rows(tokens)  # [n, D]
        if extra is not None:
            x = x + extra
        tree = None
        if parents is not None and is_chain(parents) and parents.numel() == end - (start if prefix is None else prefix):
            # a chain-shaped tree region (a floored tree that kept no sibling): node j sits in slot
            # region start + j at that position and sees what a chain row sees, so the chain pass
            # (the fused loop) computes it; exact models give both the token-by-token bits
            parents = None
        if parents is not None:
            tree = _TreeLayout.build(parents, start, end, x.dtype, prefix, exact=self.batch_invariant,
                                     windowed=past)
        if tree is not None:
            cos = self._cos[tree.positions].unsqueeze(1)  # [n, 1, d]
            sin = self._sin[tree.positions].unsqueeze(1)
            local = self._local_rows(tree.positions)
        else:
            cos = self._cos[start:end].unsqueeze(1)  # [n, 1, d]
            sin = self._sin[start:end].unsqueeze(1)
            local = self._local_rows(slice(start, end))
        hq, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        mask = None
        if tree is not None:
            mask = tree.mask
        elif n > 1 and not self.batch_invariant:
            # query j (absolute start + j) sees keys 0..start + j
            mask = torch.full((n, end), -math.inf, dtype=x.dtype).triu_(start + 1)  # [n, T]
        if taps is not None and 0 in taps:
            taps[0] = x
        if self.scripted is not None:  # the same ops compiled (bitwise this loop's result)
            if self.batch_invariant:
                out = self.scripted(x, cos, sin, cache, start, cfg, self._eps, tree=tree, taps=taps, local=local,
                                    past_window=past)
            else:
                out = self.scripted(x, cos, sin, cache, start, cfg, self._eps, mask=mask, taps=taps, local=local,
                                    past_window=past)
            if out is not None:  # (None: a Gemma 3 pass, or one past a window, that the fused call does not take)
                return out
        qk_size = self._q_size + self._kv_size
        window_mask = None  # the sliding-window layers' mask (fast mode)
        if mask is not None and past:
            positions = tree.positions if tree is not None else torch.arange(start, end)
            window_mask = _window_mask(mask, positions, cfg.sliding_window,  # type: ignore[arg-type]
                                       tree.slot_positions if tree is not None else None)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv.scaled(x, self._inv_rms(x))  # [n, (H + 2 Hkv) d]
            turn = (cos, sin) if layer.rope == 0 else local
            qk = _rotate(self._normed(layer, qkv[:, :qk_size].view(n, hq + hk, d)), *turn)  # q and k heads in one op
            k_cache, v_cache = cache.k[li], cache.v[li]  # [Hkv, T, d]
            k_cache[:, start:end] = qk[:, hq:].transpose(0, 1)
            v_cache[:, start:end] = qkv[:, qk_size:].view(n, hk, d).transpose(0, 1)
            if tree is not None and self.batch_invariant:
                if layer.window is not None and past:
                    attn = tree.attend_windowed(qk[:, :hq], cache, li, layer.window)  # [n, H d]
                else:
                    attn = tree.attend_invariant(qk[:, :hq], cache, li)  # [n, H d]
            elif tree is None and (n == 1 or self.batch_invariant):
                # each row bitwise what single-token decoding computes for it
                attn = _attend_rows_windowed(qk[:, :hq], k_cache, v_cache, start, layer.window)  # [n, H d]
            else:
                q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, H, n, d], pre-scaled
                attn = F.scaled_dot_product_attention(
                    q,
                    k_cache[:, :end].unsqueeze(0),  # [1, Hkv, T, d]
                    v_cache[:, :end].unsqueeze(0),
                    attn_mask=window_mask if layer.window is not None and window_mask is not None else mask,
                    enable_gqa=hq != hk,
                    scale=1.0,
                )[0].transpose(0, 1).reshape(n, self._q_size)  # [n, H d]
            x = self._mlp(layer, x + self._attn_out(layer, attn))
            if taps is not None and li + 1 in taps:
                taps[li + 1] = x
        return x * self._inv_rms(x)

    def _hidden_in_pieces(self, tokens: Tensor, cache: KVCache, taps: dict[int, Tensor] | None,
                          extra: Tensor | None) -> Tensor:  # tokens: [n] -> [n, D]
        """:meth:`hidden` over a long run of new positions (a prompt) in passes of
        :data:`defaults.PROMPT_PASS_CHUNK` rows, each after the last in the cache.  Exact models
        only: a row's bits do not depend on the other rows of its pass, so the result is bitwise one
        pass's, and each pass's activations stay in cache (see the default's note).  A failure
        leaves the cache as it was (:meth:`hidden` undoes every piece's reservation)."""
        n, step = tokens.numel(), defaults.PROMPT_PASS_CHUNK
        self._rope_rows(cache.length + n)
        parts: list[Tensor] = []  # [<= step, D] each
        found: list[dict[int, Tensor]] = []
        for a in range(0, n, step):
            piece = None if taps is None else dict.fromkeys(taps, torch.empty(0))
            parts.append(self.hidden(tokens[a : a + step], cache, taps=piece,
                                     extra=None if extra is None else extra[a : a + step]))
            if piece is not None:
                found.append(piece)
        if taps is not None:
            for k in taps:
                taps[k] = torch.cat([piece[k] for piece in found])  # [n, D]
        return torch.cat(parts)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, *, last_only: bool = False, compact: bool = False,
                extra: Tensor | None = None) -> Tensor:
        """Logits ``[n, V]`` (or ``[1, V]`` with ``last_only``) for ``tokens`` [n] int64;
        ``compact``: see :meth:`_logits`; ``extra``: see :meth:`hidden`."""
        h = self.hidden(tokens, cache, extra=extra)
        if last_only:
            h = h[-1:]
        return self._logits(h, compact)

    @torch.inference_mode()
    def forward_features(
        self, tokens: Tensor, cache: KVCache, taps: Sequence[int], *, last_only: bool = False,
        parents: Tensor | None = None, prefix: int | None = None,
    ) -> tuple[Tensor, Tensor]:  # tokens: [n] -> (logits [n|1, V], features [n, len(taps) + 1, D])
        """:meth:`forward` (or, with ``parents``, :meth:`forward_tree`) plus the features a
        target-aware drafter reads: per position, the residual stream after each of ``taps``
        layers, then the final hidden state (the LM head's input), stacked as ``specdec train
        data`` stores them.  The logits are bitwise those of the plain pass."""
        found: dict[int, Tensor] = {k: x for k, x in ((k, torch.empty(0)) for k in taps)}
        h = self.hidden(tokens, cache, parents=parents, prefix=prefix, taps=found)  # [n, D]
        feats = torch.stack([found[k] for k in taps] + [h], dim=1)  # [n, R, D]
        return self._logits(h[-1:] if last_only else h), feats

    @torch.inference_mode()
    def forward_batch(self, items: list[tuple[Tensor, KVCache, bool]], compact: list[bool] | None = None,
                      taps: list[Sequence[int] | None] | None = None) -> list[Any]:
        """Logits of several sequences in one pass: ``items`` are ``(tokens [n_i], cache_i, last_only_i)``;
        ``compact[i]``: item i's rows over a reduced draft vocabulary as they are (see :meth:`_logits`);
        ``taps[i]`` (a target-aware drafter's sequence): item i gets ``(logits, features [n_i,
        len(taps[i]) + 1, D])`` as :meth:`forward_features` returns them, bitwise.

        Continuous batching (Orca, Yu et al. 2022): the rows of all sequences are concatenated for
        the linear layers (one pass over the weights), attention runs per sequence against its own
        cache with exactly the shapes :meth:`hidden` uses for that sequence alone.  The packed
        linear layers are row-wise batch-invariant (see ``models/linear.py``), so each sequence's
        logits are bitwise what :meth:`forward` returns for it alone.
        """
        if not items:
            return []
        sizes = [int(t.numel()) for t, _, _ in items]
        starts: list[int] = []
        try:
            for (_, cache, _), n in zip(items, sizes):
                starts.append(cache.length)
                cache.reserve(n)
                self._rope_rows(starts[-1] + n)
            return self._forward_batch(items, sizes, starts, compact, taps)
        except BaseException:
            for (_, cache, _), a in zip(items, starts):
                cache.length = min(cache.length, a)  # undo this pass's reservations
            raise

    def _forward_batch(self, items: list[tuple[Tensor, KVCache, bool]], sizes: list[int], starts: list[int],
                       compact: list[bool] | None = None, taps: list[Sequence[int] | None] | None = None) -> list[Any]:
        cfg = self.cfg
        tokens = torch.cat([t.reshape(-1) for t, _, _ in items])  # [M]
        x = self._embed_rows(tokens)  # [M, D]
        cos = torch.cat([self._cos[a : a + n] for a, n in zip(starts, sizes)]).unsqueeze(1)  # [M, 1, d]
        sin = torch.cat([self._sin[a : a + n] for a, n in zip(starts, sizes)]).unsqueeze(1)
        local = None if self._local_rope is None else self._local_rows(
            torch.cat([torch.arange(a, a + n) for a, n in zip(starts, sizes)]))
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        # the residual streams the feature drafters among the items read, over all M rows
        found: dict[int, Tensor] | None = None
        if taps is not None and any(t is not None for t in taps):
            found = {k: x for t in taps if t is not None for k in t}
        h = None
        if self.scripted is not None:  # the same ops compiled (bitwise the loop below)
            h = self.scripted.batch(x, cos, sin, [c for _, c, _ in items], starts, sizes, cfg, self._eps,
                                    exact=self.batch_invariant, taps=found, local=local,
                                    past_window=any(self._past_window(a + n) for a, n in zip(starts, sizes)))
        if h is None:
            h = self._layers_batch_eager(x, cos, sin, items, sizes, starts, offsets, taps=found, local=local)
        rows = [torch.arange(o + n - 1, o + n) if last else torch.arange(o, o + n)
                for (_, _, last), n, o in zip(items, sizes, offsets)]
        counts = [r.numel() for r in rows]
        if self._subset is None or not compact or not any(compact):
            out: list[Any] = list(self._logits(h[torch.cat(rows)]).split(counts))  # [R, V]
        else:
            parts = self._logits(h[torch.cat(rows)], compact=True).split(counts)  # [R, Vd], then scattered where asked
            out = [p if c else full_vocab(p, self._subset, self.vocab_size) for p, c in zip(parts, compact)]
        if taps is not None and found is not None:
            for i, (t, n, o) in enumerate(zip(taps, sizes, offsets)):
                if t is not None:  # [n_i, len(t) + 1, D], every row (forward_features' last_only cuts the logits only)
                    out[i] = (out[i], torch.stack([found[k][o : o + n] for k in t] + [h[o : o + n]], dim=1))
        return out

    def _layers_batch_eager(self, x: Tensor, cos: Tensor, sin: Tensor, items: list[tuple[Tensor, KVCache, bool]],
                            sizes: list[int], starts: list[int], offsets: list[int],
                            taps: dict[int, Tensor] | None = None, local: tuple[Tensor, Tensor] | None = None
                            ) -> Tensor:  # [M, D] -> [M, D]
        """The batched pass's layer loop in Python (the reference the scripted loop mirrors);
        ``taps`` filled as :meth:`hidden` fills them, over all M rows."""
        cfg = self.cfg
        if taps is not None and 0 in taps:
            taps[0] = x
        total = x.shape[0]
        hq, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qk_size = self._q_size + self._kv_size
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv.scaled(x, self._inv_rms(x))  # [M, (H + 2 Hkv) d]
            turn = (cos, sin) if layer.rope == 0 else local
            qk = _rotate(self._normed(layer, qkv[:, :qk_size].view(total, hq + hk, d)), *turn)  # [M, H + Hkv, d]
            parts = []
            for (_, cache, _), start, n, o in zip(items, starts, sizes, offsets):
                end = start + n
                cache.k[li, :, start:end] = qk[o : o + n, hq:].transpose(0, 1)
                cache.v[li, :, start:end] = qkv[o : o + n, qk_size:].view(n, hk, d).transpose(0, 1)
                parts.append(self._attend_rows(li, qk[o : o + n, :hq], cache, start))
            attn = torch.cat(parts)  # [M, H d]
            x = self._mlp(layer, x + self._attn_out(layer, attn))
            if taps is not None and li + 1 in taps:
                taps[li + 1] = x
        return x * self._inv_rms(x)  # [M, D] the LM head's input

    def _attend_rows(self, li: int, q: Tensor, cache: KVCache, start: int) -> Tensor:  # q: [n, H, d] -> [n, H d]
        """Attention of one sequence's ``n`` new rows, with the shapes :meth:`hidden` uses alone."""
        n = q.shape[0]
        k_cache, v_cache = cache.k[li], cache.v[li]  # [Hkv, T, d]
        window = self.layers[li].window
        if n == 1 or self.batch_invariant:
            return _attend_rows_windowed(q, k_cache, v_cache, start, window)
        end = start + n
        mask = torch.full((n, end), -math.inf, dtype=q.dtype).triu_(start + 1)  # [n, T]
        if window is not None and end > window:
            mask = _window_mask(mask, torch.arange(start, end), window)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[:, :end].unsqueeze(0), v_cache[:, :end].unsqueeze(0),
            attn_mask=mask, enable_gqa=self.cfg.n_heads != self.cfg.n_kv_heads, scale=1.0,
        )  # [1, H, n, d]
        return attn[0].transpose(0, 1).reshape(n, self._q_size)

    @torch.inference_mode()
    def forward_tree(
        self, tokens: Tensor, parents: Tensor, cache: KVCache, *, prefix: int | None = None, compact: bool = False,
        extra: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[n, V]`` of a token tree scored in one pass (tree attention).

        ``tokens`` [n] int64, ``parents`` [n] int64 (``-1``: child of the cached prefix, else an
        earlier index).  Keys land at cache slots ``start + j`` in node order; keep one path
        afterwards with ``cache.compact``.  Batch-invariant models give each node's logits
        bitwise equal to scoring its path token by token.  A tree grown over several calls (a
        drafter expanding its frontier) passes ``prefix``, the first slot of the tree region,
        and ``parents`` for the whole region ``[prefix, cache.length + n)``.  ``compact``: see
        :meth:`_logits`.
        """
        return self._logits(self.hidden(tokens, cache, parents=parents, prefix=prefix, extra=extra), compact)

    @property
    def n_params(self) -> int:
        cfg = self.cfg
        per_layer = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.hidden_size
        per_layer += cfg.n_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
        return cfg.n_layers * per_layer + cfg.vocab_size * cfg.hidden_size + head

    # ------------------------------------------------------------------ partial passes
    # Self-speculative drafters (specdec.drafters.self_spec) run a subset of the layers on their
    # own cache: early exit (the first k layers), skipped attention / MLP sub-layers, or the upper
    # layers from given hidden states (cache sharing).  The sub-layers are the same operations as
    # in ``hidden``, so a row computed here is bitwise what ``hidden`` computes for it.

    def embed_tokens(self, tokens: Tensor) -> Tensor:  # tokens: [n] -> [n, D]
        return self._embed_rows(tokens).view(*tokens.shape, -1)

    def head(self, x: Tensor) -> Tensor:  # x: [n, D] residual stream -> [n, V] float32 logits
        """Final norm + LM head of a residual stream (an early exit uses it after any layer)."""
        return self._logits(self.final_norm(x))

    def reduced_head(self, ids: Tensor) -> "ReducedHead | None":
        """The LM head over the target ids ``ids`` [Vd] alone, for a self-speculative view drafting
        over a reduced vocabulary (on Qwen2.5-Coder-1.5B the 151,936-row head is ~22 % of a decoding
        step): the 4-bit or int8 head's packed columns for those ids (bitwise its logits there), or
        a tied float head's rows; None for other heads, which then draft over every token."""
        ids = ids.long().reshape(-1)
        if self._subset is not None or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            return None
        if isinstance(self.lm_head, (Q4Linear, W8A8Linear)):
            rows = self.lm_head.select_outputs(ids)
        elif self._tied_gain is not None:
            rows = Linear(self.embed[ids] * self._tied_gain, mode="invariant" if self.batch_invariant else "fast")
        else:
            rows = None
        return None if rows is None else ReducedHead(ids, rows, self)

    def final_norm(self, x: Tensor) -> Tensor:  # x: [n, D] residual stream -> [n, D]
        """The LM head's input for a residual stream: what :meth:`hidden` returns after the last layer."""
        return x * self._inv_rms(x)

    @torch.inference_mode()
    def run_layers(
        self,
        x: Tensor,  # [n, D] residual stream entering the first step
        cache: KVCache,
        steps: Sequence[tuple[int, bool, bool]],
        *,
        start: int,
        slots: Sequence[int] | None = None,
        as_drafted: bool = False,
    ) -> Tensor:  # -> [n, D] residual stream after the last step
        """Run ``steps`` = ``(layer, attention on, MLP on)`` for positions ``start .. start + n``.

        The positions must be reserved in ``cache`` already (``cache.reserve``).  ``slots[i]`` is
        the cache layer step ``i`` writes its keys/values to (default: its layer index), so a
        draft can keep a cache holding only the layers it runs.  A skipped attention sub-layer
        writes nothing.

        ``as_drafted``: each row as a self-speculative view drafts it over a cache of someone
        else's keys and values (the target's, at committed positions): the row at position ``p``
        attends to ``cache`` at ``0 .. p-1`` and to its own key and value, and nothing is written
        (``cache`` must hold ``start + n - 1`` positions).  One pass scores every row of a
        teacher-forced sequence as the view would draft it, instead of one row at a time; masked
        attention, so equal to the row-at-a-time result to rounding, not bitwise.
        """
        cfg = self.cfg
        n = x.shape[0]
        end = start + n
        self._rope_rows(end)
        cos = self._cos[start:end].unsqueeze(1)  # [n, 1, d]
        sin = self._sin[start:end].unsqueeze(1)
        local = self._local_rows(slice(start, end))
        if as_drafted:  # row i sees cache columns < start + i, then its own key (column end - 1 + i)
            ctx = end - 1
            mask = torch.full((n, ctx + n), -math.inf, dtype=x.dtype)  # [n, ctx + n]
            mask[:, :ctx].triu_(start)
            mask[:, ctx:].fill_diagonal_(0.0)
        else:
            mask = torch.full((n, end), -math.inf, dtype=x.dtype).triu_(start + 1) if n > 1 else None  # [n, T]
        if self.scripted is not None and steps and not as_drafted:
            # the same ops compiled (bitwise this loop)
            plan = [[li, int(a), int(m), li if slots is None else slots[i]] for i, (li, a, m) in enumerate(steps)]
            fast = mask if not self.batch_invariant else None
            out = self.scripted(x, cos, sin, cache, start, cfg, self._eps, mask=fast, plan=plan, local=local,
                                past_window=self._past_window(end))
            if out is not None:  # (None: a Gemma 3 pass, or one past a window, that the fused call does not take)
                return out
        for i, (li, attn_on, mlp_on) in enumerate(steps):
            layer = self.layers[li]
            if attn_on:
                slot = li if slots is None else slots[i]
                attend = self._attention_as_drafted if as_drafted else self._attention
                turn = (cos, sin) if layer.rope == 0 else local
                x = x + attend(layer, x, cache, slot, start=start, cos=turn[0], sin=turn[1], mask=mask)  # type: ignore[index]
            if mlp_on:
                x = self._mlp(layer, x)
        return x

    def _project(self, layer: _Layer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """An attention sub-layer's rotated queries [n, H, d], rotated keys [n, Hkv, d] and values
        [n, Hkv, d] for the residual stream ``x`` [n, D] (the same operations as in :meth:`hidden`)."""
        cfg = self.cfg
        n = x.shape[0]
        hq, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qk_size = self._q_size + self._kv_size
        qkv = layer.qkv.scaled(x, self._inv_rms(x))  # [n, (H + 2 Hkv) d]
        qk = _rotate(self._normed(layer, qkv[:, :qk_size].view(n, hq + hk, d)), cos, sin)
        return qk[:, :hq], qk[:, hq:], qkv[:, qk_size:].view(n, hk, d)

    def _normed(self, layer: _Layer, qk: Tensor) -> Tensor:  # qk: [n, H + Hkv, d] -> [n, H + Hkv, d]
        """The query and key heads after Qwen3's per-head norms (as they are for the other layouts)."""
        if layer.q_norm is None or layer.k_norm is None:
            return qk
        hq = self.cfg.n_heads
        return torch.cat([_head_norm(qk[:, :hq], layer.q_norm, self._eps), _head_norm(qk[:, hq:], layer.k_norm, self._eps)], dim=1)

    def _attention(
        self, layer: _Layer, x: Tensor, cache: KVCache, slot: int, *, start: int, cos: Tensor, sin: Tensor,
        mask: Tensor | None,
    ) -> Tensor:  # x: [n, D] -> [n, D] attention output (before the residual add)
        """One attention sub-layer, the same operations as in :meth:`hidden`."""
        n = x.shape[0]
        end = start + n
        q, k, v = self._project(layer, x, cos, sin)
        k_cache, v_cache = cache.k[slot], cache.v[slot]  # [Hkv, T, d]
        k_cache[:, start:end] = k.transpose(0, 1)
        v_cache[:, start:end] = v.transpose(0, 1)
        if n == 1 or self.batch_invariant:  # exactly the rows hidden() computes
            attn = _attend_rows_windowed(q, k_cache, v_cache, start, layer.window)  # [n, H d]
        else:
            if layer.window is not None and mask is not None and end > layer.window:
                mask = _window_mask(mask, torch.arange(start, end), layer.window)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k_cache[:, :end].unsqueeze(0), v_cache[:, :end].unsqueeze(0),
                attn_mask=mask, enable_gqa=self.cfg.n_heads != self.cfg.n_kv_heads, scale=1.0,
            )[0].transpose(0, 1).reshape(n, self._q_size)  # [n, H d]
        return self._attn_out(layer, attn)

    def _attention_as_drafted(
        self, layer: _Layer, x: Tensor, cache: KVCache, slot: int, *, start: int, cos: Tensor, sin: Tensor,
        mask: Tensor | None,
    ) -> Tensor:  # x: [n, D] -> [n, D] attention output (before the residual add)
        """:meth:`_attention` with ``run_layers(as_drafted=True)``'s keys: the cache's before each
        row's position, then the row's own (never written); ``mask`` [n, ctx + n] says which."""
        n = x.shape[0]
        ctx = start + n - 1
        q, k, v = self._project(layer, x, cos, sin)
        keys = torch.cat([cache.k[slot, :, :ctx], k.transpose(0, 1)], dim=1)  # [Hkv, ctx + n, d]
        values = torch.cat([cache.v[slot, :, :ctx], v.transpose(0, 1)], dim=1)
        if layer.window is not None and mask is not None and start + n > layer.window:
            # column c < ctx holds position c, column ctx + i row i's own key (position start + i)
            key_positions = torch.cat([torch.arange(ctx), torch.arange(start, start + n)])
            mask = _window_mask(mask, torch.arange(start, start + n), layer.window, key_positions)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, enable_gqa=self.cfg.n_heads != self.cfg.n_kv_heads, scale=1.0,
        )[0].transpose(0, 1).reshape(n, self._q_size)  # [n, H d]
        return self._attn_out(layer, attn)
