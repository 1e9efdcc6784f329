"""Target-aware drafters: EAGLE-1/3, Medusa-1 and MTP heads drafting from the target's features.

Each reads the target's features at the committed positions (see
:class:`~specdec.drafters.base.FeatureDrafter`: the verifier computes them in its own passes)
and the target's token embeddings, and predicts over its draft vocabulary; the logits are
scattered to the target's vocabulary with ``-inf`` outside it, and the :class:`DraftSampler`
turns them into tokens and the q they were drawn from, so every rule and sampling option
applies unchanged.  Position ``t``'s feature ``f_t`` predicts token ``t+1``; with ``L``
committed tokens the features of positions ``0 .. L-2`` are known (the last committed token is
fed by the next verification pass).

* EAGLE (Li et al. 2024, 2025): one decoder layer with its own KV cache over the committed rows
  (row t: ``(f_t, e_{t+1})``, real features); drafting appends rows that feed the layer's own
  output back (EAGLE-1: in place of the feature; EAGLE-3: in place of the fused feature), which
  is what training-time test trains.  Chains, and EAGLE-2 dynamic trees (tree attention over the
  rows of the tree's nodes).  On commit the draft rows are dropped; the next round feeds the
  accepted positions with the target's real features.
* Medusa-1 (Cai et al. 2024): head k on the last committed feature proposes the token k+1
  places past the last committed one; one pass gives every position's distribution (which does
  not depend on the earlier draft tokens).  Chains, and static sparse trees (depth d's candidates
  from head d).
* MTP (DeepSeek-V3): module k, with its own one-layer KV cache, combines module k-1's output at
  row t with the embedding of token t+k+1; draft token k comes from module k at the last
  committed row, after the rows of module k that involve draft tokens (k of them) are run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from specdec import catalog
from specdec.catalog import HEADS, is_head_folder  # noqa: F401 - re-exported
from specdec.drafters.base import Draft, DraftChain, DraftSampler
from specdec.drafters.tree_builder import TreeSpec, build_tree
from specdec.errors import ConfigError
from specdec.heads.modules import KINDS, MTP, Eagle, HeadConfig, Medusa, check_vocab_map
from specdec.heads.runtime import LayerCache, input_rows, run_layer, stored_layout
from specdec.models.base import full_vocab, layer_count
from specdec.verify import Verdict

_EMPTY = Draft(tokens=torch.empty(0, dtype=torch.long), probs=None)


class HeadDrafter:
    """What every head drafter shares: the feature stream, the embeddings, the vocabulary map."""

    supports_trees = False
    #: the head samples at this factor x the request's temperature (see ``draft_config``)
    temperature_factor: float = 1.0

    def __init__(self, head: Any, embed: Tensor, *, name: str = "") -> None:
        cfg: HeadConfig = head.cfg
        if embed.shape[1] != cfg.hidden_size:
            raise ConfigError(f"the head is for a target of width {cfg.hidden_size}, this target's is {embed.shape[1]}")
        if embed.shape[0] != cfg.target_vocab:
            raise ConfigError(f"the head is for a vocabulary of {cfg.target_vocab} tokens, this target has {embed.shape[0]}")
        self.head = head.eval()
        self.cfg = cfg
        self.embed = embed  # [V, D] the target's token embeddings (not a copy)
        self.vocab = int(embed.shape[0])
        self.d2t = head.d2t.long()  # [Vd] draft index -> target id
        self.name = name or cfg.kind
        #: taps the target computes for this drafter (see FeatureDrafter); rows (taps..., final)
        self.feature_taps, self._source = input_rows(cfg)
        self._feats: list[Tensor] = []  # [k, R, D] chunks of committed features not yet consumed
        self._n_feats = 0  # committed positions whose features have arrived

    # ------------------------------------------------------------------ the feature stream

    def prepare(self, prompt: Tensor) -> None:
        self.reset()

    def reset(self) -> None:
        self._feats = []
        self._n_feats = 0

    def add_features(self, features: Tensor | None) -> None:  # [k, R, D]
        if features is None or features.shape[0] == 0:
            return
        self._feats.append(features)
        self._n_feats += int(features.shape[0])

    def _take(self) -> Tensor | None:  # -> [k, R, D] the features not consumed yet
        if not self._feats:
            return None
        out = self._feats[0] if len(self._feats) == 1 else torch.cat(self._feats)
        self._feats = []
        return out

    def _emb(self, tokens: Tensor | list[int]) -> Tensor:  # -> [n, D] float32
        return self.embed[torch.as_tensor(tokens, dtype=torch.long)].float()

    def _rows(self, logits: Tensor) -> Tensor:  # [m, Vd] -> [m, V]
        return full_vocab(logits, self.d2t, self.vocab)

    def _draw(self, sampler: DraftSampler, row: Tensor, position: int) -> tuple[int, Tensor | None] | None:
        """The sampler's token and q for ``row`` [1, V], or None when nothing may be drawn: a
        constraint (structured output) that allows no token of the draft vocabulary here (the
        sampler's ``undefined``) — drafting stops."""
        token, q = sampler(row, position)
        if getattr(sampler, "undefined", False):
            return None
        return token, q

    def spawn(self, wrap: Callable[[Any], Any] = lambda m: m) -> "HeadDrafter":
        """A fresh drafter of the same kind (per-request state) sharing the head and embeddings."""
        return type(self)(self.head, self.embed, name=self.name)

    def extra_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.head.parameters())


class EagleDrafter(HeadDrafter):
    """EAGLE-1 / EAGLE-3 chains and EAGLE-2 dynamic trees (see the module docstring)."""

    supports_trees = True

    def __init__(self, head: Eagle, embed: Tensor, *, name: str = "") -> None:
        super().__init__(head, embed, name=name)
        self.cache = LayerCache(self.cfg)
        self._o: Tensor | None = None  # [D] the layer's output at the last committed row
        self._committed = 0  # cache rows that hold committed positions

    def reset(self) -> None:
        super().reset()
        self.cache = LayerCache(self.cfg)
        self._o = None
        self._committed = 0

    def _step(self, g: Tensor, emb: Tensor, positions: Tensor, mask: Tensor | None = None) -> Tensor:  # -> o [n, D]
        head = self.head
        attn_in, resid = head.layer_input(g[None], emb[None])  # [1, n, in], [1, n, D]
        return run_layer(head.layer, self.cfg, attn_in[0], resid[0], positions, self.cache, mask=mask)

    @torch.inference_mode()
    def _catch_up(self, context: Tensor) -> bool:
        """Feed the committed rows the cache lacks (real features); False when none exists yet."""
        self.cache.truncate(self._committed)  # drop last round's draft rows
        feats = self._take()
        if feats is not None:
            start = self._committed
            n = feats.shape[0]
            g = self.head.fuse(stored_layout(self.cfg, feats, self._source))[0]  # [n, D]
            emb = self._emb(context[start + 1 : start + 1 + n])  # e_{t+1}
            o = self._step(g, emb, torch.arange(start, start + n))
            self._o = o[-1]
            self._committed += n
        return self._o is not None

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:  # context: [L]
        if gamma <= 0 or not self._catch_up(context):
            return _EMPTY
        length = context.numel()
        o = self._o
        assert o is not None
        chain = DraftChain()
        with torch.inference_mode():
            for j in range(gamma):
                if not chain.add(self._draw(sampler, self._rows(self.head.logits(o[None])), length + j), sampler) \
                        or j + 1 == gamma:
                    break
                o = self._step(o[None], self._emb(chain.tokens[-1:]), torch.tensor([self._committed + j]))[0]
        return chain.draft()

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        """EAGLE-2: the tree builder expands the most probable nodes; each level's nodes go
        through the layer in one pass, each attending to the committed rows and its ancestors."""
        if budget <= 0 or not self._catch_up(context):
            return _EMPTY
        base = self._committed
        outs: dict[int, Tensor] = {}  # node index -> the layer's output after it
        slots: dict[int, int] = {}  # node index -> region slot
        region: list[int] = []  # region slot -> parent's slot (-1: the committed context)
        anc: list[list[int]] = []  # region slot -> its ancestors-or-self slots

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            with torch.inference_mode():
                g, depth = [], []
                for v in nodes:
                    p = parents[v]
                    slot = len(region)
                    region.append(slots[p] if p >= 0 else -1)
                    anc.append((anc[slots[p]] if p >= 0 else []) + [slot])
                    slots[v] = slot
                    depth.append(len(anc[slot]))
                    g.append(outs[p] if p >= 0 else self._o)
                n = len(nodes)
                end = base + len(region)
                mask = torch.zeros(n, end, dtype=torch.bool)
                mask[:, :base] = True
                for j, v in enumerate(nodes):
                    mask[j, [base + s for s in anc[slots[v]]]] = True
                o = self._step(torch.stack(g), self._emb([tokens[v] for v in nodes]),
                               torch.tensor([base - 1 + d for d in depth]), mask=mask)  # [n, D]
                for j, v in enumerate(nodes):
                    outs[v] = o[j]
                return self._rows(self.head.logits(o))

        with torch.inference_mode():
            root = self._rows(self.head.logits(self._o[None]))  # type: ignore[index]
        draft, _ = build_tree(root, expand, spec, sampler, position=context.numel(), budget=budget, max_depth=max_depth)
        return draft

    def commit(self, verdict: Verdict) -> None:
        self.cache.truncate(self._committed)


class MedusaDrafter(HeadDrafter):
    """Medusa-1: K heads on the last committed feature; chains and static sparse trees."""

    supports_trees = True

    def __init__(self, head: Medusa, embed: Tensor, *, name: str = "") -> None:
        super().__init__(head, embed, name=name)
        self._last: Tensor | None = None  # [D] the newest committed final hidden state

    def reset(self) -> None:
        super().reset()
        self._last = None

    def _logits(self) -> Tensor | None:  # -> [K, V] head k's row over the target vocabulary
        feats = self._take()
        if feats is not None:
            self._last = stored_layout(self.cfg, feats[-1:], self._source)[0, 0, self.cfg.inputs[0]]
        if self._last is None:
            return None
        with torch.inference_mode():
            return self._rows(self.head(self._last[None])[:, 0])

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:
        logits = self._logits() if gamma > 0 else None
        if logits is None:
            return _EMPTY
        length = context.numel()
        chain = DraftChain()
        for j in range(min(gamma, logits.shape[0])):
            if not chain.add(self._draw(sampler, logits[j : j + 1], length + j), sampler):
                break
        return chain.draft()

    def propose_tree(self, context: Tensor, budget: int, sampler: DraftSampler, spec: TreeSpec, *, max_depth: int) -> Draft:
        """A static sparse tree (Medusa's): the children of a depth-d node are depth d+1's head's
        candidates, whatever the node (the heads do not see the draft tokens)."""
        logits = self._logits() if budget > 0 else None
        if logits is None:
            return _EMPTY
        depth_of: dict[int, int] = {}

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> Tensor:
            rows = []
            for v in nodes:
                p = parents[v]
                depth_of[v] = depth_of[p] + 1 if p >= 0 else 0
                rows.append(logits[depth_of[v] + 1])
            return torch.stack(rows)

        static = replace(spec, shape="static")
        draft, _ = build_tree(logits[:1], expand, static, sampler, position=context.numel(), budget=budget,
                              max_depth=min(max_depth, logits.shape[0]))
        return draft

    def commit(self, verdict: Verdict) -> None:
        pass


class MTPDrafter(HeadDrafter):
    """MTP modules, each with its own one-layer KV cache over the committed rows (chains)."""

    def __init__(self, head: MTP, embed: Tensor, *, name: str = "") -> None:
        super().__init__(head, embed, name=name)
        self.depth = len(head.layers)
        self._fresh()

    def _fresh(self) -> None:
        self.caches = [LayerCache(self.cfg) for _ in range(self.depth)]
        #: outputs[k][t]: module k's output at committed row t ([T, D], rows 0 .. committed[k]-1)
        self.outputs: list[Tensor] = [torch.zeros(0, self.cfg.hidden_size) for _ in range(self.depth)]
        self.committed = [0] * self.depth
        self._final = torch.zeros(0, self.cfg.hidden_size)  # committed final hidden states f_t

    def reset(self) -> None:
        super().reset()
        self._fresh()

    def _module(self, k: int, h_prev: Tensor, emb: Tensor, start: int) -> Tensor:  # rows start.. -> [n, D]
        attn_in, resid = self.head.module_input(k, h_prev, emb)
        return run_layer(self.head.layers[k], self.cfg, attn_in, resid, torch.arange(start, start + h_prev.shape[0]),
                         self.caches[k])

    @torch.inference_mode()
    def _catch_up(self, context: Tensor) -> int:
        """Run every module over its committed rows not yet run; returns P, the committed features."""
        feats = self._take()
        if feats is not None:
            f = stored_layout(self.cfg, feats, self._source)[0, :, self.cfg.inputs[0]]  # [n, D]
            self._final = torch.cat([self._final, f])
        p = self._final.shape[0]
        for k in range(self.depth):
            self.caches[k].truncate(self.committed[k])
            start, stop = self.committed[k], p - k  # module k's committed rows: t <= P-1-k
            if stop <= start:
                continue
            h_prev = self._final[start:stop] if k == 0 else self.outputs[k - 1][start:stop]
            out = self._module(k, h_prev, self._emb(context[start + k + 1 : stop + k + 1]), start)
            self.outputs[k] = torch.cat([self.outputs[k], out])
            self.committed[k] = stop
        return p

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:
        p = self._catch_up(context) if gamma > 0 else 0
        if p == 0:
            return _EMPTY
        length = context.numel()
        chain = DraftChain()
        width = self.cfg.hidden_size
        prev = torch.zeros(0, width)  # module k-1's rows run this round (rows P-k+1 .. P-1)
        with torch.inference_mode():
            for k in range(min(gamma, self.depth)):
                lo = p - k  # module k's rows this round: P-k .. P-1 (they read draft tokens d_0 .. d_{k-1})
                if lo < 0:
                    break
                if k == 0:
                    out = self.outputs[0][p - 1 : p]  # [1, D] its committed row P-1
                    prev = torch.zeros(0, width)
                else:
                    h_prev = torch.cat([self.outputs[k - 1][lo : lo + 1], prev])  # [k, D] rows P-k .. P-1
                    out = self._module(k, h_prev, self._emb(chain.tokens[:k]), lo)  # [k, D]
                    prev = out
                if not chain.add(self._draw(sampler, self._rows(self.head.logits(out[-1:])), length + k), sampler):
                    break
        return chain.draft()

    def commit(self, verdict: Verdict) -> None:
        for k in range(self.depth):
            self.caches[k].truncate(self.committed[k])


# ----------------------------------------------------------------------------- building


def drafter_for(head: Any, embed: Tensor, *, name: str = "") -> HeadDrafter:
    check_vocab_map(head.d2t, head.cfg.draft_vocab, int(embed.shape[0]))  # its ids index this target's rows
    if isinstance(head, Eagle):
        return EagleDrafter(head, embed, name=name)
    if isinstance(head, Medusa):
        return MedusaDrafter(head, embed, name=name)
    if isinstance(head, MTP):
        return MTPDrafter(head, embed, name=name)
    raise ConfigError(f"no drafter for a head of type {type(head).__name__}")


def target_embeddings(target: Any) -> Tensor:
    """The target's token embeddings ``[V, D]`` (float32), which every head reads."""
    embed = getattr(target, "embed", None)
    if not isinstance(embed, Tensor):
        raise ConfigError(
            "target-aware drafters need the target's embeddings and hidden states: the native backend"
            " (a Llama, Qwen2, Qwen3, Mistral or Gemma 3 target) or the hf backend (--backend hf)"
        )
    return embed if embed.dtype == torch.float32 else embed.float()


def heads_dir() -> Path:
    from specdec.models.registry import DATA_DIR

    return DATA_DIR


def resolve_head(ref: str) -> Path | None:
    """The head folder ``ref`` names (a registry name or a local folder), or None when ``ref`` is
    not a head; a registry name whose weights are absent is a clear error."""
    name = ref.strip()
    if name.lower() in HEADS:
        folder = heads_dir() / name.lower()
        if not is_head_folder(folder):
            raise ConfigError(f"{name.lower()} is not available in this installation (its trained weights are not shipped yet)")
        return folder
    path = Path(name).expanduser()
    return path if is_head_folder(path) else None


def load_any(folder: Path, *, target_layers: int | None = None) -> Any:
    """A head module from ``folder``: our format, or an EAGLE-3 checkpoint in the shared format
    (whose default taps depend on the target's layer count)."""
    raw = json.loads((folder / "config.json").read_text())
    if raw.get("kind") in KINDS:
        from specdec.heads.modules import load_head

        return load_head(folder)
    from specdec.heads.formats import load_eagle3

    return load_eagle3(folder, target_layers=target_layers)


class Int8Head(torch.nn.Module):
    """A head's draft LM head as a dynamically quantised int8 matmul (draft-side precision only:
    never affects exactness); the largest matrix a head step reads, a quarter of the bytes."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        from specdec.models.linear import Int8Linear

        self.lin = Int8Linear(weight)

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., Vd]
        return self.lin(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class PackedLinear(torch.nn.Module):
    """A head's linear layer with its weight packed once in ``dtype`` (oneDNN; bfloat16 where the
    CPU has native bf16 matmuls): draft-side precision only.  Inputs and outputs stay float32."""

    def __init__(self, layer: torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        from specdec.models.linear import Linear

        bias = layer.bias.detach().to(dtype) if layer.bias is not None else None
        self.lin = Linear(layer.weight.detach().to(dtype), bias, mode="fast")
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        y = self.lin(x.reshape(-1, x.shape[-1]).to(self.dtype))
        return y.float().reshape(*x.shape[:-1], -1)


class W8A8Head(torch.nn.Module):
    """A head's linear layer on the draft model's int8 product (int8 weights per output channel,
    each activation row quantised on its own; one compiled call for a few rows on VNNI CPUs):
    draft-side precision only.  Inputs and outputs float32."""

    def __init__(self, *layers: torch.nn.Linear) -> None:
        """One layer, or several reading the same input, stacked into one product: each output
        column's int8 weights, scale and the row's quantisation are the same as alone, so the
        stacked result is bitwise the layers' results side by side (tested)."""
        super().__init__()
        from specdec.models.linear import W8A8Linear

        weight = torch.cat([layer.weight.detach() for layer in layers])  # [sum(out), in]
        biases = [layer.bias for layer in layers]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(layer.out_features) for b, layer in zip(biases, layers)])
        self.lin = W8A8Linear(weight, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return self.lin(x.reshape(-1, x.shape[-1]).float()).reshape(*x.shape[:-1], -1)


def _stack_w8a8(head: torch.nn.Module) -> None:
    """Every linear layer of ``head`` on :class:`W8A8Head`; a decoder layer's q / k / v
    projections, and its MLP's gate / up, each as one product (one call instead of three / two)."""
    from specdec.heads.modules import MLP, Attention

    for module in head.modules():
        if isinstance(module, Attention):
            module.qkv = W8A8Head(module.q, module.k, module.v)
            del module.q, module.k, module.v  # unused from here on: fail loudly if anything reads them
        elif isinstance(module, MLP):
            module.gate_up = W8A8Head(module.gate, module.up)
            del module.gate, module.up
    _pack(head, W8A8Head, lm_head=True)


def _pack(module: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module], *, lm_head: bool = False) -> None:
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear) and (lm_head or name != "lm_head"):
            setattr(module, name, make(child))
        else:
            _pack(child, make, lm_head=lm_head)


def build(ref: Path, target: Any, *, label: str | None = None, int8_head: bool = False,
          dtype: torch.dtype = torch.float32, quant: str | None = None) -> tuple[HeadDrafter, str]:
    """The drafter for the head in folder ``ref`` on ``target`` (a native or hf model), and its name;
    ``quant="int8"`` runs every linear layer of the head (its LM head too) on the w8a8 product,
    as ``--draft-dtype w8a8`` does for a draft model (heads have no 4-bit path: ``auto`` and ``q4``
    give them this too, wherever fbgemm runs); otherwise
    ``int8_head`` runs the head's LM head as an int8 matmul (where torch has an int8 engine),
    ``dtype`` bfloat16 its other linear layers in bfloat16 (where the CPU has native bf16)."""
    embed = target_embeddings(target)
    if getattr(target, "forward_features", None) is None:
        raise ConfigError("target-aware drafters need a target that exposes its hidden states (the native or hf backend)")
    n_layers = layer_count(target)
    from safetensors import SafetensorError

    try:
        head = load_any(ref, target_layers=n_layers)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, ZeroDivisionError, SafetensorError) as exc:
        raise ConfigError(f"cannot load the draft head in {ref}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    from specdec.models.linear import bf16_fast, int8_available

    if quant == "int8":
        _stack_w8a8(head)
    else:
        if int8_head and int8_available():
            head.lm_head = Int8Head(head.lm_head.weight)
        if dtype == torch.bfloat16 and bf16_fast():
            _pack(head, lambda layer: PackedLinear(layer, dtype))
    name = label or ref.name
    drafter = drafter_for(head, embed, name=name)
    if n_layers is not None and any(not 0 <= k <= n_layers for k in drafter.feature_taps):
        raise ConfigError(f"the head reads the target's layers {list(drafter.feature_taps)}, the target has {n_layers}")
    return drafter, name


def describe_heads() -> list[dict[str, Any]]:
    """``specdec models`` rows for the registry's heads, shipped ones under :func:`heads_dir`."""
    return catalog.describe_heads(heads_dir())
