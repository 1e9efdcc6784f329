"""OpenAI-compatible ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

Served by speculative decoding on the server itself (:class:`specdec.engine.Engine` with a local
drafter from the app's drafter factory).  Parameters the engine cannot honour (``n > 1``,
``logprobs``, ``echo``, ``logit_bias``, tools, ...) are refused with a 400/422 that names them,
never silently dropped.  Extensions: ``top_k``, ``min_p``, ``repetition_penalty``, ``method``
(verification rule) and ``gamma``; responses carry a ``specdec`` object with the run's stats.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from specdec import defaults
from specdec.engine import Engine, TextResult, default_method, parse_gamma
from specdec.errors import SpecdecError
from specdec.models.registry import LoadedModel
from specdec.sampling import SamplingConfig
from specdec.server.errors import ApiError
from specdec.server.scheduler import Cancelled as SchedulerCancelled
from specdec.verify import get_rule

if TYPE_CHECKING:
    from specdec.server.app import ServerContext

Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(max_length=256)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(max_length=256)] | Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    logit_bias: dict[str, Finite] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    seed: Annotated[int, Field(ge=0, le=(1 << 63) - 1)] | None = None
    # specdec extensions (the openai client sends them through extra_body)
    top_k: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] | None = None
    method: Annotated[str, Field(max_length=64)] | None = None
    gamma: Annotated[int, Field(ge=1, le=defaults.MAX_GAMMA)] | Literal["auto", "guide"] | None = None


class CompletionRequest(_Request):
    prompt: (
        Annotated[str, Field(max_length=1 << 22)]
        | Annotated[list[str], Field(min_length=1, max_length=128)]
        | Annotated[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]], Field(min_length=1, max_length=1 << 20)]
        | Annotated[list[list[Annotated[int, Field(ge=0, le=(1 << 31) - 1)]]], Field(min_length=1, max_length=128)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    suffix: Annotated[str, Field(max_length=1 << 16)] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Annotated[str, Field(max_length=1 << 22)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=1 << 22)] | Annotated[list[TextPart], Field(max_length=256)]
    name: Annotated[str, Field(max_length=256)] | None = None


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


# ----------------------------------------------------------------------------- helpers


class _Cancelled(Exception):
    """The streaming client went away: stop generating."""


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(out: TextResult) -> dict[str, int]:
    prompt, completion = len(out.prompt_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _stats(out: TextResult) -> dict[str, Any]:
    st = out.stats
    return {
        "method": st.method,
        "lossless": st.lossless,
        "drafter": st.drafter,
        "target_calls": st.target_calls,
        "tokens_per_target_call": st.tokens_per_target_call,
        "acceptance_rate": st.acceptance_rate,
        "wall_s": st.wall_s,
    }


class _Job:
    """One generation request, validated and ready to run in a worker thread."""

    def __init__(self, ctx: "ServerContext", req: _Request, ids: list[int], max_tokens: int | None) -> None:
        self.ctx = ctx
        model = ctx.model
        if req.model is not None and req.model != ctx.settings.model_name:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {ctx.settings.model_name!r}")
        if (req.n or 1) != 1:
            raise ApiError(400, "n > 1 is not supported; send one request per completion")
        if req.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server")
        for i, tok in enumerate(ids):
            if tok >= model.vocab_size:
                raise ApiError(400, f"prompt token {i} = {tok} is outside the vocabulary [0, {model.vocab_size})")
        room = model.max_length - len(ids) - 1
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context is {model.max_length}")
        if max_tokens is None:
            max_tokens = min(ctx.settings.default_max_tokens, room)
        if max_tokens > room:
            raise ApiError(
                400,
                f"the model's context is {model.max_length} tokens; the prompt has {len(ids)} and max_tokens asks for"
                f" {max_tokens} more (at most {room})",
            )
        stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
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
                max_new_tokens=max_tokens,
                stop=tuple(s for s in stops if s),
            )
            self.method = req.method or default_method(self.sampling)
            rule = get_rule(self.method)
            if rule.greedy_only and not self.sampling.greedy:
                raise ApiError(400, f"method {self.method!r} needs temperature 0")
            self.gamma = parse_gamma(req.gamma if req.gamma is not None else ctx.settings.gamma)
        except SpecdecError as exc:
            raise ApiError(400, str(exc)) from None
        self.ids = ids
        self.model_name = ctx.settings.model_name

    def run(self, on_text: Callable[[str], None] | None = None, cancelled: threading.Event | None = None) -> TextResult:
        """Generate (in a worker thread); ``cancelled`` also drops this request's queued forward passes."""
        ctx = self.ctx
        schedulers = [m.scheduler for m in (ctx.model, getattr(ctx, "draft_model", None)) if hasattr(m, "scheduler")]
        for sched in schedulers:
            sched.bind_cancel(cancelled)
        try:
            drafter = ctx.drafter_factory() if ctx.drafter_factory is not None else None
            target = LoadedModel(ctx.settings.model_name, ctx.model, ctx.tokenizer, None, "server", ctx.eos_ids)
            engine = Engine(target, drafter, ctx.drafter_name if drafter is not None else "none")
            out = engine.generate(self.ids, self.sampling, method=self.method, gamma=self.gamma, on_text=on_text)
        except SchedulerCancelled:
            raise _Cancelled from None
        finally:
            for sched in schedulers:
                sched.bind_cancel(None)
        ctx.metrics.completion_tokens.inc(len(out.token_ids))
        return out


def _admit(ctx: "ServerContext") -> None:
    """Take one of the server's generation slots or answer 429 (never an unbounded backlog)."""
    if not ctx.active.acquire(blocking=False):
        raise ApiError(429, f"this server is generating {ctx.settings.max_active_requests} completions already; retry later")


def _submit(ctx: "ServerContext", fn: Callable[[], Any]) -> "asyncio.Future[Any]":
    """Run ``fn`` on the generation pool; the slot taken by :func:`_admit` is given back when it ends."""

    def guarded() -> Any:
        try:
            return fn()
        finally:
            ctx.active.release()

    return asyncio.get_running_loop().run_in_executor(ctx.executor, guarded)


async def _run_blocking(job: _Job, request: Request | None = None) -> TextResult:
    """Run ``job`` in a worker thread; stop it as soon as the client disconnects (polled every 0.1 s)."""
    cancelled = threading.Event()

    def on_text(text: str) -> None:
        if cancelled.is_set():
            raise _Cancelled

    _admit(job.ctx)
    future = _submit(job.ctx, lambda: job.run(on_text, cancelled))
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.1)
            if done:
                return future.result()
            if request is not None and await request.is_disconnected():
                cancelled.set()
                raise ApiError(499, "the client closed the connection", kind="client_closed")
    except SpecdecError as exc:
        raise ApiError(400, str(exc)) from None
    except _Cancelled:
        raise ApiError(499, "the client closed the connection", kind="client_closed") from None
    finally:
        cancelled.set()  # also when this handler is cancelled


def _sse(payload: dict[str, Any] | str) -> str:
    import json

    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _stream(
    job: _Job,
    *,
    head: Callable[[], list[dict[str, Any]]],
    delta: Callable[[str], dict[str, Any]],
    tail: Callable[[TextResult], dict[str, Any]],
    usage: Callable[[TextResult], dict[str, Any]] | None,
) -> StreamingResponse:
    """Server-sent events: ``head`` chunks, one ``delta`` chunk per text piece, ``tail``, [usage], [DONE]."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def on_text(text: str) -> None:
        if cancelled.is_set():
            raise _Cancelled
        loop.call_soon_threadsafe(queue.put_nowait, ("text", text))

    def work() -> None:
        try:
            result = job.run(on_text, cancelled)
        except _Cancelled:
            return
        except SpecdecError as exc:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
            loop.call_soon_threadsafe(queue.put_nowait, ("error", f"internal error ({type(exc).__name__})"))
            return
        loop.call_soon_threadsafe(queue.put_nowait, ("done", result))

    _admit(job.ctx)
    started = False

    async def events() -> AsyncIterator[str]:
        nonlocal started
        started = True
        _submit(job.ctx, work)
        try:
            for chunk in head():
                yield _sse(chunk)
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    yield _sse(delta(value))
                elif kind == "done":
                    yield _sse(tail(value))
                    if usage is not None:
                        yield _sse(usage(value))
                    break
                else:
                    yield _sse({"error": {"message": value, "type": "invalid_request_error", "code": 400}})
                    break
            yield _sse("[DONE]")
        finally:
            cancelled.set()

    body = events()

    def release_if_never_started() -> None:  # the client left before the body was sent
        if not started:
            job.ctx.active.release()

    weakref.finalize(body, release_if_never_started)
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ----------------------------------------------------------------------------- endpoints


def openai_router(ctx: "ServerContext") -> APIRouter:
    router = APIRouter()
    metrics = ctx.metrics

    def tokenizer() -> Any:
        if ctx.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer, so it cannot serve text completions")
        return ctx.tokenizer

    @router.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": ctx.settings.model_name, "object": "model", "created": int(ctx.started), "owned_by": "specdec"}],
        }

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        if req.echo:
            raise ApiError(400, "echo is not supported by this server")
        if req.logprobs is not None:
            raise ApiError(400, "logprobs are not supported by this server")
        if (req.best_of or 1) != 1:
            raise ApiError(400, "best_of > 1 is not supported by this server")
        if req.suffix:
            raise ApiError(400, "suffix is not supported by this server")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (a list of prompts is not supported)")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty")
            ids = list(tokenizer().encode(prompt, add_special_tokens=False))
        else:
            ids = list(prompt)  # type: ignore[arg-type]
        if not ids:
            raise ApiError(400, "the prompt is empty")
        job = _Job(ctx, req, ids, req.max_tokens if req.max_tokens is not None else 16)
        tokenizer()  # the text of the answer needs it
        cid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        metrics.completions.labels("completions", str(req.stream).lower()).inc()

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": created, "model": job.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _stream(
                job,
                head=lambda: [],
                delta=lambda text: chunk(text, None),
                tail=lambda out: chunk("", _finish_reason(out.stats.finish_reason)),
                usage=(lambda out: {**chunk("", None), "choices": [], "usage": _usage(out)}) if include_usage else None,
            )
        out = await _run_blocking(job, request)
        body = chunk(out.text, _finish_reason(out.stats.finish_reason))
        return {**body, "usage": _usage(out), "specdec": _stats(out)}

    @router.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported by this server")
        tok = tokenizer()
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        messages = [
            {"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
            for m in req.messages
        ]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise ApiError(400, f"the chat template rejected the messages: {exc}") from None
        ids = list(tok.encode(text, add_special_tokens=False))
        if not ids:
            raise ApiError(400, "the conversation encodes to no tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = _Job(ctx, req, ids, max_tokens)
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        metrics.completions.labels("chat", str(req.stream).lower()).inc()

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": job.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return _stream(
                job,
                head=lambda: [chunk({"role": "assistant", "content": ""}, None)],
                delta=lambda text: chunk({"content": text}, None),
                tail=lambda out: chunk({}, _finish_reason(out.stats.finish_reason)),
                usage=(lambda out: {**chunk({}, None), "choices": [], "usage": _usage(out)}) if include_usage else None,
            )
        out = await _run_blocking(job, request)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": job.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                         "finish_reason": _finish_reason(out.stats.finish_reason)}],
            "usage": _usage(out),
            "specdec": _stats(out),
        }

    return router


