"""Gemma 3's text model on the native backend: its config read as transformers reads it, what it
refuses, and the engine choosing the native backend for it.  Its layers' agreement with
transformers and their bitwise invariance past the sliding window are in test_windowed.py."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import ConfigError
from specdec.models import registry
from specdec.models.native import NativeCausalLM, NativeConfig
from tiny import make_tiny

#: the real Gemma-3-270M's config, as transformers 5 writes it (trimmed)
REAL = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}


def test_the_real_config_is_read_as_transformers_reads_it():
    cfg = NativeConfig.from_hf(REAL)
    assert cfg.gemma and cfg.qk_norm and cfg.tie_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 1_000_000.0 and cfg.local_rope_theta == 10_000.0
    assert cfg.query_scale == 1 / 16 and cfg.head_dim == 256 and cfg.max_length == 32768
    assert cfg.sliding_window == 512 and cfg.windowed == ((True,) * 5 + (False,)) * 3
    # the older spelling: one rope_theta and the local base beside it
    old = {k: v for k, v in REAL.items() if k != "rope_parameters"} | {"rope_theta": 1e6, "rope_local_base_freq": 1e4}
    assert (NativeConfig.from_hf(old).rope_theta, NativeConfig.from_hf(old).local_rope_theta) == (1e6, 1e4)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"hidden_activation": "gelu"}, "activation"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}, "linear"),
    ({"layer_types": ["chunked_attention"] * 18}, "chunked_attention"),
])
def test_what_the_native_layers_do_not_compute_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        NativeConfig.from_hf({**REAL, **change})


def test_the_engine_runs_a_gemma3_folder_natively_as_transformers_decodes_it(tmp_path):
    """A Gemma 3 folder loads on the native backend by itself, and greedy decoding ten sliding
    windows long gives the hf backend's tokens."""
    from specdec.engine import Engine, EngineConfig
    from specdec.sampling import SamplingConfig

    folder = str(make_tiny(tmp_path / "gemma3", model_type="gemma3", window=4, layers=3, norms=True))
    assert registry.native_runs(folder) is True
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    runs = {}
    for backend in ("auto", "hf"):
        engine = Engine.build(EngineConfig(target=folder, draft="none", dtype="float32", backend=backend))
        assert engine.target.backend == ("native" if backend == "auto" else "hf")
        runs[backend] = engine.generate([2, 5, 6, 7, 8, 9], cfg).token_ids
    assert runs["auto"] == runs["hf"] and len(runs["auto"]) == 40


def test_bfloat16_embeddings_are_scaled_as_transformers_scales_them(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_tiny(tmp_path / "gemma3", model_type="gemma3", hidden=40, layers=2)  # sqrt(40) is not a bfloat16
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    native = NativeCausalLM.from_folder(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref.model.embed_tokens(ids.unsqueeze(0))[0]
    got = native.embed_tokens(ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


MINIMAL = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}


def test_gemma3_defaults_are_transformers_defaults():
    """A Gemma 3 config leaving them out reads transformers' Gemma3TextConfig defaults: a query
    scale of 256^-1/2, a global rotary base of 10^6 and a local (sliding layers') base of 10^4."""
    cfg = NativeConfig.from_hf(MINIMAL)
    assert cfg.query_scale == pytest.approx(256 ** -0.5)
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.local_rope_theta == 10_000.0
    assert NativeConfig.from_hf({**MINIMAL, "query_pre_attn_scalar": 64}).query_scale == pytest.approx(0.125)


def test_a_saved_quantised_gemma3_gets_its_output_norms_from_the_weights(tmp_path):
    """A saved quantised model holds the linear layers only: saved_model_weights must read every
    other float weight it needs, for Gemma 3 the per-layer attention and MLP output norms too
    (else building from the saved state fails with a missing key)."""
    import json
    from pathlib import Path

    from specdec.models.native import saved_model_weights

    folder = Path(make_tiny(tmp_path / "gemma3", model_type="gemma3", window=4, layers=3, norms=True))
    cfg = NativeConfig.from_hf(json.loads((folder / "config.json").read_text()))
    names = set(saved_model_weights(cfg, sorted(folder.glob("*.safetensors"))))
    for i in range(3):
        for x in ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert f"model.layers.{i}.{x}.weight" in names
    assert "model.embed_tokens.weight" in names
