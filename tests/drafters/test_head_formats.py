"""Draft heads on disk: our format, and EAGLE-3 in the formats vLLM (speculators) and SGLang
(EAGLE / SpecForge) users share, loaded into the same drafter; registry names; clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.drafters.heads import HEADS, build, drafter_for, is_head_folder, resolve_head
from specdec.errors import ConfigError
from specdec.heads.formats import SharedEagle3, load_eagle3, save_eagle3
from specdec.heads.modules import save_head
from specdec.models.linear import w8a8_available
from tiny import random_head, tiny_native

D, HEADS_N, KV, HD, INTER, V, VD = 32, 4, 2, 8, 48, 64, 20


def _shared_checkpoint(folder, *, layout: str, seed: int = 0, bias: bool = False):
    """A tiny randomly initialised EAGLE-3 checkpoint written by hand in a shared format."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    pre = "layers.0." if layout == "speculators" else "midlayer."
    w = {"fc.weight": r(D, 3 * D), "norm.weight": 1 + r(D), "lm_head.weight": r(VD, D),
         pre + "input_layernorm.weight": 1 + r(D), pre + "hidden_norm.weight": 1 + r(D),
         pre + "post_attention_layernorm.weight": 1 + r(D),
         pre + "self_attn.q_proj.weight": r(HEADS_N * HD, 2 * D), pre + "self_attn.k_proj.weight": r(KV * HD, 2 * D),
         pre + "self_attn.v_proj.weight": r(KV * HD, 2 * D), pre + "self_attn.o_proj.weight": r(D, HEADS_N * HD),
         pre + "mlp.gate_proj.weight": r(INTER, D), pre + "mlp.up_proj.weight": r(INTER, D), pre + "mlp.down_proj.weight": r(D, INTER)}
    if bias:
        w["fc.bias"] = r(D)
    ids = torch.randperm(V, generator=g)[:VD].sort().values
    w["d2t"] = ids - torch.arange(VD)  # offsets
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    layer = {"model_type": "llama", "hidden_size": D, "num_attention_heads": HEADS_N, "num_key_value_heads": KV,
             "intermediate_size": INTER, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": V}
    if layout == "speculators":
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
               "draft_vocab_size": VD, "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    else:
        cfg = layer | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    return w, ids


def _reference_logits(w, layout, feats, emb):
    """The shared format's EAGLE-3 step written out from its tensors: fc over raw taps, the layer
    on [rms(e) * g_in; rms(h) * g_h], residual h, final norm, draft head (one row, no cache)."""
    pre = "layers.0." if layout == "speculators" else "midlayer."
    rms = lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g  # noqa: E731
    h = feats.flatten() @ w["fc.weight"].T + w.get("fc.bias", 0)
    x = torch.cat([rms(emb, w[pre + "input_layernorm.weight"]), rms(h, w[pre + "hidden_norm.weight"])])
    v = x @ w[pre + "self_attn.v_proj.weight"].T  # one position: attention returns v (per kv head)
    attn = v.view(KV, HD).repeat_interleave(HEADS_N // KV, 0).flatten() @ w[pre + "self_attn.o_proj.weight"].T
    y = h + attn
    z = rms(y, w[pre + "post_attention_layernorm.weight"])
    y = y + (torch.nn.functional.silu(z @ w[pre + "mlp.gate_proj.weight"].T) * (z @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T
    return rms(y, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize(("layout", "bias"), [("speculators", False), ("eagle", False), ("speculators", True)])
def test_shared_eagle3_checkpoints_load_and_compute_their_function(tmp_path, layout, bias):
    w, ids = _shared_checkpoint(tmp_path / "h", layout=layout, bias=bias)
    assert is_head_folder(tmp_path / "h")
    head = load_eagle3(tmp_path / "h", target_layers=30)
    assert isinstance(head, SharedEagle3) and torch.equal(head.d2t, ids)  # offsets -> target ids
    # the config's tap list, else vLLM's default for a 30-layer target
    assert head.cfg.taps == ((0, 1, 2) if layout == "speculators" else (2, 15, 27))
    feats = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    emb = torch.randn(D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        g = head.fuse(feats[None, None])
        a, r = head.layer_input(g, emb[None, None])
        from specdec.heads.modules import rope_tables

        cos, sin = rope_tables(torch.tensor([0]), HD, 10000.0)
        q, k, v = head.layer.attn.project(a, cos, sin)
        o = head.layer.finish(r, head.layer.attn.attend(q, k, v, None))
        got = head.logits(o)[0, 0]
    torch.testing.assert_close(got, _reference_logits(w, layout, feats, emb), rtol=1e-4, atol=1e-4)


def test_our_eagle3_round_trips_through_the_shared_format(tmp_path):
    head = random_head("eagle3", hidden=D, vocab=V, draft_vocab=VD, taps=(0, 1, 2), heads=HEADS_N, kv_heads=KV,
                       head_dim=HD, inter=INTER)
    from specdec.heads.modules import HeadConfig, build

    cfg = HeadConfig(**{**head.cfg.__dict__, "inputs": (0, 1, 2)})  # EAGLE-3 proper: the three taps only
    ours = build(cfg)
    ours.load_state_dict({k: v for k, v in head.state_dict().items() if k != "fc.weight"} | {"fc.weight": torch.randn(D, 3 * D)})
    for layout in ("speculators", "eagle"):
        save_eagle3(ours, tmp_path / layout, layout=layout, dtype=torch.float32)
        raw = json.loads((tmp_path / layout / "config.json").read_text())
        assert raw["specdec_fuse"] == "rms" and raw["draft_vocab_size"] == VD
        back = load_eagle3(tmp_path / layout)
        assert type(back).__name__ == "Eagle" and back.cfg.taps == (0, 1, 2)
        for (k1, v1), (k2, v2) in zip(sorted(ours.state_dict().items()), sorted(back.state_dict().items())):
            assert k1 == k2 and torch.equal(v1, v2), k1
    _rewrite(tmp_path / "speculators", tensors={"fc.bias": torch.zeros(D)})  # a bias our fusion has no slot for
    with pytest.raises(ConfigError, match="has no fc.bias, but the file holds one"):
        load_eagle3(tmp_path / "speculators")
    # a shared head saved again keeps its own fusion (no rms flag) and its norm placement, in either layout
    _shared_checkpoint(tmp_path / "theirs", layout="speculators")
    shared = load_eagle3(tmp_path / "theirs")
    for layout in ("speculators", "eagle"):
        for norm_first in (False, True):
            shared.norm_before_residual = norm_first
            save_eagle3(shared, tmp_path / f"again-{layout}-{norm_first}", layout=layout, dtype=torch.float32)
            assert "specdec_fuse" not in json.loads((tmp_path / f"again-{layout}-{norm_first}" / "config.json").read_text())
            again = load_eagle3(tmp_path / f"again-{layout}-{norm_first}")
            assert again.norm_before_residual is norm_first, layout
            assert all(torch.equal(a, b) for a, b in zip(shared.state_dict().values(), again.state_dict().values()))


def test_heads_load_as_draft_folders_and_decode(tmp_path):
    from specdec.decoder import SpeculativeDecoder
    from specdec.gamma import FixedGamma
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    native = tiny_native()
    _shared_checkpoint(tmp_path / "shared", layout="speculators")
    save_head(random_head("medusa", hidden=D, vocab=V, draft_vocab=VD), tmp_path / "medusa", dtype=torch.float32)
    save_head(random_head("mtp", hidden=D, vocab=V, draft_vocab=VD), tmp_path / "mtp", dtype=torch.float32)
    plain = SpeculativeDecoder(native, None, get_rule("greedy")).generate([1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=12))
    fast = dict(int8_head=True, dtype=torch.bfloat16)  # what the engine uses on CPUs with int8 / bf16 engines
    cases = [("shared", {}), ("medusa", {}), ("shared", fast), ("medusa", fast), ("mtp", fast)]
    if w8a8_available():  # what the engine uses where torch has fbgemm (--draft-dtype auto / w8a8)
        cases += [(name, dict(quant="int8")) for name in ("shared", "medusa", "mtp")]
    for name, opts in cases:
        ref = resolve_head(str(tmp_path / name))
        assert ref is not None
        drafter, label = build(ref, native, **opts)
        assert label == name
        out = SpeculativeDecoder(native, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(
            [1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=12))
        assert out.tokens == plain.tokens and out.stats.draft_tokens_proposed > 0
    assert resolve_head(str(tmp_path)) is None  # not a head folder: other loaders take it


@pytest.mark.skipif(not w8a8_available(), reason="needs torch's fbgemm int8 engine (x86)")
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_w8a8_heads_run_every_linear_layer_in_int8(tmp_path, kind):
    """``quant="int8"``: no float linear layer is left; a decoder layer's q / k / v (and gate / up)
    run as one stacked product whose columns are bitwise the separate products' (1 row, and 20
    rows, past the few-row kernel); the head's draft logits stay within int8 rounding of the
    float head's (relative error < 3 % on 40 random rows; measured ~1 %)."""
    from specdec.drafters.heads import W8A8Head
    from specdec.heads.modules import load_head

    native = tiny_native()
    save_head(random_head(kind, hidden=D, vocab=V, draft_vocab=VD, inter=INTER), tmp_path / kind, dtype=torch.float32)
    ref = load_head(tmp_path / kind)
    drafter, _ = build(tmp_path / kind, native, quant="int8")
    head = drafter.head
    assert not any(isinstance(m, torch.nn.Linear) for m in head.modules())
    layer = head.layer if kind == "eagle3" else head.layers[0]
    ref_layer = ref.layer if kind == "eagle3" else ref.layers[0]
    for rows in (1, 20):
        x = torch.randn(rows, layer.attn.qkv.lin.in_features)
        alone = [W8A8Head(getattr(ref_layer.attn, n))(x) for n in ("q", "k", "v")]
        assert torch.equal(layer.attn.qkv(x), torch.cat(alone, dim=-1))
        h = torch.randn(rows, D)
        alone = [W8A8Head(getattr(ref_layer.mlp, n))(h) for n in ("gate", "up")]
        assert torch.equal(layer.mlp.gate_up(h), torch.cat(alone, dim=-1))
    o = torch.randn(40, D)
    with torch.no_grad():
        want, got = ref.logits(o), head.logits(o)
        assert (got - want).norm() / want.norm() < 0.03
        cos, sin = torch.ones(3, HD), torch.zeros(3, HD)
        x = torch.randn(1, 3, layer.attn.qkv.lin.in_features)
        for a, b in zip(ref_layer.attn.project(x, cos, sin), layer.attn.project(x, cos, sin)):
            assert (a - b).norm() / a.norm() < 0.03
        h = torch.randn(40, D)
        a, b = ref_layer.mlp(h), layer.mlp(h)
        assert (a - b).norm() / a.norm() < 0.03


def test_registry_names_and_errors(tmp_path, monkeypatch):
    import specdec.drafters.heads as heads

    monkeypatch.setattr(heads, "heads_dir", lambda: tmp_path)
    for name in HEADS:
        with pytest.raises(ConfigError, match="not available"):
            resolve_head(name)
    save_head(random_head("mtp", hidden=D, vocab=V, draft_vocab=VD), tmp_path / "smollm2-135m-mtp", dtype=torch.float32)
    assert resolve_head("smollm2-135m-mtp") == tmp_path / "smollm2-135m-mtp"
    assert {r["name"]: r["status"] for r in heads.describe_heads()}["smollm2-135m-mtp"] == "bundled"
    wrong = random_head("eagle1", hidden=16, vocab=V, draft_vocab=VD)
    with pytest.raises(ConfigError, match="width"):
        drafter_for(wrong, tiny_native().embed)
    from specdec.models.toy import ToyLM

    with pytest.raises(ConfigError, match="hidden states"):
        from specdec.session import TargetSession
        from specdec.sampling import SamplingConfig
        from specdec.verify import get_rule

        class NoFeatures:
            vocab_size, max_length = 4, 100

            def new_cache(self, n=None):
                return ToyLM(4).new_cache()

        TargetSession(NoFeatures(), [1, 2], SamplingConfig(temperature=0.0), get_rule("greedy"), seed=0, feature_taps=())


def _rewrite(folder, **changes):
    """The checkpoint in ``folder`` with tensors replaced (None: removed) or config keys changed."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(folder / "model.safetensors"))
    for key, value in changes.get("tensors", {}).items():
        if value is None:
            w.pop(key)
        else:
            w[key] = value.contiguous()
    save_file(w, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"].update(changes.get("layer", {}))
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name, change, says", [
    ("past_vocab", lambda w, ids: {"d2t": w["d2t"] + 1000}, "d2t must hold strictly increasing token ids in 0..63"),
    ("negative", lambda w, ids: {"d2t": w["d2t"] - ids[0] - 1}, "strictly increasing"),
    ("duplicates", lambda w, ids: {"d2t": -torch.arange(VD)}, "strictly increasing"),  # every index -> token 0
    ("float", lambda w, ids: {"d2t": w["d2t"].float() + 0.7}, "integer offsets"),
    ("short", lambda w, ids: {"d2t": w["d2t"][:-1]}, "integer offsets"),
    ("t2d_count", lambda w, ids: {"t2d": torch.ones(V, dtype=torch.bool)},
     r"t2d does not mark exactly its d2t's 20 target ids \(64 marked\)"),
    ("t2d_other_ids", lambda w, ids: {"t2d": w["t2d"].roll(1)}, r"t2d does not mark exactly its d2t's 20 target ids \(20 marked\)"),
    ("t2d_short", lambda w, ids: {"t2d": w["t2d"][:-1]}, "t2d must be a 0/1 mask"),
    ("fc_shape", lambda w, ids: {"fc.weight": w["fc.weight"][:, :-1]},
     r"fc.weight has shape \[32, 95\], its config implies \[32, 96\]"),
    ("q_shape", lambda w, ids: {"layers.0.self_attn.q_proj.weight": w["layers.0.self_attn.q_proj.weight"][:-8]},
     r"layers.0.self_attn.q_proj.weight has shape \[24, 64\]"),
])
def test_an_inconsistent_eagle3_checkpoint_is_a_one_line_error(tmp_path, name, change, says):
    """A d2t that maps draft indices past the target's vocabulary, below 0 or twice to one token, of
    floats, or a t2d that disagrees with it, used to load and fail (or silently mis-map) mid-generation;
    a tensor of the wrong shape gave only "Error(s) in loading state_dict"."""
    w, ids = _shared_checkpoint(tmp_path / name, layout="speculators")
    _rewrite(tmp_path / name, tensors=change(w, ids))
    with pytest.raises(ConfigError, match=says):
        load_eagle3(tmp_path / name)
    with pytest.raises(ConfigError, match="cannot load the draft head .*" + says) as err:
        build(tmp_path / name, tiny_native())
    assert "\n" not in str(err.value)


def test_a_head_with_no_attention_heads_or_a_damaged_file_is_a_one_line_error(tmp_path):
    _shared_checkpoint(tmp_path / "zero", layout="speculators")
    _rewrite(tmp_path / "zero", layer={"num_attention_heads": 0})
    _shared_checkpoint(tmp_path / "garbage", layout="speculators")
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    for name, says in (("zero", "num_attention_heads must be at least 1"), ("garbage", "not a readable safetensors file")):
        with pytest.raises(ConfigError, match=says):
            load_eagle3(tmp_path / name)
        with pytest.raises(ConfigError, match=says) as err:
            build(tmp_path / name, tiny_native())
        assert "\n" not in str(err.value)


def test_our_format_checks_its_draft_vocabulary_too(tmp_path):
    from safetensors.torch import load_file, save_file

    from specdec.heads.modules import load_head

    save_head(random_head("medusa", hidden=D, vocab=V, draft_vocab=VD), tmp_path / "m", dtype=torch.float32)
    assert load_head(tmp_path / "m").d2t.numel() == VD
    w = load_file(str(tmp_path / "m" / "model.safetensors"))
    save_file(w | {"d2t": w["d2t"].flip(0)}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ConfigError, match="strictly increasing"):
        load_head(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage!")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_head(tmp_path / "m")
    bad = random_head("medusa", hidden=D, vocab=V, draft_vocab=VD)
    bad.d2t[-1] = V  # past the target's rows
    with pytest.raises(ConfigError, match="strictly increasing token ids in 0..63"):
        drafter_for(bad, tiny_native().embed)


def _one_row_logits(head, feats, emb):
    """One committed row through the loaded head (as the format test does)."""
    from specdec.heads.modules import rope_tables

    with torch.no_grad():
        g = head.fuse(feats[None, None])
        a, r = head.layer_input(g, emb[None, None])
        cos, sin = rope_tables(torch.tensor([0]), head.cfg.head_dim, head.cfg.rope_theta)
        q, k, v = head.layer.attn.project(a, cos, sin)
        o = head.layer.finish(r, head.layer.attn.attend(q, k, v, None))
        return head.logits(o)[0, 0]


def test_norm_before_residual_makes_the_normalised_fused_feature_the_residual(tmp_path):
    """``norm_before_residual: true`` (vLLM / SpecForge heads trained that way): the layer's residual
    is ``hidden_norm(fc(taps))``, not the raw fused feature.  The format test only loads heads with
    the flag off, so ignoring it at inference went unnoticed (the round trip only checks the attribute)."""
    w, _ = _shared_checkpoint(tmp_path / "h", layout="speculators", seed=4)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg | {"norm_before_residual": True}))
    head = load_eagle3(tmp_path / "h")
    feats = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    emb = torch.randn(D, generator=torch.Generator().manual_seed(2))
    # the reference with the residual normalised: fold hidden_norm into the fused feature the
    # residual adds, i.e. residual = rms(h) * g_h
    pre = "layers.0."
    rms = lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g  # noqa: E731
    h = feats.flatten() @ w["fc.weight"].T
    x = torch.cat([rms(emb, w[pre + "input_layernorm.weight"]), rms(h, w[pre + "hidden_norm.weight"])])
    v = x @ w[pre + "self_attn.v_proj.weight"].T
    attn = v.view(KV, HD).repeat_interleave(HEADS_N // KV, 0).flatten() @ w[pre + "self_attn.o_proj.weight"].T
    y = rms(h, w[pre + "hidden_norm.weight"]) + attn
    z = rms(y, w[pre + "post_attention_layernorm.weight"])
    y = y + (torch.nn.functional.silu(z @ w[pre + "mlp.gate_proj.weight"].T) * (z @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T
    want = rms(y, w["norm.weight"]) @ w["lm_head.weight"].T
    torch.testing.assert_close(_one_row_logits(head, feats, emb), want, rtol=1e-4, atol=1e-4)


def test_model_prefixed_tensor_names_load_the_same_head(tmp_path):
    """Some exports keep the ``model.`` prefix on every tensor name; the loader strips it, so the head
    is the same as from the unprefixed file (without the strip, nothing is found under ``layers.0.``,
    the loader guesses ``midlayer.`` and fails)."""
    from safetensors.torch import load_file, save_file

    w, ids = _shared_checkpoint(tmp_path / "h", layout="speculators")
    plain = load_eagle3(tmp_path / "h")
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    save_file({"model." + k: v for k, v in state.items()}, str(tmp_path / "h" / "model.safetensors"))
    prefixed = load_eagle3(tmp_path / "h")
    assert torch.equal(prefixed.d2t, ids)
    for (k1, v1), (k2, v2) in zip(sorted(plain.state_dict().items()), sorted(prefixed.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2), k1


def test_default_taps_follow_vllm_for_an_odd_layer_count(tmp_path):
    """Without ``eagle_aux_hidden_state_layer_ids`` the taps are vLLM's ``(2, L // 2, L - 3)``; the
    format test uses L = 30 only, where ``L // 2`` and ``(L + 1) // 2`` agree."""
    _shared_checkpoint(tmp_path / "h", layout="eagle")
    assert load_eagle3(tmp_path / "h", target_layers=31).cfg.taps == (2, 15, 28)


def test_layer_shape_is_read_from_the_layer_config(tmp_path):
    """In the speculators layout the layer's ``head_dim``, ``rms_norm_eps`` and ``rope_theta`` live in
    ``transformer_layer_config``; reading the top level (or deriving ``head_dim`` as D / heads) loads
    a head that computes something else.  Non-default values, so a wrong source shows."""
    from safetensors.torch import load_file, save_file

    _shared_checkpoint(tmp_path / "h", layout="speculators")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["transformer_layer_config"] |= {"head_dim": 2 * HD, "rms_norm_eps": 1e-3, "rope_theta": 500000.0}
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(tmp_path / "h" / "model.safetensors"))  # attention sized for head_dim 2 * HD
    g = torch.Generator().manual_seed(3)
    for name, rows, cols in (("q_proj", HEADS_N * 2 * HD, 2 * D), ("k_proj", KV * 2 * HD, 2 * D),
                             ("v_proj", KV * 2 * HD, 2 * D), ("o_proj", D, HEADS_N * 2 * HD)):
        w[f"layers.0.self_attn.{name}.weight"] = torch.randn(rows, cols, generator=g) * 0.2
    save_file(w, str(tmp_path / "h" / "model.safetensors"))
    head = load_eagle3(tmp_path / "h")
    assert (head.cfg.head_dim, head.cfg.rms_eps, head.cfg.rope_theta) == (2 * HD, 1e-3, 500000.0)
    assert head.norm.eps == 1e-3 and head.layer.post_norm.eps == 1e-3


def test_missing_kv_head_count_means_multi_head_attention(tmp_path):
    """A layer config without ``num_key_value_heads`` is plain multi-head attention (Hkv = H), as in
    a Llama config; the fixture always writes the key."""
    from safetensors.torch import load_file, save_file

    _shared_checkpoint(tmp_path / "h", layout="speculators")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    del cfg["transformer_layer_config"]["num_key_value_heads"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(tmp_path / "h" / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name in ("k_proj", "v_proj"):
        w[f"layers.0.self_attn.{name}.weight"] = torch.randn(HEADS_N * HD, 2 * D, generator=g) * 0.2
    save_file(w, str(tmp_path / "h" / "model.safetensors"))
    assert load_eagle3(tmp_path / "h").cfg.n_kv_heads == HEADS_N


def test_a_head_that_reads_the_final_hidden_state_has_no_shared_format(tmp_path):
    """The shared formats fuse the three taps only; one of our EAGLE-3 heads that also reads the
    final hidden state (``random_head``'s default inputs) must be refused rather than written as a
    file whose ``fc`` other runtimes would feed the wrong rows."""
    head = random_head("eagle3", hidden=D, vocab=V, draft_vocab=VD, taps=(0, 1, 2), heads=HEADS_N, kv_heads=KV,
                       head_dim=HD, inter=INTER)
    assert head.cfg.inputs == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="final hidden state"):
        save_eagle3(head, tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_a_shared_head_with_an_fc_bias_round_trips_with_it(tmp_path):
    """A SpecForge head with an ``fc`` bias, saved again, keeps the bias: the round-trip test saves
    only bias-free heads, so a writer that dropped ``fc.bias`` produced a file that refuses to load
    as the same head (or, elsewhere, silently computes without the bias)."""
    _shared_checkpoint(tmp_path / "theirs", layout="speculators", bias=True)
    shared = load_eagle3(tmp_path / "theirs")
    for layout in ("speculators", "eagle"):
        save_eagle3(shared, tmp_path / layout, layout=layout, dtype=torch.float32)
        again = load_eagle3(tmp_path / layout)
        assert again.fc.bias is not None and torch.equal(again.fc.bias, shared.fc.bias), layout


def test_the_tap_layers_round_trip_through_the_shared_format(tmp_path):
    """``eagle_aux_hidden_state_layer_ids`` records the target layers the head reads (``cfg.taps``),
    not which stored rows it fuses (``cfg.inputs``); the round-trip test uses taps (0, 1, 2), where
    the two coincide."""
    from specdec.heads.modules import HeadConfig, build

    head = random_head("eagle3", hidden=D, vocab=V, draft_vocab=VD, taps=(3, 5, 7), heads=HEADS_N, kv_heads=KV,
                       head_dim=HD, inter=INTER)
    ours = build(HeadConfig(**{**head.cfg.__dict__, "inputs": (0, 1, 2)}))
    save_eagle3(ours, tmp_path / "h", layout="speculators", dtype=torch.float32)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [3, 5, 7]
    assert load_eagle3(tmp_path / "h").cfg.taps == (3, 5, 7)


def test_our_format_refuses_a_config_with_a_zero_size_or_an_odd_head_dim(tmp_path):
    """``HeadConfig`` (what ``config.json`` of our format holds) refuses sizes below 1 and an odd
    ``head_dim`` (rotary embeddings rotate pairs) with a one-line ConfigError, before any tensor is
    read; the loaders' tests only damage the shared formats' configs."""
    from specdec.heads.modules import HeadConfig, load_head, save_head

    save_head(random_head("mtp", hidden=D, vocab=V, draft_vocab=VD), tmp_path / "m", dtype=torch.float32)
    good = json.loads((tmp_path / "m" / "config.json").read_text())
    assert HeadConfig.from_json(json.dumps(good)).depth == good["depth"]
    for change, says in (({"depth": 0}, "depth must be a whole number, at least 1"),
                         ({"n_heads": 0}, "n_heads must be a whole number, at least 1"),
                         ({"head_dim": 7, "n_heads": 1, "n_kv_heads": 1}, "head_dim \\(7\\) even")):
        (tmp_path / "m" / "config.json").write_text(json.dumps(good | change))
        with pytest.raises(ConfigError, match=says):
            load_head(tmp_path / "m")


def _edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_a_draft_vocab_size_that_disagrees_with_the_tensors_is_refused(tmp_path):
    """``draft_vocab_size`` is the config's promise; a checkpoint whose ``lm_head`` / ``d2t`` hold
    another number of rows is inconsistent and must be a ConfigError, not silently loaded with the
    rows the tensors happen to have (reading the size off ``lm_head`` alone hides the mismatch)."""
    _shared_checkpoint(tmp_path / "h", layout="speculators")
    _edit_config(tmp_path / "h", lambda c: c.update(draft_vocab_size=VD + 4))
    with pytest.raises(ConfigError):
        load_eagle3(tmp_path / "h")


def test_the_target_vocabulary_is_the_layer_configs_in_the_speculators_layout(tmp_path):
    """In the speculators layout ``transformer_layer_config.vocab_size`` is the target's vocabulary;
    a top-level ``vocab_size`` (some exports write the draft vocabulary there) must not override it."""
    _, ids = _shared_checkpoint(tmp_path / "h", layout="speculators")
    _edit_config(tmp_path / "h", lambda c: c.update(vocab_size=VD))
    head = load_eagle3(tmp_path / "h")
    assert head.cfg.target_vocab == V and torch.equal(head.d2t, ids)


def test_taps_nested_under_eagle_config_are_read(tmp_path):
    """SpecForge / EAGLE exports may keep ``eagle_aux_hidden_state_layer_ids`` inside an
    ``eagle_config`` block; those are the head's taps (not vLLM's default)."""
    _shared_checkpoint(tmp_path / "h", layout="eagle")
    _edit_config(tmp_path / "h", lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}))
    assert load_eagle3(tmp_path / "h", target_layers=30).cfg.taps == (1, 4, 6)


def test_the_verifier_name_round_trips_through_the_speculators_format(tmp_path):
    """``speculators_config.verifier.name_or_path`` names the target a head was trained for; it is
    written from ``cfg.target`` and read back into it (what a head records about its target)."""
    from dataclasses import replace

    from specdec.heads.modules import build

    head = random_head("eagle3", hidden=D, vocab=V, draft_vocab=VD, taps=(0, 1, 2), heads=HEADS_N, kv_heads=KV,
                       head_dim=HD, inter=INTER)
    ours = build(replace(head.cfg, inputs=(0, 1, 2), target="org/some-target"))
    save_eagle3(ours, tmp_path / "h", layout="speculators", dtype=torch.float32)
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/some-target"
    assert load_eagle3(tmp_path / "h").cfg.target == "org/some-target"


def _our_eagle3(inputs=(0, 1, 2)):
    from dataclasses import replace

    from specdec.heads.modules import build

    head = random_head("eagle3", hidden=D, vocab=V, draft_vocab=VD, taps=(0, 1, 2), heads=HEADS_N, kv_heads=KV,
                       head_dim=HD, inter=INTER)
    ours = build(replace(head.cfg, inputs=inputs))
    return ours


def test_a_head_reading_the_final_state_by_a_negative_index_has_no_shared_format(tmp_path):
    """``cfg.inputs`` indexes ``(taps..., final)`` modulo its width (``runtime.input_rows``), so -1 is
    the final hidden state too; the writer must refuse it as it refuses index ``len(taps)``."""

    with pytest.raises(ValueError, match="final hidden state"):
        save_eagle3(_our_eagle3(inputs=(0, 1, -1)), tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_each_layout_writes_its_own_tensor_names(tmp_path):
    """vLLM (speculators) reads the layer under ``layers.0.``, SGLang (EAGLE / SpecForge) under
    ``midlayer.``; our loader accepts either, so the round trip alone cannot see a writer that used
    the other layout's names."""
    from safetensors.torch import load_file


    for layout, prefix in (("speculators", "layers.0."), ("eagle", "midlayer.")):
        save_eagle3(_our_eagle3(), tmp_path / layout, layout=layout, dtype=torch.float32)
        names = set(load_file(str(tmp_path / layout / "model.safetensors")))
        assert prefix + "self_attn.q_proj.weight" in names and prefix + "hidden_norm.weight" in names, layout
        assert not any(n.startswith(("layers.", "midlayer.")) and not n.startswith(prefix) for n in names), layout


def test_the_shared_writer_stores_weights_in_the_dtype_asked_for(tmp_path):
    """``save_eagle3(dtype=...)`` (bfloat16 by default, what the shared formats ship) applies to every
    weight; ``d2t`` stays integer offsets and ``t2d`` a bool mask."""
    from safetensors.torch import load_file


    save_eagle3(_our_eagle3(), tmp_path / "h")
    w = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert {v.dtype for k, v in w.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool


def test_the_layer_config_round_trips_through_the_shared_format(tmp_path):
    """The writer's ``transformer_layer_config`` (or the flat EAGLE config) carries every field the
    loader reads: a head whose ``head_dim`` is not D / heads and whose ``rms_eps`` / ``rope_theta`` are
    not the loader's defaults comes back with the same config.  The round-trip test's head has
    head_dim = D / heads, so a writer that omitted a field or misnamed it went unseen."""
    from dataclasses import replace

    from specdec.heads.modules import build

    cfg = replace(_our_eagle3().cfg, head_dim=2 * HD, rms_eps=1e-5, rope_theta=500000.0, depth=5)
    head = build(cfg)
    for layout in ("speculators", "eagle"):
        save_eagle3(head, tmp_path / layout, layout=layout, dtype=torch.float32)
        back = load_eagle3(tmp_path / layout).cfg
        assert (back.head_dim, back.rms_eps, back.rope_theta) == (2 * HD, 1e-5, 500000.0), layout
        assert (back.n_heads, back.n_kv_heads, back.intermediate_size) == (HEADS_N, KV, INTER), layout
    raw = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # the steps trained


def test_a_t2d_that_is_not_a_0_1_mask_is_refused(tmp_path):
    """``t2d`` must be a 0/1 mask: an integer t2d holding a 2 at one of the draft ids is damaged even
    though, read as bool, it marks the right ids."""
    w, ids = _shared_checkpoint(tmp_path / "h", layout="speculators")
    from safetensors.torch import save_file

    t2d = w["t2d"].long()
    t2d[ids[0]] = 2
    save_file(w | {"t2d": t2d}, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ConfigError, match="t2d must be a 0/1 mask"):
        load_eagle3(tmp_path / "h")


def test_a_sharded_or_pickled_checkpoint_loads_the_same_head(tmp_path):
    """Exports split across several ``*.safetensors`` files are read whole (every shard), and a folder
    with only ``pytorch_model.bin`` loads the same tensors: both give the head of the one-file checkpoint."""
    from safetensors.torch import load_file, save_file

    _shared_checkpoint(tmp_path / "one", layout="speculators")
    plain = load_eagle3(tmp_path / "one")
    w = load_file(str(tmp_path / "one" / "model.safetensors"))
    names = sorted(w)
    for folder in ("sharded", "pickled"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    save_file({k: w[k] for k in names[::2]}, str(tmp_path / "sharded" / "model-00001-of-00002.safetensors"))
    save_file({k: w[k] for k in names[1::2]}, str(tmp_path / "sharded" / "model-00002-of-00002.safetensors"))
    torch.save(w, tmp_path / "pickled" / "pytorch_model.bin")
    for folder in ("sharded", "pickled"):
        head = load_eagle3(tmp_path / folder)
        for (k1, v1), (k2, v2) in zip(sorted(plain.state_dict().items()), sorted(head.state_dict().items())):
            assert k1 == k2 and torch.equal(v1, v2), (folder, k1)


def test_a_layer_config_without_eps_or_rope_theta_gets_the_llama_defaults(tmp_path):
    """``rms_norm_eps`` and ``rope_theta`` absent from the layer config are Llama's defaults
    (1e-6 and 10000), in either layout."""
    for layout in ("speculators", "eagle"):
        folder = tmp_path / layout
        _shared_checkpoint(folder, layout=layout)
        raw = json.loads((folder / "config.json").read_text())
        layer = raw.get("transformer_layer_config") or raw
        del layer["rms_norm_eps"], layer["rope_theta"]
        (folder / "config.json").write_text(json.dumps(raw))
        cfg = load_eagle3(folder).cfg
        assert (cfg.rms_eps, cfg.rope_theta) == (1e-6, 10000.0), layout


def test_a_two_tap_head_without_tap_ids_gets_the_first_two_default_taps(tmp_path):
    """An ``fc`` over two taps and no ``eagle_aux_hidden_state_layer_ids``: the taps are the first
    two of vLLM's defaults, whether or not the target's layer count is known yet; the unresolved
    case is recorded as ``default_taps`` in the config's ``extra``."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "h"
    _shared_checkpoint(folder, layout="eagle")
    w = load_file(str(folder / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"][:, : 2 * D].contiguous()
    save_file(w, str(folder / "model.safetensors"))
    unresolved = load_eagle3(folder).cfg
    assert unresolved.taps == (2, 15) and unresolved.inputs == (0, 1)
    assert unresolved.extra == {"format": "eagle", "default_taps": True}
    resolved = load_eagle3(folder, target_layers=30).cfg
    assert resolved.taps == (2, 15) and resolved.inputs == (0, 1)
    assert resolved.extra == {"format": "eagle"}
    feats = torch.randn(1, 1, 3, D)
    assert load_eagle3(folder).fuse(feats).shape == (1, 1, D)


def test_a_single_d2t_offset_is_refused_not_broadcast_over_the_draft_vocabulary(tmp_path):
    """``d2t`` holds one offset per draft index: a one-element tensor (without a ``t2d`` to contradict
    it) would broadcast into a plausible map ``i -> i + c``; it is refused as the wrong shape."""
    _shared_checkpoint(tmp_path / "h", layout="speculators")
    _rewrite(tmp_path / "h", tensors={"d2t": torch.tensor([3]), "t2d": None})
    with pytest.raises(ConfigError, match="d2t must be 20 integer offsets, got torch.int64 of shape \\[1\\]"):
        load_eagle3(tmp_path / "h")
