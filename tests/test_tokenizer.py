"""Each token's own bytes (:class:`specdec.tokenizer.TokenBytes`): OpenAI's logprobs ``bytes``."""

from __future__ import annotations

import pytest

from specdec.models import registry
from specdec.tokenizer import TokenBytes

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
