"""Tool calling on /v1/chat/completions (``tools``, ``tool_choice``): the Hermes-style blocks,
the grammar that holds a required call, and both kinds of chat template."""

from __future__ import annotations

import json

import openai
import pytest

from serverproc import DRAFT_MODEL, ServerProcess
from specdec.errors import ConfigError
from specdec.grammar import GrammarConstraint
from specdec.models import registry
from specdec.server import tools as tc
from specdec.server.errors import ApiError
from specdec.server.openai_api import ChatMessage, _chat_ids

MODEL = DRAFT_MODEL
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def client():
    with ServerProcess.draft_model() as srv, srv.openai() as c:
        yield c


def test_answers_become_tool_calls_and_content():
    content, calls = tc.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                              '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert tc.parse("<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>")[0] is None  # nothing else said
    for text in ("no call here", "<tool_call>{not json}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>",
                 "<tool_call>{\"name\": \"add\""):  # plain text, malformed, nameless, cut off before the arguments: content
        assert tc.parse(text) == (text, [])
    # the arguments as written (not re-encoded); text between or after blocks, and a malformed block among calls, dropped
    content, calls = tc.parse('A<tool_call>{"name":"add","arguments":{"a":1}}</tool_call> b <tool_call>{oops}</tool_call>'
                              '<tool_call>{"arguments": {"b": 2}, "name": "add"}</tool_call> c', ids=["call_x"])
    assert content == "A" and [(c["id"], c["function"]["arguments"]) for c in calls] == [
        ("call_x", '{"a":1}'), (calls[1]["id"], '{"b": 2}')] and calls[1]["id"] != "call_x"
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": "x}", "b": [1, {'  # cut off inside the arguments: a call so far
    assert tc.parse(cut)[1][0]["function"]["arguments"] == '{"a": "x}", "b": [1, {'
    assert tc.held_back("Sure <tool_ca") == len("Sure ") and tc.held_back("a <tool_call>{") == 2
    assert tc.held_back("x < y") == len("x < y") and tc.held_back("tail<") == 4


def test_untagged_calls_are_read_only_when_they_are_the_whole_answer():
    """Qwen2.5-Coder writes a call without tags, often fenced: an answer that is nothing but calls
    of the tools shown is read as those calls; anything else stays text."""
    names = ["get_weather", "add"]
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    for text, expected in ((fenced, [("get_weather", {"city": "Paris"})]),
                           ('  {"name": "add", "arguments": {"a": 1, "b": 2}}\n', [("add", {"a": 1, "b": 2})]),
                           ('[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "arguments": "{}"}]',
                            [("add", {"a": 1}), ("get_weather", {})])):
        content, calls = tc.parse(text, names)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    for text in (fenced, '{"name": "add", "arguments": {}}'):
        assert tc.parse(text) == (text, [])  # no tool shown: text
    for text in ('{"name": "nope", "arguments": {}}',  # not a tool shown
                 '{"name": "add", "arguments": {}, "why": "asked"}',  # more than a call
                 'Here: {"name": "add", "arguments": {}}',  # JSON inside an answer
                 '```python\n{"name": "add", "arguments": {}}\n```', '{"name": "add", "arguments": {}', '[]', '{"ok": true}'):
        assert tc.parse(text, names) == (text, []), text
    tagged = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert tc.parse(tagged, names)[0] == "Sure." and len(tc.parse(tagged, names)[1]) == 1
    for start in ("", " \n", "{", "[", "`", "```", "```js", "```json", "```json\n", "```\n[", "```json\n  {"):
        assert tc.may_be_whole_call(start), start
    for start in ("Sure", "```python", "```jsonx", "`x", "Here {", "```\nprint"):
        assert not tc.may_be_whole_call(start), start
    gate = tc.HeldContent()  # a fenced call streams nothing as content
    assert all(gate.feed(piece, None, [i]) is None for i, piece in enumerate(("```json\n", '{"name": "add",', ' "arguments": {}}\n```')))
    assert gate.rest('```json\n{"name": "add", "arguments": {}}\n```', calls=True) == ("", None, [0, 1, 2])
    gate = tc.HeldContent()  # a code block is held only until it cannot be a call
    assert gate.feed("```", None, [0]) is None and gate.feed("python\nx = 1", None, [1]) == ("```python\nx = 1", None, [0, 1])


def test_streamed_content_is_held_where_a_call_may_begin():
    """Text goes out up to a possible call; the entries and ids of text held back go out with the
    next text sent (a piece without entries leaves them waiting), the rest at the end."""
    gate = tc.HeldContent()
    assert gate.feed("Sure", ["e1"], [1]) == ("Sure", ["e1"], [1])
    assert gate.feed(" <tool", ["e2"], [2]) == (" ", ["e2"], [2])  # "<tool" may open a call
    assert gate.feed("_c", ["e3"], [3]) is None  # "<tool_c": still a call's opening
    assert gate.feed("s", ["e4"], [4]) == ("<tool_cs", ["e3", "e4"], [3, 4])  # not one after all
    assert gate.feed("<tool_call>{", ["e5"], [5]) is None
    assert gate.rest('Sure <tool_cs<tool_call>{"name": "f"}</tool_call>', calls=True) == ("", ["e5"], [5])
    gate = tc.HeldContent()
    assert gate.feed("a", ["e1"], [1]) == ("a", ["e1"], [1])
    assert gate.feed("<", ["e2"], [2]) is None
    assert gate.feed("b", None, [3]) == ("<b", None, [2, 3])  # a piece without entries: the held one waits on
    assert gate.rest("a<b", calls=False) == ("", ["e2"], [])
    gate = tc.HeldContent()  # white space alone before a call is no content
    assert gate.feed("\n", None, [1]) is None and gate.feed("<tool_call>{", None, [2]) is None
    assert gate.rest('\n<tool_call>{"name": "f"}</tool_call>', calls=True) == ("", None, [1, 2])
    gate = tc.HeldContent()
    assert gate.feed("x <tool_ca", None, [1]) == ("x ", None, [1])
    assert gate.rest("x <tool_ca", calls=False) == ("<tool_ca", None, [])  # no call made: all of it goes


def _stream_calls(text: str, cuts: list[int]) -> tuple[list[tuple], list[dict]]:
    """The events of ``text`` streamed in pieces ending at ``cuts``, then finished; and its calls."""
    writer = tc.StreamedCalls()
    events = [e for cut in cuts for e in writer.feed(text[:cut])]
    calls = tc.parse(text, ids=writer.ids)[1]
    return events + writer.finish(calls), calls


def _gathered(events: list[tuple]) -> dict[int, list]:
    """Per call: [id, name, the argument pieces put together, how many pieces, whether done]."""
    calls: dict[int, list] = {}
    for kind, k, *what in events:
        if kind == "added":
            assert k == len(calls) and all(c[4] for c in calls.values())  # in order, each after the last is done
            calls[k] = [*what, "", 0, False]
        elif kind == "delta":
            assert not calls[k][4]
            calls[k][2] += what[0]
            calls[k][3] += 1
        else:
            assert what[0] == calls[k][2] and not calls[k][4]
            calls[k][4] = True
    return calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_calls_add_up_to_the_finished_answers(step):
    """Streamed in pieces of any size, each call is announced with its id and name, its arguments
    go out as they grow (never a piece of the closing tag) and add up to exactly the finished
    answer's arguments; the ids are the finished answer's."""
    answers = ['Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}\n</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": [1, {"b": "</tool"}], "c": 2}, "x": 1}\n</tool_call>',
               '<tool_call>{"name": "add", "arguments": {"a": 1, "b": "<"}}',  # never closed
               '<tool_call>{"name": "add", "arguments": {"a": "x</tool_call>"}}</tool_call>',  # the tag ends it
               '<tool_call>{broken}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>', "no calls",
               # a file as an argument: braces, quotes and backslashes inside a long string, cut anywhere
               '<tool_call>\n{"name": "write", "arguments": {"path": "a.py", "content": "' +
               'def f():\\n    return {\\"a\\": [1, \\"}\\"]}  # \\\\ {\\n' * 20 + '"}}\n</tool_call>']
    for text in answers:
        events, calls = _stream_calls(text, list(range(step, len(text), step)))
        streamed = _gathered(events)
        assert [(c[0], c[1], c[2], c[4]) for c in streamed.values()] == [
            (c["id"], c["function"]["name"], c["function"]["arguments"], True) for c in calls], text
    events, calls = _stream_calls(answers[0], list(range(1, len(answers[0]))))  # a character at a time
    # a piece per character, but "</tool" waits until it cannot close the block; the other shape goes out whole
    assert [c[3] for c in _gathered(events).values()] == [len('{"city": "Pa\\"ris}"}'), 1, len(calls[2]["function"]["arguments"]) - 6]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Pa\\"ris}"}', '{"a": 1}', '{"a": [1, {"b": "</tool"}], "c": 2}']
    assert [c["function"]["arguments"] for c in _stream_calls(answers[2], [len(answers[2])])[1]] == ['{"a": "x']


def test_tool_choice_picks_the_tools_and_the_grammar():
    tools = [tc.ToolDef.model_validate(ADD), tc.ToolDef.model_validate(WEATHER)]
    assert tc.chosen(tools, None) == (tools, None) and tc.chosen(tools, "auto") == (tools, None)
    assert tc.chosen(tools, "none") == ([], None) and tc.chosen(tools, "required") == (tools, "")
    assert tc.chosen(tools, {"type": "function", "function": {"name": "add"}}) == (tools, "add")
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes",
                {"type": "function", "function": "add"}, {"type": "function", "function": ["add"]}):
        with pytest.raises(ApiError):  # a 400, not an AttributeError's 500
            tc.chosen(tools, bad)
    with pytest.raises(ApiError, match="needs tools"):
        tc.chosen([], "required")
    for mode, name in (("auto", None), ("required", "")):  # OpenAI's allowed_tools: a subset, the only tools shown
        subset = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
        assert tc.chosen(tools, subset) == (tools[1:], name)
    for bad in ({"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": [WEATHER]}},
                {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
                {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}},
                {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": "add"}]}}):
        with pytest.raises(ApiError, match="allowed_tools"):
            tc.chosen(tools, bad)
    assert tc.grammar(tools, None) is None and tc.grammar(tools, "") and tc.grammar(tools, "add")


def test_a_tokenizer_that_has_the_tags_as_tokens_gets_them_in_the_grammar():
    """Qwen2.5's tokenizer has ``<tool_call>`` and ``</tool_call>`` as added tokens of their own,
    which llguidance matches by name only: with the tags written as text, the grammar allowed the
    tag's token and then refused it (a forced call on Qwen2.5 failed at its first token).  Here a
    SmolLM2 tokenizer given the two tags as added tokens stands in for Qwen2.5's."""
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    tok.add_tokens([tc.OPEN, tc.CLOSE])
    tools = [tc.ToolDef.model_validate(ADD)]
    ids = tok.encode('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>', add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(tc.OPEN) and ids[-1] == tok.convert_tokens_to_ids(tc.CLOSE)
    vocab = len(tok)
    grammar = tc.grammar(tools, "", tokenizer=tok)
    assert bool(GrammarConstraint(tok, grammar, vocab).allowed(ids, vocab)[tok.eos_token_id])  # the call, then the end
    # the tags as text: the tag's own token is allowed, then refused (now found when the constraint is made)
    with pytest.raises(ConfigError, match="the grammar cannot be followed: its matcher fails on a token it allows"):
        GrammarConstraint(tok, tc.grammar(tools, ""), vocab).allowed(ids, vocab)
    plain = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))  # no such tokens: the tags as text
    assert tc.grammar(tools, "", tokenizer=plain) == tc.grammar(tools, "")


def test_required_allows_several_calls_unless_parallel_calls_are_off():
    """``required`` is OpenAI's "one or more calls": its grammar takes a second block after the
    first; with ``parallel_tool_calls: false``, or a named function, the first block ends the answer."""
    tok = registry.load_tokenizer(registry.resolve(MODEL).folder)
    tools = [tc.ToolDef.model_validate(ADD), tc.ToolDef.model_validate(WEATHER)]
    one = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'
    vocab = len(tok)

    def ends(grammar: str, text: str) -> bool:  # whether the grammar takes ``text`` and lets the answer end there
        return bool(GrammarConstraint(tok, grammar, vocab).allowed(tok.encode(text, add_special_tokens=False), vocab)[tok.eos_token_id])

    several = tc.grammar(tools, "", several=True)
    assert ends(several, one) and ends(several, two) and ends(several, two + "\n" + one)
    for single in (tc.grammar(tools, ""), tc.grammar(tools, "add", several=True)):
        assert ends(single, one)
        with pytest.raises(ConfigError, match="breaks the grammar"):
            ends(single, two)


def test_a_template_without_tools_gets_them_in_a_system_message():
    """SmolLM2's template renders no tools: they go into a system message, earlier calls into
    the assistant's text as blocks, and a tool's result into a user turn."""
    tok = registry.load_tokenizer(registry.resolve(MODEL).folder)
    assert not tc.template_renders_tools(tok.chat_template)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [ChatMessage.model_validate(m) for m in (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "3"})]
    text = tok.decode(_chat_ids(tok, messages, tools=[tc.ToolDef.model_validate(ADD)]))
    assert text.index("Be brief.") < text.index('"name": "add"') < text.index("1 + 2?")  # one system message, first
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response>" in text


def test_an_assistants_text_before_its_calls_stays_in_front_of_the_blocks():
    """A template that renders no tools gets an assistant turn's text and then its calls as blocks,
    one per line; a turn with calls and no text is the blocks alone."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    other = {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    said = ChatMessage.model_validate({"role": "assistant", "content": "Let me add.", "tool_calls": [call, other]})
    first, second = tc.block("add", {"a": 1, "b": 2}), tc.block("add", {"a": 3, "b": 4})
    assert tc.turn(said, "Let me add.", False) == {"role": "assistant", "content": f"Let me add.\n{first}\n{second}"}
    bare = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    assert tc.turn(bare, "", False) == {"role": "assistant", "content": first}


def test_a_template_with_tools_renders_them_itself():
    """Qwen2.5's template renders tools, calls and results itself (arguments as objects, not
    strings written twice)."""
    try:
        folder = registry.resolve("qwen2.5-coder-0.5b").folder
    except Exception:  # noqa: BLE001 - the Qwen models are an optional install
        pytest.skip("the Qwen2.5-Coder-0.5B files are not installed")
    tok = registry.load_tokenizer(folder)
    assert tc.template_renders_tools(tok.chat_template)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"})]
    text = tok.decode(_chat_ids(tok, messages, tools=[tc.ToolDef.model_validate(ADD)]))
    assert "<tools>" in text and '"name": "add"' in text and '"arguments": {"a": 1, "b": 2}' in text
    assert "<tool_response>\n3\n</tool_response>" in text


def test_a_required_call_is_made_and_parsed_streamed_or_not(client):
    for choice, names in (({"type": "function", "function": {"name": "add"}}, {"add"}), ("required", {"add", "get_weather"})):
        # one call: a named function's, or required's with parallel calls off (several: the next test)
        kw = dict(model=MODEL, messages=ASK, tools=[ADD, WEATHER], tool_choice=choice, max_tokens=60, temperature=0,
                  parallel_tool_calls=False)
        out = client.chat.completions.create(**kw)
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
        [call] = choice0.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name in names
        if call.function.name == "add":
            assert set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())
        else:
            assert arguments["city"] in ("Paris", "Rome")
        assert out.model_extra["specdec"]["draft_tokens_proposed"] > 0  # speculation ran under the call's grammar
        chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        [(name, arguments, pieces)] = _client_calls(chunks)
        assert (name, arguments) == (call.function.name, call.function.arguments) and pieces > 1  # streamed as written
        assert "".join(c.delta.content or "" for c in chunks) == "" and chunks[-1].finish_reason == "tool_calls"
        sampled = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 4, "n": 3})
        assert all(c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] in ([n] for n in names)
                   for c in sampled.choices)


def test_required_may_make_several_calls(client):
    """``required`` with parallel calls allowed (the default): the grammar lets the model go on to
    another call after each, which this small model does until ``max_tokens`` cuts it off
    (``length``; the last call's arguments as far as they were written); every call names a tool
    shown, and the stream adds up to the same calls."""
    kw = dict(model=MODEL, messages=ASK, tools=[ADD, WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    out = client.chat.completions.create(**kw)
    calls = out.choices[0].message.tool_calls
    assert len(calls) >= 2 and all(c.function.name in ("add", "get_weather") for c in calls)
    assert all(json.loads(c.function.arguments) for c in calls[:-1]) and out.choices[0].finish_reason == "length"
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert [(name, arguments) for name, arguments, _ in _client_calls(chunks)] == [(c.function.name, c.function.arguments) for c in calls]
    assert chunks[-1].finish_reason == out.choices[0].finish_reason


def _client_calls(chunks: list) -> list[tuple[str, str, int]]:
    """The calls of streamed chat choices as a client puts them together: (name, arguments, how many
    chunks carried them); an id and the name come once, with the call's first chunk."""
    calls: dict[int, list] = {}
    for c in chunks:
        for d in c.delta.tool_calls or ():
            if d.index not in calls:
                assert d.index == len(calls) and d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, "", 0]
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
            calls[d.index][2] += 1
    return [tuple(calls[k]) for k in sorted(calls)]


#: a regex (vLLM's guided_regex) that holds the model to some text, then two calls
TWO_CALLS = (r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>\n'
             r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>')


def test_text_then_two_calls_stream_as_they_are_written(client):
    """With the model held to some text and two calls: the text is the content; each call streams
    its id and name once, then its arguments piece by piece, adding up to the answer not streamed."""
    kw = dict(model=MODEL, messages=ASK, tools=[ADD, WEATHER], max_tokens=80, temperature=0, extra_body={"guided_regex": TWO_CALLS})
    out = client.chat.completions.create(**kw)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert [c.function.name for c in message.tool_calls] == ["add", "get_weather"]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls = _client_calls(chunks)
    assert [(name, arguments) for name, arguments, _ in calls] == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert all(pieces > 2 for *_, pieces in calls)
    assert "".join(c.delta.content or "" for c in chunks).strip() == "Sure." and chunks[-1].finish_reason == "tool_calls"
    first_call = next(i for i, c in enumerate(chunks) if c.delta.tool_calls)
    assert first_call < len(chunks) - 3 and not any(c.delta.content for c in chunks[first_call:])
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)  # the first call alone, streamed or not
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["add"] and one.choices[0].message.content == "Sure."
    # ... and generation stopped where that call's block closed: its tokens end with the closing tag
    ids = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "return_token_ids": True}}, parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls" and one.usage.completion_tokens < out.usage.completion_tokens
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    written = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft")).decode(ids.choices[0].token_ids)
    assert written.endswith("</tool_call>") and written.count("</tool_call>") == 1
    assert "x-specdec-ignored-fields" not in client.chat.completions.with_raw_response.create(**kw, parallel_tool_calls=False).headers
    one_streamed = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True, parallel_tool_calls=False) if c.choices]
    assert [(name, arguments) for name, arguments, _ in _client_calls(one_streamed)] == [
        (message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)]
    cut = client.chat.completions.create(**{**kw, "max_tokens": 24})  # cut off inside the first call's arguments
    [call] = cut.choices[0].message.tool_calls
    assert cut.choices[0].finish_reason == "length" and call.function.name == "add"
    assert call.function.arguments and message.tool_calls[0].function.arguments.startswith(call.function.arguments)


def test_auto_shows_the_tools_and_leaves_plain_answers_alone(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    bare = client.chat.completions.create(**kw)
    auto = client.chat.completions.create(**kw, tools=[ADD, WEATHER])
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens + 40  # the tools were described to the model
    if not auto.choices[0].message.tool_calls:  # this tiny model rarely calls on its own: then it is text
        assert auto.choices[0].message.content and auto.choices[0].finish_reason in ("stop", "length")
    streamed = list(client.chat.completions.create(**kw, tools=[ADD, WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (auto.choices[0].message.content or "")
    none = client.chat.completions.create(**kw, tools=[ADD, WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens and none.choices[0].message.content == bare.choices[0].message.content


def test_an_untagged_call_reaches_the_client_as_a_call(client):
    """An answer that is a call object without tags (held here to that shape by a JSON schema,
    with the tools shown and the model free to call) is a call on both endpoints, streamed or not,
    and no content is streamed."""
    shape = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False}
    kw = dict(model=MODEL, messages=ASK, tools=[ADD, WEATHER], max_tokens=40, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": shape}})
    out = client.chat.completions.create(**kw)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "" and chunks[-1].finish_reason == "tool_calls"
    assert [(d.function.name, d.function.arguments) for c in chunks if c.delta.tool_calls for d in c.delta.tool_calls] == [
        (call.function.name, call.function.arguments)]
    resp = client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=40, temperature=0,
                                   tools=[{"type": "function", **t["function"]} for t in (ADD, WEATHER)],
                                   text={"format": {"type": "json_schema", "name": "call", "schema": shape}})
    assert [(o.type, o.name, o.arguments) for o in resp.output] == [("function_call", call.function.name, call.function.arguments)]


def test_allowed_tools_show_and_allow_a_subset(client):
    """``allowed_tools`` with ``required`` over one of two tools: that tool's call, and the prompt
    the one where only that tool is shown; on both endpoints."""
    subset = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "add"}}]}}
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, parallel_tool_calls=False)
    out = client.chat.completions.create(**kw, tools=[WEATHER, ADD], tool_choice=subset)
    alone = client.chat.completions.create(**kw, tools=[ADD], tool_choice="required")
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["add"]
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens
    assert out.choices[0].message.tool_calls[0].function.arguments == alone.choices[0].message.tool_calls[0].function.arguments
    resp = client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=40, temperature=0, parallel_tool_calls=False,
                                   tools=[{"type": "function", **t["function"]} for t in (WEATHER, ADD)],
                                   tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]})
    assert [(o.name, o.arguments) for o in resp.output] == [("add", alone.choices[0].message.tool_calls[0].function.arguments)]
    with pytest.raises(openai.BadRequestError, match="allowed_tools"):
        client.chat.completions.create(**kw, tools=[ADD], tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "x", "tools": []}})


def test_a_conversation_with_calls_and_results_is_accepted(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_requests_are_400s(client):
    for kw, message in ((dict(tool_choice="required"), "needs tools"),
                        (dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}), "not among"),
                        (dict(tools=[ADD], tool_choice="required", response_format={"type": "json_object"}), "send no other"),
                        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
                        (dict(messages=[{"role": "tool", "tool_call_id": "x"}]), "content is required"),
                        (dict(messages=[{"role": "user", "content": "x", "tool_calls": [
                            {"type": "function", "function": {"name": "add"}}]}]), "only assistant messages")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 4, **kw})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"tools": [ADD]})  # chat only


# ---------------------------------------------------------------- Mistral's [TOOL_CALLS] format

LISTED, NAMED = tc.CallFormat(tc.MISTRAL_OPEN), tc.CallFormat(tc.MISTRAL_OPEN, args=True)


def test_mistral_calls_are_read_in_both_of_its_forms():
    """After ``[TOOL_CALLS]``: a JSON list of call objects (an ``id`` after the arguments allowed), or
    each call by name, ``[ARGS]`` and its arguments (a ``[CALL_ID]`` read past); the text before the
    first marker is the content; ids are nine letters and digits."""
    answers = {
        'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}, '
        '{"name": "add", "arguments": {"a": 1}}]': ("Let me check.", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1}')]),
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]add[CALL_ID]x1[ARGS]{"a": {"b": "}"}}':
            (None, [("get_weather", '{"city": "Rome"}'), ("add", '{"a": {"b": "}"}}')]),
        '[TOOL_CALLS][{"arguments": {"a": 2}, "name": "add"}]': (None, [("add", '{"a": 2}')]),  # another shape: re-encoded
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": [2': (None, [("add", '{"a": 1, "b": [2')]),  # cut off
    }
    for fmt in (LISTED, NAMED):  # either form is read whichever the tokenizer's: the grammar alone picks one
        for text, (content, calls) in answers.items():
            got_content, got = tc.parse(text, fmt=fmt)
            assert got_content == content and [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls, text
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)
    for text in ("no calls here", "[TOOL_CALLS] not a call", "[TOOL_CALLS] [oops]", '[TOOL_CALLS]{"a": 1}'):
        assert tc.parse(text, fmt=LISTED) == (text, []), text
    hermes = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'  # a Mistral model's text is not read as blocks
    assert tc.parse(hermes, fmt=LISTED) == (hermes, []) and tc.parse(hermes)[1]
    assert tc.first_call_closed('[TOOL_CALLS]add[ARGS]{"a": 1}', NAMED)
    assert not tc.first_call_closed('[TOOL_CALLS]add[ARGS]{"a": 1', NAMED) and not tc.first_call_closed("[TOOL_CALLS] [", LISTED)
    assert tc.first_call_closed('[TOOL_CALLS] [{"name": "add", "arguments": {}}, {"name": "a', LISTED)
    gate = tc.HeldContent(LISTED)  # content is held where the marker may begin, and stops at it
    assert gate.feed("Sure [TOOL", None, [1]) == ("Sure ", None, [1]) and gate.feed("_CALLS] [", None, [2]) is None
    assert gate.rest('Sure [TOOL_CALLS] [{"name": "add", "arguments": {}}]', calls=True) == ("", None, [2])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_mistral_calls_stream_as_they_are_written(step):
    """Streamed in pieces of any size, Mistral's calls are announced in order and their arguments'
    pieces add up to the finished answer's, in both forms."""
    answers = ['Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa\\"ris]}"}, "id": "abcdefghi"}, '
               '{"arguments": {"a": 1}, "name": "add"}, {"name": "add", "arguments": {"a": [1, {"b": 2}]}}]',
               '[TOOL_CALLS]get_weather[ARGS]{"city": "[TOOL"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": {"c": "}"}}',
               '[TOOL_CALLS]add[ARGS]{"a": 1, "b": ',  # never closed
               '[TOOL_CALLS] [{"name": "add", "arguments": {"a": "x"}}']  # the list never closed
    for fmt, text in zip((LISTED, NAMED, NAMED, LISTED), answers):
        writer = tc.StreamedCalls(fmt=fmt)
        events = [e for cut in range(step, len(text), step) for e in writer.feed(text[:cut])]
        calls = tc.parse(text, ids=writer.ids, fmt=fmt)[1]
        streamed = _gathered(events + writer.finish(calls))
        assert [(c[0], c[1], c[2], c[4]) for c in streamed.values()] == [
            (c["id"], c["function"]["name"], c["function"]["arguments"], True) for c in calls], text
        assert all(len(i) == 9 for i in writer.ids)
    writer = tc.StreamedCalls(fmt=NAMED)  # a character at a time: the arguments grow piece by piece
    events = [e for cut in range(1, len(answers[1]) + 1) for e in writer.feed(answers[1][:cut])]
    assert [c[3] for c in _gathered(events).values()] == [len('{"city": "[TOOL"}'), len('{"a": 1, "b": {"c": "}"}}')]


def test_mistral_templates_get_nine_character_ids():
    """Mistral's templates refuse call ids other than nine letters and digits: an OpenAI-style id
    becomes nine derived from it, the same for the call and the result naming it; a valid one stays."""
    fmt = LISTED
    derived = fmt.template_id("call_8f2a")
    assert len(derived) == 9 and derived.isalnum() and derived == fmt.template_id("call_8f2a") != fmt.template_id("call_8f2b")
    assert fmt.template_id("abcDEF123") == "abcDEF123" and fmt.template_id(None) is None
    assert tc.HERMES.template_id("call_8f2a") == "call_8f2a"
    call = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_8f2a", "type": "function", "function": {"name": "add", "arguments": "{}"}}]})
    result = ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_8f2a", "content": "3"})
    assert tc.turn(call, "", True, fmt)["tool_calls"][0]["id"] == tc.turn(result, "3", True, fmt)["tool_call_id"] == derived


def _mistral_tokenizer(args: bool):
    """SmolLM2's tokenizer given ``[TOOL_CALLS]`` (and ``[ARGS]``) as special tokens: a stand-in for
    a Mistral tokenizer."""
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    tok.add_special_tokens({"additional_special_tokens": [tc.MISTRAL_OPEN] + ([tc.MISTRAL_ARGS] if args else [])})
    return tok


def test_mistral_grammars_hold_a_forced_call_to_its_form():
    """A forced call's grammar writes the marker (and ``[ARGS]``) as the tokenizer's own special
    tokens: a list of calls, or each call by name; one call, or several where allowed."""
    tools = [tc.ToolDef.model_validate(ADD), tc.ToolDef.model_validate(WEATHER)]
    for args, one, two in ((False, '[TOOL_CALLS] [{"name":"add","arguments":{"a":1,"b":2}}]',
                            '[TOOL_CALLS] [{"name":"add","arguments":{"a":1,"b":2}}, {"name":"get_weather","arguments":{"city":"Rome"}}]'),
                           (True, '[TOOL_CALLS]"add"[ARGS]{"a":1,"b":2}',
                            '[TOOL_CALLS]"add"[ARGS]{"a":1,"b":2}[TOOL_CALLS]"get_weather"[ARGS]{"city":"Rome"}')):
        tok = _mistral_tokenizer(args)
        fmt = tc.call_format(tok)
        assert fmt == (NAMED if args else LISTED)
        vocab = len(tok)
        if args:
            one, two = one.replace('"add"', "add").replace('"get_weather"', "get_weather"), two.replace('"add"', "add").replace('"get_weather"', "get_weather")

        def ends(grammar: str, text: str) -> bool:
            ids = tok.encode(text, add_special_tokens=False)
            return bool(GrammarConstraint(tok, grammar, vocab).allowed(ids, vocab)[tok.eos_token_id])

        assert tok.encode(two, add_special_tokens=False).count(tok.convert_tokens_to_ids(tc.MISTRAL_OPEN)) == (2 if args else 1)

        several = tc.grammar(tools, "", several=True, tokenizer=tok, fmt=fmt)
        assert ends(several, one) and ends(several, two)
        for single in (tc.grammar(tools, "", tokenizer=tok, fmt=fmt), tc.grammar(tools, "add", several=True, tokenizer=tok, fmt=fmt)):
            assert ends(single, one)
            with pytest.raises(ConfigError, match="breaks the grammar"):
                ends(single, two)
        with pytest.raises(ConfigError, match="breaks the grammar"):  # the Hermes blocks are not this format
            ends(several, '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>')
    assert tc.call_format(NoAddedTokens()) == tc.HERMES


class NoAddedTokens:
    """A tokenizer with no added tokens at all."""

    def get_added_vocab(self) -> dict[str, int]:
        return {}


#: a Mistral-style template of my own: tools rendered, calls as a list after the marker, and the
#: nine-character ids Mistral's templates insist on
MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] [{% for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}{% if message.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- endif %}{% endfor %}"""


@pytest.fixture(scope="module")
def mistral_client(tmp_path_factory):
    """A server of the bundled draft model whose tokenizer calls two of its unused special tokens
    ``[TOOL_CALLS]`` and ``[ARGS]`` (same ids, same vocabulary) under a Mistral-style template."""
    from tiny import draft_renaming

    folder = draft_renaming(tmp_path_factory.mktemp("mistral-like"), {"<repo_name>": tc.MISTRAL_OPEN, "<reponame>": tc.MISTRAL_ARGS},
                            template=MISTRAL_TEMPLATE)
    with ServerProcess.cli("--target", str(folder), "--draft", str(folder), "--dtype", "float32", "--gamma", "4") as srv, \
            srv.openai() as c:
        yield c, folder


def test_a_mistral_model_makes_forced_calls_in_its_own_format(mistral_client):
    """On a Mistral-style model a forced call is written after ``[TOOL_CALLS]`` by name and
    ``[ARGS]`` (its tokenizer has both), read back into ``tool_calls`` with nine-character ids,
    streamed or not (chat and Responses); the conversation goes on with those calls and their
    results, and with an OpenAI-style id too (the template sees nine characters)."""
    client, folder = mistral_client
    kw = dict(model=folder.name, messages=ASK, tools=[ADD, WEATHER], max_tokens=40, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert len(call.id) == 9 and call.id.isalnum()
    ids = choice.model_extra["token_ids"]
    assert ids[0] == 3 and ids.count(4) == 1  # the marker and [ARGS] as the tokenizer's own tokens
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [d for c in chunks for d in c.delta.tool_calls or ()]
    assert len(deltas) > 1 and deltas[0].function.name == "get_weather" and len(deltas[0].id) == 9
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert not any(c.delta.content for c in chunks) and chunks[-1].finish_reason == "tool_calls"
    several = client.chat.completions.create(**{**kw, "tool_choice": "required", "max_tokens": 60})
    assert all(c.function.name in ("add", "get_weather") for c in several.choices[0].message.tool_calls)
    for call_id in (call.id, "call_8f2a61c0"):  # ours, and one of OpenAI's shape
        turn = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]}
        follow = client.chat.completions.create(model=folder.name, tools=[WEATHER], max_tokens=4, temperature=0, messages=[
            *ASK, turn, {"role": "tool", "tool_call_id": call_id, "content": "18 C"}])
        assert follow.choices[0].finish_reason in ("stop", "length")
    response = client.responses.create(model=folder.name, input="What is the weather in Paris?", max_output_tokens=40,
                                       temperature=0, tools=[{"type": "function", "name": "get_weather",
                                                              "parameters": WEATHER["function"]["parameters"]}],
                                       tool_choice="required")
    [item] = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments)["city"] in ("Paris", "Rome") and len(item.call_id) == 9


def test_an_untagged_object_with_arguments_and_parameters_is_no_call():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}, "parameters": {"city": "Rome"}}'
    assert tc.parse(text, names=["get_weather"]) == (text, [])
    content, calls = tc.parse('{"name": "get_weather", "parameters": {"city": "Rome"}}', names=["get_weather"])
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]


TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
#: two untagged calls in one list (held to that shape by a regex): no closing tag for the first-call stop to see
TWO = r'\[\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}, \{"name": "get_weather", "arguments": \{"city": "Rome"\}\}\]'


@pytest.mark.usefixtures("single_thread")
def test_parallel_tool_calls_false_keeps_one_of_several_untagged_calls(client):
    """OpenAI's ``parallel_tool_calls: false``: an answer that lists two untagged calls gives the
    first alone, on chat and on the Responses API; with it on, both."""
    kw = dict(model=DRAFT_MODEL, messages=TWO_CITIES, tools=[WEATHER], max_tokens=60, temperature=0, extra_body={"guided_regex": TWO})
    both = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Rome"]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in one.message.tool_calls] == ["Paris"]
    assert one.finish_reason == "tool_calls"
    resp = client.responses.create(model=DRAFT_MODEL, input=TWO_CITIES[0]["content"], max_output_tokens=60, temperature=0,
                                   tools=[{"type": "function", **WEATHER["function"]}], parallel_tool_calls=False,
                                   extra_body={"guided_regex": TWO})
    assert [json.loads(o.arguments)["city"] for o in resp.output if o.type == "function_call"] == ["Paris"]


def test_a_named_function_is_called_once_even_with_parallel_calls_allowed():
    """A named ``tool_choice`` holds the answer to exactly one call of that function, parallel calls allowed or not."""
    tok = registry.load_tokenizer(registry.resolve(MODEL).folder)
    tools = [tc.ToolDef.model_validate(ADD)]
    one = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    vocab = len(tok)
    grammar = tc.grammar(tools, "add", several=True)
    ends = GrammarConstraint(tok, grammar, vocab).allowed(tok.encode(one, add_special_tokens=False), vocab)
    assert bool(ends[tok.eos_token_id])
    with pytest.raises(ConfigError, match="breaks the grammar"):
        GrammarConstraint(tok, grammar, vocab).allowed(tok.encode(one + "\n" + one, add_special_tokens=False), vocab)


class MistralVocab:
    """A tokenizer stand-in whose added tokens include Mistral's ``[TOOL_CALLS]``."""

    def get_added_vocab(self) -> dict[str, int]:
        return {tc.MISTRAL_OPEN: 5}


def test_mistral_ids_shorter_than_nine_are_derived_too():
    """Only an id of exactly nine letters and digits stays: a shorter one is refused by Mistral's
    templates as surely as a longer one, so it is turned into nine too."""
    for short in ("abc", "call1", "abcDEF12"):
        derived = LISTED.template_id(short)
        assert len(derived) == 9 and derived.isalnum() and derived != short


def _ends(tok, grammar: str, text: str) -> bool:
    vocab = len(tok)
    return bool(GrammarConstraint(tok, grammar, vocab).allowed(tok.encode(text, add_special_tokens=False), vocab)[tok.eos_token_id])


@pytest.mark.parametrize("call", ['{"name":"add","arguments":{"a":1,"b":2},"x":1}',  # a key besides the call's two
                                  '{"name":"add"}'])  # no arguments at all
def test_a_forced_calls_grammar_holds_the_call_object_to_name_and_arguments(call):
    """A required call's object is exactly ``name`` and ``arguments``: no other key, neither left out."""
    tok = registry.load_tokenizer(registry.resolve(MODEL).folder)
    tools = [tc.ToolDef.model_validate(ADD), tc.ToolDef.model_validate(WEATHER)]
    grammar = tc.grammar(tools, "")
    assert _ends(tok, grammar, '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>')
    with pytest.raises(ConfigError, match="breaks the grammar"):
        _ends(tok, grammar, f"<tool_call>\n{call}\n</tool_call>")


def test_a_template_that_renders_no_tools_reads_hermes_blocks_even_for_mistral():
    """The format answers are read in is the model's own only where its template renders the tools;
    else the system message asks for Hermes blocks, and those are what is read."""
    assert tc.format_for(MistralVocab(), "{{ tools }}") == LISTED
    assert tc.format_for(MistralVocab(), "{{ messages }}") == tc.HERMES
    assert tc.format_for(MistralVocab(), None) == tc.HERMES


def test_only_an_assistant_turn_carries_earlier_thinking():
    """Earlier thinking goes to the template with the assistant's turn alone; a user's or tool's
    message that carries a ``reasoning`` field does not get one."""
    for message in ({"role": "user", "content": "hi", "reasoning": "x"},
                    {"role": "tool", "tool_call_id": "c", "content": "3", "reasoning_content": "x"}):
        out = tc.turn(ChatMessage.model_validate(message), message["content"], True)
        assert "reasoning" not in out and "reasoning_content" not in out
    said = tc.turn(ChatMessage.model_validate({"role": "assistant", "content": "ok", "reasoning": "t"}), "ok", True)
    assert said["reasoning"] == said["reasoning_content"] == "t"


def test_a_block_in_another_shape_is_no_call_until_it_closes():
    """A block not in the streamable shape (``arguments`` before ``name``) is read once it closes:
    cut off before its closing tag it is no call, even where its JSON is complete."""
    text = '<tool_call>{"arguments": {"a": 1}, "name": "add"}'
    assert tc.parse(text) == (text, [])
    assert [c["function"]["name"] for c in tc.parse(text + "</tool_call>")[1]] == ["add"]


def test_the_whole_opening_tag_but_its_last_character_is_held_back():
    """Streamed text stops before any suffix that may still become ``<tool_call>``: the longest is
    the tag less its ``>``."""
    assert tc.held_back("Sure <tool_call") == len("Sure ")
    assert tc.held_back("<tool_call") == 0


def test_a_mistral_call_after_an_unreadable_marker_streams_at_once():
    """While streaming, a marker followed by no readable call does not hold up the calls after
    the next marker."""
    writer = tc.StreamedCalls(fmt=NAMED)
    events = writer.feed('[TOOL_CALLS] oops [TOOL_CALLS]add[ARGS]{"a": 1}')
    assert ("added", 0, writer.ids[0], "add") in events and ("done", 0, '{"a": 1}') in events


def test_a_closed_mistral_call_ends_a_single_call_answer():
    """``parallel_tool_calls: false``: generation stops once Mistral's first call is closed."""
    assert tc.first_call_closed('[TOOL_CALLS]add[ARGS]{"a": 1}', NAMED)
    assert not tc.first_call_closed('[TOOL_CALLS]add[ARGS]{"a": 1', NAMED)
    assert tc.first_call_closed('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]', LISTED)


def test_streamed_calls_keep_to_their_most():
    """A stream that keeps one call (``parallel_tool_calls: false``) announces the first alone."""
    writer = tc.StreamedCalls(most=1)
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    events = writer.feed(two)
    assert {e[1] for e in events} == {0} and writer.ids == writer.ids[:1] and len(writer.ids) == 1


def test_a_nine_character_id_that_is_not_ascii_is_derived_too():
    """Mistral's templates take nine ASCII letters and digits only: an id of nine non-ASCII
    letters (``str.isalnum`` is true for them) is turned into nine ASCII ones like any other."""
    odd = "ééééééééé"
    derived = LISTED.template_id(odd)
    assert derived != odd and len(derived) == 9 and derived.isascii() and derived.isalnum()


def test_an_earlier_calls_arguments_that_are_no_json_are_written_as_they_are():
    """An earlier call's arguments that are not JSON reach the template as the string sent, not
    replaced by something else."""
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "a=1"}}]})
    assert tc.turn(msg, "", True)["tool_calls"][0]["function"]["arguments"] == "a=1"
    assert '"arguments": "a=1"' in tc.turn(msg, "", False)["content"]


def test_an_earlier_call_without_arguments_has_an_empty_object():
    """A call sent back without ``arguments`` is a call with ``{}`` (OpenAI's default), written so."""
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add"}}]})
    assert tc.turn(msg, "", True)["tool_calls"][0]["function"]["arguments"] == {}
    assert tc.turn(msg, "", False)["content"] == tc.block("add", {})


def test_a_name_written_with_json_escapes_is_read_as_its_text():
    """A block's ``name`` is a JSON string: escapes in it are read (``get\\u005fweather`` is ``get_weather``)."""
    _, [call] = tc.parse('<tool_call>{"name": "get\\u005fweather", "arguments": {"city": "Rome"}}</tool_call>')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_a_closed_block_in_another_shape_without_arguments_calls_with_an_empty_object():
    """A block whose object has a name but no ``arguments`` is a call with ``{}``, not ``null``."""
    _, [call] = tc.parse('<tool_call>{"id": 1, "name": "add"}</tool_call>')
    assert call["function"] == {"name": "add", "arguments": "{}"}


class _SplitsTheTag:
    """A tokenizer stand-in that lists ``<tool_call>`` among its added tokens but encodes it as two."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2]

    def get_added_vocab(self) -> dict[str, int]:
        return {tc.OPEN: 7}


def test_a_tag_the_tokenizer_writes_in_several_tokens_is_literal_text_in_the_grammar():
    """Only a tag the tokenizer writes as one token is named as that token in a grammar; else it
    is matched as its text (llguidance could never match a name the encoder does not produce)."""
    assert tc._tag(tc.OPEN, _SplitsTheTag()) == json.dumps(tc.OPEN)


def test_a_mistral_list_left_open_before_the_next_marker_does_not_hold_up_the_calls_after_it():
    """While streaming, a ``[TOOL_CALLS]`` list that a later marker cuts off (no ``]``) is over: the
    call after the next marker streams at once, not only when the answer is finished."""
    writer = tc.StreamedCalls(fmt=NAMED)
    events = writer.feed('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    assert [e[3] for e in events if e[0] == "added"] == ["add", "get_weather"]
    assert ("done", 1, '{"city": "Rome"}') in events


def test_an_answer_that_holds_the_tag_is_not_read_as_an_untagged_call():
    """Untagged calls are read only from an answer without tags: JSON that holds the ``<tool_call>``
    text (here in a string) and no readable block stays text, as a stream that held the text at
    the tag would otherwise disagree with it."""
    text = '{"name": "add", "arguments": {"note": "<tool_call>"}}'
    assert tc.parse(text, names=["add"]) == (text, [])
