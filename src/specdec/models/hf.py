"""Hugging Face backend: any ``AutoModelForCausalLM`` behind the :class:`LanguageModel` seam.

Slower than the native path (framework overhead per call) but covers every architecture
transformers knows.  Truncation uses ``DynamicCache.crop``, which is O(1) in memory moves.
Token trees are scored with custom 4-D attention masks (each node sees the cached prefix and its
own path, at position prefix + depth; on sliding-window layers only the keys less than a window
behind the node's position), on models whose layers are full or sliding-window attention.

Target-aware drafters (EAGLE, Medusa, MTP heads) read the model's hidden states through
:meth:`HFCausalLM.forward_features` (transformers' ``output_hidden_states``, plus a hook on the
final norm for the residual after the last layer and the final state without the norm's weight)
and its token embeddings through ``embed``.

Sliding-window layers keep their whole history here (transformers' windowed cache layer drops what
falls out of the window and so cannot be rolled back past it once full; the window then lives in
the mask alone, as transformers builds it over absolute positions).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specdec.tree import ancestor_mask, check_order, depths


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

    def drop_past_length(self) -> None:
        """Cut every layer back to ``length`` positions: what a pass that failed part way (an error,
        an interrupt) appended to the layers it reached, which every later pass would attend to.
        (transformers' ``crop`` refuses to cut more than a layer holds, so each layer is sliced.)"""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > self.length:
                layer.keys = layer.keys[..., : self.length, :]
                layer.values = layer.values[..., : self.length, :]

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
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        kinds = getattr(text, "layer_types", None)
        #: the layer kinds the model reads a mask per kind for (None: one mask for every layer)
        self._kinds = sorted(set(kinds)) if kinds is not None else None
        #: the sliding window of windowed layers (None: none has one)
        self._window = sliding_window(cfg)
        #: decoder layers (a drafter's feature taps count them; None where the config does not say)
        layers = getattr(text, "num_hidden_layers", None)
        self.n_layers = int(layers) if layers is not None else None
        if tree_attention(cfg):  # token trees; absent: drafters and sessions keep to chains
            self.forward_tree = self._forward_tree

    @classmethod
    def from_folder(cls, folder: str, *, dtype: torch.dtype = torch.float32, local_files_only: bool = False) -> "HFCausalLM":
        """``folder``: a local folder or a hub id (``local_files_only``: the hub's local cache only)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=local_files_only))

    def new_cache(self, max_length: int | None = None) -> HFCache:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        # a windowed layer keeps its whole history, so rejected drafts can be cut whatever the length
        cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
        return HFCache(cache=cache)

    @property
    def embed(self) -> Tensor:  # [V, D]
        """The token embeddings as the first layer receives them (Gemma's scale applied), which
        target-aware drafters read."""
        module = self.model.get_input_embeddings()
        scale = getattr(module, "embed_scale", None)
        weight = module.weight.detach()
        return weight if scale is None else weight * scale.to(weight.dtype)

    def _run(self, tokens: Tensor, cache: HFCache, **extra: Any) -> Any:
        """One transformers pass of ``tokens`` after the cache (its slots advance by n); ``extra``:
        the model's own arguments (a mask, positions, logits_to_keep, output_hidden_states)."""
        end = cache.length + tokens.numel()
        try:
            out = self.model(
                input_ids=tokens.to(self.device).unsqueeze(0),
                **{self._cache_arg: cache.cache},
                use_cache=True,
                cache_position=torch.arange(cache.length, end, device=self.device),
                **extra,
            )
        except BaseException:
            cache.drop_past_length()  # layers the failed pass reached hold its keys: cut them off
            raise
        cache.length = end
        return out

    def _call(self, tokens: Tensor, cache: HFCache, **extra: Any) -> Tensor:  # tokens: [n] -> [n | 1, V]
        return self._run(tokens, cache, **extra).logits[0].float().cpu()

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: HFCache, *, last_only: bool = False) -> Tensor:
        return self._call(tokens, cache, logits_to_keep=1 if last_only else 0)

    @torch.inference_mode()
    def forward_features(
        self, tokens: Tensor, cache: HFCache, taps: Sequence[int], *, last_only: bool = False,
        parents: Tensor | None = None, prefix: int | None = None,
    ) -> tuple[Tensor, Tensor]:  # tokens: [n] -> (logits [n|1, V], features [n, len(taps) + 1, D])
        """:meth:`forward` (or, with ``parents``, the tree pass) plus what a target-aware drafter
        reads, as the native backend's ``forward_features`` stacks them: per position the residual
        stream after each of ``taps`` layers (0: the embeddings as the first layer receives them),
        then the final hidden state divided by its RMS (the final norm without its weight, which the
        native backend folds into the LM head; heads are trained on that)."""
        if self.n_layers is None:
            raise ValueError("this model's config does not say how many layers it has, so no layer can be tapped")
        if any(not 0 <= k <= self.n_layers for k in taps):
            raise ValueError(f"feature taps {list(taps)} are outside the model's {self.n_layers} layers")
        if parents is not None and getattr(self, "forward_tree", None) is None:
            raise ValueError("this model has no tree pass (a layer kind other than full or sliding-window attention)")
        norm = getattr(self.model.get_decoder(), "norm", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if norm is None or eps is None:
            raise ValueError("cannot read this model's final hidden state (no final RMS norm named `norm`)")
        extra = self._tree_args(tokens.numel(), parents, cache, prefix) if parents is not None else {}
        last: list[Tensor] = []  # the residual after the last layer: the final norm's input
        hook = norm.register_forward_pre_hook(lambda _module, args: last.append(args[0]))
        try:
            out = self._run(tokens, cache, output_hidden_states=True, **extra)
        finally:
            hook.remove()
        states = out.hidden_states  # L + 1 of [1, n, D]: the embeddings, after each layer (the last one normed)
        x = last[0][0].float()  # [n, D]
        final = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(eps))
        rows = [x if k == self.n_layers else states[k][0].float() for k in taps] + [final]
        feats = torch.stack(rows, dim=1).cpu()  # [n, R, D]
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        return logits.float().cpu(), feats

    @torch.inference_mode()
    def _forward_tree(self, tokens: Tensor, parents: Tensor, cache: HFCache, *, prefix: int | None = None) -> Tensor:
        """Logits ``[n, V]`` of a token tree in one pass: ``tokens`` [n], ``parents`` over the tree
        region ``[prefix, cache.length + n)`` (default ``prefix``: the cache's length; -1: a child
        of the cached prefix), as :meth:`specdec.models.native.NativeCausalLM.forward_tree`.  Keys
        land in node order; keep one path afterwards with ``cache.compact``.  Each node's row is its
        path scored token by token, up to float rounding (transformers' passes are not
        batch-invariant)."""
        return self._call(tokens, cache, **self._tree_args(tokens.numel(), parents, cache, prefix))

    def _tree_args(self, n: int, parents: Tensor, cache: HFCache, prefix: int | None) -> dict[str, Any]:
        """The attention mask(s) and positions of a tree pass of ``n`` new nodes (see :meth:`_forward_tree`)."""
        end = cache.length + n
        start = cache.length if prefix is None else prefix
        m = end - start
        if parents.numel() != m or not 0 <= start <= cache.length:
            raise ValueError(f"expected {m} tree parents for the region [{start}, {end}); got {parents.numel()}")
        check_order(parents)
        sees = torch.ones((n, end), dtype=torch.bool)  # [n, T]: the prefix, and each new node's region path
        sees[:, start:] = ancestor_mask(parents)[m - n :]
        at = torch.cat([torch.arange(start), start + depths(parents)])  # [T]: each key's position (prefix + depth)
        positions = at[end - n :]  # [n]
        dtype = next(self.model.parameters()).dtype
        lowest = torch.finfo(dtype).min

        def additive(seen: Tensor) -> Tensor:  # [n, T] bool -> [1, 1, n, T]: 0 attends
            return torch.where(seen, 0.0, lowest).to(dtype)[None, None].to(self.device)

        full = additive(sees)
        mask: Any = full  # one mask for every layer, or one per layer kind
        if self._window is not None:  # a windowed layer sees only keys less than a window behind (transformers' rule)
            windowed = additive(sees & (positions[:, None] - at[None, :] < self._window))
            mask = {kind: windowed if kind == "sliding_attention" else full for kind in self._kinds} if self._kinds else windowed
        return {"attention_mask": mask, "position_ids": positions.unsqueeze(0).to(self.device)}


def sliding_window(config: Any) -> int | None:
    """The window of ``config``'s sliding-window layers (None: every layer sees the whole context)."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    kinds = getattr(cfg, "layer_types", None)
    windowed = "sliding_attention" in kinds if kinds is not None else getattr(cfg, "use_sliding_window", True) is not False
    window = getattr(cfg, "sliding_window", None)
    return int(window) if windowed and window is not None else None


def tree_attention(config: Any) -> bool:
    """Whether a tree mask can be made for every layer of ``config``'s model: each is full or
    sliding-window attention (not chunked, linear or recurrent)."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    kinds = getattr(cfg, "layer_types", None)
    return kinds is None or all(kind in ("full_attention", "sliding_attention") for kind in kinds)
