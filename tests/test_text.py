"""Prompts, streaming detokenisation and stop strings (with SmolLM2's real tokenizer)."""

import pytest
from transformers import AutoTokenizer

from specdec.errors import ConfigError
from specdec.models.registry import DATA_DIR
from specdec.text import StopStrings, TextSink, encode_prompt, trim_at_stop


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


def test_prompts(tok):
    assert encode_prompt(tok, "x = 1", chat=False) == tok.encode("x = 1", add_special_tokens=False)
    chat = tok.decode(encode_prompt(tok, "Hi!", chat=True))
    assert "Hi!" in chat and "<|im_start|>assistant" in chat
    with pytest.raises(ConfigError, match="empty"):
        encode_prompt(tok, "  ", chat=False)
    assert trim_at_stop("abc STOP def", ("STOP", "de")) == "abc "
