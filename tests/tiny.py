"""Tiny randomly initialised Hugging Face models (with SmolLM2's tokenizer) for fast tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdec.models.registry import DATA_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny(folder: Path, *, model_type: str = "llama", seed: int = 0, max_positions: int = 256,
              layers: int = 2, hidden: int = 32, vocab: int = 49152, tied: bool = True, window: int | None = None,
              norms: bool = False) -> Path:
    """Save a tiny random ``model_type`` (llama | qwen2 | qwen3 | mistral | gemma3) model with the
    49,152-token tokenizer (``tied``: the LM head is the embedding).  ``window``: sliding-window
    attention of that window (qwen2, mistral: every layer; gemma3: every other layer, from the first);
    ``norms``: every RMSNorm's weight drawn at random instead of all ones."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
    )
    if window is not None and model_type == "qwen2":
        common.update(use_sliding_window=True, sliding_window=window, max_window_layers=0)
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    configs = {
        "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": lambda **kw: Qwen3Config(head_dim=hidden // 4, **kw),
        "mistral": lambda **kw: MistralConfig(sliding_window=window, **kw),
        # (the sliding layers' rotary base differs from the full ones', as in the real models)
        "gemma3": lambda **kw: Gemma3TextConfig(
            head_dim=hidden // 4, sliding_window=window or 4096, layer_types=kinds, **kw,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    }
    cfg = configs[model_type](**common)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # make attention biases non-zero so Qwen2's bias path is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")) or (norms and name.endswith("norm.weight")):
                p.uniform_(0.5, 1.5)  # ... and Qwen3's head norms (or, asked, every norm) not all ones
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        src = DATA_DIR / "smollm2-135m-draft" / name
        if src.is_file():
            shutil.copy(src, folder / name)
    return folder


def on_python_loop(model, run):
    """``run()`` with ``model``'s compiled layer loops switched off: the Python layer loop, the
    reference they must equal bit for bit."""
    saved, model.scripted = model.scripted, None
    try:
        return run()
    finally:
        model.scripted = saved


def without_chat_template(folder: Path) -> Path:
    """``folder`` (a model folder) with its chat template removed: a stand-in for a base model."""
    import json

    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    return folder


def draft_renaming(folder: Path, renamed: dict[str, str], *, special: bool | None = None, template: str | None = None) -> Path:
    """A copy of the bundled draft model in ``folder`` whose tokenizer calls some of its unused added
    tokens by other names (same ids, same vocabulary): a stand-in for a model that has those tokens
    (Mistral's tool-call markers, reasoning tags, fill-in-the-middle markers).  ``special``: the
    renamed tokens' flag (None: as they were); ``template``: a chat template to use instead."""
    import json

    src = DATA_DIR / "smollm2-135m-draft"
    folder.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.name != "tokenizer.json":
            shutil.copy(path, folder / path.name)
    spec = json.loads((src / "tokenizer.json").read_text())
    for entry in spec["added_tokens"]:
        if entry["content"] in renamed:
            entry["content"] = renamed[entry["content"]]
            if special is not None:
                entry["special"] = special
    spec["model"]["vocab"] = {renamed.get(k, k): v for k, v in spec["model"]["vocab"].items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def tiny_native(*, vocab: int = 64, max_length: int = 4096, seed: int = 0) -> NativeCausalLM:
    """A 2-layer native Llama with random weights (real KV cache, no files), batch-invariant like a target."""
    from specdec.models.native import NativeCausalLM

    cfg, w = tiny_llama_weights(vocab=vocab, max_length=max_length, seed=seed)
    return NativeCausalLM(cfg, w, batch_invariant=True)


def tiny_llama_weights(*, vocab: int = 64, max_length: int = 4096, seed: int = 0):
    """(NativeConfig, Hugging Face-named weights) of :func:`tiny_native`'s model."""
    from specdec.models.native import NativeConfig

    g = torch.Generator().manual_seed(seed)
    d, inter, heads, kv = 32, 64, 4, 2
    hd = d // heads
    cfg = NativeConfig(model_type="llama", vocab_size=vocab, hidden_size=d, n_layers=2, n_heads=heads,
                       n_kv_heads=kv, head_dim=hd, intermediate_size=inter, rms_eps=1e-6, rope_theta=10000.0,
                       max_length=max_length, tie_embeddings=True, attention_bias=False)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    w = {"model.embed_tokens.weight": r(vocab, d), "model.norm.weight": torch.ones(d)}
    for i in range(2):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": r(heads * hd, d), p + "self_attn.k_proj.weight": r(kv * hd, d),
              p + "self_attn.v_proj.weight": r(kv * hd, d), p + "self_attn.o_proj.weight": r(d, heads * hd),
              p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
              p + "mlp.gate_proj.weight": r(inter, d), p + "mlp.up_proj.weight": r(inter, d),
              p + "mlp.down_proj.weight": r(d, inter)}
    return cfg, w


def random_head(kind: str, *, hidden: int, vocab: int, draft_vocab: int, taps: tuple[int, ...] = (1,), heads: int = 2,
                kv_heads: int = 1, head_dim: int = 8, inter: int = 32, depth: int = 3, seed: int = 0, scale: float = 0.3):
    """A randomly initialised draft head of ``kind`` (EAGLE-3 reads every tap, the others the final
    hidden state) with a random sorted draft vocabulary of ``draft_vocab`` target ids."""
    from specdec.heads.modules import HeadConfig, build

    torch.manual_seed(seed)
    inputs = tuple(range(len(taps))) + (len(taps),) if kind == "eagle3" else (len(taps),)
    cfg = HeadConfig(kind=kind, hidden_size=hidden, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                     intermediate_size=inter, target_vocab=vocab, draft_vocab=draft_vocab, taps=taps, inputs=inputs,
                     depth=depth)
    head = build(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.d2t.copy_(torch.randperm(vocab, generator=g)[:draft_vocab].sort().values)
        for p in head.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return head.eval()


def tiny_vocab_llama(*, vocab: int = 5, layers: int = 4, seed: int = 0, batch_invariant: bool = True,
                     max_length: int = 64, tied: bool = False) -> NativeCausalLM:
    """A random 4-layer Llama with a 5-token vocabulary, logits spread enough to matter (law tests);
    ``tied``: the LM head is the embedding."""
    from specdec.models.native import NativeCausalLM, NativeConfig

    cfg = NativeConfig(model_type="llama", vocab_size=vocab, hidden_size=16, n_layers=layers, n_heads=2, n_kv_heads=1,
                       head_dim=8, intermediate_size=32, rms_eps=1e-6, rope_theta=10000.0, max_length=max_length,
                       tie_embeddings=tied, attention_bias=False)
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.4) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(vocab, 16, scale=1.0), "model.norm.weight": torch.ones(16),
         "lm_head.weight": r(vocab, 16, scale=0.8)}
    if tied:
        del w["lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": r(16, 16), p + "self_attn.k_proj.weight": r(8, 16),
              p + "self_attn.v_proj.weight": r(8, 16), p + "self_attn.o_proj.weight": r(16, 16),
              p + "input_layernorm.weight": torch.ones(16), p + "post_attention_layernorm.weight": torch.ones(16),
              p + "mlp.gate_proj.weight": r(32, 16), p + "mlp.up_proj.weight": r(32, 16), p + "mlp.down_proj.weight": r(16, 32)}
    return NativeCausalLM(cfg, w, batch_invariant=batch_invariant)


class NativeOracle:
    """``exact_law``'s view of a native model: next-token logits after any history."""

    def __init__(self, model: NativeCausalLM) -> None:
        self.model = model
        self.vocab_size = model.vocab_size

    def logits_for(self, history: list[int]) -> torch.Tensor:  # -> [V]
        return self.model.forward(torch.tensor(history), self.model.new_cache(32))[-1].double()


def assert_tokenizers_agree(tok, ref, texts) -> None:
    """``tok`` (specdec's) and ``ref`` (transformers') give the same vocabulary, size and
    end-of-sequence id, and the same encodings (with and without special tokens) and decodings
    (skipping them or not) of every text."""
    assert tok.get_vocab() == ref.get_vocab() and len(tok) == len(ref) and tok.eos_token_id == ref.eos_token_id
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
