"""Write a Hugging Face Llama folder as a GGUF file llama.cpp can run (used for the draft).

Only what the llama.cpp comparison needs: the ``llama`` architecture, weights stored as float16
(or float32) — no quantisation — and the tokenizer copied verbatim from a reference GGUF with the
same vocabulary (the target's), so both models tokenise identically inside llama.cpp.

One layout change is needed: Hugging Face Llama checkpoints rotate query/key features in two
halves (``rotate_half``: feature i pairs with i + d/2), GGUF's ``llama`` rope pairs neighbours
(2i with 2i + 1), so the rows of ``q_proj`` / ``k_proj`` are reordered head by head.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """GGUF tensor name of a Hugging Face Llama tensor name."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        if rest in _LAYER_NAMES:
            return f"blk.{int(parts[2])}.{_LAYER_NAMES[rest]}"
    raise SpecdecError(f"no GGUF name for tensor {hf_name!r} (only plain Llama checkpoints are supported)")


def rope_halves_to_pairs(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a q/k projection ``[n_heads * d, in]`` from the half-split rotary
    layout to the interleaved one: within each head, new row 2j + s is old row s * d/2 + j."""
    rows = w.shape[0]
    d = rows // n_heads
    if rows % n_heads or d % 2:
        raise SpecdecError(f"cannot split {rows} rows into {n_heads} heads of even size")
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_llama(folder: Path, out: Path, *, tokenizer_from: Path, dtype: str = "float16") -> Path:
    """Write ``folder`` (config.json + model.safetensors, ``model_type`` llama) to ``out``."""
    import gguf
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise SpecdecError(f"{folder} is a {cfg.get('model_type')!r} model; only llama is supported")
    ref = gguf.GGUFReader(str(tokenizer_from))
    ref_vocab = int(ref.fields["llama.vocab_size"].contents()) if "llama.vocab_size" in ref.fields else None
    if ref_vocab is not None and ref_vocab != cfg["vocab_size"]:
        raise SpecdecError(f"vocabulary sizes differ: {folder} has {cfg['vocab_size']}, {tokenizer_from} {ref_vocab}")
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 4.x: rope_scaling
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise SpecdecError("only the default rotary embedding is supported")
    float_type = {"float16": np.float16, "float32": np.float32}[dtype]

    tmp = out.with_name(out.name + ".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(folder.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(theta))
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "float16" else gguf.LlamaFileType.ALL_F32)
    for key, field in ref.fields.items():  # the tokenizer, verbatim
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub)

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = list(f.keys())
        for name in names:
            if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                continue
            t = f.get_tensor(name).astype(np.float32)
            if name.endswith("self_attn.q_proj.weight"):
                t = rope_halves_to_pairs(t, n_head)
            elif name.endswith("self_attn.k_proj.weight"):
                t = rope_halves_to_pairs(t, n_kv)
            # llama.cpp wants norms (1-D) in float32
            w.add_tensor(gguf_name(name), np.ascontiguousarray(t if t.ndim == 1 else t.astype(float_type)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def draft_gguf(draft: str, target_gguf: Path, *, dtype: str = "float16") -> Path:
    """The draft ``draft`` (a registry name or Hugging Face folder) as a GGUF, converted once and
    cached under ``$SPECDEC_CACHE/gguf``; its tokenizer is taken from ``target_gguf``."""
    from specdec.models.registry import cache_root, resolve

    from specdec.drafters.hybrid import split_lookup

    folder = resolve(split_lookup(draft)[0]).folder  # NAME+lookup: llama.cpp gets the model NAME
    if folder is None:
        raise SpecdecError(f"the draft {draft!r} has no local folder to convert")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise SpecdecError(f"{folder} has no model.safetensors to convert")
    st = weights.stat()
    key = hashlib.sha256(f"{weights.resolve()}|{st.st_size}|{st.st_mtime_ns}|{target_gguf}|{dtype}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{folder.name}-{dtype}-{key}.gguf"
    if out.is_file():
        return out
    return export_llama(folder, out, tokenizer_from=target_gguf, dtype=dtype)
