"""The engine: how the draft's precision is chosen (it never affects exactness), which options reach the
decoder, and the bounds it puts on them."""

from __future__ import annotations

import json
import re

import pytest
import torch

import specdec.models.linear as linear
from specdec import defaults
from specdec import engine as engine_mod
from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, self_spec
from specdec.drafters.hybrid import LookupThenModel
from specdec.engine import Engine, EngineConfig, draft_dtype, draft_int8_head, make_gamma
from specdec.errors import ConfigError
from specdec.gamma import CostGamma, FixedGamma, TreeBudget
from specdec.models.registry import LoadedModel
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


@pytest.mark.parametrize(
    ("bf16", "int8", "expect_dtype", "expect_int8"),
    [
        (True, True, torch.bfloat16, True),  # native bf16 (AVX512-BF16 / AMX): bf16 layers, int8 LM head
        (True, False, torch.bfloat16, False),  # bf16 without an int8 engine: the whole draft in bf16
        (False, True, torch.float32, True),  # e.g. AVX2: float32 layers, int8 LM head
        (False, False, torch.float32, False),  # neither: plain float32
    ],
)
def test_auto_draft_precision_follows_the_cpu(monkeypatch, bf16, int8, expect_dtype, expect_int8):
    monkeypatch.setattr(linear, "bf16_fast", lambda: bf16)
    monkeypatch.setattr(linear, "int8_available", lambda: int8)
    cfg = EngineConfig()
    assert draft_dtype(cfg) == expect_dtype and draft_int8_head(cfg) is expect_int8


def test_auto_draft_dtype_follows_the_targets_float_dtype_without_resolving_it(monkeypatch):
    """Without fast bf16 the draft takes the target's float dtype: float32 for dtype auto (q4, int8
    and float32 all compute in float32) — decided without reading the target's GGUF header."""
    from specdec.models import gguf_blocks

    monkeypatch.setattr(linear, "bf16_fast", lambda: False)
    monkeypatch.setattr(gguf_blocks, "ships_q4", lambda ref: pytest.fail("resolved the target's dtype"))
    assert draft_dtype(EngineConfig()) == torch.float32
    assert draft_dtype(EngineConfig(dtype="bfloat16")) == torch.bfloat16


def test_explicit_draft_precision(monkeypatch):
    monkeypatch.setattr(linear, "int8_available", lambda: True)
    assert draft_dtype(EngineConfig(draft_dtype="int8")) == torch.float32
    assert draft_int8_head(EngineConfig(draft_dtype="int8"))
    assert not draft_int8_head(EngineConfig(draft_dtype="float32"))
    assert not draft_int8_head(EngineConfig(draft_dtype="int8", backend="hf"))  # native backend only
    with pytest.raises(ConfigError, match="draft dtype"):
        draft_dtype(EngineConfig(draft_dtype="int4"))


@pytest.mark.parametrize(("fbgemm", "q8", "q4", "backend", "asked", "expect"), [
    (True, True, True, "auto", "auto", "q4"),  # AVX-512 VNNI: the 4-bit draft is the faster one
    (True, False, True, "auto", "auto", "q4"),  # AVX2: the 4-bit kernel runs a layer loop in one call
    (True, True, False, "auto", "auto", "int8"),  # no vectorised 4-bit kernel: every layer as the int8 target's
    (True, False, False, "auto", "auto", "int8"),  # no vectorised 4-bit kernel (e.g. no compiler)
    (False, True, True, "auto", "auto", None),  # no fbgemm: the bf16 / float32 rule above
    (True, True, True, "hf", "auto", None),  # the HF backend has no int8 layers
    (True, False, True, "auto", "bfloat16", None),
    (True, False, True, "auto", "int8", None),  # int8 = float32 layers + int8 LM head only
    (True, False, True, "auto", "w8a8", "int8"),
    (True, True, True, "auto", "q4", "q4"),
    (True, True, False, "auto", "q4", "q4"),  # asked for: also where only the slow path runs
])
def test_quantised_draft_where_torch_has_fbgemm(monkeypatch, fbgemm, q8, q4, backend, asked, expect):
    from specdec.engine import draft_quant, head_quant
    from specdec.models import kernels

    monkeypatch.setattr(linear, "w8a8_available", lambda: fbgemm)
    monkeypatch.setattr(kernels, "q8_available", lambda: q8)
    monkeypatch.setattr(kernels, "q4_fast", lambda: q4)
    cfg = EngineConfig(draft_dtype=asked, backend=backend)
    assert draft_quant(cfg) == expect
    assert head_quant(cfg) == ("int8" if expect else None)  # heads have no 4-bit path


@pytest.mark.parametrize(("ships", "fast", "expect"), [(True, True, "q4"), (True, False, "int8"), (False, True, "int8")])
def test_auto_target_is_q4_only_where_its_kernel_is_fast(monkeypatch, ships, fast, expect):
    from specdec.engine import target_dtype
    from specdec.models import gguf_blocks, kernels

    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    monkeypatch.setattr(gguf_blocks, "ships_q4", lambda ref: ships)
    monkeypatch.setattr(kernels, "q4_fast", lambda: fast)
    assert target_dtype(EngineConfig()) == (torch.float32, expect)


def test_w8a8_draft_asked_for_where_it_cannot_run_is_a_config_error(monkeypatch):
    from specdec.engine import draft_quant

    monkeypatch.setattr(linear, "w8a8_available", lambda: False)
    with pytest.raises(ConfigError, match="w8a8"):
        draft_quant(EngineConfig(draft_dtype="w8a8"))


@pytest.mark.skipif(not linear.w8a8_available(), reason="this torch build has no fbgemm int8 engine")
def test_w8a8_and_q4_draft_models_load_with_their_layers(tmp_path):
    from specdec.engine import load_draft
    from tiny import make_tiny

    folder = make_tiny(tmp_path)
    draft = load_draft(EngineConfig(draft=str(folder), draft_dtype="w8a8")).model
    assert draft.quant == "int8" and draft.int8_kernel == "fbgemm"
    assert isinstance(draft.layers[0].qkv, linear.W8A8Linear) and draft.layers[0].qkv.wide is None
    # exact per-row attention where the kernels run, so multi-row passes take the fused loop
    from specdec.models import kernels

    assert draft.batch_invariant == kernels.attention_kernel()
    if kernels.q8_available():
        assert draft.scripted is None or draft.scripted.fused is not None
    q4 = load_draft(EngineConfig(draft=str(folder), draft_dtype="q4")).model
    assert q4.quant == "q4" and all(isinstance(layer.qkv, linear.Q4Linear) for layer in q4.layers)


def test_only_a_quantised_draft_on_the_kernels_is_batch_invariant(monkeypatch):
    from specdec.engine import draft_batch_invariant
    from specdec.models import kernels

    monkeypatch.setattr(kernels, "attention_kernel", lambda: True)
    assert draft_batch_invariant("int8") and not draft_batch_invariant(None)
    monkeypatch.setattr(kernels, "attention_kernel", lambda: False)
    assert not draft_batch_invariant("int8")


def test_draft_precision_in_words(monkeypatch):
    from specdec.engine import draft_precision

    from specdec.models import kernels

    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    monkeypatch.setattr(linear, "int8_available", lambda: True)
    monkeypatch.setattr(kernels, "q8_available", lambda: True)
    monkeypatch.setattr(kernels, "q4_fast", lambda: False)
    assert draft_precision(EngineConfig()) == "w8a8"
    monkeypatch.setattr(kernels, "q4_fast", lambda: True)
    assert draft_precision(EngineConfig()) == "q4"
    assert draft_precision(EngineConfig(draft_dtype="w8a8")) == "w8a8"
    assert draft_precision(EngineConfig(draft_dtype="int8")) == "float32 + int8 head"
    assert draft_precision(EngineConfig(draft_dtype="bfloat16")) == "bfloat16"
    monkeypatch.setattr(linear, "w8a8_available", lambda: False)
    monkeypatch.setattr(linear, "bf16_fast", lambda: True)
    assert draft_precision(EngineConfig()) == "bfloat16 + int8 head"


def test_attach_puts_several_drafters_on_one_loaded_target(tmp_path):
    from tiny import make_tiny

    target = str(make_tiny(tmp_path / "t", seed=0))
    draft = str(make_tiny(tmp_path / "d", seed=1, layers=1))
    first = Engine.build(EngineConfig(target=target, draft=draft, dtype="float32", draft_dtype="float32"))
    second = Engine.attach(first.target, EngineConfig(target=target, draft="ngram", dtype="float32"))
    assert second.target is first.target and second.drafter_name == "ngram" and first.drafter is not second.drafter
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    plain = Engine(first.target, None, "none").generate([1, 2, 3, 4], cfg).token_ids
    assert first.generate([1, 2, 3, 4], cfg).token_ids == plain == second.generate([1, 2, 3, 4], cfg).token_ids
    with pytest.raises(ConfigError, match="lookup"):  # the same name checks as build(), before anything loads
        Engine.attach(first.target, EngineConfig(target=target, draft="ngram+lookup"))


def test_the_package_exports_the_library_entry_points_lazily():
    """``from specdec import Engine, EngineConfig, SamplingConfig`` works (the README's library
    example), and ``import specdec`` alone does not import torch."""
    import subprocess
    import sys

    import specdec

    assert (specdec.Engine, specdec.EngineConfig, specdec.SamplingConfig) == (Engine, EngineConfig, SamplingConfig)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        specdec.Nope  # noqa: B018
    probe = "import sys, specdec; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_hub_id_runs_in_float_on_the_hf_backend():
    """A hub id loads through transformers: auto means float32 there (not a quantised label the
    loader would ignore), and asking for int8 / q4 is refused before anything loads."""
    from specdec.engine import target_dtype

    assert target_dtype(EngineConfig(target="someorg/some-model")) == (torch.float32, None)
    assert target_dtype(EngineConfig(target="someorg/some-model", dtype="bfloat16")) == (torch.bfloat16, None)
    for quant in ("int8", "q4"):
        with pytest.raises(ConfigError, match="needs a local model"):
            target_dtype(EngineConfig(target="someorg/some-model", dtype=quant))


def test_with_prefix_cache_only_where_it_is_exact(tmp_path):
    """A batch-invariant target gets the prefix cache in front of its prefills; one that is not
    (--fast-attention) is left as it is."""
    from tiny import make_tiny

    folder = str(make_tiny(tmp_path, layers=1))
    exact = Engine.build(EngineConfig(target=folder, draft="none"))
    cached = exact.with_prefix_cache(1 << 20)
    assert cached is not exact and cached.target.model.prefix_cache.max_bytes == 1 << 20
    assert cached.target.model.inner is exact.target.model and cached.target.tokenizer is exact.target.tokenizer
    fast = Engine.build(EngineConfig(target=folder, draft="none", batch_invariant=False))
    assert fast.with_prefix_cache() is fast


def test_a_model_the_native_backend_cannot_run_loads_in_float(tmp_path, monkeypatch):
    """``--dtype auto`` quantises only what the native backend runs (read off a folder's config or a
    GGUF's header, nothing converted): a GPT-2 folder or GGUF runs in float32 on the hf backend,
    and asking for int8 / q4 there is refused before anything loads; a Llama and a Gemma 3 (folder
    or GGUF) still get their quantised target."""

    import gguf
    from tiny import make_tiny

    from specdec.engine import target_dtype
    from specdec.models import registry

    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    gemma, llama = make_tiny(tmp_path / "gemma", model_type="gemma3"), make_tiny(tmp_path / "llama")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (gpt2 / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    files = {}
    for arch in ("gpt2", "gemma3", "llama"):
        files[arch] = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(files[arch]), arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((llama / "config.json").read_text())  # no weights: not native
    refs = (gpt2, gemma, llama, bare, files["gpt2"], files["gemma3"], files["llama"], tmp_path / "junk.gguf", tmp_path / "missing")
    runs = {ref: registry.native_runs(str(ref)) for ref in refs}
    assert list(runs.values()) == [False, True, True, False, False, True, True, None, None]
    assert registry.native_runs("smollm2-135m") and registry.native_runs("someorg/some-model") is False
    for ref in (gpt2, files["gpt2"]):
        assert target_dtype(EngineConfig(target=str(ref))) == (torch.float32, None)
        for quant in ("int8", "q4"):
            with pytest.raises(ConfigError, match="needs the native backend"):
                target_dtype(EngineConfig(target=str(ref), dtype=quant))
    for ref in (llama, gemma):
        assert target_dtype(EngineConfig(target=str(ref)))[1] in ("int8", "q4")


def test_the_default_drafter_falls_back_to_lookup_on_another_tokenizer(tmp_path):
    """With no --draft given, a target whose vocabulary the default draft model does not share
    drafts by prompt lookup (and says so) instead of failing; a draft asked for by name still fails."""
    from tiny import make_tiny

    from specdec.errors import SpecdecError

    target = str(make_tiny(tmp_path / "wide", vocab=49_280))  # the same tokens, more rows: not the draft's ids
    said: list[str] = []
    engine = Engine.build(EngineConfig(target=target, draft=defaults.DEFAULT_DRAFT, dtype="float32"), progress=said.append)
    assert engine.drafter_name == "ngram" and any("prompt lookup" in line for line in said)
    with pytest.raises(SpecdecError, match="vocabulary"):
        Engine.build(EngineConfig(target=target, draft=defaults.DEFAULT_DRAFT_MODEL, dtype="float32"))


def test_a_windowed_model_runs_natively_to_its_full_context(tmp_path):
    """A model with a sliding window (4 tokens here) loads on the native backend with its whole
    context, and greedy decoding ten windows long gives the hf backend's tokens."""
    from tiny import make_tiny

    folder = str(make_tiny(tmp_path / "mistral", model_type="mistral", window=4))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40)
    runs = {}
    for backend in ("native", "hf"):
        engine = Engine.build(EngineConfig(target=folder, draft="none", dtype="float32", backend=backend))
        assert engine.target.backend == backend and engine.target.model.max_length == 256
        runs[backend] = engine.generate([1, 2, 3, 4, 5, 6], cfg).token_ids
    assert runs["native"] == runs["hf"] and len(runs["native"]) == 40


@pytest.mark.parametrize("kwargs, says", [
    ({"target": None}, "target must be a string, got None"),  # was AttributeError: 'NoneType' ... 'strip'
    ({"draft": 3}, "draft must be a string, got 3"),
    ({"backend": "bogus"}, "unknown backend 'bogus'; choose auto, native or hf"),  # was an int8 message
    ({"batch_invariant": "yes"}, "batch_invariant must be True or False"),
    ({"chat_template": b"x"}, "chat_template must be a string, got bytes"),
    ({"chat_template": "{% for m in messages %}{{ m.content }}"}, "the chat template does not compile"),  # was: at the first chat
    ({"chat_template": " "}, "the chat template is empty"),  # was: "this model has no chat template"
])
def test_engine_config_refuses_values_of_the_wrong_kind(kwargs, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        EngineConfig(**kwargs)


def test_engine_config_takes_a_folder_as_a_path(tmp_path):
    assert EngineConfig(target=tmp_path, draft=tmp_path / "d") == EngineConfig(target=str(tmp_path), draft=str(tmp_path / "d"))


@pytest.mark.parametrize("ids", [[1.9, 2.5, 7.2], [1, 2.0, 3], [True, 5], [1, 2**70]])
def test_a_draft_vocabulary_of_floats_or_booleans_is_refused(tmp_path, ids):
    """``torch.tensor(..., dtype=long)`` used to truncate them to other token ids without a word."""

    from specdec.engine import draft_vocabulary

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": ids}))
    with pytest.raises(ConfigError, match="not a draft vocabulary"):
        draft_vocabulary(EngineConfig(), str(tmp_path))
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [1, 5, 9]}))
    assert draft_vocabulary(EngineConfig(), str(tmp_path)).tolist() == [1, 5, 9]


TARGET = ToyLM(4, order=2, seed=0)
DRAFT = TARGET.perturbed(1.0, seed=1)
EOS = frozenset({3})


class _Tok:
    """Enough of a tokenizer for the text sink: token 3 (the end of sequence) reads "<e>" where
    special tokens are kept."""

    all_special_ids = [3]
    eos_token_id = 3

    def decode(self, ids, skip_special_tokens=False, **kw):
        return "".join("abc"[i] if i != 3 else ("" if skip_special_tokens else "<e>") for i in ids)

    def __len__(self):
        return 4


class _ChainOnly(ModelDrafter):
    """A model drafter without a tree pass (as self-speculative views and MTP heads)."""

    supports_trees = False


def _engine(drafter=None, tokenizer=None) -> Engine:
    return Engine(LoadedModel("toy", TARGET, tokenizer, None, "toy", EOS), drafter or ModelDrafter(DRAFT), "toy")


def test_ignore_eos_keeps_the_end_of_sequence_text_where_special_tokens_are_kept():
    """Past an ignored end of sequence the text goes on, and with special tokens kept shows each one."""
    eng = _engine(tokenizer=_Tok())
    kept = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10, skip_special_tokens=False), gamma=3,
                        ignore_eos=True)
    assert kept.token_ids == [1, 3, 2, 1, 3, 2, 1, 3, 2, 1] and kept.text == "b<e>cb<e>cb<e>cb"
    last = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=8, skip_special_tokens=False), gamma=3,
                        ignore_eos=True)  # an ignored end of sequence as the last token: still shown
    assert last.token_ids[-1] == 3 and last.text == "b<e>cb<e>cb<e>"
    skipped = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10), gamma=3, ignore_eos=True)
    assert skipped.text == "bcbcbcb"
    ended = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10, skip_special_tokens=False), gamma=3)
    assert ended.token_ids == [1, 3] and ended.text == "b"


def test_ignore_eos_reaches_the_decoder():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    stopped = _engine().generate([1, 2], cfg, gamma=3)
    assert stopped.token_ids[-1] in EOS and len(stopped.token_ids) < 20
    plain = SpeculativeDecoder(TARGET, None, get_rule("greedy")).generate([1, 2], cfg).tokens  # no eos at all
    out = _engine().generate([1, 2], cfg, gamma=3, ignore_eos=True)
    assert out.token_ids == plain and len(out.token_ids) == 20
    assert _engine().decoder(get_rule("greedy"), ignore_eos=True).eos_ids == frozenset()
    assert _engine().decoder(get_rule("greedy")).eos_ids == EOS


def test_max_draft_and_min_confidence_reach_the_decoder():
    rule = get_rule("greedy")
    dec = _engine().decoder(rule, 6, max_draft=2, min_confidence=0.25)
    assert dec.max_draft == 2 and dec.min_confidence == 0.25
    out = _engine().generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=30), gamma=6, max_draft=2, ignore_eos=True)
    assert out.result.rounds and max(r.gamma for r in out.result.rounds) <= 2
    assert max(r.gamma for r in _engine().generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=30), gamma=6,
                                                   ignore_eos=True).result.rounds) > 2


def test_tree_options_reach_the_decoder():
    rule = get_rule("greedy")
    observed: list[tuple[int, int]] = []
    dec = _engine().decoder(rule, 2, tree=6, tree_min_prob=0.3, tree_observe=lambda n, a: observed.append((n, a)))
    assert dec.tree is not None and dec.tree.min_prob == 0.3
    out = _engine().generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20), tree=6, tree_min_prob=0.3,
                             tree_observe=lambda n, a: observed.append((n, a)), ignore_eos=True)
    assert out.result.stats.tree_rounds > 0 and observed  # told of every tree round
    # the probability floor shapes the trees generate() drafts (here: 0 keeps every node of 8, 0.6 one)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    wide = _engine().generate([1, 2], cfg, tree=8, tree_min_prob=0.0, ignore_eos=True).result.rounds
    narrow = _engine().generate([1, 2], cfg, tree=8, tree_min_prob=0.6, ignore_eos=True).result.rounds
    assert max(r.gamma for r in wide) == 8 and max(r.gamma for r in narrow) == 1
    # a drafter without a tree pass drafts chains under the γ asked for, not under the tree's node count
    chain = _engine(_ChainOnly(DRAFT)).generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=20), gamma=2,
                                                tree=6, ignore_eos=True)
    assert chain.result.stats.tree_rounds == 0 and max(r.gamma for r in chain.result.rounds) <= 2


def test_logprobs_are_one_per_emitted_token():
    """The session scores a round's tokens past max_new_tokens too; the result keeps one per token."""
    eng = _engine()
    for n in range(1, 9):
        cfg = SamplingConfig(temperature=1.0, seed=n, max_new_tokens=n)
        out = eng.generate([1, 2], cfg, gamma=4, logprobs=1, ignore_eos=True)
        assert len(out.token_ids) == n and len(out.logprobs) == n


def test_auto_gamma_takes_the_known_extra_target_time():
    assert make_gamma("auto", extra_target_s=0.25).extra_target_s == 0.25
    assert make_gamma("auto").extra_target_s == 0.0


def test_min_tokens_with_logprobs_hold_off_the_end_of_sequence():
    """min_tokens floors the end of sequence in the session's law too (the logprobs' session)."""
    eng = _engine()
    for temperature in (0.0, 1.0):
        cfg = SamplingConfig(temperature=temperature, seed=4, max_new_tokens=12, min_tokens=6)
        plain = eng.generate([1, 2], cfg, gamma=3)
        out = eng.generate([1, 2], cfg, gamma=3, logprobs=1)
        assert out.token_ids == plain.token_ids and len(out.logprobs) == len(out.token_ids)
        assert not EOS & set(out.token_ids[:6])


def test_gamma_tree_and_confidence_bounds():
    from specdec.engine import parse_gamma, parse_min_confidence, parse_tree

    assert parse_gamma(defaults.MAX_GAMMA) == defaults.MAX_GAMMA and parse_gamma("1") == 1
    assert parse_tree(defaults.MAX_TREE_NODES) == defaults.MAX_TREE_NODES and parse_tree("1") == 1
    assert parse_min_confidence(1.0) == 1.0 and parse_min_confidence(0.0) == 0.0
    for bad in (0, defaults.MAX_GAMMA + 1):
        with pytest.raises(ConfigError, match="gamma must be between"):
            parse_gamma(bad)
    for bad in (0, defaults.MAX_TREE_NODES + 1):
        with pytest.raises(ConfigError, match="tree node count must be between"):
            parse_tree(bad)
    for bad in (-0.1, 1.1):
        with pytest.raises(ConfigError, match="min-confidence"):
            parse_min_confidence(bad)


def test_generate_batch_passes_ignore_eos():
    eng = _engine()
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10)
    assert [r.token_ids for r in eng.generate_batch([[1, 2], [2, 1]], cfg)] == [[1, 3], [3]]
    long = eng.generate_batch([[1, 2], [2, 1]], cfg, ignore_eos=True)
    assert [r.token_ids for r in long] == [eng.generate(p, cfg, ignore_eos=True).token_ids for p in ([1, 2], [2, 1])]
    assert all(len(r.token_ids) == 10 for r in long)


def test_a_registry_targets_model_free_default_draft_has_no_lookup_suffix():
    from specdec.engine import check_draft_name, draft_for_target

    draft = draft_for_target("gemma-3-270m", defaults.DEFAULT_DRAFT)
    assert draft == "ngram" and check_draft_name(draft) == ("ngram", False, None)  # "ngram+lookup" is refused


def test_kv_dtype_float16_needs_exact_attention():
    from specdec.engine import EngineConfig, check_kv_dtype

    assert check_kv_dtype(EngineConfig(kv_dtype="float16"), torch.float32) == torch.float16
    with pytest.raises(ConfigError, match="needs exact attention"):
        check_kv_dtype(EngineConfig(kv_dtype="float16", batch_invariant=False), torch.float32)


def test_a_factor_of_one_is_allowed_for_a_model_free_drafter():
    from specdec.engine import check_factor_applies

    for value in ("auto", 1.0, "1"):
        check_factor_applies("ngram", value)
    with pytest.raises(ConfigError, match="drafts without a model's distribution"):
        check_factor_applies("ngram", 0.5)


def test_a_draft_vocabulary_must_be_distinct_and_is_unused_on_the_hf_backend(tmp_path):
    from specdec.engine import EngineConfig, draft_vocabulary

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [1, 5, 5, 9]}))
    with pytest.raises(ConfigError, match="sorted list of distinct token ids"):
        draft_vocabulary(EngineConfig(), str(tmp_path))
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [1, 5, 9]}))
    assert draft_vocabulary(EngineConfig(), str(tmp_path)).tolist() == [1, 5, 9]
    assert draft_vocabulary(EngineConfig(backend="hf"), str(tmp_path)) is None  # the hf backend has no reduced head
    assert draft_vocabulary(EngineConfig(draft_vocab="full"), str(tmp_path)) is None


def _loaded() -> LoadedModel:
    return LoadedModel("toy", TARGET, None, None, "toy", EOS)


def test_gamma_refuses_a_boolean():
    """``True`` is an int in Python: it must not pass for γ = 1."""
    from specdec.engine import parse_gamma

    for bad in (True, False):
        with pytest.raises(ConfigError, match="gamma must be"):
            parse_gamma(bad)


def test_tree_and_factor_names_are_read_case_and_space_blind():
    from specdec.engine import parse_temperature_factor, parse_tree

    assert parse_tree(" Auto ") == "auto" and parse_tree("CHAIN") == "chain" and parse_tree(" 7 ") == 7
    assert parse_temperature_factor(" AUTO ") == "auto" and parse_temperature_factor(" 0.5 ") == 0.5


def test_a_decoders_min_confidence_is_checked():
    rule = get_rule("greedy")
    assert _engine().decoder(rule, 2, min_confidence=0.3).min_confidence == 0.3
    assert _engine().decoder(rule, 2).min_confidence == defaults.MIN_CONFIDENCE
    for bad in (-0.5, 1.5):
        with pytest.raises(ConfigError, match="min-confidence"):
            _engine().decoder(rule, 2, min_confidence=bad)


def test_gamma_auto_follows_the_last_sequence_of_the_same_rule(monkeypatch):
    """γ auto: each new decoder's controller is the successor of the engine's last one for the
    same rule (:class:`GammaMemory`), and another rule's controllers are not mixed in."""
    asked: list[CostGamma] = []
    real = CostGamma.successor

    def successor(self):
        asked.append(self)
        return real(self)

    monkeypatch.setattr(CostGamma, "successor", successor)
    eng = _engine()
    greedy, block = get_rule("greedy"), get_rule("block")
    first = eng.decoder(greedy, "auto").gamma
    assert isinstance(first, CostGamma) and asked == []
    second = eng.decoder(greedy, " AUTO ").gamma
    assert asked == [first] and second is not first
    eng.decoder(block, "auto")
    assert asked == [first]  # a fresh controller for another rule
    eng.decoder(greedy, "auto")
    assert asked == [first, second]
    fixed = eng.decoder(greedy, 3).gamma  # a fixed γ is not remembered, nor follows anything
    assert isinstance(fixed, FixedGamma) and fixed.gamma == 3 and len(asked) == 2


def test_make_tree_auto_budgets_nodes_and_a_number_fixes_them():
    from specdec.engine import make_tree

    spec, controller = make_tree("auto", FixedGamma(2), drafter=ModelDrafter(DRAFT))
    assert spec is not None and isinstance(controller, TreeBudget)
    spec, controller = make_tree(5, FixedGamma(2), drafter=ModelDrafter(DRAFT))
    assert spec is not None and isinstance(controller, FixedGamma) and controller.gamma == 5
    chain = FixedGamma(2)
    assert make_tree("chain", chain, drafter=ModelDrafter(DRAFT)) == (None, chain)


def test_tree_observe_hears_only_tree_rounds():
    """``tree_observe`` is told of the tree's budget controller; a chain decoder does not wrap
    its γ controller with it."""
    heard: list[tuple[int, int]] = []
    dec = _engine().decoder(get_rule("greedy"), 2, tree="chain", tree_observe=lambda n, a: heard.append((n, a)))
    assert dec.tree is None and isinstance(dec.gamma, FixedGamma)
    dec.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10))
    assert heard == []


def test_the_default_method_under_seed_zero_is_coupled():
    """A seed fixes the output (coupled), seed 0 included."""
    from specdec.engine import default_method

    assert default_method(SamplingConfig(temperature=1.0, seed=0)) == "coupled"
    assert default_method(SamplingConfig(temperature=1.0)) == "block"
    assert default_method(SamplingConfig(temperature=0.0, seed=0)) == "greedy"


def test_logprobs_without_a_seed_draw_one():
    """With logprobs the decoder and its scoring session must share a seed: one is drawn when the
    request has none."""
    out = _engine().generate([1, 2], SamplingConfig(temperature=1.0, max_new_tokens=6), logprobs=1, ignore_eos=True)
    assert len(out.token_ids) == 6 and len(out.logprobs) == 6


def test_min_tokens_with_ignore_eos_floors_only_the_stop_tokens():
    """With the end of sequence ignored, min_tokens masks nothing of it: the output is that of the
    same request without min_tokens (the floor is over the decoder's stop ids, not the model's
    eos ids), with logprobs or without."""
    eng = _engine()
    for logprobs in (None, 1):
        base = SamplingConfig(temperature=0.0, max_new_tokens=12)
        free = eng.generate([1, 2], base, ignore_eos=True, logprobs=logprobs).token_ids
        floored = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=12, min_tokens=8), ignore_eos=True,
                               logprobs=logprobs).token_ids
        assert 3 in free[:8] and floored == free


def test_kv_dtype_checks():
    from specdec.engine import check_kv_dtype

    assert check_kv_dtype(EngineConfig(), torch.float32) is None
    with pytest.raises(ConfigError, match="--kv-dtype must be one of"):
        check_kv_dtype(EngineConfig(kv_dtype="int8"), torch.float32)
    with pytest.raises(ConfigError, match="needs a float32, int8 or q4 target"):
        check_kv_dtype(EngineConfig(kv_dtype="float16", dtype="bfloat16"), torch.bfloat16)


def test_apply_kv_dtype_explains_a_model_that_cannot_hold_it():
    from specdec.engine import apply_kv_dtype

    apply_kv_dtype(_loaded(), None, "auto")  # nothing asked: nothing needed
    with pytest.raises(ConfigError, match="needs the native backend"):
        apply_kv_dtype(_loaded(), torch.float16, "float16")

    class Refuses(ToyLM):
        def set_kv_dtype(self, dtype):
            raise ValueError("no room for it")

    with pytest.raises(ConfigError, match="--kv-dtype float16: no room for it"):
        apply_kv_dtype(LoadedModel("toy", Refuses(4), None, None, "toy", EOS), torch.float16, "float16")


def test_target_dtype_refusals(monkeypatch):
    from specdec.engine import target_dtype

    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    with pytest.raises(ConfigError, match="not --backend hf"):
        target_dtype(EngineConfig(dtype="int8", backend="hf"))
    with pytest.raises(ConfigError, match="dtype must be auto or one of"):
        target_dtype(EngineConfig(dtype="float64"))
    assert target_dtype(EngineConfig(dtype="float16")) == (torch.float16, None)
    monkeypatch.setattr(linear, "w8a8_available", lambda: False)
    with pytest.raises(ConfigError, match="fbgemm"):
        target_dtype(EngineConfig(dtype="q4"))


def test_auto_draft_dtype_is_float_on_the_hf_backend_even_with_fast_bf16(monkeypatch):
    monkeypatch.setattr(linear, "bf16_fast", lambda: True)
    assert draft_dtype(EngineConfig(backend="hf")) == torch.float32
    assert draft_dtype(EngineConfig()) == torch.bfloat16


def test_a_quantised_draft_asked_for_on_the_hf_backend_is_refused(monkeypatch):
    from specdec.engine import draft_quant

    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    for asked in ("w8a8", "q4"):
        with pytest.raises(ConfigError, match="needs the native backend"):
            draft_quant(EngineConfig(draft_dtype=asked, backend="hf"))


def test_a_draft_vocabulary_with_a_negative_id_or_an_unknown_mode_is_refused(tmp_path):
    from specdec.engine import draft_vocabulary

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [-1, 5, 9]}))
    with pytest.raises(ConfigError, match="sorted list of distinct token ids"):
        draft_vocabulary(EngineConfig(), str(tmp_path))
    with pytest.raises(ConfigError, match="draft vocabulary must be auto or full"):
        draft_vocabulary(EngineConfig(draft_vocab="reduced"), str(tmp_path))


def test_attach_self_and_ngram_on_a_loaded_target():
    """``self`` drafts with the target at the configured factor (``+lookup`` puts prompt lookup in
    front); ``ngram`` gets the default n-gram lengths."""
    eng = Engine.attach(_loaded(), EngineConfig(target="toy", draft="self", draft_temperature_factor=0.5))
    assert isinstance(eng.drafter, ModelDrafter) and eng.drafter.model is TARGET and eng.drafter.temperature_factor == 0.5
    assert eng.drafter_name == "self"
    hybrid = Engine.attach(_loaded(), EngineConfig(target="toy", draft="self+lookup", draft_temperature_factor=" 0.75"))
    assert isinstance(hybrid.drafter, LookupThenModel) and hybrid.drafter_name == "self+lookup"
    assert hybrid.drafter.temperature_factor == 0.75
    plain = Engine.attach(_loaded(), EngineConfig(target="toy", draft="self"))
    assert plain.drafter.temperature_factor == 1.0  # auto, nothing calibrated
    ngram = Engine.attach(_loaded(), EngineConfig(target="toy", draft="ngram"))
    assert (ngram.drafter.max_ngram, ngram.drafter.min_ngram) == (defaults.NGRAM_MAX, defaults.NGRAM_MIN)


def test_a_registry_targets_own_draft_model_gets_prompt_lookup_in_front():
    from specdec.engine import draft_for_target

    assert draft_for_target("qwen2.5-coder-1.5b", defaults.DEFAULT_DRAFT) == "qwen2.5-coder-0.5b+lookup"
    assert draft_for_target("qwen2.5-coder-1.5b", "ngram") == "ngram"  # asked for: kept
    assert draft_for_target("smollm2-135m", defaults.DEFAULT_DRAFT) == defaults.DEFAULT_DRAFT


def test_auto_draft_temperature_factor_reads_the_folders_calibration(tmp_path):
    from specdec.catalog import CALIBRATION_FILE
    from specdec.engine import draft_temperature_factor

    assert draft_temperature_factor(EngineConfig(), tmp_path) == 1.0  # nothing calibrated
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"temperature_factor": 0.85}))
    assert draft_temperature_factor(EngineConfig(), tmp_path) == 0.85
    assert draft_temperature_factor(EngineConfig(draft_temperature_factor=0.5), tmp_path) == 0.5  # a number wins


class _View:
    temperature_factor = 1.0


def _attach_view(monkeypatch, vocab: torch.Tensor | None, **cfg):
    """attach() of a self-speculative view, its build replaced by a recorder: (vocab it got, view)."""
    got = {}

    def build(name, model, target_name, *, vocab=None):
        got["vocab"] = vocab
        return got.setdefault("view", _View()), "view"

    monkeypatch.setattr(engine_mod, "view_vocabulary", lambda cfg, target: vocab)
    monkeypatch.setattr(self_spec, "build", build)
    Engine.attach(_loaded(), EngineConfig(target="toy", draft="layerskip:1", **cfg))
    return got["vocab"], got["view"]


def test_a_view_drafts_over_a_reduced_vocabulary_only_where_every_id_is_the_targets(monkeypatch):
    """A reduced vocabulary whose largest id is the target's vocabulary size (one past its last
    token: another model's) is dropped; one whose ids all lie below it is kept."""
    vocab, _ = _attach_view(monkeypatch, torch.tensor([1, TARGET.vocab_size]))
    assert vocab is None
    vocab, _ = _attach_view(monkeypatch, torch.tensor([1, TARGET.vocab_size - 1]))
    assert vocab.tolist() == [1, TARGET.vocab_size - 1]


def test_a_view_samples_at_the_configured_draft_temperature_factor(monkeypatch):
    """The self-speculative view gets the configured factor, as ``self`` does."""
    _, view = _attach_view(monkeypatch, None, draft_temperature_factor=0.5)
    assert view.temperature_factor == 0.5


def test_load_draft_passes_on_its_vocabulary_and_the_targets_tokenizer(tmp_path, monkeypatch):
    """``load_draft`` of ``FOLDER+lookup`` loads FOLDER over the folder's reduced vocabulary, with
    the target (for its tokenizer object) and the float dtype asked for."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [1, 5, 9]}))
    seen = {}
    monkeypatch.setattr(engine_mod.registry, "load", lambda name, **kw: seen.update(name=name, **kw))
    target = _loaded()
    engine_mod.load_draft(EngineConfig(draft=f"{tmp_path}+lookup", draft_dtype="float32"), target=target)
    assert seen["name"] == str(tmp_path) and seen["tokenizer_of"] is target
    assert seen["vocab_subset"].tolist() == [1, 5, 9] and seen["dtype"] == torch.float32


def test_engine_config_refuses_an_int8_kernel_that_is_not_a_string():
    """Every name-valued setting is checked for its kind up front, ``int8_kernel`` too (it used to
    reach the loader)."""
    for bad in (None, 5):
        with pytest.raises(ConfigError, match="int8_kernel must be a string"):
            EngineConfig(int8_kernel=bad)


def test_a_tree_probability_floor_out_of_range_is_refused_where_it_is_parsed():
    """``parse_tree_min_prob`` is the CLI's and bench's early check: a floor outside [0, 1) fails
    there, before any model loads; None (the default floor) and a value inside pass through."""
    from specdec.engine import parse_tree_min_prob

    assert parse_tree_min_prob(None) is None and parse_tree_min_prob(0.0) == 0.0 and parse_tree_min_prob(0.5) == 0.5
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ConfigError):
            parse_tree_min_prob(bad)


def test_factor_for_reads_the_draft_name_as_the_engine_does():
    """A benchmark's one factor goes to drafters that sample from a model only: ``" NGRAM "`` and
    ``None``-model drafters get ``auto`` whatever their spelling, a model drafter the value."""
    from specdec.engine import factor_for

    assert factor_for(" NGRAM ", 0.5) == "auto" and factor_for("Lookahead", 0.5) == "auto"
    assert factor_for("none", 0.5) == "auto" and factor_for("self", 0.5) == 0.5


def test_prompt_lookup_in_front_of_a_trained_head_is_refused(tmp_path, monkeypatch):
    """``HEAD+lookup``: a head reads the target's features and has no prompt-lookup front; the name
    is refused before anything loads."""
    from specdec.drafters import heads
    from specdec.engine import check_draft_name

    monkeypatch.setattr(heads, "resolve_head", lambda ref: tmp_path if ref == "myhead" else None)
    assert check_draft_name("myhead") == ("myhead", False, tmp_path)
    with pytest.raises(ConfigError, match="adds prompt lookup to a drafting model"):
        check_draft_name("myhead+lookup")


def test_a_prompt_id_outside_the_vocabulary_is_a_config_error():
    """generate() checks token-id prompts against the target's vocabulary (a one-line error, not an
    IndexError inside the model)."""
    eng = _engine()
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        eng.generate([1, TARGET.vocab_size], SamplingConfig(temperature=0.0, max_new_tokens=4), gamma=2)


def test_stop_when_reads_the_text_as_the_request_keeps_special_tokens():
    """``stop_when`` tests the text the request gets: with special tokens kept it sees the
    end-of-sequence token's "<e>" and stops there; with them skipped it never does."""
    eng = _engine(tokenizer=_Tok())
    seen = lambda text: "<e>" in text  # noqa: E731
    kept = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10, skip_special_tokens=False), gamma=3,
                        ignore_eos=True, stop_when=seen)
    assert kept.token_ids == [1, 3] and kept.text == "b<e>"
    skipped = eng.generate([1, 2], SamplingConfig(temperature=0.0, max_new_tokens=10), gamma=3, ignore_eos=True,
                           stop_when=seen)
    assert len(skipped.token_ids) == 10


def test_auto_target_dtype_on_the_hf_backend_is_float32_even_where_int8_runs(monkeypatch):
    """``--backend hf`` with dtype auto: float32 (the hf backend has no int8 layers), not int8
    (which the same function then refuses: "needs the native backend")."""
    from specdec.engine import target_dtype
    from specdec.models import registry

    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    monkeypatch.setattr(registry, "native_runs", lambda ref: True)
    assert target_dtype(EngineConfig(backend="hf")) == (torch.float32, None)


def test_a_draft_vocabulary_of_a_model_that_cannot_be_found_is_left_to_the_loader(tmp_path):
    """draft_vocabulary() returns None for a reference that does not resolve (load() then says what
    is wrong with it) instead of raising the resolver's error itself."""
    from specdec.engine import draft_vocabulary

    assert draft_vocabulary(EngineConfig(), str(tmp_path / "nothing-here")) is None


def test_a_registry_model_without_its_own_draft_vocabulary_gets_the_shipped_one(tmp_path, monkeypatch):
    """A registry model's folder (converted on setup) without ``draft_vocab.json``: the one shipped
    under SHIPPED_DRAFT_VOCABS/NAME is used; a file in the folder comes first."""
    from types import SimpleNamespace

    from specdec.engine import draft_vocabulary
    from specdec.models import registry

    folder, shipped = tmp_path / "model", tmp_path / "shipped"
    folder.mkdir()
    (shipped / "some-model").mkdir(parents=True)
    (shipped / "some-model" / "draft_vocab.json").write_text(json.dumps({"ids": [2, 4]}))
    monkeypatch.setattr(engine_mod, "SHIPPED_DRAFT_VOCABS", shipped)
    monkeypatch.setattr(registry, "resolve", lambda ref: SimpleNamespace(folder=folder, spec=SimpleNamespace(name="some-model")))
    assert draft_vocabulary(EngineConfig(), "some-model").tolist() == [2, 4]
    (folder / "draft_vocab.json").write_text(json.dumps({"ids": [1, 3]}))
    assert draft_vocabulary(EngineConfig(), "some-model").tolist() == [1, 3]


def test_a_fed_draft_samples_at_the_configured_draft_temperature_factor(tmp_path, monkeypatch):
    """model_drafter() gives a fed draft (one that reads the target's features) the configured
    factor, as it gives a plain draft model; its loading is replaced by recorders here."""
    from types import SimpleNamespace

    made = {}
    monkeypatch.setattr(engine_mod, "fed_config", lambda folder: {"taps": [1]})
    monkeypatch.setattr(engine_mod, "load_projection", lambda folder: (None, None))
    monkeypatch.setattr(engine_mod, "FedDrafter", lambda *a, **kw: made.setdefault("fed", SimpleNamespace(**kw)))
    draft = LoadedModel("d", SimpleNamespace(hidden=None), None, tmp_path, "native", frozenset())
    drafter, name = engine_mod.model_drafter(EngineConfig(draft_temperature_factor=0.5), draft, lookup=False)
    assert drafter is made["fed"] and drafter.temperature_factor == 0.5 and name == "d"


class _KvToy(ToyLM):
    """A toy target that records the cache dtype it is given."""

    kv_dtype = None

    def set_kv_dtype(self, dtype):
        self.kv_dtype = dtype


def _build(tmp_path, monkeypatch, **cfg):
    """Engine.build() over a toy target (load() replaced): (engine, load's kwargs, progress lines)."""
    from types import SimpleNamespace

    (tmp_path / "config.json").write_text("{}")
    seen, said = {}, []

    def load(name, **kw):
        seen.update(kw)
        return LoadedModel("toy", _KvToy(4, order=2, seed=0), SimpleNamespace(chat_template=None), tmp_path, "native",
                           frozenset({3}))

    monkeypatch.setattr(engine_mod.registry, "load", load)
    eng = Engine.build(EngineConfig(target=str(tmp_path), draft="none", **cfg), progress=said.append)
    return eng, seen, said


def test_build_applies_the_cache_dtype_and_the_chat_template_asked_for(tmp_path, monkeypatch):
    """``kv_dtype`` and ``chat_template`` reach the loaded target (its cache dtype, its tokenizer)."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    eng, seen, _ = _build(tmp_path, monkeypatch, dtype="float32", kv_dtype="float16", chat_template=template)
    assert eng.target.model.kv_dtype == torch.float16 and eng.target.tokenizer.chat_template == template
    assert seen["dtype"] == torch.float32 and seen["quant"] is None
    eng, _, _ = _build(tmp_path, monkeypatch, dtype="float32")
    assert eng.target.model.kv_dtype is None and eng.target.tokenizer.chat_template is None


def test_the_int8_kernel_note_is_given_only_where_nothing_reads_the_kernel(tmp_path, monkeypatch):
    """``--int8-kernel`` with a float target: one progress line says it is unused; with an int8
    target (which reads it) no such line, and the kernel reaches load()."""
    from specdec.models import registry

    _, _, said = _build(tmp_path, monkeypatch, dtype="float32", int8_kernel="fbgemm")
    assert any("--int8-kernel fbgemm is not used" in line for line in said)
    monkeypatch.setattr(linear, "w8a8_available", lambda: True)
    monkeypatch.setattr(registry, "native_runs", lambda ref: True)
    _, seen, said = _build(tmp_path, monkeypatch, dtype="int8", int8_kernel="fbgemm")
    assert seen["quant"] == "int8" and seen["int8_kernel"] == "fbgemm"
    assert not any("--int8-kernel" in line for line in said)


def test_a_self_speculative_draft_with_nothing_shipped_fails_before_the_target_loads(monkeypatch):
    """``--draft self-skip`` (no file) for a registry target without a shipped skip set: a
    ConfigError from the names alone, before the target loads."""
    from specdec.catalog import skip_set_targets
    from specdec.models import registry

    target = next((name for name in registry.REGISTRY if name not in skip_set_targets()), None)
    if target is None:
        pytest.skip("every registry target ships a skip set")
    monkeypatch.setattr(engine_mod.registry, "load", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(ConfigError, match="no searched skip set ships"):
        Engine.build(EngineConfig(target=target, draft="self-skip"))


class _Keeps(ToyLM):
    """A toy target that keeps finished sequences (as the chat's prefix cache does)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.kept: list[list[int]] = []

    def keep_sequence(self, tokens, cache):
        self.kept.append([int(t) for t in tokens])


def test_a_generation_with_logprobs_hands_its_sequence_to_a_target_that_keeps_them():
    """With logprobs the engine's scoring session is the verifier, and the engine closes it: a
    target that keeps finished sequences gets the prompt + reply (all but the last token) once."""
    model = _Keeps(4, order=2, seed=0)
    eng = Engine(LoadedModel("toy", model, None, None, "toy", frozenset({3})), ModelDrafter(DRAFT), "toy")
    out = eng.generate([1, 2], SamplingConfig(temperature=1.0, seed=3, max_new_tokens=6), gamma=3, logprobs=1,
                       ignore_eos=True)
    assert model.kept == [[1, 2, *out.token_ids[:-1]]]


def test_a_quantised_draft_asked_for_gets_an_int8_lm_head(monkeypatch):
    """``w8a8`` and ``q4`` drafts run their LM head as an int8 matmul too, as ``int8`` does."""

    monkeypatch.setattr(linear, "int8_available", lambda: True)
    for asked in ("int8", "w8a8", "q4"):
        assert draft_int8_head(EngineConfig(draft_dtype=asked)), asked
    assert not draft_int8_head(EngineConfig(draft_dtype="bfloat16"))


def test_a_trained_head_samples_at_its_folders_calibrated_factor(tmp_path, monkeypatch):
    """Under ``auto`` a target-aware head samples at the factor its own folder ships
    (``draft_calibration.json``), as a draft model does; a number asked for wins."""
    from types import SimpleNamespace

    from specdec.catalog import CALIBRATION_FILE
    from specdec.drafters import heads

    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"temperature_factor": 0.85}))
    monkeypatch.setattr(heads, "resolve_head", lambda ref: tmp_path if ref == "myhead" else None)
    monkeypatch.setattr(heads, "build", lambda ref, target, **kw: (SimpleNamespace(temperature_factor=1.0), "myhead"))
    eng = Engine.attach(_loaded(), EngineConfig(target="toy", draft="myhead"))
    assert eng.drafter.temperature_factor == 0.85 and eng.drafter_name == "myhead"
    eng = Engine.attach(_loaded(), EngineConfig(target="toy", draft="myhead", draft_temperature_factor=0.5))
    assert eng.drafter.temperature_factor == 0.5


def test_with_prefix_cache_gives_a_draft_model_its_own_cache(monkeypatch):
    """A drafter over a loaded draft model gets that model behind a prefix cache too (its
    ``with_model``); one with no draft model of its own (``self`` shares the target's) keeps its
    drafter.  The prefix-cache pieces are replaced by recorders here."""
    from specdec.server import prefix_cache

    monkeypatch.setattr(prefix_cache, "supports_prefix_cache", lambda model: True)
    monkeypatch.setattr(prefix_cache, "PrefixCache", lambda max_bytes: ("cache", max_bytes))
    monkeypatch.setattr(prefix_cache, "PrefixCached", lambda model, cache: ("cached", model, cache))
    monkeypatch.setattr(prefix_cache, "draft_prefix_cache", lambda target, draft, max_bytes: ("draft cache", max_bytes))

    class Drafter:
        def __init__(self, model):
            self.model = model

        def with_model(self, model):
            return Drafter(model)

    draft_model = ToyLM(4, order=2, seed=5)
    eng = Engine(_loaded(), Drafter(draft_model), "d", LoadedModel("d", draft_model, None, None, "toy", frozenset()))
    cached = eng.with_prefix_cache(1000)
    assert cached.target.model == ("cached", TARGET, ("cache", 1000))
    assert cached.drafter.model == ("cached", draft_model, ("draft cache", 1000)) and cached.drafter_name == "d"
    alone = Engine(_loaded(), eng.drafter, "self").with_prefix_cache(1000)
    assert alone.drafter is eng.drafter


def test_the_drafter_name_reaches_the_decoder():
    """The engine's drafter name is what the decoder reports (stats, the server's drafter field)."""

    eng = Engine(_loaded(), ModelDrafter(DRAFT), "my-draft")
    assert eng.decoder(get_rule("greedy"), 2).drafter_name == "my-draft"


def test_the_logprobs_session_taps_the_features_the_drafter_reads(monkeypatch):
    """With logprobs the scoring session is the verifier, so it must tap the target's features a
    feature-reading drafter asks for (its ``feature_taps``); recorded here by a stand-in session
    that fails the generation right after it is made."""
    seen = {}

    class Stop(Exception):
        pass

    def session(*args, **kw):
        seen.update(kw)
        raise Stop

    class Tapping(ModelDrafter):
        feature_taps = (1, 2)

    monkeypatch.setattr(engine_mod, "TargetSession", session)
    eng = Engine(_loaded(), Tapping(DRAFT), "toy")
    with pytest.raises(Stop):
        eng.generate([1, 2], SamplingConfig(temperature=1.0, seed=1, max_new_tokens=4), gamma=2, logprobs=1)
    assert seen.get("feature_taps") == (1, 2) and seen["logprobs"] == 1 and seen["seed"] == 1


def test_self_drafting_reports_the_target_as_its_draft_model():
    """``self`` drafts with the target: the engine's draft model is the target (the server builds
    its served draft and the draft's prefix cache from ``draft_model``)."""
    target = _loaded()
    for draft in ("self", "self+lookup"):
        assert Engine.attach(target, EngineConfig(target="toy", draft=draft)).draft_model is target


def test_a_draft_model_with_prompt_lookup_in_front_is_named_so():
    """model_drafter(lookup=True): the lookup front and the ``NAME+lookup`` display name."""

    draft = LoadedModel("d", DRAFT, None, None, "toy", frozenset())
    drafter, name = engine_mod.model_drafter(EngineConfig(), draft, lookup=True)
    assert isinstance(drafter, LookupThenModel) and name == "d+lookup"
    drafter, name = engine_mod.model_drafter(EngineConfig(), draft, lookup=False)
    assert isinstance(drafter, ModelDrafter) and name == "d"


def test_generate_batch_passes_the_method_asked_for():
    """A rule named for the batch is the one each result reports (not the default for its sampling)."""
    eng = _engine()
    cfg = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=6)
    assert [r.method for r in eng.generate_batch([[1, 2], [2, 1]], cfg)] == ["coupled", "coupled"]
    assert [r.method for r in eng.generate_batch([[1, 2], [2, 1]], cfg, method="block")] == ["block", "block"]


def test_the_engine_loads_through_the_registrys_load_as_it_is_at_call_time(monkeypatch):
    """Engine.build calls ``registry.load`` when it runs, not a copy bound when the engine module was
    first imported: a test (or a tool) that replaces the registry's loader is heard, and one that
    did so while the engine was first imported leaves no stale loader behind for later callers."""

    class Reached(Exception):
        pass

    def load(name, **kwargs):
        raise Reached(name)

    monkeypatch.setattr("specdec.models.registry.load", load)
    with pytest.raises(Reached, match="smollm2-135m"):
        Engine.build(EngineConfig(target="smollm2-135m", draft="none"))
