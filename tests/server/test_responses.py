"""OpenAI's Responses API (``/v1/responses``), driven by the official ``openai`` client.

The server serves the bundled SmolLM2 draft as its target with itself as drafter (as in
``test_openai``); a greedy response must be exactly the chat endpoint's greedy answer to the same
conversation, streamed or not, continued through ``previous_response_id`` or not.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serverproc import DRAFT_MODEL, OPENAI_KEY
from tests.server.test_tools import TWO, TWO_CALLS, TWO_CITIES
from specdec.server import tools as tc
from specdec.server.errors import ApiError
from specdec.server.responses_api import (InputMessage, ResponsesRequest, ResponseStore, _chars, _format, _item_id,
                                          _tool_choice, _tools, _turns)

MODEL = DRAFT_MODEL
KEY = OPENAI_KEY
# function tools as the Responses API writes them (flat); the chat endpoint's nest them under "function"
ADD = {"type": "function", "name": "add", "description": "Add two integers", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather", "strict": None, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"

pytestmark = pytest.mark.usefixtures("single_thread")


def _chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_a_response_is_the_chat_endpoints_answer(client):
    question = "Write a Python hello world."
    for max_tokens in (40, 6):
        resp = client.responses.create(model=MODEL, input=question, instructions="You are terse.",
                                       max_output_tokens=max_tokens, temperature=0)
        chat = _chat(client, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}],
                     max_tokens)
        assert resp.output_text == chat.choices[0].message.content and resp.output_text
        assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
        assert [item.type for item in resp.output] == ["message"] and resp.output[0].role == "assistant"
        assert resp.usage.input_tokens == chat.usage.prompt_tokens
        assert resp.usage.output_tokens == chat.usage.completion_tokens
        assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
        if chat.choices[0].finish_reason == "length":
            assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        else:
            assert resp.status == "completed" and resp.incomplete_details is None
        assert resp.model_extra["specdec"]["draft_tokens_proposed"] > 0  # speculation served it
    assert client.responses.create(model=MODEL, input=question, max_output_tokens=6, temperature=0).status == "incomplete"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}]
    assert (client.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0).output_text
            == _chat(client, [{"role": "user", "content": "Say hi."}], 12).choices[0].message.content)


def test_a_stream_is_openais_event_sequence(client, server):
    kw = dict(model=MODEL, input="Write a Python hello world.", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    end = f"response.{whole.status}"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 10
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    with httpx.stream("POST", server.url + "/v1/responses", json={**kw, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:  # each event named, no [DONE]
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[-2] == f"event: {end}" and "[DONE]" not in lines[-1]


def test_stored_responses_continue_and_can_be_read_and_deleted(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=10, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    conversation = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.output_text == _chat(client, conversation, 12).choices[0].message.content
    assert second.previous_response_id == first.id
    third = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=second.id, max_output_tokens=8,
                                    temperature=0, instructions="Answer in French.")
    assert third.output_text == _chat(client, [{"role": "system", "content": "Answer in French."}, *conversation,
                                               {"role": "assistant", "content": second.output_text},
                                               {"role": "user", "content": "Thanks."}], 8).choices[0].message.content
    streamed = list(client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                            max_output_tokens=12, temperature=0, stream=True))
    assert streamed[-1].response.output_text == second.output_text  # a stream continues a stored response
    assert client.responses.retrieve(streamed[-1].response.id).output_text == second.output_text  # and is stored
    got = client.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.usage.output_tokens == second.usage.output_tokens
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="x", previous_response_id=second.id)
    unstored = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_and_logprobs(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    resp = client.responses.create(model=MODEL, input="Is the sky blue? JSON.", max_output_tokens=20, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert json.loads(resp.output_text) in ({"ok": True}, {"ok": False})
    assert resp.text.format.type == "json_schema"
    scored = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0, top_logprobs=2,
                                     include=["message.output_text.logprobs"])
    entries = scored.output[0].content[0].logprobs
    assert "".join(e.token for e in entries) == scored.output_text
    assert b"".join(bytes(e.bytes) for e in entries) == scored.output_text.encode()
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in entries)
    plain = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0)
    assert plain.output_text == scored.output_text and plain.output[0].content[0].logprobs == []
    seeded = dict(model=MODEL, input="Once upon a time", max_output_tokens=12, temperature=0.9,
                  extra_body={"seed": 3, "top_k": 40})  # the chat endpoint's extensions pass through
    assert client.responses.create(**seeded).output_text == client.responses.create(**seeded).output_text


def test_bad_requests_are_400s(client, server):
    def post(body: dict) -> httpx.Response:
        return httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    for body, message in (({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
                          ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0]"),
                          ({"input": "x", "tool_choice": "required"}, "needs tools"),
                          ({"input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "nope"}}, "not among"),
                          ({"input": "x", "tools": [ADD], "tool_choice": {"type": "web_search_preview"}}, "tool_choice must be"),
                          ({"input": [{"type": "function_call_output", "output": "3"}]}, "call_id"),
                          ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
                          ({"input": "x", "background": True}, "background"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input"),
                          ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                          ({"input": ""}, "input"), ({}, "input"),
                          ({"input": "x", "messages": []}, "messages is not a Responses API field"),
                          ({"input": "x", "temperature": 3}, "temperature"),
                          ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "schema")):
        r = post({"model": MODEL, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    r = post({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    r = post({"model": MODEL, "input": "x", "max_output_tokens": 2, "reasoning": {"effort": "low"}, "frobnicate": 1})
    assert r.status_code == 200 and {"reasoning", "frobnicate"} <= set(r.headers["x-specdec-ignored-fields"].split(", "))


def test_the_store_keeps_the_most_recently_used_within_its_bounds():
    store = ResponseStore(capacity=2, chars=100)
    for rid in "abc":
        store.put(rid, "me", [], {"id": rid}, 10)
    assert len(store) == 2
    with pytest.raises(ApiError):
        store.get("a", "me")  # the least recently used went first
    store.get("b", "me")  # b is now the most recent
    store.put("d", "me", [], {"id": "d"}, 10)
    assert store.get("b", "me")[1] == {"id": "b"}
    with pytest.raises(ApiError):
        store.get("c", "me")
    with pytest.raises(ApiError):
        store.get("b", "someone else")  # another key's responses are not found
    store.put("big", "me", [], {"id": "big"}, 95)  # past the characters' bound: older ones go
    assert len(store) == 1 and store.get("big", "me")[1] == {"id": "big"}
    store.delete("big", "me")
    assert len(store) == 0


def _as_chat(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_function_tools_make_the_chat_endpoints_calls(client):
    """A required or named call is the chat endpoint's call (same name, same arguments, greedy), as
    ``function_call`` items and no message; streamed, each call's item and arguments go out as
    OpenAI's events, and the finished response equals the one not streamed."""
    for choice, chat_choice in (("required", "required"),
                                ({"type": "function", "name": "add"}, {"type": "function", "function": {"name": "add"}})):
        kw = dict(model=MODEL, input=ASK, tools=[ADD, WEATHER], tool_choice=choice, max_output_tokens=60, temperature=0,
                  parallel_tool_calls=False)  # one call (required allows several otherwise)
        resp = client.responses.create(**kw)
        chat = _chat(client, [{"role": "user", "content": ASK}], 60, tools=[_as_chat(ADD), _as_chat(WEATHER)],
                     tool_choice=chat_choice, parallel_tool_calls=False)
        [expected] = chat.choices[0].message.tool_calls
        assert [item.type for item in resp.output] == ["function_call"] and resp.output_text == ""
        [call] = resp.output
        assert (call.name, call.arguments) == (expected.function.name, expected.function.arguments)
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        assert set(json.loads(call.arguments)) == ({"a", "b"} if call.name == "add" else {"city"})
        assert resp.tool_choice == choice if isinstance(choice, str) else resp.tool_choice.name == "add"
        assert [t.name for t in resp.tools] == ["add", "get_weather"] and resp.tools[0].parameters == ADD["parameters"]
        assert resp.model_extra["specdec"]["draft_tokens_proposed"] > 0  # speculation ran under the call's grammar
        events = list(client.responses.create(**kw, stream=True))
        kinds = [e.type for e in events]
        pieces = kinds.count("response.function_call_arguments.delta")
        assert pieces > 1 and kinds == [  # the arguments go out as they are written
            "response.created", "response.in_progress", "response.output_item.added",
            *["response.function_call_arguments.delta"] * pieces, "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        added, deltas, (done, closed, end) = events[2], events[3:-3], events[-3:]
        assert added.item.type == "function_call" and added.item.arguments == "" and added.output_index == 0
        assert added.item.status == "in_progress" and added.item.name == call.name
        assert "".join(d.delta for d in deltas) == done.arguments == closed.item.arguments == call.arguments
        assert {d.item_id for d in deltas} == {done.item_id} == {closed.item.id} == {added.item.id} == {end.response.output[0].id}
        assert (end.response.output[0].name, end.response.output[0].arguments) == (call.name, call.arguments)


def test_text_then_two_calls_stream_item_by_item(client):
    """The model held to some text and two calls: the message item, then each call's item, each
    finished before the next is added, the arguments streamed as they are written; the finished
    stream equals the response not streamed (but for new ids)."""
    kw = dict(model=MODEL, input=ASK, tools=[ADD, WEATHER], max_output_tokens=80, temperature=0,
              extra_body={"guided_regex": TWO_CALLS})
    resp = client.responses.create(**kw)
    assert [o.type for o in resp.output] == ["message", "function_call", "function_call"] and resp.output_text == "Sure."
    events = list(client.responses.create(**kw, stream=True))
    items, text, arguments = {}, "", {}
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items) and all(done for done in items.values())
            items[e.output_index] = False
        elif e.type == "response.output_item.done":
            assert not items[e.output_index]
            items[e.output_index] = True
        elif e.type == "response.output_text.delta":
            assert e.output_index == 0 and not items[0]
            text += e.delta
        elif e.type == "response.function_call_arguments.delta":
            assert e.output_index > 0 and not items[e.output_index]
            arguments[e.output_index] = arguments.get(e.output_index, "") + e.delta
    end = events[-1].response
    assert text.strip() == "Sure." and list(items) == [0, 1, 2] and all(items.values())
    assert [arguments[k] for k in (1, 2)] == [o.arguments for o in resp.output[1:]] == [o.arguments for o in end.output[1:]]
    strip = {"id", "call_id", "created_at", "specdec"}

    def shown(r):
        return [{k: v for k, v in o.model_dump().items() if k not in strip} for o in r.output]

    assert shown(end) == shown(resp) and end.status == resp.status == "completed"
    one = client.responses.create(**kw, parallel_tool_calls=False)  # the first call alone, streamed or not
    assert shown(one) == shown(resp)[:2] and one.parallel_tool_calls is False
    assert one.usage.output_tokens < resp.usage.output_tokens  # generation stopped after the first call
    last = list(client.responses.create(**kw, stream=True, parallel_tool_calls=False))[-1].response
    assert shown(last) == shown(one)
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        client.responses.create(**{**kw, "extra_body": {"guided_regex": TWO_CALLS, "parallel_tool_calls": "no"}})


def test_auto_and_none_show_the_tools_or_not(client):
    kw = dict(model=MODEL, input=ASK, max_output_tokens=12, temperature=0)
    bare = client.responses.create(**kw)
    auto = client.responses.create(**kw, tools=[ADD, WEATHER])
    chat = _chat(client, [{"role": "user", "content": ASK}], 12, tools=[_as_chat(ADD), _as_chat(WEATHER)])
    assert auto.usage.input_tokens == chat.usage.prompt_tokens > bare.usage.input_tokens + 40  # described to the model
    assert auto.output_text == (chat.choices[0].message.content or "")
    streamed = list(client.responses.create(**kw, tools=[ADD, WEATHER], stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == auto.output_text
    assert streamed[-1].response.output_text == auto.output_text
    none = client.responses.create(**kw, tools=[ADD, WEATHER], tool_choice="none")
    assert none.usage.input_tokens == bare.usage.input_tokens and none.output_text == bare.output_text


def test_a_calls_output_continues_the_conversation(client):
    """Earlier calls and their outputs, sent as input items or continued from a stored response,
    give the chat endpoint's answer to the same conversation."""
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
    chat = _chat(client, [{"role": "user", "content": ASK},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}],
                 16, tools=[_as_chat(WEATHER)])
    expected = chat.choices[0].message.content or ""
    continued = client.responses.create(model=MODEL, input=[result], previous_response_id=first.id, tools=[WEATHER],
                                        max_output_tokens=16, temperature=0)
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {**result, "output": [{"type": "input_text", "text": "18 C and sunny"}]}]
    sent = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=16, temperature=0)
    assert continued.output_text == sent.output_text == expected
    assert continued.usage.input_tokens == sent.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output[0].arguments == call.arguments  # a call's response is stored


def test_the_response_echoes_its_temperature_and_top_p(client):
    """A response carries the temperature and top_p the request gave (1.0 each where it gave none)."""
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0.5, top_p=0.9, store=False)
    assert resp.temperature == 0.5 and resp.top_p == 0.9
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert plain.temperature == 1.0 and plain.top_p == 1.0


def test_a_deleted_response_frees_its_characters():
    """Deleting a stored response gives its characters back: later responses that fit are all kept."""
    store = ResponseStore(capacity=10, chars=10)
    store.put("a", "o", [], {"id": "a"}, 8)
    store.delete("a", "o")
    store.put("b", "o", [], {"id": "b"}, 8)
    store.put("c", "o", [], {"id": "c"}, 2)  # 8 + 2 = 10 characters: both fit
    assert store.get("b", "o")[1] == {"id": "b"} and store.get("c", "o")[1] == {"id": "c"}


def _items(*items: dict) -> list:
    return ResponsesRequest.model_validate({"input": list(items)}).input


def test_an_item_without_a_type_is_a_message_and_its_parts_are_joined_as_they_are():
    """OpenAI's EasyInputMessage has no ``type``: it is a message; its text parts are one text, joined with nothing."""
    [item] = _items({"role": "user", "content": [{"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}]})
    assert isinstance(item, InputMessage)
    assert _turns([item]) == [{"role": "user", "content": "Hello"}]


def test_calls_join_the_assistant_turn_before_them():
    """A function_call after the assistant's text joins that turn (the text it said first), and
    calls in a row are one turn's calls, in order; a call's output is a tool turn."""
    items = _items({"role": "user", "content": "1 + 2 and 3 + 4?"}, {"role": "assistant", "content": "Let me add."},
                   {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
                   {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3, "b": 4}'},
                   {"type": "function_call_output", "call_id": "c1", "output": "3"})
    turns = _turns(items)
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert turns[1]["content"] == "Let me add." and [c["id"] for c in turns[1]["tool_calls"]] == ["c1", "c2"]
    assert turns[1]["tool_calls"][1]["function"] == {"name": "add", "arguments": '{"a": 3, "b": 4}'}
    assert turns[2] == {"role": "tool", "tool_call_id": "c1", "content": "3"}


def test_a_turns_size_counts_its_calls_arguments():
    """The store's size of a turn: its text and its calls' arguments."""
    turn = {"role": "assistant", "content": "ab", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert _chars(turn) == 2 + len('{"x": 1}')


def test_tool_choice_is_translated_to_the_chat_spelling():
    """required passes as it is; allowed_tools (flat here) keeps its mode and names, nested."""
    assert [_tool_choice(c) for c in (None, "none", "auto", "required")] == [None, "none", "auto", "required"]
    assert _tool_choice({"type": "function", "name": "add"}) == {"type": "function", "function": {"name": "add"}}
    assert _tool_choice({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]}) == {
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "add"}}]}}


def test_a_text_format_that_is_no_object_is_a_400():
    with pytest.raises(ApiError) as err:
        _format({"format": "json"})
    assert err.value.status == 400 and "text.format" in str(err.value)


def test_the_store_keeps_a_lone_response_bigger_than_its_characters():
    """The characters' bound drops older responses, never the one just stored."""
    store = ResponseStore(capacity=10, chars=10)
    store.put("big", "o", [], {"id": "big"}, 25)
    assert store.get("big", "o")[1] == {"id": "big"}


def test_an_evicted_response_gives_its_characters_back():
    """Responses dropped for the count free their characters: later ones that fit stay."""
    store = ResponseStore(capacity=2, chars=20)
    for rid in "abc":  # a is dropped for the count
        store.put(rid, "o", [], {"id": rid}, 10)
    store.put("d", "o", [], {"id": "d"}, 10)  # b dropped for the count; c + d = 20 characters fit
    assert store.get("c", "o")[1] == {"id": "c"} and store.get("d", "o")[1] == {"id": "d"}


def test_a_json_schema_format_moves_its_fields_under_json_schema_without_its_type():
    """``text.format`` of type json_schema becomes the chat endpoint's ``response_format``: the
    fields beside ``type`` nest under ``json_schema``, ``type`` itself stays outside."""
    schema = {"type": "object"}
    assert _format({"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}) == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    assert _format(None) is None and _format({"format": {"type": "text"}}) == {"type": "text"}


def test_a_tool_without_a_type_is_refused():
    """Only ``{"type": "function", ...}`` tools are served: a tool that names no type is a 400, not
    taken for a function."""
    with pytest.raises(ApiError) as err:
        _tools([{"name": "add", "parameters": ADD["parameters"]}])
    assert err.value.status == 400 and "only function tools" in str(err.value)


def test_allowed_tools_without_a_mode_is_a_400():
    """``allowed_tools`` needs its mode: none given is refused, not taken as ``auto``."""
    defs = _tools([ADD])
    with pytest.raises(ApiError) as err:
        tc.chosen(defs, _tool_choice({"type": "allowed_tools", "tools": [{"type": "function", "name": "add"}]}))
    assert err.value.status == 400 and "mode" in str(err.value)


def test_a_function_tool_choice_without_a_name_is_refused_as_malformed():
    """``{"type": "function"}`` with no ``name`` is a malformed tool_choice (400 naming the accepted shapes)."""
    with pytest.raises(ApiError) as err:
        _tool_choice({"type": "function"})
    assert err.value.status == 400 and "tool_choice must be" in str(err.value)


def test_a_function_call_items_id_is_made_from_its_call_id():
    """A ``function_call`` item's id is ``fc_`` and the call id without its ``call_`` prefix."""
    assert _item_id("call_abc123") == "fc_abc123" and _item_id("abcDEF123") == "fc_abcDEF123"


# --- through a server (the module's one process from tests/server/conftest.py) ---


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": DRAFT_MODEL, "max_output_tokens": 2, "store": False, **body},
                      headers={"Authorization": f"Bearer {OPENAI_KEY}"}, timeout=60)


@pytest.mark.usefixtures("single_thread")
def test_requests_echo_and_name_what_they_did_not_use(server):
    """Without tools, ``parallel_tool_calls`` has no effect and is named in the ignored-fields
    header; a response that sent no ``tool_choice`` echoes ``auto``; the chat endpoint's ``n`` is
    no Responses field (a 400)."""
    r = _post(server, {"input": "x", "parallel_tool_calls": False})
    assert r.status_code == 200 and "parallel_tool_calls" in r.headers["x-specdec-ignored-fields"].split(", ")
    assert r.json()["tool_choice"] == "auto"
    r = _post(server, {"input": "x", "n": 2})
    assert r.status_code == 400 and "n is not a Responses API field" in r.json()["error"]["message"]


def test_a_streamed_answer_of_untagged_calls_sends_no_message(client):
    """An answer that is nothing but untagged calls (a JSON list, held to that shape by a regex) is
    calls and no message: streamed, no ``output_text`` delta and no message item go out, and the
    calls' items are the finished response's (as not streamed)."""
    kw = dict(model=DRAFT_MODEL, input=TWO_CITIES[0]["content"], max_output_tokens=60, temperature=0,
              tools=[WEATHER], extra_body={"guided_regex": TWO})
    whole = client.responses.create(**kw)
    assert [o.type for o in whole.output] == ["function_call", "function_call"]
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert "response.output_text.delta" not in kinds and added == ["function_call", "function_call"], kinds
    assert [json.loads(o.arguments)["city"] for o in events[-1].response.output] == ["Paris", "Rome"]
