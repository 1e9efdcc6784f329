"""OpenAI-compatible ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

Served by speculative decoding on the server itself (:class:`specdec.engine.Engine` with a local
drafter from the app's drafter factory).  Fields this server does not know are accepted and
ignored, as vLLM does: they are named in the ``X-Specdec-Ignored-Fields`` response header and in
the server log.  Fields whose *semantics* it cannot honour (audio, tools on completions, a
``suffix`` for a model without fill-in-the-middle tokens, ...) are refused with a 400 that names
them, never silently dropped.  A ``suffix`` on a code model that has them (:mod:`specdec.fim`)
makes the prompt the code before a gap and the answer what fills it.  Chat takes
``tools``, ``tool_choice`` and ``parallel_tool_calls`` (:mod:`specdec.server.tools`).  Extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``method`` (verification rule), ``gamma`` and vLLM's
``prompt_logprobs``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``allowed_token_ids``, ``bad_words`` and guided decoding (``guided_json`` / ``_regex`` / ``_choice`` /
``_grammar``, ``structured_outputs``), ``return_token_ids`` and ``return_tokens_as_token_ids``; vLLM's extensions that would change the output and are not
implemented (beam search, logits processors, a whitespace pattern) are refused; responses
carry a ``specdec`` object with the run's speculative stats (the last stream chunk too).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec import defaults, fim
from specdec.engine import Engine, TextPiece, TextResult, default_method, make_gamma, parse_gamma, parse_tree
from specdec.gamma import CappedGamma, CostGamma
from specdec.errors import SpecdecError
from specdec.models.registry import LoadedModel
from specdec.sampling import SamplingConfig, checked_bias, offset_seed
from specdec.drafters.predicted import Predicted, predicted_ids
from specdec.session import score_prompt
from specdec.text import TextStream, encode_text
from specdec.token_filter import MAX_BAD_WORDS, constraint_factory
from specdec.tokenizer import TokenBytes
from specdec.server.draft_cap import CAPPED_WIRES, LOOKUP_WIRE_SUFFIX, RequestPace
from specdec.server.errors import ApiError, error_body
from specdec.server import reasoning
from specdec.server import tools as tool_calls
from specdec.server.tools import ToolCall, ToolDef
from specdec.server.scheduler import Cancelled as SchedulerCancelled
from specdec.server.settings import past_bound
from specdec.verify import get_rule

#: the wire label of the OpenAI endpoints' rounds (metrics, draft cap)
OPENAI_WIRE = "openai"

if TYPE_CHECKING:
    from specdec.server.app import ServerContext

Finite = Annotated[float, Field(allow_inf_nan=False)]


log = logging.getLogger("specdec.server")
#: what a request still in flight when a stopping server's grace period ends is told
SHUTTING_DOWN = "the server is shutting down; the request was ended before it finished"

#: response header naming the request fields that were accepted and ignored
IGNORED_HEADER = "X-Specdec-Ignored-Fields"
#: /v1/completions' max_tokens where a request gives none (OpenAI's and vLLM's), cut to the room the prompt leaves
COMPLETION_MAX_TOKENS = 16
#: fields clients send whose meaning this server cannot honour: a 400 when they ask for something
_REFUSED = ("tools", "functions", "audio", "web_search_options",
            # vLLM's sampling extensions this server does not implement: each would change the output
            "use_beam_search", "logits_processors", "guided_whitespace_pattern")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    #: vLLM's: with ``include_usage``, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(max_length=256)] | None = None
    # 0: nothing generated, the prompt echoed (and scored): /v1/completions with ``echo`` only
    max_tokens: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    # OpenAI bounds: temperature [0, 2], penalties [-2, 2], logit bias [-100, 100]
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(max_length=256)] | Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]], Field(max_length=1024)] | None = None
    seed: Annotated[int, Field(ge=0, le=defaults.MAX_SEED)] | None = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    # specdec / vLLM extensions (the openai client sends them through extra_body)
    top_k: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] | None = None
    ignore_eos: bool = False
    # vLLM's: at least this many tokens (end-of-sequence and stop_token_ids masked until then)
    min_tokens: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]], Field(max_length=256)] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's: only these token ids may be sampled; no word of bad_words is ever completed (token_filter)
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]], Field(max_length=1 << 18)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's guided decoding (a grammar, as response_format makes): its older fields and structured_outputs
    guided_json: dict[str, Any] | Annotated[str, Field(max_length=1 << 20)] | None = None
    guided_regex: Annotated[str, Field(max_length=1 << 16)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(max_length=1 << 12)]], Field(max_length=1024)] | None = None
    guided_grammar: Annotated[str, Field(max_length=1 << 20)] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: false keeps special tokens in the text (the end-of-sequence token that ends it left out)
    skip_special_tokens: bool = True
    method: Annotated[str, Field(max_length=64)] | None = None
    gamma: Annotated[int, Field(ge=1, le=defaults.MAX_GAMMA)] | Literal["auto", "guide"] | None = None
    # token trees: chain, auto or a node count (default: the server's --tree)
    tree: Annotated[int, Field(ge=1, le=defaults.MAX_TREE_NODES)] | Literal["chain", "auto"] | None = None
    # vLLM's: each prompt token's log-probability, rank and this many most likely tokens (not streamed)
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: only the prompt's last k tokens are read (-1: as many as the model's context holds)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=1 << 24)] | None = None
    # vLLM's: logprobs name each token ``token_id:N`` instead of its text (its bytes stay the token's own)
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt's token ids and each choice's generated ids alongside the text
    return_token_ids: bool = False
    # OpenAI's Predicted Outputs: text much of the answer is expected to repeat, drafted for free
    prediction: dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        """Names of the fields accepted without effect (unknown ones and known no-ops)."""
        extra = dict(self.model_extra or {})
        empty = []  # refused fields sent empty ("tools": []): accepted, and named as ignored
        for name in _REFUSED:
            if name not in extra:
                continue
            value = extra.pop(name)
            if value not in (None, [], {}, False):
                raise ApiError(400, f"{name} is not supported by this server", param=name)
            empty.append(name)
        for name in ("tool_choice", "function_call"):
            if name == "tool_choice" and "tools" in type(self).model_fields:
                continue  # an endpoint with tools checks it with them (server/tools.py)
            if getattr(self, name) not in (None, "none", "auto"):
                raise ApiError(400, f"{name} is not supported by this server (no tools)", param=name)
        names = sorted([*extra, *empty])
        if self.stream_options is not None:
            names += [f"stream_options.{k}" for k in sorted(self.stream_options.model_extra or {})]
        return names


def _kept_tokens(req: _Request, max_length: int, answer: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many of the prompt's tokens are read, at most (k; -1:
    as many as leave room in the model's context for ``answer`` tokens, the max_tokens the request
    will ask for, and at least one); None without it."""
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    if k == 0:
        raise ApiError(400, "truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds beside the answer)",
                       param="truncate_prompt_tokens")
    if k > max_length:
        raise ApiError(400, f"truncate_prompt_tokens ({k}) is more than the model's context ({max_length} tokens)",
                       param="truncate_prompt_tokens")
    return max(1, max_length - max(answer, 1)) if k == -1 else k


def _truncated(req: _Request, ids: list[int], max_length: int, answer: int) -> list[int]:
    """The prompt's last :func:`_kept_tokens` tokens (left truncation); the prompt as it is without
    ``truncate_prompt_tokens``, or where it is short enough already."""
    k = _kept_tokens(req, max_length, answer)
    return ids if k is None else ids[-k:]


def _stop_token_ids(req: _Request, vocab_size: int) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``, each checked against the vocabulary."""
    ids = tuple(req.stop_token_ids or ())
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ApiError(400, f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})", param="stop_token_ids")
    return ids


def _grammar(fmt: dict[str, Any] | None) -> str | None:
    """The llguidance grammar of an OpenAI ``response_format`` (None: free text).

    ``json_object``, ``json_schema`` (``{"json_schema": {"schema": {...}}}``) and two extensions:
    ``{"type": "regex", "regex": "..."}`` and ``{"type": "grammar", "grammar": "<Lark>"}``.
    """
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    from specdec.grammar import grammar_for

    try:
        if kind == "json_object":
            return grammar_for("json_object", None)
        if kind == "json_schema":
            spec = fmt.get("json_schema")  # type: ignore[union-attr]
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs json_schema.schema (an object)",
                               param="response_format")
            return grammar_for("json_schema", schema)
        if kind in ("regex", "grammar"):
            value = fmt.get(kind)  # type: ignore[union-attr]
            if not isinstance(value, str) or not value:
                raise ApiError(400, f"response_format {kind} needs a non-empty string field {kind!r}",
                               param="response_format")
            return grammar_for("regex" if kind == "regex" else "lark", value)
    except SpecdecError as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    except ValueError as exc:  # the engine's own parse errors
        raise ApiError(400, f"invalid response_format: {str(exc).splitlines()[0]}", param="response_format") from None
    raise ApiError(400, f"response_format {kind!r} is not supported: text, json_object, json_schema, regex or grammar",
                   param="response_format")


#: vLLM's guided-decoding fields -> the kind of grammar each asks for
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: structured_outputs keys that choose vLLM's backend and change nothing here
_BACKEND_ONLY = ("disable_fallback",)


def _structured(req: _Request) -> str | None:
    """The llguidance grammar a request asks for by any of its names: ``response_format``, vLLM's
    ``guided_*`` fields or its ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``); None: free text.  More than one of them is a 400, as is a key this server
    cannot honour."""
    asked: list[tuple[str, str, Any]] = []  # (field, kind, spec)
    if (req.response_format or {}).get("type", "text") != "text":
        asked.append(("response_format", "response_format", req.response_format))
    asked += [(name, kind, getattr(req, name)) for name, kind in _GUIDED.items() if getattr(req, name) is not None]
    for key, value in (req.structured_outputs or {}).items():
        if key in ("json", "regex", "choice", "grammar"):
            if value is not None:
                asked.append((f"structured_outputs.{key}", key, value))
        elif key == "json_object":
            if value:
                asked.append((f"structured_outputs.{key}", "json_object", None))
        elif key not in _BACKEND_ONLY and value not in (None, False, "", [], {}):
            raise ApiError(400, f"structured_outputs.{key} is not supported by this server",
                           param=f"structured_outputs.{key}")
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"ask for one kind of structured output, not {' and '.join(name for name, _, _ in asked)}")
    name, kind, spec = asked[0]
    if kind == "response_format":
        return _grammar(spec)
    from specdec.grammar import choice_lark, grammar_for

    try:
        if kind == "json_object":
            return grammar_for("json_object", None)
        if kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise ApiError(400, f"{name} must be a JSON Schema (an object)", param=name)
            return grammar_for("json_schema", schema)
        if kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise ApiError(400, f"{name} must be a list of non-empty strings", param=name)
            return grammar_for("lark", choice_lark(spec))
        if not isinstance(spec, str) or not spec:
            raise ApiError(400, f"{name} must be a non-empty string", param=name)
        return grammar_for("regex" if kind == "regex" else "lark", spec)
    except SpecdecError as exc:
        raise ApiError(400, str(exc), param=name) from None
    except ValueError as exc:  # a schema that is not JSON, the engine's own parse errors
        raise ApiError(400, f"invalid {name}: {str(exc).splitlines()[0]}", param=name) from None


class CompletionRequest(_Request):
    prompt: (
        Annotated[str, Field(max_length=1 << 22)]
        | Annotated[list[str], Field(min_length=1, max_length=128)]
        | Annotated[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]], Field(min_length=1, max_length=1 << 20)]
        | Annotated[list[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]]], Field(min_length=1, max_length=128)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=16)] | None = None
    suffix: Annotated[str, Field(max_length=1 << 16)] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: Annotated[str, Field(max_length=1 << 22)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. ``refusal: null`` echoed back by clients
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message that made tool calls
    content: Annotated[str, Field(max_length=1 << 22)] | Annotated[list[TextPart], Field(max_length=256)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # an assistant's earlier calls
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # a tool's result: the call it answers
    # an assistant's earlier thinking, as a reasoning model's answer gave it (vLLM's name; DeepSeek's below)
    reasoning: Annotated[str, Field(max_length=1 << 22)] | None = None
    reasoning_content: Annotated[str, Field(max_length=1 << 22)] | None = None

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _ChatTemplating(BaseModel):
    """vLLM's chat-template options (``/v1/chat/completions`` and ``/tokenize``): no generation
    prompt, the last message left open to be continued (a reply's start written by the caller),
    and keyword arguments for the template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = None
    # the request's own template (a server started with --trust-request-chat-template; else a 400)
    chat_template: Annotated[str, Field(min_length=1, max_length=1 << 20)] | None = None


class TokenizeRequest(_ChatTemplating):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (exactly one)."""

    model_config = ConfigDict(extra="allow")
    model: Annotated[str, Field(max_length=256)] | None = None
    prompt: Annotated[str, Field(max_length=1 << 22)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)] | None = None
    #: a prompt's special tokens (a BOS where the tokenizer adds one), as /v1/completions encodes a text
    #: prompt and as vLLM's default has it; chat messages get only their template's
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Annotated[str, Field(max_length=256)] | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]], Field(max_length=1 << 20)]


class ChatRequest(_Request, _ChatTemplating):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the first the model writes)
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the answer

    def ignored_fields(self) -> list[str]:
        names = super().ignored_fields()
        if self.parallel_tool_calls is not None and (not self.tools or self.tool_choice == "none"):
            names = sorted([*names, "parallel_tool_calls"])  # no tools shown: no call to limit
        return names
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's: the last message's text put in front of the reply; not built (a 400 when true)
    echo: bool = False


# ----------------------------------------------------------------------------- helpers


class _Cancelled(Exception):
    """The streaming client went away: stop generating."""


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(outs: list[TextResult], prompt_tokens: int, n: int = 1, thinking: Callable[[TextResult], int] | None = None) -> dict[str, Any]:
    """Token counts; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served
    (each prompt counted once, by its first choice: ``n`` choices per prompt); with ``thinking`` (a
    choice's thinking tokens), ``completion_tokens_details.reasoning_tokens``; with a prediction,
    ``accepted_prediction_tokens`` and ``rejected_prediction_tokens`` there too (OpenAI's Predicted
    Outputs: the prediction's tokens the answer took, and the rest of it)."""
    completion = sum(len(o.token_ids) for o in outs)
    cached = sum(o.stats.cached_prompt_tokens for o in outs[::n])
    details = {"reasoning_tokens": sum(thinking(o) for o in outs)} if thinking is not None else {}
    predicted = [o.prediction_tokens for o in outs if o.prediction_tokens is not None]
    if predicted:
        details.update(accepted_prediction_tokens=sum(a for a, _ in predicted), rejected_prediction_tokens=sum(r for _, r in predicted))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, **({"completion_tokens_details": details} if details else {})}


def _best(outs: list[TextResult], candidates: int, keep: int) -> list[int]:
    """``best_of``: per prompt (``candidates`` runs each, in order), the indices of the ``keep``
    runs with the highest mean log-probability per token (OpenAI's ranking; under the target's
    processed law, what ``logprobs`` report), best first, ties in run order."""
    def mean(i: int) -> float:
        lps = [lp for lp, _ in outs[i].logprobs or ()]
        return sum(lps) / len(lps) if lps else float("-inf")

    picked: list[int] = []
    for start in range(0, len(outs), candidates):
        runs = range(start, start + candidates)
        picked += sorted(runs, key=lambda i: (-mean(i), i))[:keep]
    return picked


def _stats(outs: list[TextResult]) -> dict[str, Any]:
    """The request's speculative stats (summed over its choices)."""
    st = [o.stats for o in outs]
    calls = sum(s.target_calls for s in st)
    tokens = sum(s.generated_tokens for s in st)
    proposed = sum(s.draft_tokens_proposed for s in st)
    accepted = sum(s.draft_tokens_accepted for s in st)
    return {
        "method": st[0].method,
        "lossless": all(s.lossless for s in st),
        "drafter": st[0].drafter,
        "gamma_policy": st[0].gamma_policy,
        "target_calls": calls,
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted,
        "tree_rounds": sum(s.tree_rounds for s in st),
        "tokens_per_target_call": tokens / calls if calls else 0.0,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "wall_s": sum(s.wall_s for s in st),
    }


def _constraints(ctx: "ServerContext", req: _Request, grammar: str | None,
                 after_thinking: tuple[int, int, bool] | None = None) -> Callable[[], Any] | None:
    """What makes each choice's constraint: ``grammar`` (after a reasoning model's thinking, with
    ``after_thinking``) under vLLM's ``allowed_token_ids`` and ``bad_words``
    (:func:`specdec.token_filter.constraint_factory`); None where none is asked for."""
    if ctx.tokenizer is None and (grammar is not None or req.bad_words):
        raise ApiError(400, f"{'structured output' if grammar is not None else 'bad_words'} needs the server's tokenizer")
    try:
        return constraint_factory(ctx.tokenizer, ctx.model.vocab_size, grammar=grammar, after_thinking=after_thinking,
                                  allowed_ids=req.allowed_token_ids, bad_words=req.bad_words or ())
    except SpecdecError as exc:
        raise ApiError(400, str(exc)) from None


def _logit_bias(req: _Request, vocab: int) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (req.logit_bias or {}).items():
        try:
            pairs.append((int(key), float(value)))
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    try:
        return checked_bias(pairs, vocab)
    except SpecdecError as exc:
        raise ApiError(400, str(exc)) from None


class _Job:
    """One request, validated: ``len(prompts) * n`` choices, run one after the other in a worker thread
    (and, on a batching server, side by side on generation slots nobody else holds: :func:`_run_choices`)."""

    def __init__(self, ctx: "ServerContext", req: _Request, prompts: list[list[int]], max_tokens: int | None,
                 *, logprobs: int | None = None, echo_logprobs: int | None = None, endpoint: str = "completions",
                 owner: str = "", tool_grammar: str | None = None, stop_when: Callable[[str], bool] | None = None,
                 after_thinking: tuple[int, int, bool] | None = None, default_max_tokens: int | None = None) -> None:
        """``stop_when``: a test of the text that ends each choice where it turns true, the text kept
        (``parallel_tool_calls: false``: the first call's block closed).  ``after_thinking``: a
        reasoning model's tags and whether the prompt opened the block (:func:`_after_thinking`).
        ``default_max_tokens``: the endpoint's max_tokens where the request gives none (None: the
        server's ``--default-max-tokens``), cut to the room the prompt leaves."""
        self.ctx = ctx
        self.stop_when = stop_when
        self.endpoint = endpoint
        self.owner = owner  # the caller's key digest (whose idle sessions may make room for this job)
        model = ctx.model
        _served(ctx, req.model)
        self.ignored = req.ignored_fields()
        #: OpenAI's Predicted Outputs as token ids: free drafts for every choice (None: none given)
        self.predicted: list[int] | None = None
        if req.prediction is not None:
            if ctx.tokenizer is None:
                raise ApiError(400, "prediction needs the server's tokenizer")
            try:
                self.predicted = predicted_ids(ctx.tokenizer, req.prediction)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
        if req.prompt_logprobs is not None and req.stream:
            raise ApiError(400, "prompt_logprobs cannot be streamed (as in vLLM): send the request without stream",
                           param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true (as in OpenAI's API and vLLM)",
                           param="stream_options")
        for ids in prompts:
            for i, tok in enumerate(ids):
                if tok >= model.vocab_size:
                    raise ApiError(400, f"prompt token {i} = {tok} is outside the vocabulary [0, {model.vocab_size})")
        longest = max(len(ids) for ids in prompts)
        room = model.max_length - longest  # prompt + max_tokens <= the context, as in vLLM
        if room < 1:  # the prompt fills the context (scoring it alone, echo with max_tokens 0, needs a row as well)
            raise ApiError(400, f"the prompt has {longest} tokens, which fill the model's context of {model.max_length}: no room"
                                " for an answer (truncate_prompt_tokens: -1 keeps as many as leave room for it)")
        if max_tokens is None:
            max_tokens = min(default_max_tokens if default_max_tokens is not None else ctx.settings.default_max_tokens, room)
        if max_tokens > room:
            raise ApiError(
                400,
                f"the model's context is {model.max_length} tokens; the prompt has {longest} and max_tokens asks for"
                f" {max_tokens} more (at most {room})",
            )
        # the most KV memory one choice can hold (each slot a job runs on holds one choice at a time):
        # the target's cache as TargetSession sizes it, and the server-side draft's, per position
        positions = min(model.max_length, longest + max_tokens + defaults.MAX_GAMMA + 1 + defaults.MAX_TREE_NODES)
        self.kv_bytes = positions * (ctx.kv_per_position + ctx.draft_kv_per_position)
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if (req.min_tokens or 0) > max_tokens:
            raise ApiError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
        try:
            self.sampling = SamplingConfig(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                min_p=req.min_p,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                frequency_penalty=req.frequency_penalty or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                seed=req.seed,
                max_new_tokens=max(max_tokens, 1),  # 0 (echo alone) never reaches the decoder: see run
                stop=tuple(s for s in stops if s),
                logit_bias=_logit_bias(req, model.vocab_size),
                stop_token_ids=_stop_token_ids(req, model.vocab_size),
                include_stop=req.include_stop_str_in_output,
                min_tokens=req.min_tokens or 0,
                skip_special_tokens=req.skip_special_tokens,
            )
            self.method = req.method or default_method(self.sampling)
            rule = get_rule(self.method)
            if rule.greedy_only and not self.sampling.greedy:
                raise ApiError(400, f"method {self.method!r} needs temperature 0")
            self.gamma = parse_gamma(req.gamma if req.gamma is not None else ctx.settings.gamma)
            self.tree = parse_tree(req.tree if req.tree is not None else ctx.settings.tree)
        except SpecdecError as exc:
            raise ApiError(400, str(exc)) from None
        bound = ctx.settings.max_gamma
        over = past_bound(bound, gamma=self.gamma, tree=self.tree)
        if over is not None:
            what = "tokens" if over[0] == "gamma" else "tree nodes"
            raise ApiError(400, f"{over[0]} {over[1]} asks for more than this server drafts in a round: at most {bound} {what} (--max-gamma)")
        if self.tree != "chain" and getattr(model, "forward_tree", None) is None:
            raise ApiError(400, "token trees need tree attention, which this target's backend lacks (on the hf backend, a model with layers other than full or sliding-window attention, such as chunked or linear attention, has none)")
        self.grammar = _structured(req)
        if tool_grammar is not None:  # tool_choice required or named: exactly one call
            if self.grammar is not None:
                raise ApiError(400, "tool_choice required or named is a structured output of its own: send no other")
            self.grammar = tool_grammar
        # each choice's constraint: its own grammar matcher (each has its own history) under the
        # request's one filter of allowed ids and bad words
        self._constraint = _constraints(ctx, req, self.grammar, after_thinking)
        if self._constraint is not None:
            try:
                self._constraint()  # a bad grammar is a 400 now, not an error event later
            except SpecdecError as exc:
                raise ApiError(400, str(exc)) from None
        self.prompts = prompts
        self.max_tokens = max_tokens
        # runs per prompt: n, or best_of candidates of which the n best are returned
        self.n = max(req.n or 1, getattr(req, "best_of", None) or 1)
        self.logprobs = logprobs
        self.echo_logprobs = echo_logprobs  # echo with logprobs: the prompt's tokens scored too, this many best
        self.prompt_logprobs = req.prompt_logprobs  # vLLM's prompt_logprobs: the same scores, this many best
        asked = [k for k in (echo_logprobs, req.prompt_logprobs) if k is not None]
        self._score_top = max(asked) if asked else None  # the best tokens to keep at each prompt position
        self.scored: dict[int, list[tuple[float, list[tuple[int, float]], int]]] = {}  # prompt index -> its scores
        self._scoring = [threading.Lock() for _ in prompts]  # one per prompt: choices of others score side by side
        self.ignore_eos = req.ignore_eos
        self.model_name = ctx.settings.model_name
        if self.ignored:
            log.warning("ignored request fields: %s", ", ".join(self.ignored))

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def headers(self) -> dict[str, str]:
        return {IGNORED_HEADER: ", ".join(self.ignored)} if self.ignored else {}

    def _gamma(self, drafter: Any, index: int = 0, pace: RequestPace | None = None, auto: CostGamma | None = None) -> Any:
        """The request's γ policy (``auto``: γ auto's controller for this choice); on a batching
        server, for the rules whose output does not depend on γ (greedy, coupled), capped to what
        the server's load makes worth drafting
        (:mod:`specdec.server.draft_cap`), each round reported back to the cap's estimates; and
        with ``pace`` (the request's choices side by side), choice ``index``'s threshold rises while
        it is ahead of the slowest of them (:class:`~specdec.server.draft_cap.RequestPace`)."""
        base = auto if auto is not None else self.gamma
        cap = getattr(self.ctx, "draft_cap", None)
        if cap is None or self.method not in CAPPED_WIRES:
            return base
        # acceptance is the rule's (greedy accepts more than coupled sampling), and prompt lookup's
        # drafts (a target row each, no draft pass) are tracked apart from the draft model's
        wire = f"{OPENAI_WIRE}-{self.method}"
        lookup = wire + LOOKUP_WIRE_SUFFIX

        def ceiling(name: str, drafted: bool) -> Callable[..., int | None]:  # (wanted tokens, if known)
            if pace is None:
                return lambda wanted=None: cap.cap(name, server_drafted=drafted, wanted=wanted)
            return lambda wanted=None: cap.cap(name, server_drafted=drafted, value=pace.value(index), wanted=wanted)

        def observe(name: str, drafted: bool) -> Callable[[int, int], None]:
            def observed(gamma: int, accepted: int) -> None:
                cap.observe_round(name, gamma, accepted, server_drafted=drafted)
                if pace is not None:
                    pace.add(index, accepted + 1)
            return observed

        if getattr(drafter, "free_drafts", False):  # prompt lookup alone: every round is a free one
            return CappedGamma(make_gamma(base), cap=ceiling(lookup, False), observe=observe(lookup, False))
        return CappedGamma(make_gamma(base), cap=ceiling(wire, True), observe=observe(wire, True),
                           free_cap=ceiling(lookup, False), observe_free=observe(lookup, False))

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def score(self, index: int) -> list[tuple[float, list[tuple[int, float]], int]]:
        """The prompt of choice ``index`` scored (``echo`` with ``logprobs``, ``prompt_logprobs``), once per prompt."""
        at = index // self.n
        with self._scoring[at]:
            if at not in self.scored:
                self.scored[at] = score_prompt(self.ctx.model, self.prompts[at], int(self._score_top or 0))
            return self.scored[at]

    def scores(self, index: int, top: int | None) -> list[tuple[float, list[tuple[int, float]], int]] | None:
        """Choice ``index``'s prompt scores, each position's best tokens cut to ``top`` (None: not asked for)."""
        if top is None:
            return None
        return [(lp, best[:top], rank) for lp, best, rank in self.scored[index // self.n]]

    def run(
        self, index: int = 0, on_piece: Callable[[TextPiece], None] | None = None,
        cancelled: threading.Event | None = None, pace: RequestPace | None = None,
    ) -> TextResult:
        """Choice ``index`` (in a worker thread): prompt ``index // n``; with a seed, sample
        ``j = index % n`` uses seed + j.  ``cancelled`` also drops this request's queued forward passes;
        ``pace``: the request's choices side by side (see :meth:`_gamma`)."""
        ctx = self.ctx
        j = index % self.n
        from dataclasses import replace

        sampling = self.sampling
        if sampling.seed is not None and j:
            sampling = replace(sampling, seed=offset_seed(sampling.seed, j))
        if self._constraint is not None:
            sampling = replace(sampling, constraint=self._constraint())
        schedulers = [m.scheduler for m in (ctx.model, getattr(ctx, "draft_model", None)) if hasattr(m, "scheduler")]
        for sched in schedulers:
            sched.bind_cancel(cancelled)
        if pace is not None:
            pace.start(index)
        try:
            drafter = ctx.drafter_factory() if ctx.drafter_factory is not None else None
            name = ctx.drafter_name if drafter is not None else "none"
            if self.predicted:  # the caller's prediction drafts first, the server's drafter where it has nothing
                drafter, name = Predicted(self.predicted, drafter), "prediction" if drafter is None else f"prediction+{name}"
            target = LoadedModel(ctx.settings.model_name, ctx.model, ctx.tokenizer, None, "server", ctx.eos_ids)
            engine = Engine(target, drafter, name)
            started = time.perf_counter()
            if self._score_top is not None:
                self.score(index)  # before any text streams (the echoed prompt's chunk carries it)
            if self.max_tokens == 0:  # echo alone: the prompt scored where asked, nothing generated
                prompt = self.prompt_of(index)
                nothing = engine.decoder(get_rule(self.method), self.gamma).nothing(len(prompt), time.perf_counter() - started)
                return self._finished(TextResult("", [], prompt, nothing))
            # γ auto: the successor of the controller of the server's last ended choice under this rule
            # (constrained output, which a grammar often makes easy to draft, learns apart from free text)
            # (a tree's node budget comes from its own controller: neither the memory nor the cap applies)
            memory_key = self.method + ("+constrained" if self._constraint is not None else "")
            chain = self.tree == "chain"
            auto = ctx.gamma_memory.next(memory_key) if chain and drafter is not None and self.gamma == "auto" else None
            cap = getattr(ctx, "draft_cap", None)
            # a tree round's drafted nodes cost draft passes the cap counts: they count as drafted too
            nodes = (lambda gamma, accepted: cap.observe_drafted(gamma)) if cap is not None and not chain else None
            out = engine.generate(self.prompt_of(index), sampling, method=self.method,
                                  gamma=self._gamma(drafter, index, pace, auto) if chain else self.gamma, on_piece=on_piece,
                                  logprobs=self.logprobs, ignore_eos=self.ignore_eos, tree=self.tree, tree_observe=nodes,
                                  stop_when=self.stop_when, max_draft=ctx.settings.max_gamma)
            if auto is not None:
                ctx.gamma_memory.keep(memory_key, auto)
            if isinstance(drafter, Predicted):
                out.prediction_tokens = drafter.taken()
        except SchedulerCancelled:
            raise _Cancelled from None
        finally:
            if pace is not None:
                pace.finish(index)
            for sched in schedulers:
                sched.bind_cancel(None)
        return self._finished(out)

    def _finished(self, out: TextResult) -> TextResult:
        """``out``, counted in the server's metrics."""
        ctx = self.ctx
        ctx.metrics.completion_tokens.inc(len(out.token_ids))
        if getattr(ctx, "draft_cap", None) is not None:
            ctx.draft_cap.observe_tokens(len(out.token_ids))
        ctx.metrics.observe_generation(self.endpoint, out.stats)
        return out

def _admit(job: _Job) -> None:
    """Take one of the server's generation slots (or answer 429) and hold the KV bytes the job can
    use under the server's KV cap, next to the sessions' (or answer 503): never an unbounded backlog."""
    ctx = job.ctx
    if not ctx.active.acquire(blocking=False):
        raise ApiError(429, f"this server is generating {ctx.settings.max_active_requests} completions already; retry later")
    try:
        ctx.store.claim(job.owner, job.kv_bytes)
    except BaseException:
        ctx.active.release()
        raise


def _release(job: _Job) -> None:
    """Give back what :func:`_admit` took."""
    job.ctx.store.release(job.kv_bytes)
    job.ctx.active.release()


def _spare_slot(job: _Job) -> bool:
    """Take one more generation slot and its KV bytes for ``job``, only where both are free now
    (nobody waits, no idle session is evicted for it) and spare slots in use stay within half of
    all slots; :func:`_release_spare` gives them back."""
    ctx = job.ctx
    if not ctx.spare.acquire(blocking=False):
        return False
    if not ctx.active.acquire(blocking=False):
        ctx.spare.release()
        return False
    if not ctx.store.try_claim(job.kv_bytes):
        ctx.active.release()
        ctx.spare.release()
        return False
    return True


def _release_spare(job: _Job) -> None:
    _release(job)
    job.ctx.spare.release()


def _run_choices(job: _Job, on_piece: Callable[[int], Callable[[TextPiece], None] | None], cancelled: threading.Event,
                 on_done: Callable[[int, TextResult], None] | None = None) -> list[TextResult]:
    """Every choice of ``job`` (in a worker thread holding its admitted slot), results in index order;
    ``on_piece(i)`` is choice ``i``'s callback for its streamed pieces, ``on_done(i, result)`` is called
    as each ends.

    On a batching server a request's several prompts or ``n`` choices also run on spare generation
    slots — each taken without waiting, with its own KV claim, at most
    :data:`~specdec.defaults.SERVER_CHOICES_SIDE_BY_SIDE` at once and never more than half of all
    slots server-wide, and given back when its thread runs out of choices — so the scheduler
    batches their passes as it batches separate requests'.
    Each choice is the same computation wherever it runs (its prompt, its seed), so the results
    are those of running them one after the other.  A failing choice stops the others from starting
    new ones; the first failure is raised.
    """
    n = job.choices
    results: list[TextResult | None] = [None] * n
    pending = iter(range(n))
    pace = RequestPace(waiting=n) if n > 1 else None  # a choice ahead of the others drafts less
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                i = None if failures else next(pending, None)
            if i is None:
                return
            try:
                results[i] = job.run(i, on_piece(i), cancelled, pace)
                if on_done is not None:
                    on_done(i, results[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in the admitted thread
                with lock:
                    failures.append(exc)
                return

    def extra() -> None:
        try:
            work()
        finally:
            _release_spare(job)

    helpers = []
    if job.ctx.settings.batching:
        while len(helpers) < min(n, defaults.SERVER_CHOICES_SIDE_BY_SIDE) - 1 and _spare_slot(job):
            try:
                helpers.append(job.ctx.executor.submit(extra))
            except RuntimeError:  # the executor is shutting down: give the slot back, run here
                _release_spare(job)
                break
    work()
    for h in helpers:
        h.result()
    if failures:
        raise failures[0]
    return results  # type: ignore[return-value]


def _submit(job: _Job, fn: Callable[[], Any]) -> "asyncio.Future[Any]":
    """Run ``fn`` on the generation pool; what :func:`_admit` took is given back when it ends."""

    def guarded() -> Any:
        try:
            return fn()
        finally:
            _release(job)

    return asyncio.get_running_loop().run_in_executor(job.ctx.executor, guarded)


async def _run_blocking(job: _Job, request: Request | None = None) -> list[TextResult]:
    """Run every choice of ``job`` in a worker thread; stop as soon as the client disconnects
    (polled every 0.1 s)."""
    cancelled = threading.Event()

    def on_piece(piece: TextPiece) -> None:
        if cancelled.is_set():
            raise _Cancelled

    aborted = threading.Event()
    _admit(job)
    job.ctx.live.add(aborted.set)
    future = _submit(job, lambda: _run_choices(job, lambda index: on_piece, cancelled))
    # a client that leaves abandons the future, which then ends in _Cancelled: retrieve that here,
    # or asyncio logs it with a traceback ("Future exception was never retrieved")
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.1)
            if done:
                return future.result()
            if aborted.is_set():
                raise ApiError(503, SHUTTING_DOWN, kind="server_shutdown")
            if request is not None and await request.is_disconnected():
                cancelled.set()
                raise ApiError(499, "the client closed the connection", kind="client_closed")
    except SpecdecError as exc:
        raise ApiError(400, str(exc)) from None
    except _Cancelled:
        raise ApiError(499, "the client closed the connection", kind="client_closed") from None
    finally:
        job.ctx.live.discard(aborted.set)
        cancelled.set()  # also when this handler is cancelled


def _sse(payload: dict[str, Any] | str, named: bool = False) -> str:
    """One server-sent event; ``named``: with an ``event:`` line naming the payload's ``type``
    (the Responses API's events)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    if named and isinstance(payload, dict) and "type" in payload:
        return f"event: {payload['type']}\ndata: {data}\n\n"
    return f"data: {data}\n\n"


def _stream(
    job: _Job,
    *,
    head: Callable[[int], list[dict[str, Any]]],
    delta: Callable[[int, TextPiece], dict[str, Any] | list[dict[str, Any]] | None],
    tail: Callable[[int, TextResult], dict[str, Any] | list[dict[str, Any]]],
    usage: Callable[[list[TextResult]], dict[str, Any]] | None,
    head_waits: bool = False,
    finish: Callable[[dict[str, Any], list[TextResult]], dict[str, Any]] | None = None,
    named: bool = False,
    continuous_usage: bool = False,
) -> StreamingResponse:
    """Server-sent events: per choice, ``head`` chunks, ``delta`` chunks per streamed piece (one or
    a list: its text and, where asked for, the log-probabilities of the tokens it completes; None:
    nothing to send), ``tail`` (one chunk or several); then [usage] and [DONE].  Choices run as
    :func:`_run_choices` runs them — side
    by side on spare slots where there are some — so their chunks interleave, each carrying its
    index (as OpenAI's streams of ``n`` choices do); a choice's own chunks keep their order.  The
    request's speculative stats ride on the last chunk of the choice that ends last (``finish``
    puts them there: by default a ``specdec`` field).  ``head_waits``: the first choice's head
    chunks go out with its first event, not at once (they need its work).  ``named``: the
    Responses API's framing (each event named by its ``type``, no [DONE]).  ``continuous_usage``
    (vLLM's ``continuous_usage_stats``): each chunk also carries its choice's usage so far (its
    prompt's tokens, the tokens its pieces have brought until then, all of them from its tail on)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def put(kind: str, value: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def piece_of(index: int) -> Callable[[TextPiece], None]:
        def on_piece(piece: TextPiece) -> None:
            if cancelled.is_set():
                raise _Cancelled
            put("piece", (index, piece))

        return on_piece

    def work() -> None:
        try:
            _run_choices(job, piece_of, cancelled, on_done=lambda index, result: put("done", (index, result)))
        except _Cancelled:
            return
        except SpecdecError as exc:
            put("error", (str(exc), 400, "invalid_request_error"))
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
            log.exception("streamed completion failed")  # the client sees the type only: the log keeps the rest
            put("error", (f"internal error ({type(exc).__name__})", 500, "server_error"))
            return
        put("end", None)

    _admit(job)
    started = False

    async def events() -> AsyncIterator[str]:
        nonlocal started
        started = True
        _submit(job, work)
        results: dict[int, TextResult] = {}
        opened: set[int] = set()  # choices whose head chunks went out
        last: dict[str, Any] | None = None  # the last choice's final chunk, held back to carry the stats
        made: dict[int, int] = {}  # per choice: the tokens its pieces have brought (continuous usage)

        def counted(index: int, chunk: dict[str, Any]) -> dict[str, Any]:
            if not continuous_usage:
                return chunk
            prompt, done = len(job.prompt_of(index)), made.get(index, 0)
            return {**chunk, "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}

        def abort() -> None:  # the server is stopping: the decode stops at its next piece, the client is told
            cancelled.set()
            queue.put_nowait(("error", (SHUTTING_DOWN, 503, "server_shutdown")))

        job.ctx.live.add(abort)

        def opening(index: int) -> list[str]:
            if index in opened:
                return []
            opened.add(index)
            return [_sse(counted(index, chunk), named) for chunk in head(index)]

        try:
            if not head_waits:  # else the head goes out with the choice's first event (it needs the job's work)
                for chunk in opening(0):
                    yield chunk
            while True:
                kind, value = await queue.get()
                if kind == "piece":
                    index, piece = value
                    sent = delta(index, piece)
                    made[index] = made.get(index, 0) + len(piece.token_ids or ())
                    if sent is not None:
                        for chunk in opening(index):
                            yield chunk
                        for chunk in sent if isinstance(sent, list) else [sent]:
                            yield _sse(counted(index, chunk), named)
                elif kind == "done":
                    index, result = value
                    for chunk in opening(index):
                        yield chunk
                    results[index] = result
                    made[index] = len(result.token_ids)
                    ends = tail(index, result)
                    ends = [counted(index, chunk) for chunk in (ends if isinstance(ends, list) else [ends])]
                    held = len(results) == job.choices  # the last choice's last chunk carries the stats
                    for chunk in ends[:-1] if held else ends:
                        yield _sse(chunk, named)
                    if held:
                        last = ends[-1]
                elif kind == "end":
                    outs = [results[i] for i in sorted(results)]
                    if usage is not None and last is not None:
                        yield _sse(last, named)
                        last = usage(outs)
                    if last is not None:
                        yield _sse(finish(last, outs) if finish is not None else {**last, "specdec": _stats(outs)}, named)
                    break
                else:
                    message, status, kind = value  # after the stream began, an error event with the status it would have had
                    yield _sse(error_body(message, kind, status))
                    break
            if not named:
                yield _sse("[DONE]")
        finally:
            job.ctx.live.discard(abort)
            cancelled.set()

    body = events()

    def release_if_never_started() -> None:  # the client left before the body was sent
        if not started:
            _release(job)

    weakref.finalize(body, release_if_never_started)
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **job.headers})


def _served(ctx: "ServerContext", name: str | None) -> None:
    """A request naming another model than the one served is a 404 (as OpenAI answers it)."""
    names = ctx.settings.model_names
    if name is not None and name not in names:
        served = " or ".join(repr(n) for n in names)
        raise ApiError(404, f"model {name!r} is not served here; this server serves {served}")


#: names a chat template's keyword arguments may not take (the rendering's own)
_TEMPLATE_OWN = ("messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                 "tokenize", "return_tensors", "return_dict", "chat_template")


def _chat_ids(tok: Any, messages: list[ChatMessage], opts: _ChatTemplating | None = None,
              tools: list[ToolDef] | None = None, *, trust_template: bool = False) -> list[int]:
    """Token ids of a conversation through the model's chat template (what /v1/chat/completions
    generates after).  With ``continue_final_message`` the text ends right after the last
    message's content, its end-of-turn tokens left out, so the reply continues that message.
    ``tools``: shown to the model (by the template where it renders them, else in a system
    message: :mod:`specdec.server.tools`).  The request's own ``chat_template`` renders it instead
    of the model's where ``trust_template`` (the server's ``--trust-request-chat-template``) allows."""
    opts = opts or _ChatTemplating()
    if opts.chat_template is not None and not trust_template:
        raise ApiError(400, "chat_template is not accepted by this server (start it with --trust-request-chat-template"
                            " to let requests bring their own)")
    template = opts.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise ApiError(400, "this model has no chat template; use /v1/completions, or start the server with"
                            " --chat-template PATH|TEMPLATE")
    if opts.continue_final_message and opts.add_generation_prompt:
        raise ApiError(400, "continue_final_message needs add_generation_prompt false (as in vLLM): the reply continues"
                            " the last message instead of starting a new one")
    kwargs = dict(opts.chat_template_kwargs or {})
    clash = sorted(set(kwargs) & set(_TEMPLATE_OWN))
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(clash)}")
    native = tool_calls.template_renders_tools(template)
    fmt = tool_calls.format_for(tok, template)
    turns = [tool_calls.turn(m, m.text, native, fmt) for m in messages]
    if tools and native:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    elif tools:  # the template cannot show them: a system message does
        described = tool_calls.system_text(tools)
        if turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": turns[0]["content"] + "\n\n" + described}
        else:
            turns.insert(0, {"role": "system", "content": described})
    if opts.chat_template is not None:
        kwargs["chat_template"] = opts.chat_template
    try:
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=opts.add_generation_prompt, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
        raise ApiError(400, f"the chat template rejected the messages: {exc}") from None
    if opts.continue_final_message:
        text = _open_final(text, turns[-1]["content"])
    return list(tok.encode(text, add_special_tokens=False))


def _thinks(ctx: Any, tok: Any, ids: list[int], req: Any) -> tuple[bool, bool, reasoning.Tags]:
    """(whether a chat answer's thinking block goes to its reasoning, whether the prompt ``ids``
    opened that block already: R1's template does, the block's tags).  Where the tags are special
    tokens (Mistral's ``[THINK]``) the request's text keeps special tokens, as for Mistral's calls."""
    thinks = bool(ctx.reasoning_on)
    tags = ctx.reasoning_tags if thinks else reasoning.THINK
    if thinks and reasoning.special_tags(tok, tags):
        req.skip_special_tokens = False
    return thinks, thinks and reasoning.prompt_opens(tok, ids, tags), tags


def _after_thinking(tok: Any, thinks: bool, opened: bool, tags: reasoning.Tags) -> tuple[int, int, bool] | None:
    """Where the parser is on and the block's tags are tokens of their own: their ids and whether
    the prompt opened the block, so a structured output (a forced call, ``response_format``, a
    guided grammar) holds after the thinking, as vLLM's does; None otherwise (from the first token)."""
    ids = reasoning.tag_ids(tok, tags) if thinks else None
    return None if ids is None else (*ids, opened)


def _first_call(fmt: tool_calls.CallFormat, thinks: bool, opened: bool, tags: reasoning.Tags) -> Callable[[str], bool]:
    """``parallel_tool_calls: false``'s stop: the first call closed, looked for after any thinking."""
    stop = tool_calls.stop_at_first_call(fmt)
    if not thinks:
        return stop
    return lambda text: stop(reasoning.split(text, opened, tags)[1] or "")


def _thinking(thought: str | None) -> dict[str, str]:
    """A message's (or delta's) thinking: vLLM's ``reasoning`` and DeepSeek's older ``reasoning_content``."""
    return {"reasoning": thought, "reasoning_content": thought} if thought else {}


def _call_format(tok: Any, req: Any, shown: list[Any]) -> tool_calls.CallFormat:
    """How the answer to ``req`` writes its calls (with tools shown); where that is after a special
    token (Mistral's ``[TOOL_CALLS]``) the request's text keeps special tokens, as vLLM does."""
    fmt = tool_calls.format_for(tok, getattr(req, "chat_template", None) or getattr(tok, "chat_template", None))
    if shown and fmt.mistral:
        req.skip_special_tokens = False
    return fmt


def _open_final(text: str, content: str) -> str:
    """``text`` (a rendered conversation) cut right after its last message's ``content``: whatever the
    template wrote after it (the end of the turn) goes.  Templates that strip a message's
    surrounding white space are matched by the stripped content."""
    for body in (content, content.strip()):
        at = text.rfind(body) if body else -1
        if at >= 0:
            return text[: at + len(body)]
    raise ApiError(400, "continue_final_message needs a last message with text, found as written in the rendered"
                        " conversation")


def _piece(tok: Any, token: int) -> str:
    return tok.decode([token])


class _Names:
    """How a response's log-probabilities name tokens: a token's ``text`` (what the choice's text
    holds of it), its ``label`` (the text, or vLLM's ``token_id:N`` with ``return_tokens_as_token_ids``)
    and its own ``bytes`` (part of a character where the token holds part of one: OpenAI's chat
    ``bytes``, which join to the text's UTF-8 across tokens)."""

    def __init__(self, tok: Any, token_bytes: TokenBytes, as_ids: bool = False, left_out: frozenset[int] | None = None) -> None:
        self.tok = tok
        self._bytes = token_bytes
        self.as_ids = as_ids
        # the tokens a message's text leaves out: every special one, or (special tokens kept) those that end it
        self.left_out = frozenset(getattr(tok, "all_special_ids", None) or ()) if left_out is None else left_out

    def text(self, token: int) -> str:
        return _piece(self.tok, token)

    def label(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else _piece(self.tok, token)

    def bytes(self, token: int) -> list[int]:
        return list(self._bytes(token))


def text_left_out(req: Any, eos_ids: frozenset[int]) -> frozenset[int]:
    """With special tokens kept in the text, the tokens it still leaves out: the end-of-sequence or
    stop token that ends it (as :func:`specdec.text.output_sink` does), none with
    ``include_stop_str_in_output``."""
    if getattr(req, "include_stop_str_in_output", False):
        return frozenset()
    return frozenset(getattr(req, "stop_token_ids", None) or ()) | (frozenset() if getattr(req, "ignore_eos", False) else eos_ids)


def _chat_logprobs(names: _Names, token_ids: list[int], logprobs: list | None) -> dict[str, Any] | None:
    """OpenAI chat ``logprobs`` of ``token_ids`` (a whole answer or a streamed piece of it): the
    target's processed law at each emitted position whose token is part of the message; special
    tokens (the end of the turn) are left out where the message's text leaves them out
    (:attr:`_Names.left_out`), so the entries' tokens join to the content.  An ordinary token
    that ends the answer as one of ``stop_token_ids`` keeps its entry, as in vLLM, though the
    content leaves its text out."""
    if logprobs is None:
        return None
    special = names.left_out

    def entry(token: int, lp: float) -> dict[str, Any]:
        return {"token": names.label(token), "logprob": max(lp, -9999.0), "bytes": names.bytes(token)}

    return {"content": [
        {**entry(token, lp), "top_logprobs": [entry(i, v) for i, v in top]}
        for token, (lp, top) in zip(token_ids, logprobs) if token not in special
    ], "refusal": None}


def _tokens_and_offsets(names: _Names, token_ids: list[int], offset: int) -> tuple[list[str], list[int]]:
    """Each token's name in legacy logprobs and the character of the text it starts at, the first
    at ``offset``.  A token that holds part of a character (its text alone reads U+FFFD) counts the
    characters its bytes complete, so the offsets never run backwards nor past the text: the token
    that starts a character is at that character, the one that ends it moves past it."""
    tokens, offsets = [], []
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    for token in token_ids:
        offsets.append(offset)
        text = names.text(token)
        tokens.append(names.label(token))
        offset += len(utf8.decode(bytes(names.bytes(token)))) if "\ufffd" in text or utf8.getstate()[0] else len(text)
    return tokens, offsets


def _completion_logprobs(names: _Names, token_ids: list[int], logprobs: list | None, offset: int) -> dict[str, Any] | None:
    """Legacy completions ``logprobs`` of ``token_ids`` (a whole answer or a streamed piece of it,
    whose first token's text starts at character ``offset`` of the choice's text): tokens,
    token_logprobs, top_logprobs, text_offset (characters of the text, whatever the tokens' labels)."""
    if logprobs is None:
        return None
    tokens, offsets = _tokens_and_offsets(names, token_ids, offset)
    return {"tokens": tokens, **_legacy_scores(names, token_ids, logprobs), "text_offset": offsets}


def _legacy_scores(names: _Names, token_ids: list[int], logprobs: list) -> dict[str, list]:
    """token_logprobs and top_logprobs as OpenAI's legacy completions report them: the sampled
    token's log-probability is always among its position's alternatives (up to logprobs + 1 of
    them; logprobs 0: that one alone)."""
    tops = []
    for token, entry in zip(token_ids, logprobs):
        top = {names.label(i): max(v, -9999.0) for i, v in entry[1]}
        top.setdefault(names.label(token), max(entry[0], -9999.0))
        tops.append(top)
    return {"token_logprobs": [max(entry[0], -9999.0) for entry in logprobs], "top_logprobs": tops}


def _echo_logprobs(names: _Names, prompt_ids: list[int], prompt_logprobs: list | None) -> dict[str, Any] | None:
    """Legacy completions ``logprobs`` of an echoed prompt (``echo`` with ``logprobs``): its first
    token has none (null, as OpenAI reports it), each later one the target's own law given the
    tokens before it; offsets from the start of the choice's text."""
    if prompt_logprobs is None:
        return None
    # the offsets run over the whole prompt (its first token may hold part of a character, which
    # the tokens after it complete), not from the second token on
    tokens, offsets = _tokens_and_offsets(names, prompt_ids, 0)
    scored = _legacy_scores(names, prompt_ids[1:], prompt_logprobs)
    return {"tokens": tokens,
            "token_logprobs": [None, *scored["token_logprobs"]],
            "top_logprobs": [None, *scored["top_logprobs"]],
            "text_offset": offsets}


def _vllm_prompt_logprobs(tok: Any, prompt_ids: list[int], scores: list | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a map from token
    id to its log-probability, rank and text, for the prompt's token (first) and the best ones."""
    if scores is None:
        return None

    def entry(token: int, lp: float, rank: int) -> dict[str, Any]:
        return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": _piece(tok, token)}

    out: list[dict[str, Any] | None] = [None]
    for token, (lp, best, rank) in zip(prompt_ids[1:], scores):
        at = {str(token): entry(token, lp, rank)}
        for r, (i, v) in enumerate(best, start=1):
            at.setdefault(str(i), entry(i, v, r))
        out.append(at)
    return out


def _joined(*parts: dict[str, Any] | None) -> dict[str, Any] | None:
    """Legacy ``logprobs`` objects one after the other (the echoed prompt's, then the answer's)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {key: [v for p in present for v in p[key]] for key in present[0]}


# ----------------------------------------------------------------------------- endpoints


def _owner(request: Request) -> str:
    """The caller's key digest, set by the server's key guard ('' without keys)."""
    from specdec.server.guard import OWNER

    return str(request.scope.get(OWNER) or "")


def openai_router(ctx: "ServerContext") -> APIRouter:
    router = APIRouter()
    metrics = ctx.metrics

    def tokenizer() -> Any:
        if ctx.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer, so it cannot serve text completions")
        return ctx.tokenizer

    def names(req: _Request) -> _Names:
        return _Names(tokenizer(), ctx.token_bytes, req.return_tokens_as_token_ids,
                      None if req.skip_special_tokens else text_left_out(req, ctx.eos_ids))

    def model_card(name: str) -> dict[str, Any]:  # OpenAI's model object, with vLLM's max_model_len
        return {"id": name, "object": "model", "created": int(ctx.started), "owned_by": "specdec",
                "max_model_len": ctx.model.max_length}

    @router.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in ctx.settings.model_names]}

    @router.get("/v1/models/{model:path}")
    def model(model: str) -> dict[str, Any]:
        """OpenAI's model retrieval (``client.models.retrieve``); 404 for a model not served here."""
        _served(ctx, model)
        return model_card(model)

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        keep = req.n or 1
        if req.best_of is not None and req.best_of < keep:
            raise ApiError(400, f"best_of ({req.best_of}) must be at least n ({keep})", param="best_of")
        ranked = req.best_of is not None and req.best_of > keep  # candidates generated, the best n returned
        if ranked and req.stream:
            raise ApiError(400, "best_of greater than n cannot be streamed (as in OpenAI's API)")
        fill = None  # a suffix: the prompt is the code before a gap, the answer what fills it
        if req.suffix:
            if req.echo:
                raise ApiError(400, "echo cannot be combined with suffix: the model reads a fill-in-the-middle prompt, "
                                    "not the prompt as sent")
            try:
                fill = fim.require_style(tokenizer())
            except SpecdecError as exc:
                raise ApiError(400, str(exc)) from None
            req = req.model_copy(update={"stop_token_ids": list(fim.stop_ids(tokenizer(), fill, req.stop_token_ids or ()))})
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens 0 needs echo (the prompt echoed, and scored with logprobs; nothing generated)")
        raw = req.prompt
        many = isinstance(raw, list) and bool(raw) and isinstance(raw[0], (str, list))
        items: list[Any] = list(raw) if many else [raw]  # type: ignore[arg-type]
        prompts: list[list[int]] = []
        texts: list[str] = []
        answer = req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS
        for item in items:
            if fill is not None:  # an empty prefix is a gap at the file's start
                try:  # truncated, it loses the code farthest before the gap, never a marker
                    ids = fim.prompt_ids(tokenizer(), item if isinstance(item, str) else list(item), req.suffix or "", fill,
                                         at_most=_kept_tokens(req, ctx.model.max_length, answer))
                except SpecdecError as exc:
                    raise ApiError(400, str(exc)) from None
            elif isinstance(item, str):
                if not item:
                    raise ApiError(400, "the prompt is empty")
                ids = encode_text(tokenizer(), item)
            else:
                ids = list(item)
            if not ids:
                raise ApiError(400, "the prompt is empty")
            kept = _truncated(req, ids, ctx.model.max_length, answer)
            prompts.append(kept)
            texts.append(item if isinstance(item, str) and len(kept) == len(ids) else "")  # echo: the prompt as read
        job = _Job(ctx, req, prompts, req.max_tokens, default_max_tokens=COMPLETION_MAX_TOKENS,
                   logprobs=0 if ranked and req.logprobs is None else req.logprobs,  # best_of ranks by them
                   echo_logprobs=req.logprobs if req.echo else None, owner=_owner(request))
        tok = tokenizer()  # the text of the answer needs it
        named = names(req)
        if req.echo:
            texts = [t or tok.decode(ids) for t, ids in zip(texts, prompts)]
        cid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        metrics.completions.labels("completions", str(req.stream).lower()).inc()
        prompt_tokens = sum(len(ids) for ids in prompts)

        def echoed(index: int) -> str:
            return texts[index // job.n] if req.echo else ""

        ids_shown: set[int] = set()  # streamed choices whose prompt ids went out (return_token_ids)

        def chunk(index: int, text: str, finish: str | None, logprobs: Any = None,
                  token_ids: list[int] | None = None) -> dict[str, Any]:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if req.return_token_ids:  # vLLM's: the prompt's ids on a choice's first chunk, each chunk its new ids
                if index not in ids_shown:
                    ids_shown.add(index)
                    choice["prompt_token_ids"] = job.prompt_of(index)
                choice["token_ids"] = token_ids or []
            return {"id": cid, "object": "text_completion", "created": created, "model": job.model_name,
                    "choices": [choice]}

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            offsets: dict[int, int] = {}  # per choice: where the next streamed token's text starts

            def streamed(index: int, piece: TextPiece) -> dict[str, Any] | None:
                lps = None
                if piece.logprobs is not None and piece.token_ids:
                    start = offsets.get(index, len(echoed(index)))
                    lps = _completion_logprobs(named, piece.token_ids, piece.logprobs, start)
                    offsets[index] = lps["text_offset"][-1] + len(named.text(piece.token_ids[-1]))  # type: ignore[index]
                if piece.text or lps is not None or (req.return_token_ids and piece.token_ids):
                    return chunk(index, piece.text, None, lps, piece.token_ids)
                return None

            def head(index: int) -> list[dict[str, Any]]:
                if not req.echo:
                    return []
                scored = job.scores(index, job.echo_logprobs)
                return [chunk(index, echoed(index), None, _echo_logprobs(named, job.prompt_of(index), scored))]

            return _stream(
                job,
                head=head,
                head_waits=job.echo_logprobs is not None,
                delta=streamed,
                tail=lambda index, out: chunk(index, "", _finish_reason(out.stats.finish_reason)),
                usage=(lambda outs: {**chunk(0, "", None), "choices": [], "usage": _usage(outs, prompt_tokens, job.n)})
                if include_usage else None,
                continuous_usage=include_usage and req.stream_options.continuous_usage_stats,  # type: ignore[union-attr]
            )
        outs = await _run_blocking(job, request)
        picked = _best(outs, job.n, keep) if ranked else range(len(outs))  # run i of each choice
        choices = [
            {"index": index, "text": echoed(i) + outs[i].text,
             "logprobs": _joined(_echo_logprobs(named, outs[i].prompt_ids, job.scores(i, job.echo_logprobs)),
                                 _completion_logprobs(named, outs[i].token_ids,
                                                      outs[i].logprobs if req.logprobs is not None else None,
                                                      len(echoed(i)))),
             "finish_reason": _finish_reason(outs[i].stats.finish_reason),
             **({"prompt_logprobs": _vllm_prompt_logprobs(tok, outs[i].prompt_ids, job.scores(i, job.prompt_logprobs))}
                if job.prompt_logprobs is not None else {}),
             **({"prompt_token_ids": outs[i].prompt_ids, "token_ids": outs[i].token_ids} if req.return_token_ids else {})}
            for index, i in enumerate(picked)
        ]
        body = {"id": cid, "object": "text_completion", "created": created, "model": job.model_name,
                "choices": choices, "usage": _usage(outs, prompt_tokens, job.n), "specdec": _stats(outs)}
        return JSONResponse(body, headers=job.headers)

    @router.post("/tokenize")
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's tokenizer endpoint (lm-evaluation-harness uses it instead of a local tokenizer)."""
        _served(ctx, req.model)
        tok = tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send either prompt or messages")
        if req.prompt is not None:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            ids = _chat_ids(tok, req.messages, req,  # type: ignore[arg-type]
                            trust_template=ctx.settings.trust_request_chat_template)
        return {"count": len(ids), "max_model_len": ctx.model.max_length, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @router.post("/detokenize")
    def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        _served(ctx, req.model)
        tok = tokenizer()
        vocab = ctx.model.vocab_size
        for i, t in enumerate(req.tokens):
            if t >= vocab:
                raise ApiError(400, f"token {i} = {t} is outside the vocabulary [0, {vocab})")
        return {"prompt": tok.decode(req.tokens)}

    @router.get("/tokenizer_info")
    def tokenizer_info() -> dict[str, Any]:
        """The served tokenizer's special tokens, chat template and context (vLLM's endpoint)."""
        tok = tokenizer()
        return {"tokenizer_class": type(tok).__name__, "model_max_length": ctx.model.max_length,
                "vocab_size": ctx.model.vocab_size,
                **{name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
                "chat_template": getattr(tok, "chat_template", None)}

    @router.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true")
        if req.echo:
            raise ApiError(400, "echo is not supported by /v1/chat/completions on this server")
        tok = tokenizer()
        shown, forced = tool_calls.chosen(req.tools, req.tool_choice)  # the tools the model sees, a call it must make
        ids = _chat_ids(tok, req.messages, req, tools=shown, trust_template=ctx.settings.trust_request_chat_template)
        if not ids:
            raise ApiError(400, "the conversation encodes to no tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ids = _truncated(req, ids, ctx.model.max_length, max_tokens if max_tokens is not None else ctx.settings.default_max_tokens)
        fmt = _call_format(tok, req, shown)
        thinks, opened, tags = _thinks(ctx, tok, ids, req)
        job = _Job(ctx, req, [ids], max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None, endpoint="chat",
                   owner=_owner(request),
                   tool_grammar=tool_calls.grammar(shown, forced, several=req.parallel_tool_calls is not False, tokenizer=tok, fmt=fmt),
                   stop_when=_first_call(fmt, thinks, opened, tags) if shown and req.parallel_tool_calls is False else None,
                   after_thinking=_after_thinking(tok, thinks, opened, tags))
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        metrics.completions.labels("chat", str(req.stream).lower()).inc()
        named = names(req)
        most_calls = 1 if req.parallel_tool_calls is False else None  # OpenAI's parallel_tool_calls: false

        def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None,
                  token_ids: list[int] | None = None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if req.return_token_ids:  # vLLM's: each chunk's new ids (the prompt's ride on the role chunks)
                choice["token_ids"] = token_ids or []
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": job.model_name,
                    "choices": [choice]}

        def message(out: TextResult, call_ids: list[str] = ()) -> tuple[dict[str, Any], str]:
            """The answer's message and finish reason: with tools shown, its calls parsed out (the
            first with ``call_ids``); ``tool_calls`` unless the answer was cut off."""
            finish = _finish_reason(out.stats.finish_reason)
            thought, text = reasoning.split(out.text, opened, tags) if thinks else (None, out.text)
            said = {"role": "assistant", **_thinking(thought if req.include_reasoning else None)}
            if not shown:
                return {**said, "content": text}, finish
            content, calls = tool_calls.parse(text or "", names=[t.function.name for t in shown], ids=call_ids, fmt=fmt)
            calls = calls[:most_calls]
            if not calls:
                return {**said, "content": text}, finish
            return {**said, "content": content, "tool_calls": calls}, "length" if finish == "length" else "tool_calls"

        def thought_tokens(out: TextResult) -> int:
            return reasoning.thinking_tokens(tok, out.token_ids, out.text, opened, skip_special_tokens=req.skip_special_tokens, tags=tags)

        counted = thought_tokens if thinks else None  # usage's reasoning_tokens

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            # with tools shown, content stops where a call may begin; each call goes out as it is written
            gates: dict[int, tool_calls.HeldContent] = {}  # per choice
            writers: dict[int, tool_calls.StreamedCalls] = {}  # per choice
            thinking: dict[int, reasoning.StreamedReasoning] = {}  # per choice, where the parser is on

            def call_chunks(index: int, events: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
                """OpenAI's tool-call deltas: the id and name with the first piece of the arguments, then the others."""
                out: list[dict[str, Any]] = []
                for kind, k, *what in events:
                    if kind == "added":
                        call_id, name = what
                        delta = {"index": k, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
                        out.append(chunk(index, {"tool_calls": [delta]}, None))
                    elif kind == "delta":
                        last = out[-1]["choices"][0]["delta"]["tool_calls"][0] if out else None
                        if last is not None and last["index"] == k and last["function"]["arguments"] == "":
                            last["function"]["arguments"] = what[0]  # the call's first piece goes with its name
                        else:
                            out.append(chunk(index, {"tool_calls": [{"index": k, "function": {"arguments": what[0]}}]}, None))
                return out

            def streamed(index: int, piece: TextPiece) -> list[dict[str, Any]] | dict[str, Any] | None:
                lps = _chat_logprobs(named, piece.token_ids, piece.logprobs)
                if lps is not None and not lps["content"]:  # an end-of-turn token alone
                    lps = None
                text, token_ids = piece.text, piece.token_ids
                said: list[dict[str, Any]] = []
                if thinks:  # its thinking first, with the piece's entries and ids; the rest as content
                    thought, text = thinking.setdefault(index, reasoning.StreamedReasoning(opened, tags)).feed(text)
                    if thought and req.include_reasoning:
                        said.append(chunk(index, _thinking(thought), None, lps, token_ids))
                        lps, token_ids = None, []
                    if not text and not lps and not token_ids:
                        return said or None
                if shown:
                    gate = gates.setdefault(index, tool_calls.HeldContent(fmt))
                    sent = gate.feed(text, lps["content"] if lps is not None else None, token_ids)
                    calls = call_chunks(index, writers.setdefault(index, tool_calls.StreamedCalls(most_calls, fmt)).feed(gate.text))
                    if sent is None:
                        return [*said, *calls] or None
                    text, entries, token_ids = sent
                    lps = {"content": entries, "refusal": None} if entries is not None else None
                    return [*said, chunk(index, {"content": text}, None, lps, token_ids), *calls]
                if text or lps is not None or (req.return_token_ids and token_ids):
                    return [*said, chunk(index, {"content": text}, None, lps, token_ids)]
                return said or None

            def head(index: int) -> list[dict[str, Any]]:
                opening = chunk(index, {"role": "assistant", "content": ""}, None)
                return [{**opening, "prompt_token_ids": ids} if req.return_token_ids else opening]

            def tail(index: int, out: TextResult) -> list[dict[str, Any]]:
                ends = []
                text = out.text
                if thinks:  # what the split still held back
                    thought, held = thinking.pop(index, reasoning.StreamedReasoning(opened, tags)).finish()
                    ends += [chunk(index, _thinking(thought), None)] if thought and req.include_reasoning else []
                    ends += [chunk(index, {"content": held}, None)] if held and not shown else []
                    text = reasoning.split(out.text, opened, tags)[1] or ""
                if not shown:
                    return [*ends, chunk(index, {}, message(out)[1])]
                writer = writers.pop(index, None) or tool_calls.StreamedCalls(most_calls, fmt)
                answer, finish = message(out, writer.ids)
                rest, pending, rest_ids = gates.pop(index, tool_calls.HeldContent(fmt)).rest(text, "tool_calls" in answer)
                lps = {"content": pending, "refusal": None} if pending is not None else None
                if rest or lps is not None or rest_ids:
                    ends.append(chunk(index, {"content": rest}, None, lps, rest_ids))
                ends += call_chunks(index, writer.finish(answer.get("tool_calls", [])))
                return [*ends, chunk(index, {}, finish)]

            return _stream(
                job,
                head=head,
                delta=streamed,
                tail=tail,
                usage=(lambda outs: {**chunk(0, {}, None), "choices": [], "usage": _usage(outs, len(ids), job.n, counted)})
                if include_usage else None,
                continuous_usage=include_usage and req.stream_options.continuous_usage_stats,  # type: ignore[union-attr]
            )
        outs = await _run_blocking(job, request)
        answers = [message(out) for out in outs]
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": job.model_name,
            "choices": [{"index": i, "message": answers[i][0],
                         "logprobs": _chat_logprobs(named, out.token_ids, out.logprobs),
                         "finish_reason": answers[i][1],
                         **({"token_ids": out.token_ids} if req.return_token_ids else {})}
                        for i, out in enumerate(outs)],
            "usage": _usage(outs, len(ids), job.n, counted),
            **({"prompt_logprobs": _vllm_prompt_logprobs(tok, ids, job.scores(0, job.prompt_logprobs))}
               if job.prompt_logprobs is not None else {}),
            **({"prompt_token_ids": ids} if req.return_token_ids else {}),
            "specdec": _stats(outs),
        }
        return JSONResponse(body, headers=job.headers)

    return router
