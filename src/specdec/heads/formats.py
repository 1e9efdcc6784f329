"""EAGLE-3 heads in the formats vLLM and SGLang users share them in.

Two layouts are in use for the same network (a fusion ``fc`` over three of the target's
residual streams, one decoder layer whose attention reads ``[norm(embedding); norm(fused)]``,
a final norm and a draft LM head over a reduced vocabulary):

* the ``speculators`` format (vLLM): ``config.json`` with ``"speculators_model_type": "eagle3"``,
  the layer's shape in ``transformer_layer_config`` (a Llama config: ``hidden_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``rms_norm_eps``,
  ``rope_theta``, ``vocab_size`` = the target's), ``draft_vocab_size``,
  ``norm_before_residual``; tensors ``fc.weight``, ``layers.0.{self_attn.{q,k,v,o}_proj,
  input_layernorm, hidden_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``;
* the EAGLE / SpecForge format (SGLang): a flat Llama-style ``config.json`` with
  ``"architectures": ["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``; the same tensors
  with the layer under ``midlayer.`` instead of ``layers.0.``.

In both, ``d2t[i]`` is an *offset*: draft index ``i`` is target token ``i + d2t[i]``; ``t2d`` is a
boolean mask over the target vocabulary.  Our heads store the target ids themselves.  The
target taps are ``eagle_aux_hidden_state_layer_ids`` where given (the residual stream entering
those layers = after that many layers, our tap convention), else vLLM's default
``(2, L // 2, L - 3)`` for an ``L``-layer target.

Those runtimes feed the three taps to ``fc`` as they are; heads trained here normalise each tap
first (see :class:`~specdec.heads.modules.Eagle`).  :class:`SharedEagle3` is an :class:`Eagle`
whose fusion is theirs (raw taps, optional ``fc`` bias, optional norm-before-residual), so a
head trained elsewhere computes here exactly what it computes there.  Saving one of our heads
writes the same tensors plus ``"specdec_fuse": "rms"``: our loader restores it exactly, other
runtimes ignore the field and feed raw taps (see NOTES).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from specdec.catalog import is_eagle3_checkpoint  # noqa: F401 - the format's test, torch-free
from specdec.errors import ConfigError
from specdec.heads.modules import Eagle, HeadConfig, check_vocab_map, load_state, read_safetensors

_LAYER = {  # our parameter name -> theirs, inside the decoder layer
    "layer.attn.q.weight": "self_attn.q_proj.weight",
    "layer.attn.k.weight": "self_attn.k_proj.weight",
    "layer.attn.v.weight": "self_attn.v_proj.weight",
    "layer.attn.o.weight": "self_attn.o_proj.weight",
    "embed_norm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "layer.post_norm.weight": "post_attention_layernorm.weight",
    "layer.mlp.gate.weight": "mlp.gate_proj.weight",
    "layer.mlp.up.weight": "mlp.up_proj.weight",
    "layer.mlp.down.weight": "mlp.down_proj.weight",
}
_TOP = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


class SharedEagle3(Eagle):
    """EAGLE-3 with the shared formats' fusion: ``fc`` over the raw concatenated taps (optional
    bias) and, with ``norm_before_residual``, the normalised fused feature as the residual."""

    def __init__(self, cfg: HeadConfig, *, fc_bias: bool = False, norm_before_residual: bool = False) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.inputs) * d, d, bias=fc_bias)
        self.norm_before_residual = norm_before_residual

    def fuse(self, feats: Tensor) -> Tensor:  # [B, T, k, D] -> [B, T, D]
        rows = feats[:, :, list(self.cfg.inputs)].float()
        return self.fc(rows.flatten(2))

    def layer_input(self, g: Tensor, emb: Tensor) -> tuple[Tensor, Tensor]:
        attn_in, resid = super().layer_input(g, emb)
        return attn_in, (self.hidden_norm(g) if self.norm_before_residual else resid)


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    state: dict[str, Tensor] = {}
    if files:
        for f in files:
            state.update(read_safetensors(f))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {folder}")
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_eagle3(folder: Path, *, target_layers: int | None = None) -> Eagle:
    """An EAGLE-3 head from a speculators or EAGLE / SpecForge checkpoint folder."""
    raw = json.loads((folder / "config.json").read_text())
    layer_cfg = raw.get("transformer_layer_config") or raw
    state = _read_tensors(folder)
    prefix = "layers.0." if any(k.startswith("layers.0.") for k in state) else "midlayer."
    d = int(layer_cfg["hidden_size"])
    heads = int(layer_cfg["num_attention_heads"])
    if heads < 1:
        raise ConfigError(f"the head's num_attention_heads must be at least 1, got {heads}")
    lm = state["lm_head.weight"]
    draft_vocab = int(raw.get("draft_vocab_size") or lm.shape[0])
    vocab = int(layer_cfg.get("vocab_size") or raw.get("vocab_size"))
    fc = state["fc.weight"]
    n_taps = fc.shape[1] // d
    taps = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    extra: dict = {"format": "speculators" if prefix == "layers.0." else "eagle"}
    if taps is None:
        if target_layers is None:  # resolved against the target when the drafter is built
            extra["default_taps"] = True
            taps = (2, 15, 27)[:n_taps]
        else:
            taps = (2, target_layers // 2, target_layers - 3)[:n_taps]
    cfg = HeadConfig(
        kind="eagle3", hidden_size=d, n_heads=heads, n_kv_heads=int(layer_cfg.get("num_key_value_heads") or heads),
        head_dim=int(layer_cfg.get("head_dim") or d // heads), intermediate_size=int(layer_cfg["intermediate_size"]),
        target_vocab=vocab, draft_vocab=draft_vocab, rms_eps=float(layer_cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer_cfg.get("rope_theta", 10000.0)), inputs=tuple(range(len(taps))), taps=tuple(int(t) for t in taps),
        depth=1, target=str(((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", "")), extra=extra,
    )
    ours_rms = raw.get("specdec_fuse") == "rms"
    if ours_rms and "fc.bias" in state:  # our fusion has no bias: refused, not dropped in silence
        raise ConfigError(f"{folder}: a head marked \"specdec_fuse\": \"rms\" has no fc.bias, but the file holds one;"
                          " remove the mark (a shared-format head) or the tensor")
    head: Eagle = Eagle(cfg) if ours_rms else SharedEagle3(cfg, fc_bias="fc.bias" in state,
                                                            norm_before_residual=bool(raw.get("norm_before_residual", False)))
    mine: dict[str, Tensor] = {}
    for ours, theirs in _LAYER.items():
        mine[ours] = state[prefix + theirs]
    for ours, theirs in _TOP.items():
        mine[ours] = state[theirs]
    if "fc.bias" in state and not ours_rms:
        mine["fc.bias"] = state["fc.bias"]
    offsets = state.get("d2t")
    base = torch.arange(draft_vocab)
    if offsets is not None and (offsets.is_floating_point() or offsets.dtype == torch.bool
                                or tuple(offsets.shape) != (draft_vocab,)):
        raise ConfigError(f"the head's d2t must be {draft_vocab} integer offsets,"
                          f" got {offsets.dtype} of shape {list(offsets.shape)}")
    mine["d2t"] = base + offsets.long() if offsets is not None else base
    check_vocab_map(mine["d2t"], draft_vocab, vocab, state.get("t2d"))
    names = {ours: prefix + theirs for ours, theirs in _LAYER.items()}
    load_state(head, {k: (v.float() if v.is_floating_point() else v) for k, v in mine.items()}, names)
    return head.eval()


def save_eagle3(head: Eagle, folder: Path, *, layout: str = "speculators", dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an EAGLE-3 head in the speculators (``layout="speculators"``) or EAGLE / SpecForge
    (``"eagle"``) format: offsets in ``d2t``, the ``t2d`` mask, the Llama layer config."""
    from safetensors.torch import save_file

    cfg: HeadConfig = head.cfg
    if cfg.kind != "eagle3":
        raise ValueError(f"only EAGLE-3 heads have a shared format, not {cfg.kind!r}")
    if any(i % (len(cfg.taps) + 1) == len(cfg.taps) for i in cfg.inputs):
        raise ValueError("the shared format fuses target taps only; this head also reads the final hidden state")
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    params = head.state_dict()
    state = {prefix + theirs: params[ours] for ours, theirs in _LAYER.items()}
    state |= {theirs: params[ours] for ours, theirs in _TOP.items()}
    if "fc.bias" in params:
        state["fc.bias"] = params["fc.bias"]
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    d2t = head.d2t.long()
    state["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()
    t2d = torch.zeros(cfg.target_vocab, dtype=torch.bool)
    t2d[d2t] = True
    state["t2d"] = t2d
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.target_vocab, "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False,
    }
    # norm_before_residual: read from the top level in either layout (SpecForge writes it there too)
    raw: dict = {"draft_vocab_size": cfg.draft_vocab, "eagle_aux_hidden_state_layer_ids": list(cfg.taps),
                 "norm_before_residual": bool(getattr(head, "norm_before_residual", False))}
    if layout == "speculators":
        raw |= {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": max(cfg.depth, 1)}],
                                       "verifier": {"name_or_path": cfg.target, "architectures": ["LlamaForCausalLM"]}}}
    else:
        raw |= layer | {"architectures": ["LlamaForCausalLMEagle3"]}
    if not isinstance(head, SharedEagle3):
        raw["specdec_fuse"] = "rms"  # our fusion normalises each tap first (other runtimes ignore this)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    save_file(state, str(folder / "model.safetensors"))
