"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` (``/v1/chat/completions``; ``/v1/responses``
translates its own spelling to these).

The model is told about the tools by its chat template (``tools=`` as transformers passes it),
and writes each call as a Hermes-style block, the format Qwen2.5 and many other open models were
trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The answer's blocks become the message's ``tool_calls``, the text before the first one its
``content`` (``finish_reason`` ``tool_calls``, or ``length`` where the answer was cut off); text
between or after the blocks is dropped, as vLLM's Hermes parser drops it.  A block in this shape
(``name`` first, then an object of ``arguments``) is read as it is written: its ``arguments`` are
the object's text as the model wrote it, and streamed (:class:`StreamedCalls`) they go out as
they grow, so the pieces sent add up to exactly what the finished answer holds (an answer cut off
inside a call ends with the arguments written so far, as OpenAI's does).  A block in another
shape is read once it closes, its arguments re-encoded from the JSON it holds; a malformed one is
no call.  ``parallel_tool_calls: false`` keeps the first call alone, and generation stops once
its block is closed (:func:`first_call_closed`).

A template that does not render tools (SmolLM2's) gets a system message describing them in that
format instead, and earlier calls and tool results are written into the conversation as blocks
too.

Models that were not trained on the tags write a call without them: Qwen2.5-Coder answers with
the object alone, often in a ```` ```json ```` fence.  An answer that is nothing but such calls (one
object or a list of them, fenced or not, each naming a tool shown and holding only ``name`` and
``arguments`` — or ``parameters``, Llama 3's word) is read as calls too; JSON in the middle of an
answer, or naming no tool shown, stays text.

Mistral's models write calls after a ``[TOOL_CALLS]`` token instead: a JSON list of call objects
(``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]``, Mistral 7B v0.3's and Mixtral's format),
or, from the tokenizers that have an ``[ARGS]`` token on, each call as its name, ``[ARGS]`` and the
arguments' object (``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``, a ``[CALL_ID]`` between
them read too).  The marker is a special token, which the answer's text leaves out unless told
to keep special tokens: with tools shown to such a model the text keeps them (as vLLM does), the
calls are read from it, and the content is the text before the first marker.  Its call ids are
nine letters and digits, what Mistral's templates insist on; an earlier call's id of another
shape is turned into such one (the same for the call and its result) when the conversation is
rendered (:class:`CallFormat`).

``tool_choice``: ``none`` (no tools shown, nothing parsed), ``auto`` (the model decides),
``allowed_tools`` (``auto`` or ``required`` over a subset of the tools, the only ones shown),
``required`` or a named function: then a grammar holds the answer to calls whose arguments
follow the function's JSON Schema: one or more calls of any tool for ``required`` (one alone with
``parallel_tool_calls: false``), exactly one call of the named one.  The grammar
masks draft and target alike, so the output is exactly the constrained target's law, as for any
structured output.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.server.errors import ApiError
from specdec.tokenizer import added_vocab

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: a block's start up to its arguments' opening brace: ``{"name": "<name>", "arguments": `` then ``{``
#: what a JSON object's nesting depends on: a quote or a bracket; inside a string, all up to its closing quote
_STRUCTURE = re.compile(r'["{}\[\]]')
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
#: Mistral's call marker, and what its newer tokenizers write between a call's name and arguments
MISTRAL_OPEN, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
#: a Mistral call written by name: the name, an optional id, the optional ``[ARGS]``, then the arguments' ``{``
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_-]*\s*)?(?:\[ARGS\])?\s*(?=\{)")
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallFormat:
    """How a model writes its calls: Hermes-style blocks (``<tool_call>`` ... ``</tool_call>``, the
    default), or after Mistral's ``[TOOL_CALLS]`` token (``args``: calls written by name and
    ``[ARGS]``, which a forced call's grammar then writes; else a JSON list)."""

    open: str = OPEN  # what a call (or Mistral's list of calls) starts with
    args: bool = False

    @property
    def mistral(self) -> bool:
        return self.open == MISTRAL_OPEN

    def new_id(self) -> str:
        """A new call's id: OpenAI's ``call_…``, or nine letters and digits for Mistral."""
        if self.mistral:
            return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def template_id(self, call_id: str | None) -> str | None:
        """An earlier call's id as the template gets it: Mistral's templates refuse any but nine
        letters and digits, so another id becomes nine derived from it (the call and the tool
        result that names it get the same)."""
        if not self.mistral or call_id is None or (len(call_id) == 9 and call_id.isascii() and call_id.isalnum()):
            return call_id
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        return "".join(_ID_CHARS[(digest >> (6 * k)) % len(_ID_CHARS)] for k in range(9))


HERMES = CallFormat()


def call_format(tokenizer: Any) -> CallFormat:
    """The call format of the model behind ``tokenizer``: Mistral's where ``[TOOL_CALLS]`` is one of
    its added tokens, by name and ``[ARGS]`` where that is one too; else Hermes-style blocks."""
    vocab = added_vocab(tokenizer)
    if MISTRAL_OPEN in vocab:
        return CallFormat(MISTRAL_OPEN, args=MISTRAL_ARGS in vocab)
    return HERMES


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
    for ``none``; the name is ``""`` for ``required`` (any tool), None where the model decides.
    ``allowed_tools`` (OpenAI's subset of the tools, ``auto`` or ``required`` among them) shows the
    model that subset alone, so a call of another tool is never asked for."""
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
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not any(t.function.name == name for t in tools):
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools")
        return tools, name
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        allowed = tool_choice.get("allowed_tools")
        mode = allowed.get("mode") if isinstance(allowed, dict) else None
        listed = allowed.get("tools") if isinstance(allowed, dict) else None
        if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
            raise ApiError(400, "tool_choice allowed_tools needs a mode ('auto' or 'required') and a list of tools")
        names = [t["function"].get("name") if isinstance(t, dict) and isinstance(t.get("function"), dict) else None
                 for t in listed]
        unknown = [n for n in names if not any(t.function.name == n for t in tools)]
        if unknown:
            raise ApiError(400, f"tool_choice allowed_tools names {unknown[0]!r}, which is not among the tools")
        return [t for t in tools if t.function.name in names], (None if mode == "auto" else "")
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} "
                   "or {'type': 'allowed_tools', 'allowed_tools': {'mode': ..., 'tools': [...]}}")


def _tag(tag: str, tokenizer: Any) -> str:
    """A call's tag in a Lark grammar: the tokenizer's own token where it has the tag as one added
    token (Qwen2.5's ``<tool_call>``: llguidance matches such a token by name only, never as the
    text it decodes to; a name outside angle brackets, Mistral's ``[TOOL_CALLS]``, by its id),
    else the literal text."""
    if tokenizer is not None and len(tokenizer.encode(tag, add_special_tokens=False)) == 1:
        vocab = added_vocab(tokenizer)
        if tag in vocab:
            return tag if tag.startswith("<") and tag.endswith(">") else f"<[{vocab[tag]}]>"
    return json.dumps(tag)


def grammar(tools: list[ToolDef], name: str | None, several: bool = False, tokenizer: Any = None,
            fmt: CallFormat = HERMES) -> str | None:
    """The llguidance grammar of one call (``name`` "": of any tool; a name: of that one; None: no
    grammar), or with ``several`` and ``name`` "" of one call or more (``required`` with parallel
    calls allowed: OpenAI's "one or more tools"); the tags as ``tokenizer`` writes them, the calls
    in ``fmt``."""
    if name is None:
        return None
    from specdec.errors import SpecdecError
    from specdec.grammar import grammar_for

    picked = [t for t in tools if not name or t.function.name == name]
    compact = {"x-guidance": {"whitespace_flexible": False}}  # compact: small models spiral into whitespace
    many = several and not name
    if fmt.mistral and fmt.args:  # each call: the marker, its name, [ARGS], its arguments' object
        marker, args = _tag(MISTRAL_OPEN, tokenizer), _tag(MISTRAL_ARGS, tokenizer)
        rules = [f"call{k}: {marker} {json.dumps(t.function.name)} {args} %json "
                 f"{json.dumps({**(t.function.parameters or {'type': 'object'}), **compact})}" for k, t in enumerate(picked)]
        lark = "\n".join([f"start: call{'+' if many else ''}", "call: " + " | ".join(f"call{k}" for k in range(len(picked))), *rules])
    else:
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": t.function.parameters or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in picked]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **compact}
        if fmt.mistral:  # the marker, then a JSON list of calls
            more = ' (", " call)*' if many else ""
            start = f'start: {_tag(MISTRAL_OPEN, tokenizer)} " [" call{more} "]"'
            lark = f"{start}\ncall: %json {json.dumps(schema)}"
        else:
            block = f'block: {_tag(OPEN, tokenizer)} "\\n" call "\\n" {_tag(CLOSE, tokenizer)}'
            start = 'start: block ("\\n" block)*' if many else "start: block"
            lark = f"{start}\n{block}\ncall: %json {json.dumps(schema)}"
    try:
        return grammar_for("lark", lark)
    except (SpecdecError, ValueError) as exc:
        raise ApiError(400, f"invalid tool parameters: {str(exc).splitlines()[0]}") from None


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads a ``tools`` variable (else :func:`system_text` describes them)."""
    return "tools" in (template or "")


def format_for(tokenizer: Any, template: str | None) -> CallFormat:
    """The call format answers are read in: the model's own (:func:`call_format`) where its chat
    template renders the tools, else the Hermes-style blocks :func:`system_text` asks for."""
    return call_format(tokenizer) if template_renders_tools(template) else HERMES


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


def turn(message: Any, text: str, native: bool, fmt: CallFormat = HERMES) -> dict[str, Any]:
    """A chat message as a template turn: ``native`` templates get ``tool_calls`` and ``tool``
    turns as transformers passes them (the ids as ``fmt``'s templates take them), and an assistant's
    earlier thinking (``reasoning`` or ``reasoning_content``) under both names; others the calls
    as blocks in the assistant's text and the tool's result as a user turn in a ``<tool_response>``
    block."""
    role = "system" if message.role == "developer" else message.role
    calls = message.tool_calls or []
    thought = getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None)
    if native:
        out: dict[str, Any] = {"role": role, "content": text}
        if thought is not None and role == "assistant":  # templates that show earlier thinking read either name
            out["reasoning_content"] = out["reasoning"] = thought
        if calls:
            out["tool_calls"] = [{"type": "function", "id": fmt.template_id(c.id),
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in calls]
        if role == "tool" and message.tool_call_id is not None:
            out["tool_call_id"] = fmt.template_id(message.tool_call_id)
        return out
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if calls:
        written = "\n".join(block(c.function.name, _arguments(c.function.arguments)) for c in calls)
        return {"role": role, "content": f"{text}\n{written}" if text else written}
    return {"role": role, "content": text}


def _text(arguments: Any) -> str:
    """A call's ``arguments`` as OpenAI's API carries them: a string as it is, anything else as JSON."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call(name: str, arguments: Any, call_id: str | None = None, fmt: CallFormat = HERMES) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry (a new id unless ``call_id``), its ``arguments`` a JSON string."""
    return {"id": call_id or fmt.new_id(), "type": "function", "function": {"name": name, "arguments": _text(arguments)}}


def _object_end(text: str, start: int, resume: list[Any] | None = None) -> tuple[int, bool]:
    """How far the JSON object that opens at ``text[start]`` reaches: (the end of its closing
    brace, True), or (the end of ``text``, False) while it is still open.  Only strings and nesting
    are followed; what is inside is not checked (arguments are not always valid JSON).

    ``resume`` (where to go on, the depth there and whether inside a string; kept by the caller)
    lets a stream, which asks again with each piece of a text that only grows, go on where the
    last scan stopped instead of reading the whole object again: a call may write a whole file as
    one argument."""
    at, depth, quoted = resume if resume else (start, 0, False)
    end = len(text)
    while True:
        if quoted:
            stop = _STRING_BODY.match(text, at).end()  # to the closing quote, a last backslash or the end
            if stop >= end or text[stop] != '"':
                at = stop
                break
            at, quoted = stop + 1, False
        m = _STRUCTURE.search(text, at)
        if m is None:
            at = end
            break
        at = m.end()
        if m.group() == '"':
            quoted = True
        elif m.group() in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return at, True
    if resume is not None:
        resume[:] = [at, depth, quoted]
    return end, False


def _head(body: str) -> tuple[str, int] | None:
    """(the name, where the arguments object starts) of a block's text in the streamable shape, else None."""
    m = _HEAD.match(body)
    if m is None:
        return None
    try:
        return json.loads(f'"{m.group(1)}"'), m.end()
    except ValueError:
        return None


def _read_block(body: str, closed: bool, resume: list[Any] | None = None) -> tuple[str, Any] | None:
    """(name, arguments) of one block's text (``closed``: its closing tag was written), or None
    while it is no call (yet).  The streamable shape gives the arguments as written so far (its
    scan going on from ``resume``: see :func:`_object_end`); another shape is read once closed, as
    JSON with a string ``name``."""
    head = _head(body)
    if head is not None:
        name, start = head
        return name, body[start:_object_end(body, start, resume)[0]]
    if not closed:
        return None
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], call.get("arguments", {})


def _tagged(text: str, final: bool, scans: dict[int, list[Any]] | None = None) -> list[tuple[str, Any, bool]]:
    """The tagged calls in ``text`` in order: (name, arguments, closed).  While the answer is still
    being written (``final`` False) the reading stops at an open block not yet readable, and an
    open block's arguments leave out a tail that may become its closing tag; ``scans`` keeps where
    each block's scan stopped, per block (a stream reads the same blocks again with each piece)."""
    found: list[tuple[str, Any, bool]] = []
    at = text.find(OPEN)
    while at >= 0:
        start = at + len(OPEN)
        end = text.find(CLOSE, start)
        closed = end >= 0
        body = text[start:end] if closed else text[start:]
        if not closed and not final:
            body = body[:held_back(body, CLOSE)]
        read = _read_block(body, closed, None if scans is None else scans.setdefault(at, []))
        if read is not None:
            found.append((*read, closed))
        elif not closed and not final:
            break  # not readable yet: the calls after it wait for it
        if not closed:
            break
        at = text.find(OPEN, end + len(CLOSE))
    return found


def _listed(body: str, final: bool, scans: dict[Any, list[Any]] | None, key: int) -> tuple[list[tuple[str, Any, bool]], bool]:
    """The calls of a Mistral list (``body``: what follows its marker, a ``[`` first) in order:
    (name, arguments, closed), and whether the list is over (closed, or no more calls readable).
    An object in the streamable shape gives its arguments as written so far; another is read once
    closed; an open one ends the reading for now (``final``: the answer was cut off there)."""
    found: list[tuple[str, Any, bool]] = []
    at = body.index("[") + 1
    while True:
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
        if at >= len(body):
            return found, final
        if body[at] != "{":
            return found, True  # "]" or something that is no call: the list ends here
        head = _head(body[at:])
        if head is not None:
            name, start = head[0], at + head[1]
            end, closed = _object_end(body, start, None if scans is None else scans.setdefault((key, at), []))
            if closed:  # the arguments are closed: the call's object closes after them (an "id" may come first)
                end_call, closed = _object_end(body, at, [end, 1, False])
            found.append((name, body[start:end], closed))
            if not closed:
                return found, final
            at = end_call
            continue
        end, closed = _object_end(body, at)
        if not closed:
            return found, final
        try:
            call = json.loads(body[at:end])
        except ValueError:
            return found, True
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return found, True
        found.append((call["name"], call.get("arguments", {}), True))
        at = end


def _mistral(text: str, final: bool, scans: dict[Any, list[Any]] | None = None) -> list[tuple[str, Any, bool]]:
    """Mistral's calls in ``text`` in order, (name, arguments, closed): after each ``[TOOL_CALLS]``
    either a JSON list of call objects or one call by name (``name[ARGS]{...}``); while the answer
    is still being written (``final`` False) the reading stops at a call not yet readable."""
    found: list[tuple[str, Any, bool]] = []
    at = text.find(MISTRAL_OPEN)
    while at >= 0:
        start = at + len(MISTRAL_OPEN)
        following = text.find(MISTRAL_OPEN, start)
        body = text[start:following] if following >= 0 else text[start:]
        if body.lstrip().startswith("["):
            calls, over = _listed(body, final or following >= 0, scans, at)
            found += calls
            if not over:
                break
        else:
            named = _NAMED.match(body)
            if named is None:
                if following < 0 and not final:
                    break  # the name may still be being written
            else:
                arguments = named.end()
                end, closed = _object_end(body, arguments, None if scans is None else scans.setdefault(at, []))
                found.append((named.group(1), body[arguments:end], closed))
                if not closed:
                    break
        at = following
    return found


def _calls(text: str, final: bool, fmt: CallFormat, scans: dict[Any, list[Any]] | None = None) -> list[tuple[str, Any, bool]]:
    """The calls ``fmt`` writes in ``text``, (name, arguments, closed) in order."""
    return _mistral(text, final, scans) if fmt.mistral else _tagged(text, final, scans)


def _whole_answer_calls(text: str, names: Collection[str]) -> list[tuple[str, Any]]:
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
        calls.append((call["name"], call.get("arguments", call.get("parameters", {}))))
    return calls


def first_call_closed(text: str, fmt: CallFormat = HERMES) -> bool:
    """Whether ``text`` holds a call (in ``fmt``) that is closed (after it, ``parallel_tool_calls:
    false`` keeps nothing: generation can stop there)."""
    if (MISTRAL_OPEN if fmt.mistral else CLOSE) not in text:
        return False
    return any(closed for *_, closed in _calls(text, True, fmt))


def stop_at_first_call(fmt: CallFormat) -> Any:
    """:func:`first_call_closed` for ``fmt``'s calls (a decoder's ``stop_when``)."""
    return lambda text: first_call_closed(text, fmt)


def parse(text: str, names: Collection[str] = (), ids: Collection[str] = (),
          fmt: CallFormat = HERMES) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI ``tool_calls``) of a finished answer: each readable call in ``fmt`` is a call
    (see the module's note), the text before the first call's tag or marker, stripped, the content
    (None if nothing is left).  Without calls the whole text is the content.  Without tags, an
    answer that is nothing but untagged calls of the tools ``names`` is those calls, with no
    content.  The first calls take the ids ``ids`` (those a stream gave them), the rest new ones."""
    tagged = [(name, arguments) for name, arguments, _ in _calls(text, True, fmt)]
    calls = tagged or (_whole_answer_calls(text, names) if names and fmt.open not in text else [])
    if not calls:
        return text, []
    given = list(ids)
    made = [_call(name, arguments, given[k] if k < len(given) else None, fmt) for k, (name, arguments) in enumerate(calls)]
    return (text_before_calls(text, fmt).strip() or None) if tagged else None, made


def text_before_calls(text: str, fmt: CallFormat = HERMES) -> str:
    """The answer's text before its first call's tag or marker; "" where it holds none (an answer
    of untagged calls is all calls: no text comes before them)."""
    at = text.find(fmt.open)
    return text[:at] if at >= 0 else ""


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


def held_back(text: str, tag: str = OPEN) -> int:
    """Where streamed text must stop for now: at ``tag`` (a call's opening tag unless told), or at
    a suffix that may still become it."""
    at = text.find(tag)
    if at >= 0:
        return at
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class HeldContent:
    """One streamed answer's content while tools are shown: text goes out up to where a call may
    begin (:func:`held_back`), and none of it while the whole answer may still be an untagged call
    (:func:`may_be_whole_call`); the log-probability entries and token ids of text held back wait
    with it, and go out with the next text sent (or with the rest at the end)."""

    def __init__(self, fmt: CallFormat = HERMES) -> None:
        self.tag = fmt.open  # where a call begins
        self.text = ""  # the answer so far
        self.sent = 0  # how much of it went out
        self.entries: list[Any] | None = None  # log-probability entries of text not yet sent
        self.ids: list[int] = []  # token ids of text not yet sent

    def feed(self, text: str, entries: list[Any] | None, ids: list[int]) -> tuple[str, list[Any] | None, list[int]] | None:
        """A piece's text, entries (None: no log-probabilities for it) and ids: (text, entries, ids) to
        send now — entries None where this piece had none — or None while all of it is held."""
        self.text += text
        stop = 0 if self.sent == 0 and may_be_whole_call(self.text) else held_back(self.text, self.tag)
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
        stop = (final.find(self.tag) if self.tag in final else self.sent) if calls else len(final)
        out = final[self.sent:stop] if stop > self.sent else ""
        if calls and not final[:stop].strip():
            out = ""  # nothing but white space before the calls: no content
        held, self.entries = self.entries, None
        ids_out, self.ids = self.ids, []
        return out, held, ids_out


class StreamedCalls:
    """One streamed answer's tagged calls as they are written: a call is announced once its name is
    (``("added", k, call id, name)``), its arguments go out as they grow (``("delta", k, text)``)
    and it is finished once its block closes (``("done", k, arguments)``), the calls in order (a
    block in another shape goes out whole once it closes).  :meth:`finish` sends what is left,
    given the finished answer's calls as :func:`parse` gives them with :attr:`ids`: the pieces of
    each call's arguments add up to its ``arguments`` there."""

    def __init__(self, most: int | None = None, fmt: CallFormat = HERMES) -> None:
        self.most = most  # calls streamed at most (the rest are dropped), None: all
        self.fmt = fmt
        self.ids: list[str] = []  # the calls announced so far
        self.names: list[str] = []  # ... their names
        self.sent: list[str] = []  # the arguments sent of each
        self.done = 0  # how many are finished
        self._scans: dict[Any, list[Any]] = {}  # where each call's scan stopped (see _object_end)

    def _advance(self, calls: list[tuple[str, str, bool, str | None]]) -> list[tuple[Any, ...]]:
        events: list[tuple[Any, ...]] = []
        for k, (name, arguments, closed, call_id) in enumerate(calls[:self.most]):
            if k == len(self.ids):
                self.ids.append(call_id or self.fmt.new_id())
                self.names.append(name)
                self.sent.append("")
                events.append(("added", k, self.ids[k], name))
            if len(arguments) > len(self.sent[k]) and arguments.startswith(self.sent[k]):
                events.append(("delta", k, arguments[len(self.sent[k]):]))
                self.sent[k] = arguments
            if closed and k == self.done:
                events.append(("done", k, arguments))
                self.done += 1
        return events

    def feed(self, text: str) -> list[tuple[Any, ...]]:
        """The events the answer so far, ``text``, adds."""
        return self._advance([(name, _text(arguments), closed, None)
                              for name, arguments, closed in _calls(text, False, self.fmt, self._scans)])

    def finish(self, calls: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        """The events left once the answer is finished with ``calls``."""
        return self._advance([(c["function"]["name"], c["function"]["arguments"], True, c["id"]) for c in calls])
