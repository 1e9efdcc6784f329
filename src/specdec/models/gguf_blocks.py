"""4-bit weight blocks read from a GGUF file as shipped (for the ``q4`` target).

A GGUF model's layer matrices come as Q4_0 / Q4_1 blocks (32 inputs of one output: 4-bit codes,
a float16 scale and, for Q4_1, a float16 minimum; Q4_0 is Q4_1 with ``m = -8 d``, which float16
represents exactly).  :func:`read_q4_blocks` returns them under the Hugging Face names the native
backend uses, with llama.cpp's row permutation of the query and key projections of Llama models
undone (the one ``transformers`` undoes when it converts the file), so that dequantising a block
gives the converted float32 weight (tested).  Matrices of other block types are not returned;
the loader quantises those from float32 (:func:`specdec.models.linear.quantize_q4_1`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdec.models.linear import Q4Blocks

#: GGUF tensor name (within ``blk.N.``) -> Hugging Face name (within ``model.layers.N.``)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: architectures whose query / key rows llama.cpp's converter permutes (interleaved rotary halves)
PERMUTED = ("llama",)


def _unpermute(rows: int, n_head: int) -> torch.Tensor:
    """The GGUF row index of each Hugging Face row of a permuted q / k projection ([rows] int64)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def read_q4_blocks(path: str | Path, n_heads: int, n_kv_heads: int) -> dict[str, Q4Blocks]:
    """Every Q4_0 / Q4_1 layer matrix of the GGUF at ``path``, by Hugging Face weight name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    out: dict[str, Q4Blocks] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES or parts[3] != "weight":
            continue
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1"):
            continue
        raw = np.asarray(t.data, dtype=np.uint8)  # [rows, nb * bytes per block]
        size = 20 if kind == "Q4_1" else 18
        blocks = torch.from_numpy(raw.reshape(raw.shape[0], -1, size).copy())  # [N, nb, size]
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, nb]
        if kind == "Q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
            qs = blocks[..., 4:20]
        else:
            m = d * -8.0  # exact: a power of two
            qs = blocks[..., 2:18]
        b = Q4Blocks(qs.contiguous(), d.contiguous(), m.contiguous())
        if arch in PERMUTED and parts[2] in ("attn_q", "attn_k"):
            b = b.take(_unpermute(b.qs.shape[0], n_heads if parts[2] == "attn_q" else n_kv_heads))
        out[f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"] = b
    return out
