"""Each token's own bytes (:class:`specdec.tokenizer.TokenBytes`): OpenAI's logprobs ``bytes``."""

from __future__ import annotations

import hashlib
import json

import pytest

from specdec.models import registry
from specdec.tokenizer import TokenBytes, vocab_digest

#: text whose characters SmolLM2's byte-level BPE splits over several tokens (emoji, CJK), and
#: bytes it spells with stand-in characters (space, tab, newline, a soft hyphen)
TEXT = "Grüße 😀 你好世界 — naïve café\n\tx\u00ad y"


@pytest.fixture(scope="module")
def smollm2():
    return registry.load_tokenizer(registry.resolve("smollm2-135m-draft").folder)


def test_byte_level_tokens_join_to_the_texts_utf8(smollm2):
    ids = smollm2.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in smollm2.decode([t]) for t in ids)  # some token holds part of a character
    own = TokenBytes(smollm2)
    assert b"".join(own(t) for t in ids) == TEXT.encode("utf-8")
    assert own(smollm2.eos_token_id) == smollm2.decode([smollm2.eos_token_id]).encode()  # an added token: its text


def test_whole_tokens_are_their_decoded_text_and_transformers_agrees(smollm2):
    """Every 7th id of the vocabulary: where a token decodes to whole characters its bytes are
    that text; the same tokenizer as transformers loads it gives the same bytes."""
    own, theirs = TokenBytes(smollm2), TokenBytes(smollm2.hf)
    checked = 0
    for t in range(0, len(smollm2), 7):
        text = smollm2.decode([t])
        if "\ufffd" not in text:
            assert own(t) == text.encode("utf-8"), t
            checked += 1
        assert own(t) == theirs(t), t
    assert checked > 6000


def test_byte_fallback_vocabularies_give_their_bytes():
    """A SentencePiece-style vocabulary (Llama 2's, Gemma's): characters outside it are spelled as
    ``<0xNN>`` byte tokens, and ``▁`` stands for a space."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "\u2581a": 1, "b": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "\u2581": 259}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])

    class Wrapped:  # what a transformers fast tokenizer holds
        _tokenizer = backend

        def decode(self, ids: list[int]) -> str:
            return backend.decode(ids)

    ids = backend.encode("ab 😀").ids
    assert 3 + 0xF0 in ids  # the emoji's first byte
    assert b"".join(TokenBytes(Wrapped())(t) for t in ids) == " ab 😀".encode("utf-8")


def test_other_tokenizers_give_their_decoded_text():
    class Plain:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(0x4E00 + i) for i in ids)

    assert TokenBytes(Plain())(5) == chr(0x4E05).encode("utf-8")


def test_added_tokens_and_the_serialised_backend_are_transformers(smollm2):
    """What specdec's tokenizer answers without building transformers' class (the added tokens
    by text; the backend llguidance reads) is what transformers' tokenizer answers."""
    assert smollm2.get_added_vocab() == smollm2.hf.get_added_vocab() and len(smollm2.get_added_vocab()) > 10
    assert smollm2.backend_json() == smollm2.hf.backend_tokenizer.to_str()


def test_a_non_special_added_token_is_in_the_added_vocabulary_as_transformers_says(tmp_path):
    """An added token that is not special (a tokenizer.json can hold one; the shipped ones hold
    none) is in ``get_added_vocab`` as it is in transformers', not only the special ones."""
    import shutil

    src = registry.resolve("smollm2-135m-draft").folder
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):  # config.json: its model type
        shutil.copy(src / name, folder / name)
    data = json.loads((folder / "tokenizer.json").read_text())
    new_id = max([*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]) + 1  # past every id
    data["added_tokens"].append({"id": new_id, "content": "<plain-added>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours = registry.load_tokenizer(folder)
    assert type(ours).__name__ == "FastTokenizer"  # specdec's own answer, not transformers' behind it
    assert ours.get_added_vocab()["<plain-added>"] == new_id
    assert ours.get_added_vocab() == ours.hf.get_added_vocab()


class _Wrapped:  # what a transformers fast tokenizer holds
    def __init__(self, backend):
        self._tokenizer = backend

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def test_a_non_ascii_added_token_is_its_texts_utf8(smollm2):
    """An added token is its text in UTF-8, not read through the byte-level alphabet: "é" and "ú"
    are byte-level stand-ins for the single bytes 0xE9 / 0xFA, which would give Latin-1 bytes."""
    backend = smollm2._tokenizer.__class__.from_str(smollm2._tokenizer.to_str())
    backend.add_tokens(["<café>", "ñandú"])
    own = TokenBytes(_Wrapped(backend))
    for text in ("<café>", "ñandú"):
        assert own(backend.token_to_id(text)) == text.encode("utf-8")


def test_only_a_whole_byte_token_is_read_as_its_byte():
    """In a byte-fallback vocabulary only ``<0xNN>`` is a byte token; a six-character piece that
    merely starts with ``<0x`` is text like any other."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<0x41": 1, "<0x41!": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    own = TokenBytes(_Wrapped(backend))
    assert own(3 + 0x41) == b"A"  # a byte token
    assert own(2) == b"<0x41!"


class _Vocab:
    def __init__(self, vocab):
        self._vocab = vocab

    def get_vocab(self):
        return dict(self._vocab)


def test_the_vocab_digest_is_the_sha256_of_the_pairs_in_id_order():
    """The digest goes over the wire (an edge and a server of other versions compare it), so its
    definition is fixed: SHA-256 of the JSON list of [token, id] in id order, non-ASCII written
    as itself (UTF-8), as hex."""
    vocab = {"b": 0, "a": 1, "é": 2, "<s>": 3}  # id order differs from the tokens' order
    want = hashlib.sha256(json.dumps([["b", 0], ["a", 1], ["é", 2], ["<s>", 3]], ensure_ascii=False).encode()).hexdigest()
    assert want == "3e2ee2f7dd72c3c57bba7cec5cf8fce5f31b1b8978ab1b251b9ae4481859e048"
    assert vocab_digest(_Vocab(vocab)) == want


def _fresh():
    """A FastTokenizer of the bundled draft of its own (set_chat_template changes it)."""
    from specdec.tokenizer import FastTokenizer, plain_config

    folder = registry.resolve("smollm2-135m-draft").folder
    return FastTokenizer(folder, plain_config(folder))


def test_decode_takes_a_single_id_and_keeps_special_tokens_by_default(smollm2):
    """As transformers' decode: an int is one token, and special tokens stay unless asked."""
    eos = smollm2.eos_token_id
    ids = smollm2.encode("hi", add_special_tokens=False) + [eos]
    assert smollm2.decode(eos) == smollm2.decode([eos]) == smollm2.hf.decode([eos]) == "<|im_end|>"
    assert smollm2.decode(ids) == smollm2.hf.decode(ids) == "hi<|im_end|>"
    assert smollm2.decode(ids, skip_special_tokens=True) == "hi"


def test_a_tokenized_chat_is_what_transformers_returns(smollm2):
    """``tokenize=True`` is transformers' call (its ids), never the rendered text."""
    messages = [{"role": "user", "content": "hi"}]
    ours = smollm2.apply_chat_template(messages, add_generation_prompt=True)
    assert not isinstance(ours, str)
    assert ours == smollm2.hf.apply_chat_template(messages, add_generation_prompt=True)


def test_a_message_key_set_to_none_is_dropped_as_transformers_drops_it():
    """OpenAI's ``content: null`` (or any None-valued key) is left out of the message the template
    sees, as transformers leaves it out: ``m.get('name', 'anon')`` renders the default."""
    tok = _fresh()
    tok.set_chat_template("{% for m in messages %}{{ m.get('name', 'anon') }}:{{ m.content }};{% endfor %}")
    messages = [{"role": "user", "content": "hi", "name": None}]
    assert tok.apply_chat_template(messages, tokenize=False) == "anon:hi;" == tok.hf.apply_chat_template(messages, tokenize=False)


def test_an_empty_conversation_is_transformers_error():
    tok = _fresh()
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([], tokenize=False)


def test_a_chat_template_set_reaches_transformers_tokenizer_before_and_after_it_loads():
    """``--chat-template`` must hold for every path, also the calls handed to transformers: set
    after transformers' tokenizer loaded, set before it loads, and kept across pickling."""
    import pickle

    template = "T{{ messages[0].content }}"
    loaded_first = _fresh()
    loaded_first.hf
    loaded_first.set_chat_template(template)
    assert loaded_first.hf.chat_template == template
    set_first = _fresh()
    set_first.set_chat_template(template)
    assert set_first.hf.chat_template == template
    copied = pickle.loads(pickle.dumps(_set(template)))
    assert copied.chat_template == template and copied.hf.chat_template == template


def _set(template):
    tok = _fresh()
    tok.set_chat_template(template)
    return tok


def test_hf_tokenizer_is_the_transformers_one_behind_ours(smollm2):
    from specdec.tokenizer import hf_tokenizer

    assert hf_tokenizer(smollm2) is smollm2.hf and hf_tokenizer(smollm2.hf) is smollm2.hf


def test_chat_template_values_are_checked_and_read(tmp_path):
    """``--chat-template``: inline text (``{{`` or ``{%``) is the template; a file is read; a
    blank, uncompilable or unreadable one is a one-line ConfigError, and a folder is no file."""
    from specdec.errors import ConfigError
    from specdec.tokenizer import check_chat_template, read_chat_template

    assert read_chat_template("{% if true %}x{% endif %}") == "{% if true %}x{% endif %}"
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert read_chat_template(str(path)) == "{{ messages }}"
    with pytest.raises(ConfigError, match="empty"):
        check_chat_template("  \n")
    with pytest.raises(ConfigError, match="does not compile"):
        check_chat_template("{% if %}")
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path))


@pytest.mark.parametrize("field", ["reasoning_content", "thinking"])
def test_a_reasoning_field_reaches_the_template_under_transformers_aliases(field):
    """transformers copies a message's ``reasoning_content`` to ``thinking`` and back before
    rendering; such conversations render as transformers renders them (both names set)."""
    tok = _fresh()
    tok.set_chat_template("{% for m in messages %}{{ m.thinking|default('-') }}|{{ m.reasoning_content|default('-') }};{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", field: "R"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "-|-;R|R;" == tok.hf.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("template", ["{% set ns = namespace(_x=1) %}{{ ns._x }}",
                                      "{% set ns = namespace(a=1) %}{% set ns._x = 2 %}x"])
def test_a_namespace_refuses_underscore_names_as_transformers_does(template):
    """The sandbox's ``namespace`` refuses underscore-prefixed names, made or set, as transformers'
    does (a way out of the sandbox otherwise)."""
    import jinja2

    tok = _fresh()
    tok.set_chat_template(template)
    for who in (tok, tok.hf):
        with pytest.raises(jinja2.exceptions.SecurityError, match="underscore-prefixed"):
            who.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_tojson_honours_sort_keys_as_transformers_does():
    tok = _fresh()
    tok.set_chat_template("{{ messages[0] | tojson(sort_keys=True) }}")
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == '{"content": "hi", "role": "user"}' == tok.hf.apply_chat_template(messages, tokenize=False)


def test_the_vocabulary_and_its_size_include_the_added_tokens_as_transformers_counts_them(tmp_path):
    """``len`` and ``get_vocab`` count an added token past the model's vocabulary (as Qwen2's
    special tokens are), as transformers' do, so the vocabulary digest of both loaders agrees."""
    import shutil

    from tokenizers import Tokenizer

    from specdec.tokenizer import FastTokenizer, plain_config

    folder = registry.resolve("smollm2-135m-draft").folder
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(["<extra_added>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(folder / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    tok = FastTokenizer(tmp_path, plain_config(tmp_path))
    new_id = tok.get_vocab()["<extra_added>"]
    assert len(tok) == len(tok.hf) == new_id + 1
    assert tok.get_vocab() == tok.hf.get_vocab()
    assert vocab_digest(tok) == vocab_digest(tok.hf)


def test_a_chat_template_set_after_a_render_replaces_the_compiled_one():
    """``set_chat_template`` after conversations were already rendered: the next render uses the
    new template, not the one compiled before."""
    tok = _fresh()
    messages = [{"role": "user", "content": "hi"}]
    before = tok.apply_chat_template(messages, tokenize=False)
    tok.set_chat_template("T{{ messages[0].content }}")
    assert before != "Thi" and tok.apply_chat_template(messages, tokenize=False) == "Thi"


def test_continue_final_message_is_transformers_option_not_a_template_variable():
    """``continue_final_message=True`` (an option of transformers' apply_chat_template, which cuts
    the rendered text after the last message's content) gives transformers' text."""
    tok = _fresh()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    ours = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours == tok.hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours.endswith("The answer is")


def test_a_byte_level_piece_only_partly_of_the_byte_alphabet_is_its_decoded_text():
    """TokenBytes reads a byte-level piece through the byte alphabet only where every character of
    it is in that alphabet; a piece holding another character ("€", U+20AC, stands for no byte) is
    its decoded text in UTF-8, not an error."""
    from tokenizers import Tokenizer, decoders, models

    backend = Tokenizer(models.BPE({"a": 0, "a\u20ac": 1}, []))
    backend.decoder = decoders.ByteLevel()
    own = TokenBytes(_Wrapped(backend))
    assert own(0) == b"a"
    assert own(1) == backend.decode([1]).encode("utf-8")


def _folder(tmp_path, config):
    tmp_path.mkdir()
    (tmp_path / "tokenizer.json").write_text("{}")  # plain_config only looks for the file
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_add_prefix_space_true_keeps_transformers_even_for_a_rebuilt_class(tmp_path):
    """A rebuilt class (Qwen2's) builds its pre-tokenizer with the config's add_prefix_space: only
    None or False is what load checks the file against; True must go to transformers."""
    from specdec.tokenizer import plain_config

    base = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>"}
    assert plain_config(_folder(tmp_path / "a", {**base})) is not None
    assert plain_config(_folder(tmp_path / "b", {**base, "add_prefix_space": False})) is not None
    assert plain_config(_folder(tmp_path / "c", {**base, "add_prefix_space": True})) is None


def test_a_config_template_beside_a_chat_template_file_keeps_transformers(tmp_path):
    """Two chat template sources: which one wins is transformers' call, so the folder is not plain."""
    from specdec.tokenizer import plain_config

    config = {"eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}"}
    assert plain_config(_folder(tmp_path / "a", config)) is not None
    both = _folder(tmp_path / "b", config)
    (both / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")
    assert plain_config(both) is None
    alone = _folder(tmp_path / "c", {"eos_token": "</s>"})
    (alone / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")
    assert plain_config(alone) is not None


def test_a_file_that_configures_padding_alone_is_encoded_without_it(tmp_path):
    """transformers' wrapper encodes with no padding unless asked: a tokenizer.json that sets a
    fixed-length padding (and no truncation) must not pad our encodings either."""
    import shutil

    from specdec.tokenizer import FastTokenizer, plain_config

    src = registry.DATA_DIR / "smollm2-135m-draft"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tok = FastTokenizer(tmp_path, plain_config(tmp_path))
    want = FastTokenizer(src, plain_config(src)).encode("Hello world")
    assert len(want) < 16
    assert tok.encode("Hello world") == want


class _Renderer:
    """A stand-in for transformers' tokenizer that records the conversations it is asked to render."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, conversation, **kw):
        self.calls.append(conversation)
        return "rendered by transformers"


class _Str(str):
    pass


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hi", 1: "a non-string key"},
    {"role": "user", "content": _Str("hi")},  # a str subclass, not JSON's str
])
def test_a_conversation_not_made_of_json_types_alone_is_transformers_to_render(message):
    """Only JSON's exact types (string keys, no subclasses) are rendered here; anything else goes
    to transformers' apply_chat_template."""
    tok = _fresh()
    fake = tok._hf = _Renderer()
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain != "rendered by transformers" and fake.calls == []
    assert tok.apply_chat_template([message], tokenize=False) == "rendered by transformers"
    assert fake.calls == [[message]]


def test_a_longer_piece_in_byte_token_brackets_is_text_not_a_byte():
    """``<0x41AB>`` looks like a byte token but is eight characters: its bytes are its text."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<0x41AB>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    own = TokenBytes(_Wrapped(backend))
    assert own(1) == b"<0x41AB>"
    assert own(2 + 0x41) == b"A"


def test_a_backend_that_is_not_a_tokenizers_one_gives_the_decoded_text():
    """A tokenizer whose ``_tokenizer`` is something else (no ``id_to_token``) is read through its
    decode, not as a ``tokenizers`` backend."""

    class Other:
        _tokenizer = object()

        def decode(self, ids):
            return "".join(chr(0x61 + i) for i in ids)

    assert TokenBytes(Other())(2) == b"c"


def test_a_tokenizer_that_rendered_a_chat_still_pickles_and_renders_the_same():
    """The compiled template (not picklable: the sandbox's functions are local) is left out of the
    pickle and compiled again after it."""
    import pickle

    tok = _fresh()
    chat = [{"role": "user", "content": "Hi!"}]
    want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    again = pickle.loads(pickle.dumps(tok))
    assert again.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want


def test_a_long_chat_template_value_that_is_no_template_is_a_config_error():
    """``--chat-template`` with a long text holding neither ``{{`` nor ``{%`` (too long to be a
    file name) is the same one-line ConfigError as a short one, not an OSError traceback."""
    from specdec.errors import ConfigError
    from specdec.tokenizer import read_chat_template

    with pytest.raises(ConfigError, match=r"neither a file nor a Jinja template") as err:
        read_chat_template("You are a helpful assistant. " * 200)
    assert "(… 5800 characters)" in str(err.value) and len(str(err.value)) < 400  # shown cut, on one line
