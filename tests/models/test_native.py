"""The native Llama/Qwen2/Qwen3 path reproduces transformers and rolls its cache back exactly."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from specdec.errors import ConfigError
from specdec.models import kernels
from specdec.models.hf import HFCausalLM
from specdec.models.linear import Int8Linear, int8_available, w8a8_available
from specdec.models.native import NativeCausalLM, NativeConfig, _attend_rows_aten
from tiny import make_tiny, on_python_loop, tiny_llama_weights, tiny_native


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), model_type=request.param)


def test_matches_transformers(tiny_folder):
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    native = NativeCausalLM.from_folder(tiny_folder)
    ids = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids.unsqueeze(0)).logits[0]
    out = native.forward(ids, native.new_cache(64))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_incremental_equals_prefill_and_rollback(tiny_folder):
    model = NativeCausalLM.from_folder(tiny_folder)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (20,), generator=g)
    full = model.forward(ids, model.new_cache(64))
    cache = model.new_cache(64)
    model.forward(ids[:12], cache)
    step = torch.cat([model.forward(ids[i : i + 1], cache) for i in range(12, 20)])
    assert torch.allclose(step, full[12:], atol=1e-4)
    # write garbage past position 15, roll back, continue: same as never having written it
    cache.truncate(15)
    model.forward(torch.randint(0, 49152, (5,), generator=g), cache)
    cache.truncate(15)
    again = model.forward(ids[15:20], cache)
    assert torch.allclose(again, full[15:], atol=1e-4)
    assert cache.length == 20


def test_last_only_and_context_limit(tiny_folder):
    model = NativeCausalLM.from_folder(tiny_folder)
    ids = torch.arange(10)
    assert torch.allclose(model.forward(ids, model.new_cache())[-1:], model.forward(ids, model.new_cache(), last_only=True), atol=1e-5)
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="full"):
        model.forward(ids, cache)


def test_hf_backend_matches_native(tiny_folder):
    """... and calls the model with the cache argument its transformers names now: no deprecation
    warning (transformers 5.x warns that ``past_key_values`` is removed in 5.40)."""

    native = NativeCausalLM.from_folder(tiny_folder)
    hf = HFCausalLM.from_folder(str(tiny_folder))
    ids = torch.randint(0, 49152, (9,), generator=torch.Generator().manual_seed(2))
    hc = hf.new_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        a = torch.cat([hf.forward(ids[:5], hc), hf.forward(ids[5:], hc)])
    hc.truncate(6)
    b = hf.forward(ids[6:], hc)
    n = native.forward(ids, native.new_cache(32))
    assert torch.allclose(a, n, atol=1e-4) and torch.allclose(b, n[6:], atol=1e-4)


def test_bfloat16_path_runs_and_agrees_roughly(tiny_folder):
    f32 = NativeCausalLM.from_folder(tiny_folder)
    b16 = NativeCausalLM.from_folder(tiny_folder, dtype=torch.bfloat16)
    ids = torch.arange(16)
    a, b = f32.forward(ids, f32.new_cache(32)), b16.forward(ids, b16.new_cache(32))
    assert b.dtype == torch.float32 and torch.allclose(a, b, atol=0.1)


@pytest.mark.skipif(not int8_available(), reason="this torch build has no int8 CPU engine")
def test_int8_head_is_close_and_only_touches_the_head(tiny_folder):
    f32 = NativeCausalLM.from_folder(tiny_folder)
    q8 = NativeCausalLM.from_folder(tiny_folder, int8_head=True)
    assert isinstance(q8.lm_head, Int8Linear) and not isinstance(f32.lm_head, Int8Linear)
    ids = torch.arange(16)
    a, b = f32.forward(ids, f32.new_cache(32)), q8.forward(ids, q8.new_cache(32))
    assert b.shape == a.shape and b.dtype == torch.float32
    # the hidden states are computed in float32 either way; only the head's product is quantised
    assert torch.equal(f32.hidden(ids, f32.new_cache(32)), q8.hidden(ids, q8.new_cache(32)))
    assert (b - a).norm() / a.norm() < 0.05 and not torch.equal(a, b)


@pytest.mark.skipif(not w8a8_available(), reason="this torch build has no fbgemm int8 engine")
@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_a_quantised_drafts_int8_head_builds_no_head_it_throws_away(tiny_folder, monkeypatch, quant):
    """A quantised draft asked for an int8 head quantises its head with its layers, as without the
    option, and constructs no Int8Linear on the way (one was built and dropped: 5 s of fbgemm
    packing for Qwen2.5-Coder-0.5B's head)."""
    import specdec.models.native as native

    built = []
    monkeypatch.setattr(native, "Int8Linear", lambda *a, **k: built.append(a) or Int8Linear(*a, **k))
    with_option = NativeCausalLM.from_folder(tiny_folder, quant=quant, int8_head=True)
    without = NativeCausalLM.from_folder(tiny_folder, quant=quant)
    assert built == [] and type(with_option.lm_head) is type(without.lm_head)
    ids = torch.arange(16)
    assert torch.equal(with_option.forward(ids, with_option.new_cache(32)), without.forward(ids, without.new_cache(32)))


@pytest.mark.parametrize("quant", [None, "q4"])
def test_a_chain_shaped_tree_is_scored_by_the_chain_pass(tiny_folder, monkeypatch, quant):
    """A tree region that is a chain (a floored tree that kept no sibling) puts node j at the
    chain's position and lets it see what a chain row sees, so ``forward_tree`` runs the chain pass
    (no tree layout, the fused loop where there is one): the same logits and cache bits as
    ``forward``, scored whole or in two parts (``prefix``).  A region with a branch still builds
    its layout."""
    from specdec.models import kernels, native

    if quant == "q4" and not kernels.q4_available():
        pytest.skip("the 4-bit target needs the kernel library")
    model = NativeCausalLM.from_folder(tiny_folder, batch_invariant=True, quant=quant)
    built: list[int] = []
    build = native._TreeLayout.build.__func__
    monkeypatch.setattr(native._TreeLayout, "build", classmethod(lambda cls, p, *a, **kw: built.append(p.numel()) or build(cls, p, *a, **kw)))
    g = torch.Generator().manual_seed(6)
    prompt, nodes = torch.randint(0, 49152, (20,), generator=g), torch.randint(0, 49152, (5,), generator=g)
    chain = torch.arange(-1, 4)

    def run(score) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
        cache = model.new_cache(64)
        model.forward(prompt, cache)
        out = score(cache, cache.length)
        return out, cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()

    ref = run(lambda c, base: model.forward(nodes, c))
    whole = run(lambda c, base: model.forward_tree(nodes, chain, c))
    parts = run(lambda c, base: torch.cat([model.forward_tree(nodes[:2], chain[:2], c),
                                           model.forward_tree(nodes[2:], chain, c, prefix=base)]))
    for a, b, c in zip(ref, whole, parts):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert built == []
    branched = torch.tensor([-1, 0, 0, 1, 3])  # the last two nodes extend a path, the region branches
    run(lambda c, base: model.forward_tree(nodes, branched, c))
    run(lambda c, base: torch.cat([model.forward_tree(nodes[:3], branched[:3], c),
                                   model.forward_tree(nodes[3:], branched, c, prefix=base)]))
    assert built == [5, 3, 5]


@pytest.mark.parametrize("window", [None, 4])
def test_a_long_run_of_new_rows_is_scored_in_pieces_bitwise(tmp_path, monkeypatch, window):
    """An exact model scores more than ``PROMPT_PASS_CHUNK`` new positions (a long prompt) in
    several passes: the logits, the cache and the tapped features are bitwise one pass's, each
    piece is at most the chunk, and a piece that fails leaves the cache as it was.  With a 4-token
    sliding window (Mistral) the pieces cross it."""
    from specdec import defaults

    folder = make_tiny(tmp_path / "m", model_type="llama" if window is None else "mistral", window=window, layers=3)
    model = NativeCausalLM.from_folder(folder, batch_invariant=True)
    ids = torch.randint(0, 49152, (11,), generator=torch.Generator().manual_seed(4))
    extra = torch.randn(11, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    one_cache = model.new_cache(32)
    model.forward(ids[:2], one_cache)
    one_taps = {1: torch.empty(0), 3: torch.empty(0)}
    one = model.hidden(ids[2:], one_cache, taps=one_taps, extra=extra[2:])  # [9, D], one pass
    seen: list[int] = []
    hidden = model.hidden

    def spy(tokens, cache, **kw):
        seen.append(tokens.numel())
        return hidden(tokens, cache, **kw)

    monkeypatch.setattr(defaults, "PROMPT_PASS_CHUNK", 4)
    monkeypatch.setattr(model, "hidden", spy)
    cache = model.new_cache(32)
    model.forward(ids[:2], cache)
    taps = {1: torch.empty(0), 3: torch.empty(0)}
    pieces = model.hidden(ids[2:], cache, taps=taps, extra=extra[2:])
    assert seen == [2, 9, 4, 4, 1]
    assert torch.equal(pieces, one)
    assert all(torch.equal(taps[k], one_taps[k]) for k in taps)
    for li in range(model.cfg.n_layers):
        assert torch.equal(cache.k[li][:, :11], one_cache.k[li][:, :11])
        assert torch.equal(cache.v[li][:, :11], one_cache.v[li][:, :11])
    small = model.new_cache(9)  # room for the first two pieces, not the third
    model.forward(ids[:1], small)
    with pytest.raises(ValueError, match="full"):
        model.forward(ids[1:], small)
    assert small.length == 1
    with pytest.raises(ValueError, match="context"):
        model.forward(torch.zeros(300, dtype=torch.long), model.new_cache())


# ----------------------------------------------------------------------------- malformed configs and weights

#: SmolLM2-135M's and Qwen2.5-Coder-0.5B's configs as their converted folders hold them (trimmed)
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "rms_norm_eps": 9.999999747378752e-06,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}
QWEN = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "rms_norm_eps": 9.999999974752427e-07,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "max_position_embeddings": 32768,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False}


def test_the_shipped_configs_are_read():
    assert NativeConfig.from_hf(SMOLLM2).head_dim == 64 and NativeConfig.from_hf(QWEN).head_dim == 64
    older = {k: v for k, v in QWEN.items() if k != "rope_parameters"} | {"rope_theta": 1e6, "rope_scaling": None,
                                                                          "num_key_value_heads": None, "head_dim": None}
    cfg = NativeConfig.from_hf(older)
    assert (cfg.rope_theta, cfg.n_kv_heads, cfg.head_dim) == (1e6, 14, 64)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("flags", [{}, {"attention_bias": True}, {"mlp_bias": True}], ids=["none", "attention", "mlp"])
def test_the_biases_read_are_the_ones_transformers_builds(kind, flags):
    """Where the native layers take a config, the biases they add (query / key / value, nothing else)
    are exactly the bias parameters transformers builds for it; where transformers would build
    others (an output-projection bias from ``attention_bias``, Llama's MLP biases from ``mlp_bias``)
    the config is refused in one line that points to ``--backend hf``, not run without them."""
    import transformers

    cfg = {**LLAMA, "model_type": kind, "head_dim": 8, **flags}
    if kind == "gemma3_text":  # (its rotary parameters are by layer kind: its defaults here)
        del cfg["rope_parameters"]
    config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = {name.split(".", 3)[3] for name, _ in model.named_parameters() if name.endswith("bias") and ".layers.0." in name}
    try:
        read = NativeConfig.from_hf(cfg)
    except ConfigError as exc:
        assert "--backend hf" in str(exc) and "\n" not in str(exc)
        assert built - {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
        return
    expected = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"} if read.attention_bias else set()
    assert built == expected


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"])
def test_what_a_config_leaves_out_reads_as_transformers_defaults(kind):
    """Tied embeddings and the head size where a config does not say (Gemma 3 ties, the others do
    not; Qwen3's heads are 128 wide and Gemma 3's 256, the others' the hidden size over the heads),
    as transformers reads them; an activation other than the one these layers compute is refused."""
    import transformers

    cfg = {k: v for k, v in LLAMA.items() if k not in ("rope_parameters", "tie_word_embeddings")} | {"model_type": kind}
    theirs = transformers.AutoConfig.for_model(kind, **{k: v for k, v in cfg.items() if k != "model_type"})
    ours = NativeConfig.from_hf(cfg)
    assert ours.tie_embeddings == theirs.tie_word_embeddings
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    key = "hidden_activation" if kind == "gemma3_text" else "hidden_act"
    with pytest.raises(ConfigError, match="activation 'relu' is not supported by the native backend"):
        NativeConfig.from_hf(cfg | {key: "relu"})


@pytest.mark.parametrize("change, field", [
    ({"num_hidden_layers": 0}, "num_hidden_layers"), ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers"), ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers"), ({"hidden_size": "32"}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"), ({"intermediate_size": None}, "intermediate_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"), ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),  # 9 heads in groups of 2
    ({"num_attention_heads": 7, "num_key_value_heads": 7, "head_dim": None}, "hidden_size"),  # 576 / 7
    ({"head_dim": 7}, "head_dim"), ({"head_dim": 0}, "head_dim"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"), ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"rope_parameters": {"rope_theta": 0.0}}, "rope_theta"), ({"rope_parameters": {"rope_theta": -1e4}}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": float("inf")}}, "rope_theta"), ({"rope_parameters": {"rope_theta": "abc"}}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": 10**400}}, "rope_theta"),
    ({"rope_parameters": [1, 2]}, "rope_parameters"), ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"), ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"max_position_embeddings": "8192"}, "max_position_embeddings"),
])
def test_a_malformed_config_is_refused_in_one_line_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field) as err:
        NativeConfig.from_hf({**SMOLLM2, **change})
    assert "\n" not in str(err.value)


def test_weights_of_layers_the_config_does_not_declare_are_refused():
    """A config declaring fewer layers than the weights hold would run another model without a word
    (the rest dropped); one declaring more, a KeyError.  A GGUF's leftover 4-bit blocks count too."""
    from specdec.models.linear import quantize_q4_1

    cfg, w = tiny_llama_weights()
    extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in w.items() if ".layers.1." in k}
    with pytest.raises(ConfigError, match=r"declares 2 layers but the weights hold layers 0\.\.2"):
        NativeCausalLM(cfg, {**w, **extra})
    with pytest.raises(ConfigError, match=r"declares 3 layers but the weights hold layers 0\.\.1"):
        NativeCausalLM(dataclasses.replace(cfg, n_layers=3), dict(w))
    blocks = {"model.layers.2.mlp.up_proj.weight": quantize_q4_1(w["model.layers.1.mlp.up_proj.weight"])}
    with pytest.raises(ConfigError, match=r"declares 2 layers but the weights hold layers 0\.\.2"):
        NativeCausalLM(cfg, dict(w), quant="q4", q4_blocks=blocks)
    NativeCausalLM(cfg, dict(w))  # as declared: fine


@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_rotary_tables_grow_on_demand_with_the_same_bits(tmp_path, monkeypatch, model_type):
    """The rotary tables cover the first 4,096 positions and double as a sequence needs more (a
    context of 10^5-10^6 positions cost 10^8 bytes of tables up front, and an absurd one gigabytes):
    with tables of 8 rows to start, prefill, steps, a tree pass and a batched pass give the bits of
    a model built with the whole context's tables (Gemma 3: its sliding layers' own tables too),
    and a position past the context is still refused."""
    from specdec import defaults
    from specdec.engine import Engine, EngineConfig

    folder = str(make_tiny(tmp_path / model_type, model_type=model_type, max_positions=64, window=4 if model_type == "gemma3" else None,
                           norms=True))

    def model(initial: int):
        monkeypatch.setattr(defaults, "ROPE_TABLE_INITIAL", initial)
        return Engine.build(EngineConfig(target=folder, draft="none", dtype="float32")).target.model

    grown, whole = model(8), model(4096)
    assert grown._cos.shape[0] == 8 and whole._cos.shape[0] == 64
    ids = torch.tensor([(7 * i) % 50 + 3 for i in range(60)])
    outs = []
    for m in (grown, whole):
        cache = m.new_cache(64)
        prefill = m.forward(ids[:20], cache)
        steps = [m.forward(ids[i : i + 1], cache) for i in range(20, 50)]
        tree = m.forward_tree(ids[50:55], torch.tensor([-1, 0, 0, 1, 1]), cache)
        other = m.new_cache(64)
        m.forward(ids[:30], other)
        batched = m.forward_batch([(ids[30:33], other, False), (ids[55:57], m.new_cache(64), False)])
        outs.append([prefill, *steps, tree, *batched])
        with pytest.raises(ValueError, match="past the model's context of 64"):
            m._rope_rows(65)
    assert grown._cos.shape[0] == 64
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_failed_batched_pass_undoes_every_sequences_reservation():
    """The second sequence's cache is full: the pass raises, and the first sequence's cache, reserved
    already, is back at its length, so the same pass (with room) then gives what it gives alone."""
    model = tiny_native()
    ids = torch.arange(1, 9)
    roomy, full = model.new_cache(32), model.new_cache(4)
    model.forward(ids[:3], roomy)
    model.forward(ids[:3], full)
    with pytest.raises(ValueError, match="full"):
        model.forward_batch([(ids[3:6], roomy, False), (ids[3:6], full, False)])
    assert roomy.length == 3 and full.length == 3
    alone = model.new_cache(32)
    model.forward(ids[:3], alone)
    want = model.forward(ids[3:6], alone)
    (got,) = model.forward_batch([(ids[3:6], roomy, False)])
    assert torch.equal(got, want) and roomy.length == 6


@pytest.mark.skipif(not int8_available(), reason="this torch build has no int8 engine")
def test_an_int8_linear_adds_its_bias():
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(40, 64, generator=g) * 0.05, torch.randn(40, generator=g) * 5
    x = torch.randn(3, 64, generator=g)
    got = Int8Linear(w, bias)(x)
    assert torch.allclose(got, x @ w.T + bias, atol=0.05)
    assert torch.allclose(Int8Linear(w)(x), x @ w.T, atol=0.05)


TREE = torch.tensor([-1, 0, 0, 1, 1, 2, 5])  # branches, then a chain below node 2


def test_exact_tree_passes_on_aten_attention_are_bitwise_the_python_loop(monkeypatch):
    """Without the attention kernel, an exact model's tree pass runs the TorchScript loop's own
    per-node schedule (runs of nodes extending one another): its logits and the cache it leaves
    (the region back in node order) bitwise the Python loop's, and each node bitwise its path
    scored token by token."""
    monkeypatch.setattr(kernels, "attention_kernel", lambda: False)
    model = tiny_native()
    assert model.scripted is not None
    ids = torch.arange(3, 13)
    nodes = ids[3:10]

    def tree():
        cache = model.new_cache(64)
        model.forward(ids[:3], cache)
        return model.forward_tree(nodes, TREE, cache), cache.k[:, :, :10].clone(), cache.v[:, :, :10].clone()

    got, k, v = tree()
    want, want_k, want_v = on_python_loop(model, tree)
    assert torch.equal(got, want) and torch.equal(k, want_k) and torch.equal(v, want_v)
    for j, path in ((4, [0, 1, 4]), (6, [0, 2, 5, 6])):
        cache = model.new_cache(64)
        model.forward(ids[:3], cache)
        rows = model.forward(nodes[path], cache)
        assert torch.equal(got[j], rows[-1])


def test_a_cache_never_holds_more_than_the_models_context():
    """new_cache clamps a longer request to the model's context, and keeps a shorter one."""
    model = tiny_native(max_length=128)
    assert model.new_cache(1000).max_length == 128
    assert model.new_cache().max_length == 128
    assert model.new_cache(40).max_length == 40


def test_n_params_counts_every_layer_matrix_and_the_embedding_once_when_tied():
    """n_params is the weights' element count but for the norms' gains: q, k, v (two KV heads
    each), o, gate, up, down per layer and the embedding, which a tied head does not repeat."""

    model = tiny_native()
    _, w = tiny_llama_weights()
    assert model.n_params == sum(t.numel() for name, t in w.items() if not name.endswith("norm.weight"))


#: a small Llama config (SmolLM2's layout, trimmed)
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
         "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("field", ["rope_type", "type"])
def test_rope_scaling_is_refused_by_name(key, field):
    """A scaled rotary embedding (linear, YaRN, Llama 3's) is refused naming its type, under either
    key and either spelling of the type's field; the default type is read."""

    cfg = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    with pytest.raises(ConfigError, match="rope scaling 'yarn' is not supported"):
        NativeConfig.from_hf({**cfg, key: {field: "yarn", "factor": 4.0, "rope_theta": 1e4}})
    assert NativeConfig.from_hf({**cfg, key: {field: "default", "rope_theta": 1e4}}).rope_theta == 1e4


def test_a_config_without_a_context_length_gets_2048_positions():
    """max_position_embeddings absent (or null) reads as transformers' Llama default, 2048."""

    cfg = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    assert NativeConfig.from_hf(cfg).max_length == 2048
    assert NativeConfig.from_hf({**cfg, "max_position_embeddings": None}).max_length == 2048
    assert NativeConfig.from_hf(LLAMA).max_length == 512


@pytest.mark.parametrize("invariant", [True, False])
def test_layer_subset_plans_are_bitwise_the_python_loop(invariant):
    """run_layers with skipped sub-layers and cache slots other than the layer index: the compiled
    loop's raw residual stream (no final norm) and the keys it writes to each slot are bitwise the
    Python loop's, and a layer whose attention is skipped writes nothing."""

    cfg, w = tiny_llama_weights()
    model = NativeCausalLM(cfg, w, batch_invariant=invariant)
    assert model.scripted is not None
    steps = [(1, True, False), (0, False, True), (1, False, True)]
    x = model.embed_tokens(torch.arange(5, 10))

    def run():
        cache = model.new_cache(64)
        cache.reserve(2)
        first = model.run_layers(x[:2], cache, steps, start=0, slots=[0, 1, 1])
        cache.reserve(3)
        rest = model.run_layers(x[2:], cache, steps, start=2, slots=[0, 1, 1])
        return torch.cat([first, rest]), cache.k[:, :, :5].clone(), cache.v[:, :, :5].clone()

    got, k, v = run()
    want, want_k, want_v = on_python_loop(model, run)
    assert torch.equal(got, want) and torch.equal(k, want_k) and torch.equal(v, want_v)
    assert not torch.equal(got, model.final_norm(got))  # the raw residual stream
    assert k[0].any() and not k[1].any() and not v[1].any()  # slot 1: only skipped attention, nothing written


def test_a_pass_as_drafted_writes_nothing_to_the_cache():
    """run_layers(as_drafted=True) reads the cache's keys and values and writes none of its own."""
    model = tiny_native()
    cache = model.new_cache(64)
    model.forward(torch.arange(3, 9), cache)
    k, v = cache.k.clone(), cache.v.clone()
    x = model.embed_tokens(torch.arange(4, 8))
    model.run_layers(x, cache, [(0, True, True), (1, True, True)], start=3, as_drafted=True)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_a_chain_of_parents_not_covering_the_grown_region_is_refused():
    """forward_tree with ``prefix``: ``parents`` must cover the region [prefix, end), a chain too
    (a chain that does not is refused, not scored as if it started at the new rows)."""
    model = tiny_native()
    cache = model.new_cache(64)
    model.forward(torch.arange(3, 8), cache)
    with pytest.raises(ValueError, match="expected 4 tree parents"):
        model.forward_tree(torch.arange(8, 10), torch.tensor([-1, 0]), cache, prefix=3)
    fresh = model.new_cache(64)
    model.forward(torch.arange(3, 8), fresh)
    model.forward_tree(torch.arange(8, 10), torch.tensor([-1, 0, 1, 2]), fresh, prefix=3)  # covering it: fine


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("parents", [[-1, 0, 1], [-1, 5], [-1, 1], [-2, 0]])
def test_a_refused_tree_pass_leaves_the_cache_as_it_was(invariant, parents):
    """Parents of the wrong count, past the tree, pointing at a node itself or below the root level
    are a ValueError that says so, and the cache keeps its length: the next pass scores as if the
    refused one had never been asked for."""

    cfg, w = tiny_llama_weights()
    model = NativeCausalLM(cfg, w, batch_invariant=invariant)
    cache, plain = model.new_cache(64), model.new_cache(64)
    model.forward(torch.arange(3, 8), cache)
    model.forward(torch.arange(3, 8), plain)
    with pytest.raises(ValueError, match="tree parents"):
        model.forward_tree(torch.arange(8, 10), torch.tensor(parents), cache)
    assert cache.length == 5
    assert torch.equal(model.forward(torch.arange(8, 10), cache), model.forward(torch.arange(8, 10), plain))


needs_int8 = pytest.mark.skipif(not int8_available(), reason="this torch build has no int8 engine")


@needs_int8
def test_an_int8_heads_weights_use_the_whole_int8_range_per_output_channel():
    """Per-output-channel symmetric quantisation with scale max|w| / 127: every row's largest
    weight becomes +-127 and the row's scale is exactly max|w| / 127."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=g) * (torch.rand(40, 1, generator=g) * 3 + 0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw, _ = torch.ops.quantized.linear_unpack(Int8Linear(w).packed)
    assert torch.equal(qw.int_repr().abs().amax(1), torch.full((40,), 127, dtype=torch.int8))
    want = (w.abs().amax(1) / 127.0).double()
    assert torch.allclose(qw.q_per_channel_scales(), want, rtol=1e-6)


@needs_int8
def test_an_int8_heads_activations_are_quantised_with_reduce_range():
    """The draft's int8 head quantises activations with fbgemm's ``reduce_range`` (7 bits), which
    keeps the u8 x s8 pair sums of CPUs without VNNI from saturating int16; inputs are picked so
    that the 7- and 8-bit results differ (40 x 64 weight, 3 rows)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=g) * 0.05
    x = torch.randn(3, 64, generator=g)
    lin = Int8Linear(w)
    seven = torch.ops.quantized.linear_dynamic(x, lin.packed, True)
    eight = torch.ops.quantized.linear_dynamic(x, lin.packed, False)
    assert not torch.equal(seven, eight)
    assert torch.equal(lin(x), seven)


def test_an_rms_norm_eps_of_zero_is_read():
    """rms_norm_eps must be "at least 0" (not above): zero is a valid epsilon, only negatives are refused."""
    assert NativeConfig.from_hf({**LLAMA, "rms_norm_eps": 0.0}).rms_eps == 0.0
    assert NativeConfig.from_hf({**LLAMA, "rms_norm_eps": 0}).rms_eps == 0.0


def test_a_given_head_dim_frees_hidden_size_from_being_a_multiple_of_the_heads():
    """hidden_size need divide by the heads only where head_dim is derived from it (Qwen3 and
    Gemma 3 give head_dim, and their hidden size need not be heads * head_dim)."""
    cfg = NativeConfig.from_hf({**LLAMA, "num_attention_heads": 7, "num_key_value_heads": 7, "head_dim": 16})
    assert (cfg.n_heads, cfg.head_dim, cfg.hidden_size) == (7, 16, 32)


def test_a_draft_vocabulary_id_equal_to_the_vocab_size_is_refused():
    """Draft-vocabulary ids lie in 0..V-1: an id of V is refused as a ConfigError naming the range
    (not an IndexError from deep inside the head's construction)."""
    cfg, w = tiny_llama_weights(vocab=64)
    with pytest.raises(ConfigError, match=r"0\.\.63"):
        NativeCausalLM(cfg, dict(w), vocab_subset=torch.tensor([0, 5, 64]))
    NativeCausalLM(cfg, dict(w), vocab_subset=torch.tensor([0, 5, 63]))  # the last id: fine


def test_a_reduced_head_over_an_id_past_the_vocabulary_is_none():
    """reduced_head returns None (the draft then drafts over every token) for ids outside 0..V-1,
    the id V included, rather than failing."""
    model = tiny_native(vocab=64)
    assert model.reduced_head(torch.tensor([1, 64])) is None
    assert model.reduced_head(torch.tensor([-1, 3])) is None
    assert model.reduced_head(torch.tensor([1, 63])) is not None


def test_low_precision_rows_are_causal_attention_over_their_own_key_too():
    """A bfloat16 row at position p attends to keys 0..p, its own included (a float64 reference;
    10 random (start, n) cases, bfloat16 accuracy)."""
    g = torch.Generator().manual_seed(3)
    for case in range(10):
        start, n = case * 3, 1 + case % 4
        k = torch.randn(2, 64, 16, generator=g)
        v = torch.randn(2, 64, 16, generator=g)
        q = torch.randn(n, 4, 16, generator=g) * 0.25
        out = _attend_rows_aten(q.bfloat16(), k.bfloat16(), v.bfloat16(), start).float()
        kd, vd = k.bfloat16().double(), v.bfloat16().double()
        for j in range(n):
            p = start + j
            s = torch.einsum("hgd,htd->hgt", q[j].bfloat16().double().view(2, 2, 16), kd[:, : p + 1])
            ref = torch.einsum("hgt,htd->hgd", torch.softmax(s, -1), vd[:, : p + 1]).reshape(-1)
            assert torch.allclose(out[j].double(), ref, atol=3e-2), (start, j)
