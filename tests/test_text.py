"""Prompts, streaming detokenisation and stop strings (with SmolLM2's real tokenizer)."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from specdec.errors import ConfigError
from specdec.models.registry import DATA_DIR
from specdec.sampling import SamplingConfig
from specdec.text import (StopStrings, StopWhen, TextSink, TextStream, encode_messages, encode_prompt, logprob_rows, output_stop,
                          prompt_ids, stop_cut, trim_at_stop)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))


def test_stream_never_shows_a_stop_string(tok):
    ids = tok.encode("Hello there, general. END of the story", add_special_tokens=False)
    shown: list[str] = []
    sink = TextSink(tok, ("END",), shown.append)
    stop = StopStrings(tok, ("END",))
    kept = None
    for i in range(len(ids)):
        sink.push(ids[i : i + 1])
        kept = stop(ids[: i + 1])
        if kept is not None:
            break
    final = sink.finish(ids[:kept])
    assert final == "Hello there, general. " and "".join(shown) == final
    assert "END" not in tok.decode(ids[: kept - 1])  # the kept prefix is the shortest one


def test_stream_without_stops_and_unicode(tok):
    text = "naïve café — ok ✓"
    ids = tok.encode(text, add_special_tokens=False)
    shown: list[str] = []
    sink = TextSink(tok, (), shown.append)
    for t in ids:
        sink.push([t])
    assert sink.finish(ids) == text and "".join(shown) == text and all("\ufffd" not in s for s in shown)


def test_an_empty_stop_string_matches_nothing(tok):
    """An empty stop string (``--stop ""``) is ignored, as StopStrings ignores it: it once made the
    stream skip a character at every push (a hold-back of -1)."""
    ids = tok.encode("x squared_term = 1.", add_special_tokens=False)
    shown: list[str] = []
    sink = TextSink(tok, ("",), shown.append)
    for t in ids:
        sink.push([t])
    assert sink.finish(ids) == "x squared_term = 1." == "".join(shown)


def test_prompts(tok):
    assert encode_prompt(tok, "x = 1", chat=False) == tok.encode("x = 1", add_special_tokens=False)
    chat = tok.decode(encode_prompt(tok, "Hi!", chat=True))
    assert "Hi!" in chat and "<|im_start|>assistant" in chat
    with pytest.raises(ConfigError, match="empty"):
        encode_prompt(tok, "  ", chat=False)
    assert trim_at_stop("abc STOP def", ("STOP", "de")) == "abc "


def test_streaming_detokenisation_is_incremental_and_equals_the_full_decode(tok, monkeypatch):
    text = "naïve café — 日本語 ✓ <|im_end|> def f(x):\n    return x"
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok)
    assert stream._incremental is not None  # the tokenizers library's DecodeStream
    calls = []
    monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(a) or "")
    pieces = [stream.push([t]) for t in ids]
    assert calls == []  # no re-decoding of the whole output per push
    monkeypatch.undo()
    assert "".join(pieces) == stream.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stops", [(), ("END",), ("é",)])
def test_spans_hand_over_each_token_once_and_only_after_its_text(tok, stops):
    """``on_span``: the spans cover the kept tokens in order, each once; a token is handed over only
    once its text is out (so never a token held back with a possible stop string), and ``finish``
    hands over the rest, text or not (here the end-of-turn token)."""
    ids = tok.encode("naïve café — ok ✓ The END is near<|im_end|>", add_special_tokens=False)
    shown: list[str] = []
    spans: list[tuple[str, int, int]] = []
    sink = TextSink(tok, stops, shown.append, lambda text, a, b: spans.append((text, a, b)))
    stop = StopStrings(tok, stops)
    kept = len(ids)
    for i in range(len(ids)):
        sink.push(ids[i : i + 1])
        if (cut := stop(ids[: i + 1])) is not None:
            kept = cut
            break
    final = sink.finish(ids[:kept])
    assert "".join(t for t, _, _ in spans) == "".join(shown) == final
    assert [a for _, a, _ in spans] == [0] + [b for _, _, b in spans[:-1]] and spans[-1][2] == kept
    assert sum(1 for _, a, b in spans if b > a) > 2  # handed over as the text goes, not all at the end
    printed = ""
    for text, _, end in spans[:-1]:  # the last one may hold the stop string's token, whose text is cut
        printed += text
        assert printed.startswith(tok.decode(ids[:end], skip_special_tokens=True))
    if stops == ("END",):
        assert final.endswith("The ") and spans[-1][2] - spans[-1][1] >= 1  # the stop's token came last


def _stream(tok, ids, **kw):
    """Push ``ids`` one round of three at a time through a sink and a stop check, as the decoder does;
    (final text, what was streamed, tokens kept)."""
    shown: list[str] = []
    stops = kw.pop("stops", ())
    sink = TextSink(tok, stops, shown.append, **kw)
    stop = StopStrings(tok, stops, min_tokens=kw.get("min_tokens", 0)) if stops else None
    kept = list(ids)
    for i in range(0, len(ids), 3):
        upto = ids[: i + 3]
        keep = stop(upto) if stop is not None else None
        if keep is not None:
            sink.push(upto[i:keep])
            kept = upto[:keep]
            break
        sink.push(upto[i:])
    final = sink.finish(kept)
    return final, "".join(shown), kept


def test_min_tokens_keeps_stop_strings_out_of_the_first_tokens_text(tok):
    """vLLM's min_tokens: a stop string counts only where it starts after the first min_tokens
    tokens' text; the streamed text never shows more than the final one."""
    ids = tok.encode("one. two. three. four. five.", add_special_tokens=False)
    final, shown, kept = _stream(tok, ids, stops=(".",))
    assert final == shown == "one" and tok.decode(kept).startswith("one.")
    for n in (2, 3, 5):
        floor = len(tok.decode(ids[:n]))
        want = tok.decode(ids)[: tok.decode(ids).index(".", floor)]
        final, shown, kept = _stream(tok, ids, stops=(".",), min_tokens=n)
        assert final == shown == want, n
    assert trim_at_stop("a. b. c.", (".",), start=2) == "a. b"


def test_include_stop_keeps_the_stop_string(tok):
    ids = tok.encode("Hello there, general. END of the story", add_special_tokens=False)
    final, shown, _ = _stream(tok, ids, stops=("END",), keep_stop=True)
    assert final == shown == "Hello there, general. END"
    assert trim_at_stop("abc STOP def", ("STOP", "de"), keep=True) == "abc STOP"


def test_a_stop_token_ends_the_ids_but_not_the_text(tok):
    """vLLM's stop_token_ids: the token stays in the ids (and in the spans), its text is left out
    unless the stop string is kept."""
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    last = ids[-1]
    spans: list[tuple[str, int, int]] = []
    sink = TextSink(tok, (), None, lambda text, a, b: spans.append((text, a, b)), hidden=frozenset({last}))
    for t in ids:
        sink.push([t])
    assert sink.finish(ids) == tok.decode(ids[:-1])
    assert "".join(s[0] for s in spans) == tok.decode(ids[:-1])
    assert [i for _, a, b in spans for i in range(a, b)] == list(range(len(ids)))  # every token once
    kept = TextSink(tok, (), None, hidden=frozenset({last}), keep_stop=True)
    kept.push(ids)
    assert kept.finish(ids) == tok.decode(ids)


def test_stop_when_keeps_the_shortest_prefix_whose_text_is_done(tok):
    """A stop on what the text says (the server's first closed tool call): checked in rounds of three
    tokens, it keeps exactly the shortest token prefix whose text passes, that text whole; combined
    with a stop string, whichever comes first wins."""
    from specdec.text import StopWhen, first_stop

    ids = tok.encode("Sure. <tool_call> {} </tool_call> and more text after it", add_special_tokens=False)
    shortest = next(k for k in range(1, len(ids) + 1) if "</tool_call>" in tok.decode(ids[:k]))
    for rounds in (1, 3, len(ids)):
        stop = StopWhen(tok, lambda text: "</tool_call>" in text)
        kept = next(keep for i in range(rounds, len(ids) + rounds, rounds) if (keep := stop(ids[:i])) is not None)
        assert kept == shortest, rounds
    assert tok.decode(ids[:shortest]).endswith("</tool_call>")
    both = first_stop(StopStrings(tok, ("more",)), StopWhen(tok, lambda text: "</tool_call>" in text))
    assert both(ids) == shortest  # the call closes first
    early = first_stop(StopStrings(tok, ("Sure",)), None, StopWhen(tok, lambda text: "</tool_call>" in text))
    assert early(ids) == 1
    assert first_stop(None, None) is None


def test_special_tokens_kept_in_the_text_except_the_one_that_ends_it(tok):
    """vLLM's ``skip_special_tokens: false``: special tokens stay in the text (streamed and final
    alike) and stop strings are looked for in that text; the end-of-sequence token that ends the
    output is still left out (unless the stop is kept), its id kept; by default none shows."""
    from specdec.text import output_sink, output_stop

    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [start] + tok.encode("user said", add_special_tokens=False) + [end]
    kept = SamplingConfig(skip_special_tokens=False)
    for sampling, want in ((SamplingConfig(), "Hi thereuser said"), (kept, "Hi there<|im_start|>user said")):
        shown: list[str] = []
        sink = output_sink(tok, sampling, shown.append, eos_ids=frozenset({end}))
        for t in ids:
            sink.push([t])
        assert sink.finish(ids) == want and "".join(shown) == want
    sink = output_sink(tok, SamplingConfig(skip_special_tokens=False, include_stop=True), eos_ids=frozenset({end}))
    sink.push(ids)
    assert sink.finish(ids).endswith("said<|im_end|>")
    for sampling, cut in ((SamplingConfig(stop=("<|im_start|>user",)), None),  # not in the text: never found
                          (SamplingConfig(stop=("<|im_start|>user",), skip_special_tokens=False), ids.index(start) + 2)):
        stop = output_stop(tok, sampling)
        assert next((k for i in range(1, len(ids) + 1) if (k := stop(ids[:i])) is not None), None) == cut


def test_a_plain_prompt_gets_the_tokenizers_bos_and_a_chat_one_only_the_templates(tok):
    """A tokenizer that puts a BOS in front of a text (Gemma, Llama 3, Mistral) gets it on a plain
    prompt, as Hugging Face and vLLM encode one; a chat prompt's template writes its own, so the
    conversation is encoded without another (the same ids as a tokenizer that adds none)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    inner = tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    inner.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    bos = PreTrainedTokenizerFast(tokenizer_object=inner, chat_template=tok.chat_template)
    assert bos.encode("x = 1")[0] == 1  # the premise: this tokenizer adds a BOS
    assert encode_prompt(bos, "x = 1", chat=False) == [1, *tok.encode("x = 1", add_special_tokens=False)]
    assert encode_prompt(bos, "Hi!", chat=True) == encode_prompt(tok, "Hi!", chat=True)


def test_a_template_that_rejects_the_conversation_is_a_clear_error():
    """A chat template that raises (``raise_exception``, as Gemma's and Mistral's do on a system
    message; or a bad index) gives a one-line ConfigError naming it, with specdec's tokenizer and
    with transformers'."""

    from specdec.models.registry import load_tokenizer
    from specdec.tokenizer import set_chat_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for tokenizer in (load_tokenizer(DATA_DIR / "smollm2-135m-draft"), AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))):
        set_chat_template(tokenizer, "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}x")
        with pytest.raises(ConfigError, match=r"^the chat template rejected the conversation: no system role$"):
            encode_messages(tokenizer, messages)
        assert encode_messages(tokenizer, messages[1:]) == tokenizer.encode("x", add_special_tokens=False)
        set_chat_template(tokenizer, "{{ messages[5].content }}")
        with pytest.raises(ConfigError, match="the chat template rejected the conversation: .*5"):
            encode_messages(tokenizer, messages)


@pytest.mark.parametrize("messages, says", [
    ([{"role": "user"}], "user message 0 needs a 'content' string, got None"),  # was KeyError: 'content'
    ([{"content": "hi"}], "message 0 needs a 'role' string, got {'content': 'hi'}"),
    (["hi"], "message 0 needs a 'role' string, got 'hi'"),
    ([{"role": "Human", "content": "hi"}], "no message has the role 'user' (roles given: 'Human')"),  # was "the prompt is empty"
    ([{"role": "user", "content": "  "}], "the prompt is empty"),
])
def test_a_conversation_without_a_usable_user_turn_is_named(messages, says):
    from specdec.models.registry import load_tokenizer

    tokenizer = load_tokenizer(DATA_DIR / "smollm2-135m-draft")
    with pytest.raises(ConfigError) as refused:
        encode_messages(tokenizer, messages)
    assert str(refused.value) == says


def test_the_earliest_stop_string_wins_whatever_the_order_given():
    assert trim_at_stop("abc STOP def", ("de", "STOP")) == "abc "
    assert trim_at_stop("abc STOP def", ("de", "STOP"), keep=True) == "abc STOP"


def test_a_stop_string_inside_the_min_tokens_text_does_not_end_the_output_early(tok):
    """With min_tokens, the kept prefix is the shortest whose text *after the floor* holds a stop
    string: a stop string in the first min_tokens tokens' text must not cut it short."""
    ids = tok.encode("one. two three. four", add_special_tokens=False)
    floor = len(tok.decode(ids[:2]))
    assert tok.decode(ids[:2]) == "one."  # the first stop lies inside the floor
    keep = StopStrings(tok, (".",), min_tokens=2)(ids)
    assert keep is not None and "." in tok.decode(ids[:keep])[floor:]
    assert "." not in tok.decode(ids[: keep - 1])[floor:]
    assert tok.decode(ids[:keep]).endswith("three.")


def test_a_token_is_handed_over_with_the_text_that_completes_it(tok):
    """Without stop strings every pushed token's text is out at once, so each push's span holds
    that token (not a later one)."""
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    spans = []
    sink = TextSink(tok, (), None, lambda text, a, b: spans.append((text, a, b)))
    for i, t in enumerate(ids):
        sink.push([t])
        assert spans[-1][1:] == (i, i + 1), spans
    assert sink.finish(ids) == "alpha beta gamma delta"


class _SlowTokenizer:
    """The tokenizer without its fast backend: TextStream decodes the whole output at each push."""
    def __init__(self, tok):
        self._tok = tok

    def decode(self, tokens, skip_special_tokens=True):
        return self._tok.decode(tokens, skip_special_tokens=skip_special_tokens)


def test_the_full_decode_stream_never_shows_half_a_character(tok):
    text = "naïve café — ok ✓"
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(_SlowTokenizer(tok))
    assert stream._incremental is None
    pieces = [stream.push([t]) for t in ids]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_a_chat_prompt_carries_the_system_message(tok):
    """``encode_prompt(..., chat=True, system=...)`` (``--system``) puts the system turn in the
    conversation the template renders; without it the template's default system turn (if any)
    stands instead."""
    with_system = tok.decode(encode_prompt(tok, "Hi!", chat=True, system="Answer like a pirate."))
    assert "<|im_start|>system\nAnswer like a pirate.<|im_end|>" in with_system
    assert "Answer like a pirate." not in tok.decode(encode_prompt(tok, "Hi!", chat=True))


def test_a_boolean_is_not_a_token_id():
    """``True`` is an ``int`` subclass; read as id 1 it would silently change the prompt."""
    assert prompt_ids([0, 5, 9], 10) == [0, 5, 9]
    for bad in ([True, 5], [5, False]):
        with pytest.raises(ConfigError, match="must be an integer id, got (True|False)"):
            prompt_ids(bad, 10)


def test_a_stop_string_at_the_very_start_of_the_text_is_found():
    """A stop string at index 0 cuts the whole text (``find`` returns 0, a falsy hit and cut)."""
    assert stop_cut("STOP abc", ("STOP",)) == 0
    assert stop_cut("STOP abc", ("STOP",), keep=True) == 4
    assert trim_at_stop("STOP abc", ("STOP",)) == ""
    assert trim_at_stop("STOP abc", ("STOP",), keep=True) == "STOP"


def test_output_stop_applies_min_tokens(tok):
    """The decoder's stop check built from sampling options honours ``min_tokens``: a stop string
    inside the first ``min_tokens`` tokens' text does not end the output."""
    ids = tok.encode("one. two three. four", add_special_tokens=False)
    assert tok.decode(ids[:2]) == "one."  # the premise: the first stop lies in the first two tokens
    stop = output_stop(tok, SamplingConfig(stop=(".",), min_tokens=2))
    keep = stop(ids)
    assert keep == StopStrings(tok, (".",), min_tokens=2)(ids)
    assert tok.decode(ids[:keep]).endswith("three.")


def test_logprob_rows_write_minus_infinity_as_minus_9999(tok):
    """A token the processing removed has log-probability -inf; JSON has no infinity, so the rows
    carry OpenAI's -9999.0 (both for the chosen token and its alternatives)."""
    rows = logprob_rows(tok, [5], [(float("-inf"), [(7, -0.5), (9, float("-inf"))])])
    assert rows[0]["logprob"] == -9999.0 and [t["logprob"] for t in rows[0]["top"]] == [-0.5, -9999.0]
    json.dumps(rows, allow_nan=False)  # valid strict JSON
    assert rows[0]["token"] == tok.decode([5]) and rows[0]["top"][1]["id"] == 9


class _RewritingTokenizer:
    """A slow tokenizer whose decode rewrites earlier text once more tokens come (as clean-up of
    tokenization spaces does: ``"a ."`` -> ``"a."``)."""
    def decode(self, tokens, skip_special_tokens=True):
        text = "".join({1: "a", 2: " ", 3: "."}[t] for t in tokens)
        return text.replace(" .", ".")


def test_the_full_decode_stream_shows_nothing_where_earlier_text_was_rewritten():
    """Where the whole output's decode no longer starts with what was shown, the push shows
    nothing (text already out cannot be taken back) instead of a slice from the wrong place."""
    stream = TextStream(_RewritingTokenizer())
    assert stream.push([1]) == "a" and stream.push([2]) == " "
    assert stream.push([3, 1]) == ""  # "a.a" does not extend "a ": no slice of it is new text
    assert stream.text == "a.a"


class _CleaningTokenizer:
    """A fast tokenizer (it has a ``_tokenizer`` backend) whose decode cleans up tokenization
    spaces, as transformers does for WordPiece ones: ``"a ,"`` -> ``"a,"``."""
    clean_up_tokenization_spaces = True

    def __init__(self, tok):
        self._tok = tok
        self._tokenizer = tok.backend_tokenizer

    def decode(self, tokens, skip_special_tokens=True):
        text = self._tok.decode(tokens, skip_special_tokens=skip_special_tokens)
        for before, after in ((" ,", ","), (" .", "."), (" !", "!"), (" 's", "'s")):
            text = text.replace(before, after)
        return text


def test_a_tokenizer_that_cleans_up_spaces_is_streamed_by_full_decodes(tok):
    """``clean_up_tokenization_spaces`` rewrites text across token boundaries, which the
    incremental ``DecodeStream`` does not: such a tokenizer's stream decodes the whole output, so
    the streamed text is the cleaned-up full decode."""
    clean = _CleaningTokenizer(tok)
    ids = tok.encode("Hello , world . It 's fine !", add_special_tokens=False)
    want = clean.decode(ids)
    assert want == "Hello, world. It's fine!"  # the premise: clean-up changes this text
    stream = TextStream(clean)
    assert stream._incremental is None
    for t in ids:
        stream.push([t])
    assert stream.text == want


def test_a_conversation_with_one_empty_user_turn_among_others_is_not_empty(tok):
    """"the prompt is empty" only where every user turn is blank: one blank turn in a longer
    conversation is rendered like the rest."""
    messages = [{"role": "user", "content": " "}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}]
    assert "hi" in tok.decode(encode_messages(tok, messages))


def test_token_ids_must_lie_inside_the_vocabulary_at_both_ends():
    """The vocabulary is [0, vocab_size): vocab_size itself and -1 are refused, 0 and vocab_size - 1 kept."""
    assert prompt_ids([0, 9], 10) == [0, 9]
    for bad in ([10], [-1]):
        with pytest.raises(ConfigError, match=r"outside the vocabulary \[0, 10\)"):
            prompt_ids(bad, 10)


def test_bytes_are_not_read_as_token_ids():
    """``b"hi"`` iterates as ints (104, 105); it must be refused, not read as ids."""
    for bad in (b"\x01\x02", bytearray(b"\x01")):
        with pytest.raises(ConfigError, match="must be text or a list of token ids"):
            prompt_ids(bad, 1000)


def test_numpy_integer_ids_are_ids_and_come_back_as_python_ints():
    """Any integral id (numpy's too) is accepted, and the list holds plain ints."""
    ids = prompt_ids([np.int64(3), np.int32(4)], 10)
    assert ids == [3, 4] and all(type(t) is int for t in ids)
    assert prompt_ids(np.array([1, 2]), 10) == [1, 2]


class _ByteFallback:
    """A SentencePiece-style tokenizer (Llama 2's, Gemma's kind) with no vocabulary beyond "b":
    every other character is spelled as ``<0xNN>`` byte tokens, and an incomplete character decodes
    as one U+FFFD per byte (the ByteFallback decoder), so the text *shrinks* once it completes."""
    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, normalizers

        vocab = {"<unk>": 0, "b": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "\u2581": 259}
        self._tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
        self._tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        self._tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])

    def encode(self, text):
        return self._tokenizer.encode(text).ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_a_stop_string_straddling_a_completed_byte_fallback_character_is_found_in_that_round():
    """The stop check looks again at the last ``len(stop)`` characters already checked: a stop
    string that starts with a character whose bytes only now complete (the text was "...���", 3
    U+FFFDs, and is now "...😀 a") is found in the round that completes it."""
    bf = _ByteFallback()
    ids = bf.encode("ab 😀 ab")
    assert bf.decode(ids[:7]) == " ab \ufffd\ufffd\ufffd" and bf.decode(ids[:10]) == " ab 😀 a"  # the premise
    stop = StopStrings(bf, ("😀 a",))
    assert stop(ids[:7]) is None
    assert stop(ids[:10]) == 10


def test_an_empty_stop_string_never_stops_the_decoder(tok):
    """StopStrings ignores ``""`` (which every text contains), as TextSink does; with a real stop
    beside it, only the real one counts."""
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    assert all(StopStrings(tok, ("",))(ids[:i]) is None for i in range(1, len(ids) + 1))
    assert StopStrings(tok, ("", "gamma"))(ids) == len(ids)


def test_a_stop_token_stays_in_the_streams_ids(tok):
    """A hidden stop token (vLLM's stop_token_ids) leaves the text but not the ids: the engine reads
    a span's token ids from ``sink.stream.tokens``, so they line up with the spans' indices."""
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    spans = []
    sink = TextSink(tok, (), None, lambda text, a, b: spans.append((a, b)), hidden=frozenset({ids[-1]}))
    for t in ids:
        sink.push([t])
    sink.finish(ids)
    assert sink.stream.tokens == ids and spans[-1][1] == len(ids)


def _push_each(sink, ids):
    for t in ids:
        sink.push([t])


def test_with_include_stop_the_stop_string_is_streamed_when_found_not_only_at_finish(tok):
    """``keep_stop``: once a push brings the stop string, the text through it is out already
    (what is streamed before ``finish`` is the final text, not the text before the stop)."""
    ids = tok.encode("Hello there, general. END of the story", add_special_tokens=False)
    keep = StopStrings(tok, ("END",))(ids)
    shown: list[str] = []
    sink = TextSink(tok, ("END",), shown.append, keep_stop=True)
    _push_each(sink, ids[:keep])
    assert "".join(shown) == "Hello there, general. END"
    assert sink.finish(ids[:keep]) == "Hello there, general. END" == "".join(shown)


def test_a_stop_string_inside_the_min_tokens_text_does_not_hold_the_stream(tok):
    """With ``min_tokens`` a stop string in the first tokens' text does not count while streaming
    either: the text up to the real stop is out before ``finish``."""
    ids = tok.encode("one. two three. four", add_special_tokens=False)
    assert tok.decode(ids[:2]) == "one."  # the premise
    keep = StopStrings(tok, (".",), min_tokens=2)(ids)
    shown: list[str] = []
    sink = TextSink(tok, (".",), shown.append, min_tokens=2)
    _push_each(sink, ids[:keep])
    assert "".join(shown) == "one. two three"


def test_text_before_min_tokens_is_streamed_at_once(tok):
    """Nothing in the first ``min_tokens`` tokens' text can be cut, so it is streamed as it comes,
    however long a stop string is held back for."""
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    long_stop = ("z" * 40,)
    shown: list[str] = []
    sink = TextSink(tok, long_stop, shown.append, min_tokens=len(ids))
    sink.push(ids[:2])
    assert "".join(shown) == tok.decode(ids[:2])
    shown.clear()
    sink = TextSink(tok, long_stop, shown.append, min_tokens=len(ids) - 1)
    sink.push(ids)  # one round crosses the floor: the text up to it is out
    assert "".join(shown) == tok.decode(ids[:-1])


def test_finish_hands_over_no_empty_span_once_everything_is_out(tok):
    """Where every token and its text is out before ``finish`` (no stop strings), ``finish`` has
    nothing to hand over: no extra span with no text and no tokens (an empty streamed piece)."""
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    spans = []
    sink = TextSink(tok, (), None, lambda text, a, b: spans.append((text, a, b)))
    _push_each(sink, ids)
    before = list(spans)
    assert sink.finish(ids) == "alpha beta gamma"
    assert spans == before and all(text or b > a for text, a, b in spans)


def test_stop_strings_starting_at_the_same_place_cut_the_same_whatever_their_order():
    """Two stop strings found at the same index: with ``keep`` the text ends after the shorter one
    (the decoder's shortest prefix holds it first), whichever order they were given in."""
    for stops in (("STOP", "ST"), ("ST", "STOP")):
        assert stop_cut("abc STOP def", stops, keep=True) == len("abc ST"), stops
        assert stop_cut("abc STOP def", stops) == len("abc "), stops


def test_output_sink_applies_min_tokens_and_stop_token_ids(tok):
    """The sink built from sampling options honours ``min_tokens`` (a stop inside the first
    tokens' text does not cut) and ``stop_token_ids`` (such a token's text is left out)."""
    from specdec.text import output_sink

    ids = tok.encode("one. two three. four", add_special_tokens=False)
    assert tok.decode(ids[:2]) == "one."  # the premise
    sink = output_sink(tok, SamplingConfig(stop=(".",), min_tokens=2))
    sink.push(ids)
    assert sink.finish(ids) == "one. two three"
    words = tok.encode("alpha beta gamma", add_special_tokens=False)
    sink = output_sink(tok, SamplingConfig(stop_token_ids=(words[-1],)))
    sink.push(words)
    assert sink.finish(words) == tok.decode(words[:-1])


def test_a_template_error_is_reported_by_its_first_line():
    """A template's multi-line error becomes a one-line ConfigError holding its first line (the
    message itself, not a trailing detail)."""
    from specdec.models.registry import load_tokenizer
    from specdec.tokenizer import set_chat_template

    tokenizer = load_tokenizer(DATA_DIR / "smollm2-135m-draft")
    set_chat_template(tokenizer, "{{ raise_exception('no system role\\nsee the model card') }}")
    with pytest.raises(ConfigError, match=r"^the chat template rejected the conversation: no system role$"):
        encode_messages(tokenizer, [{"role": "user", "content": "hi"}])


def test_an_empty_stop_string_cuts_nothing():
    """``stop_cut`` / ``trim_at_stop`` ignore ``""`` (found everywhere) beside real stop strings."""
    assert stop_cut("abc", ("",)) is None
    assert stop_cut("abc", ("", "b")) == 1


def test_a_first_check_over_many_tokens_looks_at_all_their_text(tok):
    """The first call (nothing checked yet) searches the whole text, not only its tail."""
    ids = tok.encode("Hello there, general. END of the story", add_special_tokens=False)
    assert StopStrings(tok, ("Hello",))(ids) == 1


def test_a_stop_token_at_the_end_of_a_many_token_round_is_not_streamed(tok):
    """A round of several tokens ending in a hidden stop token: its text is not streamed either."""
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    shown: list[str] = []
    sink = TextSink(tok, (), shown.append, hidden=frozenset({ids[-1]}))
    sink.push(ids)
    assert "".join(shown) == tok.decode(ids[:-1])
    assert sink.finish(ids) == tok.decode(ids[:-1]) == "".join(shown)


def test_stop_when_sees_each_tokens_text_once(tok):
    """StopWhen decodes only the new tokens of each call: the text it tests is the output's text,
    never the earlier text repeated (a test it can never pass must never stop it)."""
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    stop = StopWhen(tok, lambda text: text.count("alpha") >= 2)
    assert all(stop(ids[:i]) is None for i in range(1, len(ids) + 1))
    assert stop.stream.text == "alpha beta gamma delta"


def test_a_token_holding_half_a_character_is_handed_over_only_with_its_text(tok):
    """Emoji and CJK characters take several byte-level tokens: a span never ends inside such a
    character (the tokens it hands over decode to whole characters)."""
    ids = tok.encode("ok 😀 你好世界 done", add_special_tokens=False)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # the premise
    for size in (1, 2, 3):  # rounds of one, two, three tokens
        spans = []
        sink = TextSink(tok, (), None, lambda text, a, b: spans.append((text, a, b)))
        for i in range(0, len(ids), size):
            sink.push(ids[i : i + size])
        assert sink.finish(ids) == "ok 😀 你好世界 done"
        assert all("\ufffd" not in tok.decode(ids[:b]) for _, _, b in spans), (size, spans)
        assert [i for _, a, b in spans for i in range(a, b)] == list(range(len(ids)))


def test_a_stop_string_ending_in_a_byte_fallback_character_is_found_in_the_round_that_completes_it():
    """With a byte-fallback tokenizer (Llama 2, Gemma) a half-arrived character decodes as one
    U+FFFD per byte, so the text gets shorter once the character completes ("ab ���" -> "ab 😀").
    StopStrings starts its next search ``len(stop)`` characters before the *old* (longer) length,
    past the completed character, and misses a stop string that ends in it: here "😀" arrives in
    a round that also brings " ab"; the check answers None instead of 8 (the shortest prefix
    holding "😀").  If that round is the generation's last (max tokens), the stop is never seen."""
    bf = _ByteFallback()
    ids = bf.encode("ab 😀 ab")
    assert bf.decode(ids[:7]) == " ab \ufffd\ufffd\ufffd" and bf.decode(ids[:8]) == " ab 😀"  # the premise
    stop = StopStrings(bf, ("😀",))
    assert stop(ids[:7]) is None
    assert stop(ids) == 8


def test_the_same_stop_one_token_at_a_time_is_found_at_its_token():
    bf = _ByteFallback()
    ids = bf.encode("ab 😀 ab")
    stop = StopStrings(bf, ("😀",))
    found = next(i for i in range(1, len(ids) + 1) if stop(ids[:i]) is not None)
    assert found == 8  # currently 9: one round late


def test_stop_when_decodes_only_the_new_tokens_prefixes_in_the_round_it_stops(tok):
    """StopWhen's promise: only the round that makes ``done`` true decodes prefixes, and only those
    ending in that round's new tokens (earlier prefixes were already known not done), so a long
    output is not decoded again from the start at the end."""
    ids = tok.encode("one two three four five six seven eight nine END ten", add_special_tokens=False)
    at = next(k for k in range(1, len(ids) + 1) if "END" in tok.decode(ids[:k]))
    stop = StopWhen(tok, lambda text: "END" in text)
    for i in range(1, at - 1):
        assert stop(ids[:i]) is None
    decoded: list[int] = []
    real = stop.stream.decode
    stop.stream.decode = lambda tokens: (decoded.append(len(tokens)), real(tokens))[1]
    assert stop(ids[: at + 1]) == at  # this round brings tokens at-1, at, at+1
    assert decoded and min(decoded) >= at - 1, decoded


def test_the_stream_holds_back_only_what_could_still_start_a_stop_string(tok):
    """With stop string "END" (3 characters) the sink shows, after every push, all of the text but
    its last 2 characters: no more is held back than a stop string's proper prefix."""
    ids = tok.encode("Hello there, general kenobi", add_special_tokens=False)
    shown: list[str] = []
    sink = TextSink(tok, ("END",), shown.append)
    for i, t in enumerate(ids):
        sink.push([t])
        text = tok.decode(ids[: i + 1])
        assert "".join(shown) == text[: max(0, len(text) - 2)], i


def test_on_text_never_gets_an_empty_piece_when_spans_are_wanted_too(tok):
    """With both callbacks, ``finish`` hands the hidden stop token over as a span with no text: the
    text callback is not called with an empty string (a stream would send an empty delta)."""
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    eos = tok.eos_token_id
    pieces: list[str] = []
    spans: list[tuple[str, int, int]] = []
    sink = TextSink(tok, (), pieces.append, lambda text, a, b: spans.append((text, a, b)), hidden=frozenset({eos}))
    for t in ids + [eos]:
        sink.push([t])
    assert sink.finish(ids + [eos]) == "alpha beta gamma"
    assert spans[-1][2] == len(ids) + 1  # the premise: the stop token was handed over at finish
    assert "".join(pieces) == "alpha beta gamma" and all(pieces), pieces


def test_output_stop_without_a_tokenizer_is_no_check():
    """No tokenizer (token-id prompts with no text side): stop strings cannot be looked for, and
    ``output_stop`` gives no check rather than one that fails on its first call."""
    assert output_stop(None, SamplingConfig(stop=("END",))) is None


def test_a_stop_string_in_the_min_tokens_texts_trailing_space_does_not_hold_the_stream(tok):
    """The floor is the first ``min_tokens`` tokens' whole text, trailing newlines included: a
    newline stop string inside it neither cuts nor stalls the stream ("Hi\\n\\n" then "there...")."""
    ids = tok.encode("Hi\n\nthere we go", add_special_tokens=False)
    assert tok.decode(ids[:3]) == "Hi\n\n"  # the premise
    shown: list[str] = []
    sink = TextSink(tok, ("\n",), shown.append, min_tokens=3)
    for t in ids:
        sink.push([t])
    assert "".join(shown) == "Hi\n\nthere we go"  # all out before finish (a 1-character stop holds nothing)
    assert sink.finish(ids) == "Hi\n\nthere we go"


def test_stop_when_looks_in_the_text_with_special_tokens_where_they_are_kept(tok):
    """``skip_special_tokens=False``: the text StopWhen tests is the output's text, special tokens
    included, so a test on a special token's text can pass (and it cannot by default)."""
    start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [start] + tok.encode("user", add_special_tokens=False)
    kept = StopWhen(tok, lambda text: "<|im_start|>" in text, skip_special_tokens=False)
    assert kept(ids) == ids.index(start) + 1
    assert StopWhen(tok, lambda text: "<|im_start|>" in text)(ids) is None


def test_an_empty_system_message_is_no_system_turn(tok):
    """``--system ""`` writes no (empty) system turn: the template's default system turn stands,
    as without ``system``."""
    assert encode_prompt(tok, "Hi!", chat=True, system="") == encode_prompt(tok, "Hi!", chat=True)
    assert "<|im_start|>system\n<|im_end|>" not in tok.decode(encode_prompt(tok, "Hi!", chat=True, system=""))


def test_a_stop_string_only_in_the_min_tokens_text_does_not_stop_the_decoder(tok):
    """Called one token at a time, the check says nothing until a stop string appears after the
    first min_tokens tokens' text: one inside that text alone is no stop (it used to be taken as
    one, keeping every token)."""
    ids = tok.encode("one. two three. four", add_special_tokens=False)
    assert tok.decode(ids[:2]) == "one."
    stop = StopStrings(tok, (".",), min_tokens=2)
    kept = [stop(ids[:n]) for n in range(1, len(ids) + 1)]
    first = next(i for i, k in enumerate(kept) if k is not None)
    assert tok.decode(ids[: first + 1]) == "one. two three."  # the first call that sees the second "."
    assert kept[first] == first + 1
