"""Sliding-window layers on the native backend (Mistral, a windowed Qwen2, Gemma 3): a row at position
``p >= window`` sees keys ``p - window + 1 .. p`` alone.

The models are tiny and random with a 4-token window, so every pass below crosses it: equal to
transformers to rounding, and, on a batch-invariant model, every row bitwise what decoding it alone
computes -- in a chain pass, a batched pass, a token tree deeper than the window, and a pass that
starts below the window and ends past it; and the fused layer call, which windows steps, chain, tree
and batched passes itself, bitwise the Python loop there."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.errors import ConfigError
from specdec.drafters import NgramDrafter
from specdec.drafters.self_spec import LayerPlan, LayerView, SelfSpecDrafter
from specdec.gamma import FixedGamma
from specdec.models import kernels
from specdec.models.hf import HFCausalLM
from specdec.models.linear import w8a8_available
from specdec.models.native import NativeCausalLM, NativeConfig, layer_windows
from specdec.sampling import SamplingConfig
from specdec.drafters.tree_builder import TreeSpec
from specdec.verify import get_rule
from tiny import make_tiny, on_python_loop

WINDOW = 4
#: (model type, the layers' kinds written into the config: None keeps what transformers wrote)
KINDS = {
    "mistral": ("mistral", None),  # every layer windowed
    "qwen2-mixed": ("qwen2", ["full_attention", "sliding_attention", "sliding_attention"]),
    "gemma3": ("gemma3", None),  # sliding, full, sliding (its own layer layout: see test_gemma3.py)
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def windowed_folder(request, tmp_path_factory):
    model_type, kinds = KINDS[request.param]
    folder = make_tiny(tmp_path_factory.mktemp(request.param), model_type=model_type, window=WINDOW, layers=3, norms=True)
    if kinds is not None:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        cfg["layer_types"] = kinds
        path.write_text(json.dumps(cfg))
    return folder


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def _one_by_one(model: NativeCausalLM, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, V], each row decoded alone
    cache = model.new_cache(64)
    return torch.cat([model.forward(ids[i : i + 1], cache) for i in range(ids.numel())])


def test_the_windows_are_read_as_transformers_reads_them():
    n = {"num_hidden_layers": 3}
    assert layer_windows({**n, "model_type": "mistral", "sliding_window": 8}) == (8, (True, True, True))
    assert layer_windows({**n, "model_type": "mistral", "sliding_window": None}) == (None, ())
    # Qwen2 windows nothing unless asked, then the layers from max_window_layers on
    assert layer_windows({**n, "model_type": "qwen2", "sliding_window": 8, "max_window_layers": 1}) == (None, ())
    assert layer_windows({**n, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
                          "max_window_layers": 1}) == (8, (False, True, True))
    assert layer_windows({**n, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention", "full_attention"]}) == (8, (True, False, False))
    assert layer_windows({**n, "model_type": "llama", "sliding_window": 8}) == (None, ())

    with pytest.raises(ConfigError, match="chunked_attention"):
        layer_windows({**n, "model_type": "mistral", "sliding_window": 8,
                       "layer_types": ["chunked_attention", "full_attention", "full_attention"]})


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("layers", [4, 30])
@pytest.mark.parametrize("first", [None, 2])
def test_qwen_windows_match_transformers_with_and_without_max_window_layers(kind, layers, first):
    """Without ``max_window_layers`` a Qwen config slides from transformers' default layer (28) on:
    no layer of a 4-layer model, the last two of a 30-layer one (not none of them)."""
    import transformers

    cfg = {"model_type": kind, "num_hidden_layers": layers, "sliding_window": 8, "use_sliding_window": True}
    if first is not None:
        cfg["max_window_layers"] = first
    config_class = transformers.Qwen2Config if kind == "qwen2" else transformers.Qwen3Config
    theirs = tuple(t == "sliding_attention" for t in config_class(**cfg).layer_types)
    expected = (8, theirs) if any(theirs) else (None, ())
    assert layer_windows(cfg) == expected
    assert any(theirs) == (first is not None or layers > 28)


def test_specdecs_own_window_key_windows_every_layer_of_any_model():
    from specdec.models.native import OWN_WINDOW_KEY

    n = {"num_hidden_layers": 3}
    # a Llama has no window in transformers' reading; specdec's own key gives it one
    assert layer_windows({**n, "model_type": "llama", OWN_WINDOW_KEY: 512}) == (512, (True, True, True))
    assert layer_windows({**n, "model_type": "llama", "sliding_window": 8, OWN_WINDOW_KEY: 16}) == (16, (True, True, True))
    for bad in (0, -3, 2.5, "512", True):
        with pytest.raises(ConfigError, match=OWN_WINDOW_KEY):
            layer_windows({**n, "model_type": "llama", OWN_WINDOW_KEY: bad})


def test_the_shipped_draft_attends_to_its_last_512_positions():
    from specdec.models.native import OWN_WINDOW_KEY
    from specdec.models.registry import read_config, resolve

    cfg = read_config(resolve("smollm2-135m-draft").folder)
    assert cfg[OWN_WINDOW_KEY] == 512 and cfg["model_type"] == "llama"
    assert layer_windows(cfg) == (512, (True,) * cfg["num_hidden_layers"])
    # with no distance past 512 seen, it drafts through the whole of its target's context
    assert cfg["max_position_embeddings"] == read_config(resolve("smollm2-135m").folder)["max_position_embeddings"]


def test_a_llama_with_the_own_key_is_the_same_model_as_mistral_with_that_window(tmp_path):
    """The key changes nothing but the window: a tiny Llama given it scores 23 positions through a
    4-token window bitwise as the same weights loaded as a Mistral with that window, and differs from
    the Llama without it past the window."""
    from specdec.models.native import OWN_WINDOW_KEY

    folder = make_tiny(tmp_path / "llama", model_type="llama", layers=3, norms=True)
    path = folder / "config.json"
    plain = json.loads(path.read_text())
    ids = _ids(23, seed=2)
    full = NativeCausalLM.from_folder(folder, batch_invariant=True).forward(ids, NativeCausalLM.from_folder(folder).new_cache(64))
    path.write_text(json.dumps({**plain, OWN_WINDOW_KEY: WINDOW}))
    own = NativeCausalLM.from_folder(folder, batch_invariant=True)
    got = own.forward(ids, own.new_cache(64))
    path.write_text(json.dumps({**plain, "model_type": "mistral", "sliding_window": WINDOW}))
    mistral = NativeCausalLM.from_folder(folder, batch_invariant=True)
    assert torch.equal(got, mistral.forward(ids, mistral.new_cache(64)))
    assert torch.equal(got[:WINDOW], full[:WINDOW]) and not torch.allclose(got[WINDOW:], full[WINDOW:])


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
def test_matches_transformers_past_the_window(windowed_folder, invariant):
    """The whole context (not the window) is the native model's, and 23 positions through a 4-token
    window give transformers' logits, in one pass and one token at a time."""
    native = NativeCausalLM.from_folder(windowed_folder, batch_invariant=invariant)
    hf = HFCausalLM.from_folder(str(windowed_folder))
    assert native.max_length == 256 and native.cfg.sliding_window == WINDOW
    ids = _ids(23)
    want = hf.forward(ids, hf.new_cache())
    assert torch.allclose(native.forward(ids, native.new_cache(64)), want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(_one_by_one(native, ids), want, atol=1e-4, rtol=1e-4)
    # the partial passes self-speculative views run, every layer on: the same model
    steps = tuple((li, True, True) for li in range(native.cfg.n_layers))
    cache = native.new_cache(64)
    cache.reserve(ids.numel())
    with torch.inference_mode():
        layered = native.head(native.run_layers(native.embed_tokens(ids), cache, steps, start=0))
    assert torch.allclose(layered, want, atol=1e-4, rtol=1e-4)
    # a batched pass: one sequence past the window beside one below it
    caches = [native.new_cache(64), native.new_cache(64)]
    native.forward(ids[:8], caches[0])
    got = native.forward_batch([(ids[8:], caches[0], False), (ids[:3], caches[1], False)])
    assert torch.allclose(got[0], want[8:], atol=1e-4, rtol=1e-4) and torch.allclose(got[1], want[:3], atol=1e-4, rtol=1e-4)


def _quantised(folder, quant):
    if quant is not None and not (w8a8_available() and (quant != "q4" or kernels.q4_available())):
        pytest.skip(f"{quant} needs the int8 engine and the kernel library")
    return NativeCausalLM.from_folder(folder, batch_invariant=True, quant=quant)


@pytest.mark.parametrize("quant", [None, "int8", "q4"])
def test_each_row_is_bitwise_as_decoded_alone_in_every_pass(windowed_folder, quant):
    """Batch-invariant: a chain pass from below the window (its first rows in the compiled loop's
    reach) to past it, a later chain pass, and one batched pass of three sequences (below, across
    and past the window) give every row the bits of decoding it alone."""
    model = _quantised(windowed_folder, quant)
    ids = _ids(20, seed=1)
    alone = _one_by_one(model, ids)  # [20, V]
    cache = model.new_cache(64)
    passes = [model.forward(ids[:2], cache), model.forward(ids[2:9], cache), model.forward(ids[9:], cache)]
    assert torch.equal(torch.cat(passes), alone)

    others = [_ids(6, seed=2), _ids(11, seed=3)]
    solo = [_one_by_one(model, s) for s in others]
    caches = [model.new_cache(64) for _ in range(3)]
    model.forward(ids[:9], caches[0])
    model.forward(others[1][:5], caches[2])
    got = model.forward_batch([(ids[9:], caches[0], False), (others[0], caches[1], False), (others[1][5:], caches[2], False)])
    assert torch.equal(got[0], alone[9:]) and torch.equal(got[1], solo[0]) and torch.equal(got[2], solo[1][5:])


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_fused_passes_past_the_window_are_bitwise_the_python_loop(windowed_folder, quant):
    """The fused layer call windows a row's keys itself: decoding steps across the window, a chain
    pass past it, a token tree deeper than the window (whole and grown in two calls), a batched
    pass of sequences below, across and past it, and a layer subset's rows across it give the
    logits, keys and values of the Python layer loop (the reference; the model without its
    compiled loops)."""
    model = _quantised(windowed_folder, quant)
    if model.scripted is None or model.scripted.fused is None:
        pytest.skip("the fused layer call is not available here")
    ids = _ids(20, seed=4)

    def run() -> list[torch.Tensor]:
        cache, below, across = model.new_cache(64), model.new_cache(64), model.new_cache(64)
        out = [model.forward(ids[:3], cache)]
        out += [model.forward(ids[i : i + 1], cache) for i in range(3, 8)]  # steps across the window
        out.append(model.forward(ids[8:13], cache))  # a chain pass past it
        base, parents = cache.length, torch.tensor([-1, 0, 0, 1, 3, -1])  # a tree 4 deep past it, whole ...
        out.append(model.forward_tree(ids[13:19], parents, cache))
        cache.truncate(base)
        out.append(model.forward_tree(ids[13:15], parents[:2], cache))  # ... and grown in two calls
        out.append(model.forward_tree(ids[15:19], parents, cache, prefix=base))
        cache.truncate(base)
        model.forward(ids[:1], below)
        model.forward(ids[:2], across)
        out += model.forward_batch([(ids[13:16], cache, False), (ids[1:3], below, False), (ids[2:6], across, False)])
        # a self-speculative draft's layer subset (a skipped MLP, its own cache slots) past the window
        steps, sub = [(0, True, True), (2, True, False)], model.new_cache(64)
        sub.reserve(3)
        x = model.run_layers(torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5)), sub,
                             steps, start=0, slots=[0, 1])
        for i in range(3, 8):
            sub.reserve(1)
            x = torch.cat([x, model.run_layers(x[-1:], sub, steps, start=i, slots=[0, 1])])
        out.append(x)
        return out + [c.k[:, :, : c.length].clone() for c in (cache, below, across, sub)] + \
            [c.v[:, :, : c.length].clone() for c in (cache, below, across, sub)]

    fused, reference = run(), on_python_loop(model, run)
    assert len(fused) == len(reference)
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("quant", [None, "q4"])
def test_tree_nodes_past_the_window_are_bitwise_their_paths(windowed_folder, quant):
    """A tree five nodes deep over a 4-token window: each node's logits (its path's first nodes out of
    its window by then) are bitwise those of decoding the prompt and its path token by token, whole
    and grown over two calls (``prefix``); fast mode agrees to rounding."""
    model = _quantised(windowed_folder, quant)
    prompt, nodes = _ids(6, seed=4), _ids(8, seed=5)
    # depths 0 0 1 2 3 4 1 2: node 5 sits at slot 5 of the region, depth 4; its root (slot 1, depth 0)
    # is out of its window by position, though not by slot
    parents = torch.tensor([-1, -1, 1, 2, 3, 4, 0, 6])

    def path_of(j: int) -> list[int]:
        out = []
        while j >= 0:
            out.append(j)
            j = int(parents[j])
        return out[::-1]

    want = torch.stack([_one_by_one(model, torch.cat([prompt, nodes[path_of(j)]]))[-1] for j in range(8)])
    for split in (None, 3):
        cache = model.new_cache(64)
        model.forward(prompt, cache)
        if split is None:
            got = model.forward_tree(nodes, parents, cache)
        else:
            base = cache.length
            got = torch.cat([model.forward_tree(nodes[:split], parents[:split], cache),
                             model.forward_tree(nodes[split:], parents, cache, prefix=base)])
        assert torch.equal(got, want), split
    if quant is None:
        fast = NativeCausalLM.from_folder(windowed_folder)
        cache = fast.new_cache(64)
        fast.forward(prompt, cache)
        assert torch.allclose(fast.forward_tree(nodes, parents, cache), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
def test_greedy_drafting_past_the_window_equals_plain_greedy(windowed_folder, invariant):
    """40 greedy tokens, ten windows' worth: an early-exit view (its own layers windowed too, cache
    shared on the invariant model), an n-gram tree and a layer-skipping view give plain decoding's
    tokens."""
    model = NativeCausalLM.from_folder(windowed_folder, batch_invariant=invariant)
    prompt = _ids(7, seed=6).tolist() * 2  # repeats, so the n-gram drafter finds something
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    plain = SpeculativeDecoder(model, None, get_rule("greedy")).generate(prompt, cfg).tokens
    drafters = [
        (SelfSpecDrafter(LayerView(model, LayerPlan.early_exit(3, 2), keep_hidden=True), share=True), None),
        (NgramDrafter(max_ngram=3, min_ngram=1), TreeSpec(shape="static", sample=False)),
        (SelfSpecDrafter(LayerView(model, LayerPlan.skipping(3, {1}, {2}))), None),
    ]
    for drafter, tree in drafters:
        out = SpeculativeDecoder(model, drafter, get_rule("greedy"), gamma=FixedGamma(3), tree=tree).generate(prompt, cfg)
        assert out.tokens == plain, type(drafter).__name__


def test_a_pass_as_drafted_sees_each_rows_window(windowed_folder):
    """``run_layers(as_drafted=True)`` (the skip-set search and SWIFT score a set with it): each row
    of one pass past the window gets what the view drafting from that row over the target's keys
    computes, to rounding."""
    model = NativeCausalLM.from_folder(windowed_folder)
    plan = LayerPlan.skipping(3, {1}, set())
    seq = _ids(14, seed=7)
    n, start = seq.numel(), 3
    cache = model.new_cache(n)
    model.forward(seq, cache)
    with torch.inference_mode():
        got = model.head(model.run_layers(model.embed_tokens(seq[start:-1]), cache, plan.steps, start=start, as_drafted=True))
    view = LayerView(model, plan)
    for t in range(start, n - 1):
        own = view.new_cache(n)
        own.reserve(t)
        for slot, layer in enumerate(plan.attention_layers):
            own.k[slot, :, :t] = cache.k[layer, :, :t]
            own.v[slot, :, :t] = cache.v[layer, :, :t]
        assert torch.allclose(got[t - start], view.forward(seq[t : t + 1], own)[0], atol=1e-5, rtol=1e-5), t


def test_a_config_without_windows_keeps_none():
    cfg = NativeConfig.from_hf({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "intermediate_size": 16, "sliding_window": 32768,
                                "max_window_layers": 2, "use_sliding_window": False, "max_position_embeddings": 32768})
    assert cfg.sliding_window is None and cfg.windowed == () and cfg.max_length == 32768


@pytest.mark.parametrize("window", [0, -3, "16", 4.7, True, "x"])
def test_a_sliding_window_of_no_whole_positions_is_refused(window):
    """A Mistral config whose sliding_window is not a whole number of at least one position (a
    string, a float, a bool) is refused in one line naming the field, as every other count is (a
    window of 0 would mask every key of a row past it; 4.7 was read as 4, True as 1)."""
    cfg = {"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
           "num_attention_heads": 2, "intermediate_size": 16, "sliding_window": window}
    with pytest.raises(ConfigError, match="sliding_window must be a whole number, at least 1"):
        layer_windows(cfg)
    with pytest.raises(ConfigError, match="sliding_window must be a whole number, at least 1"):
        NativeConfig.from_hf(cfg)


@pytest.mark.parametrize("first", [-1, 1.5, "1"])
def test_a_qwen_window_start_that_is_no_layer_count_is_refused(first):
    """Qwen2's max_window_layers (0 windows every layer) must be a whole number of at least 0."""
    cfg = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 16, "sliding_window": 4, "use_sliding_window": True, "max_window_layers": first}
    with pytest.raises(ConfigError, match="max_window_layers must be a whole number, at least 0"):
        layer_windows(cfg)
    assert layer_windows({**cfg, "max_window_layers": 0}) == (4, (True, True))


@pytest.mark.parametrize("extra", [
    {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 2},  # the window starts past the last layer
    {"model_type": "mistral", "layer_types": ["full_attention", "full_attention"]},
])
def test_a_window_no_layer_uses_is_no_window(extra):
    """A config naming a window that no layer takes reads as no window at all (so no pass is sent
    to the Python loop for being past it)."""
    cfg = {"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 16, "sliding_window": 4, **extra}
    assert layer_windows(cfg) == (None, ())
    read = NativeConfig.from_hf(cfg)
    assert read.sliding_window is None and read.windowed == ()


def _windowed_tiny(invariant: bool = True):
    """tiny_native's weights as a Mistral with a 4-position window over both layers."""
    import dataclasses

    from tiny import tiny_llama_weights

    cfg, w = tiny_llama_weights()
    cfg = dataclasses.replace(cfg, model_type="mistral", sliding_window=4, windowed=(True, True))
    return NativeCausalLM(cfg, w, batch_invariant=invariant)


@pytest.mark.parametrize("first", [1, 3, 4])
def test_passes_reaching_past_the_window_are_bitwise_the_python_loop(first):
    """Chain, batched and single-row passes whose last row sits at or past the window (position 4:
    the first that sees fewer keys than its position) give the Python loop's bits: the compiled
    TorchScript loops, which do not window, must hand such passes back to it."""

    model = _windowed_tiny()
    assert model.scripted is not None
    ids = torch.arange(3, 12)

    def passes():
        cache = model.new_cache(64)
        out = [model.forward(ids[:first], cache), model.forward(ids[first:5], cache)]
        out += [model.forward(ids[i : i + 1], cache) for i in range(5, 7)]
        a, b = model.new_cache(64), model.new_cache(64)
        model.forward(ids[:first], a)
        out += model.forward_batch([(ids[first:5], a, False), (ids[:5], b, False)])
        return out

    for got, want in zip(passes(), on_python_loop(model, passes)):
        assert torch.equal(got, want)
