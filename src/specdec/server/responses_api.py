"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is turned into the chat request it amounts to and served by the same machinery as
``/v1/chat/completions`` (speculative decoding on the server, every sampling option and
extension of that endpoint, structured output from ``text.format``); the answer is written as a
Responses object: one assistant ``message`` item with one ``output_text`` part.  Streamed, it is
OpenAI's event sequence (``response.created`` … ``response.output_text.delta`` …
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it), each event
named and numbered.

``store`` (true unless the request says false) keeps the response in a bounded in-memory store
(:data:`specdec.defaults.RESPONSES_STORED` responses, ``RESPONSES_STORED_CHARS`` characters; least
recently used dropped; per API key), so
``GET`` returns it and ``previous_response_id`` continues its conversation: that response's input
and output come before the new input; its ``instructions`` do not (as in OpenAI's API).  The
store lives in the server process: a restart forgets it.

Function tools: ``tools`` (``{"type": "function", "name", "description", "parameters", "strict"}``)
and ``tool_choice`` (``none``, ``auto``, ``required``, ``{"type": "function", "name"}`` or
``{"type": "allowed_tools", "mode", "tools"}``) work as on
the chat endpoint (:mod:`specdec.server.tools`: the model writes Hermes-style blocks; a required or
named call is held to the function's JSON Schema by a grammar, so the output keeps the constrained
target's law).  Each call the answer makes is a ``function_call`` output item after the message
(which is left out when the model said nothing else); streamed, the message item is finished
where the first call begins, and each call's item is added once its name is written, its
arguments streamed as they are written (``response.function_call_arguments.delta`` / ``.done``)
and the item closed once the call is, before the next is added; text stops streaming where a
call may begin.  ``parallel_tool_calls: false`` keeps the first call alone.  Input may carry earlier
``function_call`` items and their ``function_call_output`` results.  Hosted tools (web search,
file search, …), background runs and non-text input are refused with a 400.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from specdec import defaults
from specdec.engine import TextPiece, TextResult
from specdec.server import tools as tool_calls
from specdec.server.errors import ApiError
from specdec.server.openai_api import (
    ChatRequest, _after_thinking, _call_format, _chat_ids, _chat_logprobs, _first_call, _Job, _Names, _owner, _run_blocking, _stats, _stream,
    _thinks, text_left_out,
)
from specdec.server import reasoning
from specdec.server.tools import ToolDef

if TYPE_CHECKING:
    from specdec.server.app import ServerContext

#: what makes the answer carry log-probabilities (with ``top_logprobs`` alternatives)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: Responses fields accepted without effect here (named in the ignored-fields header)
_NO_EFFECT = ("reasoning", "truncation", "metadata", "user", "service_tier",
              "safety_identifier", "prompt_cache_key", "max_tool_calls", "prompt_cache_retention")


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text", "text"]
    text: Annotated[str, Field(max_length=1 << 22)]


class InputMessage(BaseModel):
    """A message item (OpenAI's ``EasyInputMessage`` or ``message`` item): text content only."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str, Field(max_length=1 << 22)] | Annotated[list[InputPart], Field(max_length=256)]


class FunctionCallItem(BaseModel):
    """A call the model made earlier (sent back with the conversation)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: Annotated[str, Field(max_length=256)]
    name: Annotated[str, Field(max_length=64)]
    arguments: Annotated[str, Field(max_length=1 << 20)]


class FunctionCallOutputItem(BaseModel):
    """A call's result, answering the call with the same ``call_id``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(max_length=256)]
    output: Annotated[str, Field(max_length=1 << 22)] | Annotated[list[InputPart], Field(max_length=256)]


def _item_type(item: Any) -> str:
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(max_length=256)] | None = None
    input: Annotated[str, Field(min_length=1, max_length=1 << 22)] | Annotated[list[InputItem], Field(min_length=1, max_length=1024)]
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Annotated[str, Field(max_length=64)] | dict[str, Any] | None = None
    instructions: Annotated[str, Field(max_length=1 << 22)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Annotated[str, Field(max_length=128)] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=16)] | None = None
    background: bool = False


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat endpoint's ``response_format`` (a JSON schema's fields sit in a
    ``json_schema`` object there; the rest is the same)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "text.format must be an object")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def _text(content: str | list[InputPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _turns(items: str | list[Any]) -> list[dict[str, Any]]:
    """The input as chat messages: a message item is a turn; a function call joins the assistant
    turn right before it (the text it said first) or starts one; a call's output is a tool turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    turns: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1]["role"] == "assistant":
                turns[-1] = {**turns[-1], "tool_calls": [*(turns[-1].get("tool_calls") or []), call]}
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            turns.append({"role": item.role, "content": _text(item.content)})
    return turns


def _chars(turn: dict[str, Any]) -> int:
    """A turn's size in the store: its text and its calls' arguments."""
    return len(turn.get("content") or "") + sum(len(c["function"]["arguments"]) for c in turn.get("tool_calls") or ())


def _tools(tools: list[dict[str, Any]] | None) -> list[ToolDef]:
    """Responses function tools (flat: ``name``, ``parameters`` … beside ``type``) as the chat endpoint's."""
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.get("type") != "function":
            raise ApiError(400, f"tools[{i}]: only function tools are supported by this server, not {tool.get('type')!r}")
        fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        try:
            out.append(ToolDef.model_validate({"type": "function", "function": fields}))
        except ValidationError as exc:
            raise ApiError(400, f"tools[{i}]: {_first_error(exc)}") from None
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A Responses ``tool_choice`` in the chat endpoint's spelling."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":  # flat here, nested on the chat endpoint
        listed = choice.get("tools")
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": [
            {"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
            for t in (listed if isinstance(listed, list) else [])]}}
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} or "
                   "{'type': 'allowed_tools', 'mode': ..., 'tools': [...]} on this server")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


class ResponseStore:
    """Stored responses, per owner: id -> (owner, the conversation so far, the response body, its
    size); at most ``capacity`` of them and ``chars`` characters of the text each added (its new
    input and its output: the earlier turns are shared with the response it continues), the least
    recently used dropped first.  Thread-safe."""

    def __init__(self, capacity: int = defaults.RESPONSES_STORED, chars: int = defaults.RESPONSES_STORED_CHARS) -> None:
        self.capacity = capacity
        self.chars = chars
        self._items: OrderedDict[str, tuple[str, list[dict[str, Any]], dict[str, Any], int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def put(self, rid: str, owner: str, turns: list[dict[str, Any]], body: dict[str, Any], size: int) -> None:
        with self._lock:
            self._items[rid] = (owner, turns, body, size)
            self._held += size
            while len(self._items) > self.capacity or (self._held > self.chars and len(self._items) > 1):
                self._held -= self._items.popitem(last=False)[1][3]

    def get(self, rid: str, owner: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(conversation, body) of ``rid``; 404 for an id this owner never stored (or one dropped)."""
        with self._lock:
            found = self._items.get(rid)
            if found is None or found[0] != owner:
                raise ApiError(404, f"response {rid!r} not found (stored responses are kept in memory: at most "
                                    f"{self.capacity}, the least recently used dropped, none across restarts)")
            self._items.move_to_end(rid)
            return found[1], found[2]

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner)
        with self._lock:
            gone = self._items.pop(rid, None)
            if gone is not None:
                self._held -= gone[3]

    def __len__(self) -> int:
        return len(self._items)


def responses_router(ctx: "ServerContext") -> APIRouter:
    router = APIRouter()
    store: ResponseStore = ctx.responses

    @router.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Any:
        if req.background:
            raise ApiError(400, "background responses are not supported by this server")
        owner = _owner(request)
        if ctx.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer, so it cannot serve text responses")
        defs = _tools(req.tools)
        shown, forced = tool_calls.chosen(defs, _tool_choice(req.tool_choice))  # the tools the model sees, a call it must make
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = list(store.get(req.previous_response_id, owner)[0])
        turns = history + _turns(req.input)  # the conversation this response continues (stored with it)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        logprobs = req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or ())
        known = set(ResponsesRequest.model_fields)
        extra = {k: v for k, v in (req.model_extra or {}).items() if k not in known}
        parallel = extra.pop("parallel_tool_calls", None)
        if parallel is not None and not isinstance(parallel, bool):
            raise ApiError(400, "parallel_tool_calls must be true or false")
        ignored = sorted(k for k in extra if k in _NO_EFFECT) + (["parallel_tool_calls"] if parallel is not None and not shown else [])
        parallel = parallel is not False
        for name in ignored:
            extra.pop(name, None)
        for name in ("messages", "max_tokens", "max_completion_tokens", "response_format", "logprobs", "n", "echo"):
            if name in extra:  # the chat endpoint's spellings of what a Responses request says its own way
                raise ApiError(400, f"{name} is not a Responses API field")
        try:
            chat = ChatRequest(model=req.model, messages=system + turns, max_tokens=req.max_output_tokens,
                               stream=req.stream, response_format=_format(req.text), logprobs=logprobs,
                               top_logprobs=req.top_logprobs if logprobs else None, **extra)
        except ValidationError as exc:
            raise ApiError(400, _first_error(exc)) from None
        tok = ctx.tokenizer
        ids = _chat_ids(tok, chat.messages, chat, tools=shown, trust_template=ctx.settings.trust_request_chat_template)
        fmt = _call_format(tok, chat, shown)  # Mistral's calls: the text keeps special tokens
        thinks, opened, tags = _thinks(ctx, tok, ids, chat)  # the answer's <think> block: a reasoning item
        job = _Job(ctx, chat, [ids], req.max_output_tokens, logprobs=(req.top_logprobs or 0) if logprobs else None,
                   endpoint="responses", owner=owner, tool_grammar=tool_calls.grammar(shown, forced, several=parallel, tokenizer=tok, fmt=fmt),
                   stop_when=_first_call(fmt, thinks, opened, tags) if shown and not parallel else None,
                   after_thinking=_after_thinking(tok, thinks, opened, tags))
        job.ignored = sorted(job.ignored + ignored)
        named = _Names(tok, ctx.token_bytes, left_out=None if chat.skip_special_tokens else text_left_out(chat, ctx.eos_ids))
        # on a scale-out replica the id names it (as session ids do), so the gateway routes to its store
        rid = f"resp_{ctx.settings.session_id_prefix}{secrets.token_hex(16)}"
        mid, created = f"msg_{secrets.token_hex(16)}", int(time.time())
        rsid = f"rs_{secrets.token_hex(16)}"  # the reasoning item's, where the answer thinks
        ctx.metrics.completions.labels("responses", str(req.stream).lower()).inc()

        parsed: list[Any] = [None, None]  # the answer parsed last and what it gave (its calls keep their ids)

        most_calls = None if parallel else 1  # parallel_tool_calls false: the first call alone
        writer = tool_calls.StreamedCalls(most_calls, fmt)  # streamed: the calls as they are written (their ids)

        def answer(out: TextResult) -> tuple[str | None, list[dict[str, Any]]]:
            """(the message's text, None for none; the calls) of an answer: with tools shown, its calls
            parsed out; where it thinks, of what follows its thinking."""
            text = reasoning.split(out.text, opened, tags)[1] if thinks else out.text
            if not shown:
                return text, []
            if parsed[0] is not out:
                content, calls = tool_calls.parse(text or "", names=[t.function.name for t in shown], ids=writer.ids, fmt=fmt)
                calls = calls[:most_calls]
                parsed[:] = [out, (content, calls) if calls else (text, [])]
            return parsed[1]

        def status_of(out: TextResult) -> str:
            return "incomplete" if out.stats.finish_reason == "length" else "completed"

        def output(out: TextResult) -> list[dict[str, Any]]:
            """The output items: the thinking (where there was some), the message (unless the model
            only thought or made calls), then each call."""
            content, calls = answer(out)
            thought = reasoning.split(out.text, opened, tags)[0] if thinks else None
            items = [_reasoning_item(rsid, thought, "completed")] if thought else []
            items += [] if content is None else [_message(mid, status_of(out), _part(content, named, out, logprobs))]
            return items + [_function_call(call, "completed") for call in calls]

        def body(status: str, out: TextResult | None) -> dict[str, Any]:
            """The response object: in progress (no output yet) or finished with ``out``."""
            incomplete = out is not None and out.stats.finish_reason == "length"
            if out is not None:
                status = status_of(out)
            return {
                "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": job.model_name,
                "output": [] if out is None else output(out), "parallel_tool_calls": parallel,
                "previous_response_id": req.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "store": req.store,
                "temperature": 1.0 if chat.temperature is None else chat.temperature,
                "text": {"format": req.text.get("format") if req.text and req.text.get("format") else {"type": "text"}},
                "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
                "tools": [{"type": "function", **t.function.model_dump(include={"name", "description", "parameters", "strict"})}
                          for t in defs],
                "top_logprobs": req.top_logprobs, "top_p": 1.0 if chat.top_p is None else chat.top_p,
                "truncation": "disabled", "user": None, "metadata": {},
                "usage": None if out is None else _usage(out, len(ids), reasoning.thinking_tokens(
                    tok, out.token_ids, out.text, opened, skip_special_tokens=chat.skip_special_tokens, tags=tags) if thinks else 0),
            }

        def finished(out: TextResult, stats: dict[str, Any]) -> dict[str, Any]:
            done = {**body("completed", out), "specdec": stats}
            if req.store:
                content, calls = answer(out)
                said = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                store.put(rid, owner, turns + [said], done, sum(_chars(t) for t in turns[len(history):]) + _chars(said))
            return done

        if req.stream:
            seq = iter(range(1 << 62))

            def event(kind: str, **fields: Any) -> dict[str, Any]:
                return {"type": kind, "sequence_number": next(seq), **fields}

            where = {"item_id": mid, "output_index": 0, "content_index": 0}  # the message's (after any thinking)
            gate = tool_calls.HeldContent(fmt)  # with tools shown, text stops where a call may begin
            message = {"opened": False, "closed": False}  # the message item: went out (with its first text), finished
            seen: list[Any] = []  # with logprobs: the entries of the text sent
            splitter = reasoning.StreamedReasoning(opened, tags) if thinks else None
            thought = {"text": "", "opened": False, "closed": False}  # the reasoning item, as the message's

            def thinking(text: str) -> list[dict[str, Any]]:
                """The reasoning item: added with its first text, each piece a delta."""
                out: list[dict[str, Any]] = []
                if not thought["opened"]:
                    thought["opened"] = True
                    where["output_index"] = 1  # the message and the calls come after it
                    out.append(event("response.output_item.added", output_index=0, item=_reasoning_item(rsid, None, "in_progress")))
                thought["text"] += text
                return [*out, event("response.reasoning_text.delta", item_id=rsid, output_index=0, content_index=0, delta=text)]

            def thought_done() -> list[dict[str, Any]]:
                """The reasoning item's end (once, where it was opened): before the message or any call."""
                if not thought["opened"] or thought["closed"]:
                    return []
                thought["closed"] = True
                return [event("response.reasoning_text.done", item_id=rsid, output_index=0, content_index=0, text=thought["text"]),
                        event("response.output_item.done", output_index=0, item=_reasoning_item(rsid, thought["text"], "completed"))]

            def opening() -> list[dict[str, Any]]:
                if message["opened"]:
                    return []
                message["opened"] = True
                return [*thought_done(), event("response.output_item.added", output_index=where["output_index"], item=_message(mid, "in_progress", None)),
                        event("response.content_part.added", **where, part=_part("", named, None, False))]

            def closing(text: str, entries: list[Any], status: str) -> list[dict[str, Any]]:
                """The message's end, once it opened (at the end, or where the first call begins: then
                with the log-probabilities of the text sent so far)."""
                if message["closed"] or not message["opened"]:
                    return []
                message["closed"] = True
                part = {**_part(text, named, None, False), "logprobs": entries}
                return [event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                        event("response.content_part.done", **where, part=part),
                        event("response.output_item.done", output_index=where["output_index"], item=_message(mid, status, part))]

            def call_events(events: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
                """A call's item added once its name is written (the message finished first), its
                arguments as they grow, the item done once the call is."""
                out: list[dict[str, Any]] = []
                for kind, k, *what in events:
                    item_id = _item_id(writer.ids[k])
                    if kind == "added":
                        before = tool_calls.text_before_calls(gate.text, fmt)
                        if before.strip() and not message["opened"]:  # held while the answer might have been a call
                            out += text_event(before[gate.sent:], None)
                        out += closing(before.strip(), seen, "completed")
                        out += thought_done()
                    at = k + int(message["opened"]) + int(thought["opened"])
                    if kind == "added":
                        item = _function_call({"id": writer.ids[k], "function": {"name": writer.names[k], "arguments": ""}},
                                              "in_progress")
                        out.append(event("response.output_item.added", output_index=at, item=item))
                    elif kind == "delta":
                        out.append(event("response.function_call_arguments.delta", item_id=item_id, output_index=at,
                                         delta=what[0]))
                    else:
                        item = _function_call({"id": writer.ids[k], "function": {"name": writer.names[k], "arguments": what[0]}},
                                              "completed")
                        out += [event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                                      arguments=what[0]),
                                event("response.output_item.done", output_index=at, item=item)]
                return out

            def head(index: int) -> list[dict[str, Any]]:
                opening_body = body("in_progress", None)
                return [event("response.created", response=opening_body),
                        event("response.in_progress", response=opening_body)]

            def text_event(text: str, entries: list[Any] | None) -> list[dict[str, Any]]:
                seen.extend(entries or ())
                return [*opening(), event("response.output_text.delta", **where, delta=text, logprobs=entries or [])]

            def delta(index: int, piece: TextPiece) -> list[dict[str, Any]] | None:
                if not piece.text and not (logprobs and piece.logprobs):
                    return None
                lps = _chat_logprobs(named, piece.token_ids, piece.logprobs)
                text, entries = piece.text, lps["content"] if lps is not None else None
                out: list[dict[str, Any]] = []
                if splitter is not None:  # the thinking first; a thinking piece's entries are in the message's at the end
                    said, text = splitter.feed(text)
                    out += thinking(said) if said else []
                    if not text:
                        return out or None
                if not shown:
                    return out + text_event(text, entries)
                sent = gate.feed(text, entries, piece.token_ids)
                out += text_event(*sent[:2]) if sent is not None else []
                return out + call_events(writer.feed(gate.text)) or None

            def tail(index: int, out: TextResult) -> list[dict[str, Any]]:
                content, calls = answer(out)
                ends: list[dict[str, Any]] = []
                if splitter is not None:  # what the split held back
                    said, held = splitter.finish()
                    ends += thinking(said) if said else []
                    ends += text_event(held, None) if held and not shown else []
                    ends += thought_done()
                if shown and not message["closed"]:
                    rest, entries, _ = gate.rest(reasoning.split(out.text, opened, tags)[1] or "" if thinks else out.text, bool(calls))
                    if (rest or entries) and (content is not None or message["opened"]):
                        ends += text_event(rest, entries)
                if content is not None and not message["closed"]:
                    ends += opening()
                ends += closing(content or "", _part("", named, out, logprobs)["logprobs"], status_of(out))
                ends += call_events(writer.finish(calls))
                return [*ends, {"type": f"response.{status_of(out)}"}]  # numbered when it goes out, with the stats

            def finish(last: dict[str, Any], outs: list[TextResult]) -> dict[str, Any]:
                return event(last["type"], response=finished(outs[0], _stats(outs)))

            return _stream(job, head=head, delta=delta, tail=tail, usage=None, finish=finish, named=True)
        outs = await _run_blocking(job, request)
        return JSONResponse(finished(outs[0], _stats(outs)), headers=job.headers)

    @router.get("/v1/responses/{rid}")
    def retrieve(rid: str, request: Request) -> dict[str, Any]:
        return store.get(rid, _owner(request))[1]

    @router.delete("/v1/responses/{rid}")
    def delete(rid: str, request: Request) -> dict[str, Any]:
        store.delete(rid, _owner(request))
        return {"id": rid, "object": "response", "deleted": True}

    return router


def _reasoning_item(rsid: str, text: str | None, status: str) -> dict[str, Any]:
    """The answer's thinking as a ``reasoning`` output item (its text as one ``reasoning_text`` part)."""
    parts = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": rsid, "type": "reasoning", "status": status, "summary": [], "content": parts}


def _message(mid: str, status: str, part: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": mid, "type": "message", "status": status, "role": "assistant", "content": [] if part is None else [part]}


def _item_id(call_id: str) -> str:
    """A ``function_call`` item's id, made from its call's."""
    return f"fc_{call_id.removeprefix('call_')}"


def _function_call(call: dict[str, Any], status: str) -> dict[str, Any]:
    """A call (as :func:`specdec.server.tools.parse` gives it) as a ``function_call`` output item."""
    return {"id": _item_id(call["id"]), "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def _part(text: str, named: _Names, out: TextResult | None, logprobs: bool) -> dict[str, Any]:
    """An ``output_text`` part; its ``logprobs`` (the chat endpoint's entries) where asked for."""
    lps = _chat_logprobs(named, out.token_ids, out.logprobs) if logprobs and out is not None else None
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": lps["content"] if lps is not None else []}


def _usage(out: TextResult, prompt_tokens: int, thinking: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": out.stats.cached_prompt_tokens},
            "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": thinking},
            "total_tokens": prompt_tokens + len(out.token_ids)}
