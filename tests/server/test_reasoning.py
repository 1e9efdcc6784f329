"""A reasoning model's ``<think>`` block as the chat message's ``reasoning`` (``--reasoning-parser``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from serverproc import DRAFT_MODEL, ServerProcess
from specdec.server import reasoning as rs
from specdec.server.openai_api import _usage

pytestmark = pytest.mark.usefixtures("single_thread")

ANSWERS = [("<think>a b</think>Answer", False, ("a b", "Answer")),
           ("a b</think>Answer", True, ("a b", "Answer")),  # the template opened the block (R1's prompt)
           ("\n<think>\nhm</think>\n\nok", False, ("\nhm", "\n\nok")),
           ("  <think>cut off</thi", False, ("cut off</thi", None)),  # still thinking: all of it is thinking
           ("still thinking", True, ("still thinking", None)),
           ("plain", False, (None, "plain")), ("plain</think>x", False, (None, "plain</think>x")),  # no block opened
           ("<think>x</think>", False, ("x", None)), ("<thin", False, (None, "<thin")), ("", False, (None, ""))]


def _in(tags: rs.Tags, text: str | None) -> str | None:
    """An answer of :data:`ANSWERS` written with ``tags`` (whole tags, then the cut-off pieces)."""
    if text is None:
        return None
    return text.replace("</think>", tags.close).replace("<think>", tags.open).replace("</thi", tags.close[:5]).replace(
        "<thin", tags.open[:5])


@pytest.mark.parametrize("tags", [rs.THINK, rs.MISTRAL], ids=["think", "mistral"])
@pytest.mark.parametrize("text, opened, expected", ANSWERS)
def test_thinking_is_split_from_the_answer_streamed_or_not(text, opened, expected, tags):
    """The split of a finished answer, and the same answer streamed in pieces of 1, 2, 3 and all of
    its characters: the pieces add up to the same reasoning and content, and no piece of a tag that
    may still be written goes out as thinking.  Both pairs of tags (Mistral's ``[THINK]``)."""
    text, expected = _in(tags, text), tuple(_in(tags, e) for e in expected)
    assert rs.split(text, opened, tags) == expected
    for step in (1, 2, 3, max(1, len(text))):
        stream = rs.StreamedReasoning(opened, tags)
        pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
        thought, content = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        assert (thought or None, content or None) == (expected[0] or None, expected[1] or None), step
        if tags.close in text:
            assert not any(tags.close[0] in p[0] for p in pieces[:-1]), pieces  # "</thi..." waited until it was known


def test_the_parser_is_on_where_the_tokenizer_has_both_tags():
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    assert not rs.parser_on("auto", tok) and rs.parser_on("think", tok) and not rs.parser_on("none", tok)
    tok.add_tokens([rs.OPEN, rs.CLOSE])
    assert rs.parser_on("auto", tok) and not rs.parser_on("none", tok)
    ids = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert rs.prompt_opens(tok, ids) and not rs.prompt_opens(tok, ids[:-2])
    answer = tok.encode("<think>hm</think>ok", add_special_tokens=False)
    assert rs.thinking_tokens(tok, answer, tok.decode(answer), False) == answer.index(tok.convert_tokens_to_ids(rs.CLOSE)) + 1
    assert rs.thinking_tokens(tok, answer[:3], tok.decode(answer[:3]), False) == 3  # cut off while thinking: all of it
    plain = tok.encode("no thinking", add_special_tokens=False)
    assert rs.thinking_tokens(tok, plain, "no thinking", False) == 0 and rs.thinking_tokens(tok, plain, "no thinking", True) == 2


def test_mistral_tags_are_read_off_the_tokenizer():
    """``[THINK]`` / ``[/THINK]`` as special tokens: Mistral's pair, the parser on by itself, and a
    text without special tokens would lose them; ``<think>`` as plain added tokens keeps the usual pair."""
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    assert rs.tags_of(tok) == rs.THINK and not rs.special_tags(tok, rs.THINK)
    tok.add_tokens([rs.MISTRAL.open, rs.MISTRAL.close], special_tokens=True)
    assert rs.tags_of(tok) == rs.MISTRAL and rs.parser_on("auto", tok) and rs.special_tags(tok, rs.MISTRAL)
    ids = tok.encode("<|im_start|>assistant\n[THINK]", add_special_tokens=False)
    assert rs.prompt_opens(tok, ids, rs.MISTRAL) and not rs.prompt_opens(tok, ids[:-1], rs.MISTRAL)
    plain = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    plain.add_tokens([rs.OPEN, rs.CLOSE])
    assert rs.tags_of(plain) == rs.THINK and rs.tag_ids(plain) is not None and not rs.special_tags(plain, rs.THINK)


def tok():
    from specdec.models import registry

    return registry.load_tokenizer(registry.resolve(DRAFT_MODEL).folder)


#: the model held to some thinking, then an answer (vLLM's guided_regex)
THOUGHT = r"<think>The capital of France is Paris\.</think>\n\nParis\."


@pytest.fixture(scope="module")
def client():
    with ServerProcess.draft_model("--reasoning-parser", "think") as srv, srv.openai() as c:
        yield c


def test_a_thinking_answer_reaches_the_client_as_reasoning_and_content(client):
    """Not streamed: ``reasoning`` (and ``reasoning_content``) hold the thinking, ``content`` the rest,
    the logprobs every token; streamed: reasoning deltas, then content deltas, adding up to the same."""
    kw = dict(model=DRAFT_MODEL, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=40,
              temperature=0, logprobs=True, extra_body={"guided_regex": THOUGHT})
    whole = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "return_token_ids": True}})
    out = whole.choices[0]
    extra = out.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == "The capital of France is Paris."
    assert out.message.content == "\n\nParis."
    assert "".join(e.token for e in out.logprobs.content) == "<think>The capital of France is Paris.</think>\n\nParis."
    ids = out.model_extra["token_ids"]  # usage counts the tokens up to the one that completes </think>
    thinking = whole.usage.completion_tokens_details.reasoning_tokens
    assert "</think>" in tok().decode(ids[:thinking]) and "</think>" not in tok().decode(ids[:thinking - 1])
    assert 0 < thinking < whole.usage.completion_tokens
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    thought = [c.delta.model_extra.get("reasoning") or "" for c in chunks]
    content = [c.delta.content or "" for c in chunks]
    assert "".join(thought) == extra["reasoning"] and "".join(content) == out.message.content
    last_thought = max(i for i, t in enumerate(thought) if t)
    assert not any(content[:last_thought]) and sum(bool(t) for t in thought) > 1  # thinking first, piece by piece
    assert sum(len(c.logprobs.content) for c in chunks if c.logprobs) == len(out.logprobs.content)
    hidden = {**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}}  # vLLM's: the thinking left out
    out = client.chat.completions.create(**hidden).choices[0]
    assert out.message.content == "\n\nParis." and "reasoning" not in (out.message.model_extra or {})
    chunks = [c.choices[0] for c in client.chat.completions.create(**hidden, stream=True) if c.choices]
    assert not any(c.delta.model_extra.get("reasoning") for c in chunks)
    assert "".join(c.delta.content or "" for c in chunks) == "\n\nParis."
    assert sum(len(c.logprobs.content) for c in chunks if c.logprobs) == len(out.logprobs.content)


def test_tool_calls_are_read_after_the_thinking(client):
    """With tools shown, a call written while thinking is thinking; the one after it is the call, and
    ``parallel_tool_calls: false`` stops at the first call after the thinking."""
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    regex = (r'<think>Maybe <tool_call>\{"name": "add", "arguments": \{\}\}</tool_call> helps\.</think>'
             r'<tool_call>\n\{"name": "add", "arguments": \{"a": 1\}\}\n</tool_call>')
    kw = dict(model=DRAFT_MODEL, messages=[{"role": "user", "content": "1 + 1?"}], tools=[add], max_tokens=80, temperature=0,
              extra_body={"guided_regex": regex})
    for extra in ({}, {"parallel_tool_calls": False}):
        out = client.chat.completions.create(**kw, **extra).choices[0]
        [call] = out.message.tool_calls
        assert out.finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"a": 1}
        assert out.message.content is None and "<tool_call>" in out.message.model_extra["reasoning"]
        chunks = [c.choices[0] for c in client.chat.completions.create(**kw, **extra, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.delta.tool_calls or ()]
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert "".join(c.delta.model_extra.get("reasoning") or "" for c in chunks) == out.message.model_extra["reasoning"]


def test_a_thinking_response_has_a_reasoning_item_first(client):
    """The Responses API: the thinking is a ``reasoning`` item before the message (and the calls),
    streamed as its own events, the items' indexes shifted after it; the stream's last response is
    the one not streamed."""
    kw = dict(model=DRAFT_MODEL, input="Capital of France?", max_output_tokens=40, temperature=0,
              extra_body={"guided_regex": THOUGHT})
    out = client.responses.create(**kw)
    thought, said = out.output
    assert thought.type == "reasoning" and thought.content[0].text == "The capital of France is Paris."
    assert said.type == "message" and out.output_text == "\n\nParis."
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == out.output_text
    add = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    regex = r'<think>Add them\.</think><tool_call>\n\{"name": "add", "arguments": \{"a": 1\}\}\n</tool_call>'
    calls = dict(model=DRAFT_MODEL, input="1 + 1?", tools=[add], max_output_tokens=60, temperature=0, extra_body={"guided_regex": regex})
    out = client.responses.create(**calls)
    assert [i.type for i in out.output] == ["reasoning", "function_call"] and out.output[1].arguments == '{"a": 1}'
    events = list(client.responses.create(**calls, stream=True))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "function_call")]
    assert [i.type for i in events[-1].response.output] == ["reasoning", "function_call"]


def test_earlier_thinking_reaches_a_template_that_shows_it():
    """An assistant message's ``reasoning`` (or DeepSeek's ``reasoning_content``) reaches a template
    that renders tools under both names, as templates that show earlier thinking read one or the other."""
    from specdec.server import tools as tc
    from specdec.server.openai_api import ChatMessage

    for field in ("reasoning", "reasoning_content"):
        said = ChatMessage.model_validate({"role": "assistant", "content": "Paris.", field: "The capital."})
        turn = tc.turn(said, said.text, True)
        assert turn["reasoning"] == turn["reasoning_content"] == "The capital." and turn["content"] == "Paris."
        assert "reasoning" not in tc.turn(said, said.text, False)  # a template that renders no tools: text alone
    asked = ChatMessage.model_validate({"role": "user", "content": "Capital?", "reasoning": "ignored"})
    assert "reasoning" not in tc.turn(asked, asked.text, True)


@pytest.fixture(scope="module")
def tagged_client(tmp_path_factory):
    """A server of the bundled draft model whose tokenizer calls two of its unused tokens ``<think>``
    (id 3) and ``</think>`` (id 4), not special (as Qwen3's): the parser turns on by itself
    (``auto``), and structured output holds after the thinking's closing token."""
    from tiny import draft_renaming

    folder = draft_renaming(tmp_path_factory.mktemp("thinking"), {"<repo_name>": rs.OPEN, "<reponame>": rs.CLOSE}, special=False)
    with ServerProcess.cli("--target", str(folder), "--draft", str(folder), "--dtype", "float32", "--gamma", "4") as srv, \
            srv.openai() as c:
        yield c, folder.name


#: an answer with no free text (a string's inside could take the tags' tokens too) and an end
COUNT = {"type": "object", "properties": {"n": {"enum": [2, 4, 6, 8]}}, "required": ["n"], "additionalProperties": False}
#: the model pushed to open the block at once and close it right after (T = 0)
THINK_AT_ONCE = {"3": 60, "4": 100}


def test_structured_output_holds_after_the_thinking(tagged_client):
    """``response_format`` and a forced call on a model whose tags are tokens of their own: the
    answer may open the block first (the biases make it), anything goes inside it, and the grammar
    holds from the token after ``</think>``; an answer that opens no block is the grammar's from its
    first token; a block the prompt opened (``continue_final_message``) may be closed at once."""
    client, model = tagged_client
    ask = [{"role": "user", "content": "How many legs has a cat?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "count", "schema": COUNT}}
    kw = dict(model=model, messages=ask, max_tokens=30, temperature=0, response_format=fmt)
    out = client.chat.completions.create(**kw, logit_bias=THINK_AT_ONCE, extra_body={"return_token_ids": True}).choices[0]
    assert out.model_extra["token_ids"][:2] == [3, 4] and out.finish_reason == "stop"
    assert json.loads(out.message.content)["n"] in (2, 4, 6, 8) and not out.message.model_extra.get("reasoning")
    plain = client.chat.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    assert 3 not in plain.model_extra["token_ids"] and json.loads(plain.message.content)["n"] in (2, 4, 6, 8)
    opened = client.chat.completions.create(
        **{**kw, "messages": ask + [{"role": "assistant", "content": "<think>\n"}]}, logit_bias={"4": 100},
        extra_body={"return_token_ids": True, "continue_final_message": True, "add_generation_prompt": False}).choices[0]
    assert opened.model_extra["token_ids"][0] == 4 and json.loads(opened.message.content)["n"] in (2, 4, 6, 8)
    add = {"type": "function", "function": {"name": "add", "parameters": COUNT}}
    calls = dict(model=model, messages=ask, tools=[add], tool_choice="required", parallel_tool_calls=False,
                 max_tokens=40, temperature=0, logit_bias=THINK_AT_ONCE)
    out = client.chat.completions.create(**calls, extra_body={"return_token_ids": True}).choices[0]
    [call] = out.message.tool_calls
    assert out.model_extra["token_ids"][:2] == [3, 4] and out.finish_reason == "tool_calls"
    assert call.function.name == "add" and json.loads(call.function.arguments)["n"] in (2, 4, 6, 8)
    chunks = [c.choices[0] for c in client.chat.completions.create(**calls, stream=True) if c.choices]
    assert "".join(d.function.arguments or "" for c in chunks for d in c.delta.tool_calls or ()) == call.function.arguments
    said = client.responses.create(model=model, input=ask[0]["content"], max_output_tokens=40, temperature=0,
                                   tools=[{"type": "function", "name": "add", "parameters": COUNT}], tool_choice="required", parallel_tool_calls=False,
                                   extra_body={"logit_bias": THINK_AT_ONCE})
    assert said.usage.output_tokens_details.reasoning_tokens == 2  # an empty block: no reasoning item
    assert [i.type for i in said.output] == ["function_call"] and said.output[0].arguments == call.function.arguments


@pytest.fixture(scope="module")
def mistral_thinking(tmp_path_factory):
    """The bundled draft whose special tokens 3 and 4 are renamed ``[THINK]`` and ``[/THINK]`` (as
    Magistral's tokenizer has them): the parser turns on by itself with Mistral's tags."""
    from tiny import draft_renaming

    folder = draft_renaming(tmp_path_factory.mktemp("magistral"), {"<repo_name>": rs.MISTRAL.open, "<reponame>": rs.MISTRAL.close})
    with ServerProcess.cli("--target", str(folder), "--draft", str(folder), "--dtype", "float32", "--gamma", "4") as srv, \
            srv.openai() as c:
        yield c, folder.name


def test_mistral_thinking_is_split_on_its_special_tokens(mistral_thinking):
    """A block the prompt opened with ``[THINK]`` and never closed is all reasoning; closed at once
    (the bias), the rest is content, streamed or not, though both tags are special tokens (the text
    keeps them for the split); structured output holds after ``[/THINK]``."""
    client, model = mistral_thinking
    ask = [{"role": "user", "content": "Capital of France?"}]
    opened = dict(model=model, messages=ask + [{"role": "assistant", "content": "[THINK]"}], max_tokens=12, temperature=0,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    out = client.chat.completions.create(**opened)
    assert out.choices[0].message.model_extra["reasoning"] and out.choices[0].message.content is None
    assert out.usage.completion_tokens_details.reasoning_tokens == out.usage.completion_tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "count", "schema": COUNT}}
    shut = dict(opened, logit_bias={"4": 100}, response_format=fmt)  # closed at once, then JSON (no more [/THINK] fits)
    closed = client.chat.completions.create(**shut).choices[0]
    assert not closed.message.model_extra.get("reasoning") and json.loads(closed.message.content)["n"] in (2, 4, 6, 8)
    chunks = [c.choices[0] for c in client.chat.completions.create(**shut, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == closed.message.content
    said = client.chat.completions.create(model=model, messages=ask, max_tokens=30, temperature=0, response_format=fmt,
                                          logit_bias=THINK_AT_ONCE, extra_body={"return_token_ids": True})
    assert said.choices[0].model_extra["token_ids"][:2] == [3, 4] and said.usage.completion_tokens_details.reasoning_tokens == 2
    assert json.loads(said.choices[0].message.content)["n"] in (2, 4, 6, 8)


def test_a_held_back_start_of_a_tag_is_content_at_the_end_of_a_stream(client):
    kw = dict(model=DRAFT_MODEL, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=10,
              temperature=0, extra_body={"guided_regex": r"<thi"})
    out = client.chat.completions.create(**kw).choices[0]
    assert out.message.content == "<thi" and "reasoning" not in (out.message.model_extra or {})
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "<thi"
    assert not any(c.delta.model_extra.get("reasoning") for c in chunks)


def _streamed(text: str, opened: bool, step: int = 1) -> tuple[str, str]:
    stream = rs.StreamedReasoning(opened)
    pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)


def test_the_first_closing_tag_ends_the_thinking():
    """A second ``</think>`` is part of the answer, finished or streamed."""
    text = "<think>a</think>b</think>c"
    assert rs.split(text, False) == ("a", "b</think>c")
    assert _streamed(text, False) == ("a", "b</think>c")


@pytest.mark.parametrize("text, opened, expected", [
    ("  plain answer", False, (None, "  plain answer")),  # no block: the content is the text as it is
    ("  still thinking", True, ("  still thinking", None)),  # the prompt opened the block: all of it
])
def test_leading_whitespace_is_kept_outside_a_tag(text, opened, expected):
    """Only whitespace before an opening tag is dropped; otherwise no character is lost, streamed or not."""
    assert rs.split(text, opened) == expected
    for step in (1, 3, len(text)):
        thought, content = _streamed(text, opened, step)
        assert (thought or None, content or None) == expected, step


@pytest.fixture(scope="module")
def tokenizer_factory():
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    return lambda: AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))


def test_tags_need_both_tokens(tokenizer_factory):
    """One of a pair is not the pair: only ``[THINK]`` is not Mistral's tags, and only ``<think>``
    turns nothing on (no ids, parser off under auto); with both, the ids are (open, close)."""
    tok = tokenizer_factory()
    tok.add_tokens([rs.MISTRAL.open], special_tokens=True)
    assert rs.tags_of(tok) == rs.THINK
    tok = tokenizer_factory()
    tok.add_tokens([rs.OPEN])
    assert rs.tag_ids(tok) is None and not rs.parser_on("auto", tok)
    tok.add_tokens([rs.CLOSE])
    assert rs.tag_ids(tok) == (tok.convert_tokens_to_ids(rs.OPEN), tok.convert_tokens_to_ids(rs.CLOSE))


def test_one_special_tag_is_enough_to_need_special_tokens_kept(tokenizer_factory):
    """A text without special tokens would lose ``[THINK]`` when only it is special: keep them."""
    tok = tokenizer_factory()
    tok.add_tokens([rs.MISTRAL.open], special_tokens=True)
    tok.add_tokens([rs.MISTRAL.close], special_tokens=False)
    assert rs.special_tags(tok, rs.MISTRAL)


def test_thinking_tokens_stop_at_the_closing_tag_even_before_trailing_special_tokens(tokenizer_factory):
    """``<think>hm</think>`` then an end-of-text token (decoded to nothing): the thinking ends at
    ``</think>``'s token, not at the last token; Mistral's special tags are found in a text that keeps them."""
    tok = tokenizer_factory()
    tok.add_tokens([rs.OPEN, rs.CLOSE])
    ids = tok.encode("<think>hm</think>", add_special_tokens=False) + [tok.eos_token_id]
    close_at = ids.index(tok.convert_tokens_to_ids(rs.CLOSE)) + 1
    assert close_at < len(ids)
    assert rs.thinking_tokens(tok, ids, tok.decode(ids, skip_special_tokens=True), False) == close_at
    mistral = tokenizer_factory()
    mistral.add_tokens([rs.MISTRAL.open, rs.MISTRAL.close], special_tokens=True)
    ids = mistral.encode("[THINK]hm[/THINK]ok", add_special_tokens=False)
    text = mistral.decode(ids, skip_special_tokens=False)
    k = ids.index(mistral.convert_tokens_to_ids(rs.MISTRAL.close)) + 1
    assert k < len(ids)
    assert rs.thinking_tokens(mistral, ids, text, False, skip_special_tokens=False, tags=rs.MISTRAL) == k


@pytest.fixture(scope="module")
def plain_tokenizer():
    """SmolLM2's tokenizer as shipped: ``<think>`` is no token of its own but several pieces."""
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    return AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))


def test_a_prompt_opens_a_block_written_in_several_tokens(plain_tokenizer):
    """``--reasoning-parser think`` on a tokenizer without a ``<think>`` token: the generation prompt
    ``<think>\\n`` is several tokens (``<``, ``think``, ``>``, newline), and still opens the block."""
    tok = plain_tokenizer
    ids = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert len(ids) - len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False)) >= 4  # the premise
    assert rs.prompt_opens(tok, ids)
    assert not rs.prompt_opens(tok, tok.encode("<|im_start|>assistant\n", add_special_tokens=False))


def test_a_prompt_whose_block_is_already_closed_does_not_open_one(plain_tokenizer):
    """Qwen3's non-thinking generation prompt ends ``<think>\\n\\n</think>\\n\\n``: the block is
    closed, so the answer starts outside it (all of it is content)."""
    tok = plain_tokenizer.__class__.from_pretrained(plain_tokenizer.name_or_path)  # a copy: the fixture stays plain
    tok.add_tokens([rs.OPEN, rs.CLOSE])
    ids = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert not rs.prompt_opens(tok, ids)
    assert rs.prompt_opens(tok, tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False))


def test_thinking_ends_at_the_token_that_completes_the_closing_tag_mid_token(plain_tokenizer):
    """Without a ``</think>`` token the tag is written in pieces, and the piece that completes it
    may carry more text (``>.`` in SmolLM2's tokens): the thinking still ends at that token."""
    tok = plain_tokenizer
    ids = tok.encode("<think>hm</think>.\n", add_special_tokens=False)
    k = next(k for k in range(1, len(ids) + 1) if rs.CLOSE in tok.decode(ids[:k]))
    assert not tok.decode(ids[:k]).endswith(rs.CLOSE)  # the premise: that token carries more than the tag's end
    assert rs.thinking_tokens(tok, ids, tok.decode(ids), False) == k < len(ids)


def _result(tokens):
    return SimpleNamespace(token_ids=list(tokens), prediction_tokens=None, stats=SimpleNamespace(cached_prompt_tokens=0))


def test_reasoning_tokens_add_up_over_every_choice_not_only_each_prompts_first():
    """n = 2 choices per prompt: each choice's thinking counts (cached tokens are the ones counted once per prompt)."""
    outs = [_result([1, 2]), _result([3, 4, 5]), _result([6]), _result([7, 8])]
    usage = _usage(outs, prompt_tokens=4, n=2, thinking=lambda o: len(o.token_ids) - 1)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 1 + 2 + 0 + 1
    assert "completion_tokens_details" not in _usage(outs, prompt_tokens=4, n=2)  # no parser: nothing said of thinking


def test_only_a_closing_mistral_tag_is_not_mistrals_pair():
    """A tokenizer with ``[/THINK]`` but no ``[THINK]`` token keeps the ``<think>`` pair (the opening one
    alone is the mirror case test_reasoning checks)."""
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    tok.add_tokens([rs.MISTRAL.close], special_tokens=True)
    assert rs.tags_of(tok) == rs.THINK


@pytest.fixture(scope="module")
def letters():
    """The in-process tiny app of test_openai_requests (letter tokenizer: no thinking tags, parser auto: off)."""
    from fastapi.testclient import TestClient
    from tiny import tiny_native
    from toy_server import ChatLetters

    from specdec.drafters import ModelDrafter
    from specdec.server import ServerSettings, create_app

    model, draft = tiny_native(vocab=26, max_length=64), tiny_native(vocab=26, max_length=64, seed=1)
    app = create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(model_name="tiny"),
                     drafter_factory=lambda: ModelDrafter(draft), drafter_name="tiny")
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def test_without_the_parser_usage_has_no_reasoning_tokens(letters):
    """The parser off (a tokenizer without the tags, ``auto``): no ``reasoning_tokens`` in the usage,
    not a count of 0 that would claim the answer was looked at for thinking."""
    r = letters.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4,
                                                    "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert "reasoning_tokens" not in (usage.get("completion_tokens_details") or {})


ASK = [{"role": "user", "content": "Capital of France?"}]


def _chunks(client, **kw):
    return [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]


def test_thinking_cut_off_inside_a_closing_tag_stays_hidden_without_include_reasoning(client):
    """An answer that stops in the middle of ``</think>`` (``</th``, held back while streaming as a
    tag may follow) is all thinking: with ``include_reasoning: false`` none of it goes out, not
    even the held-back tail at the end of the stream."""
    kw = dict(model=DRAFT_MODEL, messages=ASK, max_tokens=20, temperature=0, extra_body={"guided_regex": r"<think>ab</th"})
    shown = client.chat.completions.create(**kw).choices[0]
    assert shown.message.model_extra["reasoning"] == "ab</th" and shown.message.content is None  # the premise
    kw["extra_body"] = {**kw["extra_body"], "include_reasoning": False}
    chunks = _chunks(client, **kw)
    assert not any(c.delta.model_extra.get("reasoning") or c.delta.model_extra.get("reasoning_content") for c in chunks)
    assert "".join(c.delta.content or "" for c in chunks) == ""


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_with_tools_the_thinking_is_never_streamed_as_content(client):
    """Tools shown: the thinking goes out as reasoning only; the content deltas hold nothing of it."""
    regex = r'<think>Add them\.</think><tool_call>\n\{"name": "add", "arguments": \{"a": 1\}\}\n</tool_call>'
    kw = dict(model=DRAFT_MODEL, messages=ASK, tools=[ADD], max_tokens=60, temperature=0, extra_body={"guided_regex": regex})
    chunks = _chunks(client, **kw)
    assert "".join(c.delta.model_extra.get("reasoning") or "" for c in chunks) == "Add them."
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]


def test_with_tools_a_held_back_start_of_a_tag_is_content_once(client):
    """``<thi`` (it might have become ``<think>``) is content at the end, sent once, tools shown or not."""
    kw = dict(model=DRAFT_MODEL, messages=ASK, tools=[ADD], max_tokens=10, temperature=0, extra_body={"guided_regex": r"<thi"})
    assert client.chat.completions.create(**kw).choices[0].message.content == "<thi"  # the premise
    chunks = _chunks(client, **kw)
    assert "".join(c.delta.content or "" for c in chunks) == "<thi"


def test_each_streamed_choice_is_split_on_its_own(client):
    """n = 2 streamed: each choice's reasoning and content deltas add up to that choice's own split."""
    regex = r"<think>The capital is Paris\.</think>Paris\."
    kw = dict(model=DRAFT_MODEL, messages=ASK, max_tokens=30, temperature=0, n=2, extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**kw).choices
    assert [c.message.model_extra["reasoning"] for c in whole] == ["The capital is Paris."] * 2  # the premise
    thought, content = {0: "", 1: ""}, {0: "", 1: ""}
    for event in client.chat.completions.create(**kw, stream=True):
        for c in event.choices:
            thought[c.index] += c.delta.model_extra.get("reasoning") or ""
            content[c.index] += c.delta.content or ""
    assert thought == {0: "The capital is Paris.", 1: "The capital is Paris."}
    assert content == {0: "Paris.", 1: "Paris."}
