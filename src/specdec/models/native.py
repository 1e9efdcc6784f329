"""Native Llama / Qwen2 decoder: plain tensors, a static KV cache, no framework overhead.

This is the fast path for the model families the registry ships (SmolLM2 is Llama, the
Qwen2.5-Coder pair is Qwen2).  It reads a Hugging Face folder (``config.json`` +
``*.safetensors``) and reproduces ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (checked against
them in ``tests/models/test_native.py``).  Structure follows gpt-fast's model.py in spirit: one
function per block, fused QKV and gate/up projections, and the cache as a preallocated buffer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.errors import ConfigError
from specdec.kv_cache import KVCache
from specdec.models.linear import Int8Linear, Linear
from specdec.tree import ancestor_mask, depths, paths

SUPPORTED = ("llama", "qwen2", "mistral")


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

    @classmethod
    def from_hf(cls, cfg: dict) -> "NativeConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED:
            raise ConfigError(f"native backend supports {SUPPORTED}, not {model_type!r}; use --backend hf")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in ("default", None):
            raise ConfigError(f"rope scaling {rope_type!r} is not supported by the native backend")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)) if rope else cfg.get("rope_theta", 10000.0)
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_length=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        )


@dataclass
class _Layer:
    attn_norm: Tensor  # [D]
    qkv: Linear  # D -> (H + 2 Hkv) d
    out: Linear  # H d -> D
    mlp_norm: Tensor  # [D]
    gate_up: Linear  # D -> 2 I
    down: Linear  # I -> D


def _rope_tables(cfg: NativeConfig, length: int) -> tuple[Tensor, Tensor]:
    """cos/sin ``[length, head_dim]`` in Hugging Face's rotate-half layout."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x: [n, h, d]; cos/sin: [n, 1, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class _TreeLayout:
    """Where a token tree's nodes sit and what each one sees (tree attention, SpecInfer §4.2)."""

    start: int  # first cache slot of the tree region
    positions: Tensor  # [n] int64 absolute positions: start + depth
    paths: tuple[Tensor, ...]  # per node: its root-to-node indices (ancestors, then itself)
    mask: Tensor  # [n, end] additive: 0 for the cached prefix and the node's ancestors-or-self

    @classmethod
    def build(cls, parents: Tensor, start: int, end: int, dtype: torch.dtype, prefix: int | None = None) -> "_TreeLayout":
        """``parents`` covers the tree region ``[prefix, end)`` (default: just the new nodes);
        the last ``end - start`` entries are the nodes being scored now."""
        s = start if prefix is None else prefix
        n, m = end - start, end - s
        if parents.numel() != m:
            raise ValueError(f"expected {m} tree parents for the region [{s}, {end}); got {parents.numel()}")
        anc = ancestor_mask(parents)[m - n :]  # [n, m]
        mask = torch.zeros((n, end), dtype=dtype)
        mask[:, s:] = torch.zeros((n, m), dtype=dtype).masked_fill_(~anc, -math.inf)
        node_paths = tuple(torch.tensor(p) for p in paths(parents)[m - n :])
        return cls(s, s + depths(parents)[m - n :], node_paths, mask)

    def attend_invariant(self, q: Tensor, cache: KVCache, li: int, gqa: bool) -> Tensor:  # q: [1, H, n, d] -> [1, H, n, d]
        """One query row per node against ``cache[:start] + its path``, laid out contiguously in
        the cache exactly as token-by-token decoding of that path would have it (same shapes,
        same strides), so each row is bitwise the sequential result.  The nodes' own keys are
        restored in node order afterwards; copying is O(depth) per node.
        """
        s, m = self.start, self.mask.shape[1] - self.start
        k_new = cache.k[li, :, s : s + m].clone()  # [Hkv, m, d] the whole tree region
        v_new = cache.v[li, :, s : s + m].clone()
        rows = []
        for j, p in enumerate(self.paths):
            depth = p.numel()
            cache.k[li, :, s : s + depth] = k_new[:, p]
            cache.v[li, :, s : s + depth] = v_new[:, p]
            rows.append(
                F.scaled_dot_product_attention(
                    q[:, :, j : j + 1],
                    cache.k[li, :, : s + depth].unsqueeze(0),
                    cache.v[li, :, : s + depth].unsqueeze(0),
                    enable_gqa=gqa,
                )
            )
        cache.k[li, :, s : s + m] = k_new
        cache.v[li, :, s : s + m] = v_new
        return torch.cat(rows, dim=2)


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
    ) -> None:
        self.cfg = cfg
        #: score multi-token inputs one query row at a time with exactly the shapes single-token
        #: decoding uses, so that row i is bitwise what plain decoding computes (the linear layers
        #: are batch-invariant already); costs 5-10% on a 5-9-token verification pass
        self.batch_invariant = batch_invariant
        self.vocab_size = cfg.vocab_size
        self.max_length = cfg.max_length
        self.dtype = dtype

        mode = "invariant" if batch_invariant else "fast"

        # tensors are popped as they are packed, so a large model's raw weights are freed layer by
        # layer instead of doubling the peak memory (the dict passed in is consumed)
        def w(name: str) -> Tensor:
            return weights.pop(name).to(dtype)

        def b(name: str) -> Tensor | None:
            return weights.pop(name).to(dtype) if name in weights else None

        self.embed = w("model.embed_tokens.weight")  # [V, D]
        self.layers: list[_Layer] = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            biases = [b(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            qkv_b = torch.cat(biases) if all(x is not None for x in biases) else None
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=Linear(qkv_w, qkv_b, mode=mode),
                    out=Linear(w(p + "self_attn.o_proj.weight"), mode=mode),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]), mode=mode),
                    down=Linear(w(p + "mlp.down_proj.weight"), mode=mode),
                )
            )
        self.norm = w("model.norm.weight")
        head = self.embed if cfg.tie_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
        #: int8_head (drafts only: never for a target, whose logits define the output law): the LM
        #: head, by far the largest matrix of a small draft, as a dynamically quantised int8 matmul
        self.lm_head = Int8Linear(head) if int8_head else Linear(head, mode=mode)
        cos, sin = _rope_tables(cfg, cfg.max_length)
        self._cos, self._sin = cos.to(dtype), sin.to(dtype)
        self._q_size = cfg.n_heads * cfg.head_dim
        self._kv_size = cfg.n_kv_heads * cfg.head_dim

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_folder(
        cls,
        folder: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        int8_head: bool = False,
    ) -> "NativeCausalLM":
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = NativeConfig.from_hf(json.loads((folder / "config.json").read_text()))
        weights: dict[str, Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        return cls(cfg, weights, dtype=dtype, batch_invariant=batch_invariant, int8_head=int8_head)

    # ------------------------------------------------------------------ LanguageModel

    def new_cache(self, max_length: int | None = None) -> KVCache:
        length = min(max_length or self.max_length, self.max_length)
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, length, dtype=self.dtype)

    @torch.inference_mode()
    def hidden(
        self, tokens: Tensor, cache: KVCache, *, parents: Tensor | None = None, prefix: int | None = None
    ) -> Tensor:  # tokens: [n] -> [n, D]
        """Final-norm hidden states of the new positions (the input of the LM head).

        ``parents`` [n] (a token tree, see :mod:`specdec.tree`): node j sits at position
        ``start + depth(j)`` and attends to the cache and its own ancestors only.
        """
        cfg = self.cfg
        n = tokens.numel()
        start = cache.reserve(n)
        end = start + n
        if end > self._cos.shape[0]:
            raise ValueError(f"position {end} is past the model's context of {self._cos.shape[0]}")
        x = self.embed[tokens]  # [n, D]
        hq, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        tree = _TreeLayout.build(parents, start, end, x.dtype, prefix) if parents is not None else None
        if tree is not None:
            cos = self._cos[tree.positions].unsqueeze(1)  # [n, 1, d]
            sin = self._sin[tree.positions].unsqueeze(1)
        else:
            cos = self._cos[start:end].unsqueeze(1)  # [n, 1, d]
            sin = self._sin[start:end].unsqueeze(1)
        mask = None
        if tree is not None:
            mask = tree.mask
        elif n > 1:
            # query j (absolute start + j) sees keys 0..start + j
            mask = torch.full((n, end), -math.inf, dtype=x.dtype).triu_(start + 1)  # [n, T]
        qk_size = self._q_size + self._kv_size
        for li, layer in enumerate(self.layers):
            h = F.rms_norm(x, (cfg.hidden_size,), layer.attn_norm, cfg.rms_eps)
            qkv = layer.qkv(h)  # [n, (H + 2 Hkv) d]
            qk = _rotate(qkv[:, :qk_size].view(n, hq + hk, d), cos, sin)  # q and k heads in one op
            cache.k[li, :, start:end] = qk[:, hq:].transpose(0, 1)
            cache.v[li, :, start:end] = qkv[:, qk_size:].view(n, hk, d).transpose(0, 1)
            q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            if tree is not None and self.batch_invariant:
                attn = tree.attend_invariant(q, cache, li, hq != hk)
            elif n > 1 and self.batch_invariant:
                attn = torch.cat(
                    [
                        F.scaled_dot_product_attention(
                            q[:, :, j : j + 1],
                            cache.k[li, :, : start + j + 1].unsqueeze(0),
                            cache.v[li, :, : start + j + 1].unsqueeze(0),
                            enable_gqa=hq != hk,
                        )
                        for j in range(n)
                    ],
                    dim=2,
                )
            else:
                attn = F.scaled_dot_product_attention(
                    q,
                    cache.k[li, :, :end].unsqueeze(0),  # [1, Hkv, T, d]
                    cache.v[li, :, :end].unsqueeze(0),
                    attn_mask=mask,
                    enable_gqa=hq != hk,
                )  # [1, H, n, d]
            x = x + layer.out(attn[0].transpose(0, 1).reshape(n, self._q_size))
            h = F.rms_norm(x, (cfg.hidden_size,), layer.mlp_norm, cfg.rms_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return F.rms_norm(x, (cfg.hidden_size,), self.norm, cfg.rms_eps)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, *, last_only: bool = False) -> Tensor:
        """Logits ``[n, V]`` (or ``[1, V]`` with ``last_only``) for ``tokens`` [n] int64."""
        h = self.hidden(tokens, cache)
        if last_only:
            h = h[-1:]
        return self.lm_head(h).float()

    @torch.inference_mode()
    def forward_tree(self, tokens: Tensor, parents: Tensor, cache: KVCache, *, prefix: int | None = None) -> Tensor:
        """Logits ``[n, V]`` of a token tree scored in one pass (tree attention).

        ``tokens`` [n] int64, ``parents`` [n] int64 (``-1``: child of the cached prefix, else an
        earlier index).  Keys land at cache slots ``start + j`` in node order; keep one path
        afterwards with ``cache.compact``.  Batch-invariant models give each node's logits
        bitwise equal to scoring its path token by token.  A tree grown over several calls (a
        drafter expanding its frontier) passes ``prefix``, the first slot of the tree region,
        and ``parents`` for the whole region ``[prefix, cache.length + n)``.
        """
        return self.lm_head(self.hidden(tokens, cache, parents=parents, prefix=prefix)).float()

    @property
    def n_params(self) -> int:
        cfg = self.cfg
        per_layer = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.hidden_size
        per_layer += cfg.n_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
        return cfg.n_layers * per_layer + cfg.vocab_size * cfg.hidden_size + head
