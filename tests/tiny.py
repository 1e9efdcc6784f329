"""Tiny randomly initialised Hugging Face models (with SmolLM2's tokenizer) for fast tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdec.models.registry import DATA_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny(folder: Path, *, model_type: str = "llama", seed: int = 0, max_positions: int = 256,
              layers: int = 2, hidden: int = 32, vocab: int = 49152) -> Path:
    """Save a tiny random ``model_type`` (llama | qwen2) model with the 49,152-token tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
    )
    cfg = LlamaConfig(**common) if model_type == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # make attention biases non-zero so Qwen2's bias path is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        src = DATA_DIR / "smollm2-135m-draft" / name
        if src.is_file():
            shutil.copy(src, folder / name)
    return folder
