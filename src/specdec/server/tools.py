"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` (``/v1/chat/completions``; ``/v1/responses``
translates its own spelling to these).

The model is told about the tools by its chat template (``tools=`` as transformers passes it),
and writes each call as a Hermes-style block, the format Qwen2.5 and many other open models were
trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The answer's blocks become the message's ``tool_calls`` (the text around them its ``content``,
``finish_reason`` ``tool_calls``).  A template that does not render tools (SmolLM2's) gets a
system message describing them in that format instead, and earlier calls and tool results are
written into the conversation as blocks too.

Models that were not trained on the tags write a call without them: Qwen2.5-Coder answers with
the object alone, often in a ```` ```json ```` fence.  An answer that is nothing but such calls (one
object or a list of them, fenced or not, each naming a tool shown and holding only ``name`` and
``arguments`` — or ``parameters``, Llama 3's word) is read as calls too; JSON in the middle of an
answer, or naming no tool shown, stays text.

``tool_choice``: ``none`` (no tools shown, nothing parsed), ``auto`` (the model decides),
``required`` or a named function: then a grammar holds the answer to exactly one call, of any
tool or of the named one, with arguments that follow the function's JSON Schema.  The grammar
masks draft and target alike, so the output is exactly the constrained target's law, as for any
structured output.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.server.errors import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Annotated[str, Field(max_length=1 << 16)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(max_length=64)]
    arguments: Annotated[str, Field(max_length=1 << 20)] = "{}"


class ToolCall(BaseModel):
    """A call in an earlier assistant message (as OpenAI clients send the conversation back)."""

    model_config = ConfigDict(extra="allow")
    id: Annotated[str, Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def chosen(tools: list[ToolDef] | None, tool_choice: Any) -> tuple[list[ToolDef], str | None]:
    """(the tools shown to the model, the one function a named ``tool_choice`` asks for) — no tools
    for ``none``; the name is ``""`` for ``required`` (any tool), None where the model decides."""
    tools = list(tools or ())
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "none":
        return [], None
    if not tools:
        raise ApiError(400, f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "required":
        return tools, ""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not any(t.function.name == name for t in tools):
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools")
        return tools, name
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


def grammar(tools: list[ToolDef], name: str | None) -> str | None:
    """The llguidance grammar of one call (``name`` "": of any tool; a name: of that one; None: no grammar)."""
    if name is None:
        return None
    from specdec.errors import SpecdecError
    from specdec.grammar import grammar_for

    picked = [t for t in tools if not name or t.function.name == name]
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in picked]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}  # compact: small models spiral into whitespace
    lark = f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}"
    try:
        return grammar_for("lark", lark)
    except (SpecdecError, ValueError) as exc:
        raise ApiError(400, f"invalid tool parameters: {str(exc).splitlines()[0]}") from None


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads a ``tools`` variable (else :func:`system_text` describes them)."""
    return "tools" in (template or "")


def system_text(tools: list[ToolDef]) -> str:
    """The tools described in a system message, for a template that does not render them."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("You can call these functions (JSON signatures):\n" + listed + "\n\nTo call one, answer with "
            f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}')


def _arguments(text: str) -> Any:
    """A call's arguments for a template: the JSON object its string holds (templates write them
    with ``tojson``), else the string as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def block(name: str, arguments: Any) -> str:
    """A call written as the model writes it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def turn(message: Any, text: str, native: bool) -> dict[str, Any]:
    """A chat message as a template turn: ``native`` templates get ``tool_calls`` and ``tool``
    turns as transformers passes them; others the calls as blocks in the assistant's text and the
    tool's result as a user turn in a ``<tool_response>`` block."""
    role = "system" if message.role == "developer" else message.role
    calls = message.tool_calls or []
    if native:
        out: dict[str, Any] = {"role": role, "content": text}
        if calls:
            out["tool_calls"] = [{"type": "function", "id": c.id,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in calls]
        if role == "tool" and message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if calls:
        written = "\n".join(block(c.function.name, _arguments(c.function.arguments)) for c in calls)
        return {"role": role, "content": f"{text}\n{written}" if text else written}
    return {"role": role, "content": text}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry, its ``arguments`` a JSON string (re-encoded where the model wrote an object)."""
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}


def _whole_answer_calls(text: str, names: Collection[str]) -> list[dict[str, Any]]:
    """The calls an answer makes without tags: all of it (fenced or not) one call object or a list
    of them, each naming a tool in ``names`` with nothing but ``name`` and ``arguments`` (or
    ``parameters``); else none."""
    body = text.strip()
    fenced = _FENCED.fullmatch(body)
    try:
        found = json.loads(fenced.group(1) if fenced else body)
    except ValueError:
        return []
    found = found if isinstance(found, list) else [found]
    calls = []
    for call in found:
        if not (isinstance(call, dict) and call.get("name") in names and 1 <= len(call) <= 2
                and set(call) - {"name"} <= {"arguments", "parameters"}):
            return []
        calls.append(_call(call["name"], call.get("arguments", call.get("parameters", {}))))
    return calls


def parse(text: str, names: Collection[str] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI ``tool_calls``) of an answer: every well-formed block (a JSON object with
    a string ``name``) is a call, its ``arguments`` re-encoded as a JSON string; the rest of the
    text, stripped, is the content (None if nothing is left).  Malformed blocks stay in the text.
    Without blocks, an answer that is nothing but untagged calls of the tools ``names`` (see the
    module's note) is those calls, with no content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        calls.append(_call(call["name"], call.get("arguments", {})))
        kept.append(text[at:m.start()])
        at = m.end()
    if not calls:
        bare = _whole_answer_calls(text, names) if names else []
        return (None, bare) if bare else (text, [])
    kept.append(text[at:])
    return "".join(kept).strip() or None, calls


def may_be_whole_call(text: str) -> bool:
    """Whether ``text``, an answer's start, may still become an untagged call (an object or a list,
    bare or in a ```` ```json ```` fence): streamed content waits while it may."""
    s = text.lstrip()
    if not s or s[0] in "{[" or "```".startswith(s):
        return True
    if not s.startswith("```"):
        return False
    rest = s[3:]
    if "json".startswith(rest):
        return True
    rest = (rest[4:] if rest.startswith("json") else rest).lstrip()
    return not rest or rest[0] in "{["


def held_back(text: str) -> int:
    """Where streamed content must stop for now: at a call's opening tag, or at a suffix that may
    still become one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class HeldContent:
    """One streamed answer's content while tools are shown: text goes out up to where a call may
    begin (:func:`held_back`), and none of it while the whole answer may still be an untagged call
    (:func:`may_be_whole_call`); the log-probability entries and token ids of text held back wait
    with it, and go out with the next text sent (or with the rest at the end)."""

    def __init__(self) -> None:
        self.text = ""  # the answer so far
        self.sent = 0  # how much of it went out
        self.entries: list[Any] | None = None  # log-probability entries of text not yet sent
        self.ids: list[int] = []  # token ids of text not yet sent

    def feed(self, text: str, entries: list[Any] | None, ids: list[int]) -> tuple[str, list[Any] | None, list[int]] | None:
        """A piece's text, entries (None: no log-probabilities for it) and ids: (text, entries, ids) to
        send now — entries None where this piece had none — or None while all of it is held."""
        self.text += text
        stop = 0 if self.sent == 0 and may_be_whole_call(self.text) else held_back(self.text)
        if self.sent == 0 and not self.text[:stop].strip():
            stop = 0  # white space alone does not start the content: it may be all there is before a call
        out = self.text[self.sent:stop] if stop > self.sent else ""
        self.sent = max(self.sent, stop)
        if entries is not None:
            self.entries = (self.entries or []) + list(entries)
        self.ids.extend(ids)
        if not out:
            return None
        held = None
        if entries is not None:  # a piece without entries leaves the held ones for the next that has some
            held, self.entries = self.entries, None
        ids_out, self.ids = self.ids, []
        return out, held, ids_out

    def rest(self, final: str, calls: bool) -> tuple[str, list[Any] | None, list[int]]:
        """What is left to send of the finished answer ``final``: its content up to the first call where
        it made calls (nothing more where the whole answer was its calls), else all of it; the held
        entries (None if none) and ids."""
        stop = (final.find(OPEN) if OPEN in final else self.sent) if calls else len(final)
        out = final[self.sent:stop] if stop > self.sent else ""
        if calls and not final[:stop].strip():
            out = ""  # nothing but white space before the calls: no content
        held, self.entries = self.entries, None
        ids_out, self.ids = self.ids, []
        return out, held, ids_out
