"""The HTTP server: the edge-cloud verify API plus OpenAI-compatible completions.

:func:`create_app` takes objects that are already loaded (a :class:`LanguageModel`, optionally a
tokenizer and a drafter factory), so tests can serve exact toy models and the ``serve`` command can
serve real ones.  Requests run in worker threads (plain ``def`` endpoints and executor jobs), so
the event loop stays responsive; their forward passes go to one scheduler that runs the pending
work of all requests as one batch (:mod:`specdec.server.scheduler`), or, with batching off, one
at a time under a lock.

Endpoints (all but ``/health`` and the OpenAPI document need ``Authorization: Bearer <key>`` when
the server has keys; the key is checked from the headers before any body is read, and a session
belongs to the key that created it; a keyless server answers only to loopback Host/Origin headers):

* ``GET /health``
* ``POST /v1/sessions`` -> session id; ``GET`` / ``DELETE /v1/sessions/{id}``
* ``POST /v1/sessions/{id}/verify`` -> verdict of one round (``seq`` makes it idempotent)
* ``GET /metrics`` (Prometheus text format)
* ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` via SSE)

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad
input; a bad request never changes a session.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec import __version__
from specdec.drafters.base import Drafter
from specdec.models.base import LanguageModel
from specdec.gamma import GammaMemory
from specdec.remote.protocol import (
    CreateSessionRequest,
    CreateSessionResponse,
    ErrorResponse,
    Health,
    SessionInfo,
    VerifyRequest,
    VerifyResponse,
)
from specdec.errors import ConfigError
from specdec.server.errors import ApiError, error_body
from specdec.server.metrics import ServerMetrics
from specdec.server.guard import OWNER, Guard
from specdec.server import memory
from specdec.server.draft_cap import CAPPED_WIRES, DraftCap, calibrate
from specdec.server.prefix_cache import PrefixCache, supports_prefix_cache
from specdec.server.scheduler import BatchedModel, Overloaded, PassStats, Scheduler, SchedulerMetrics
from specdec.server.compute import one_openmp_thread
from specdec.server.sessions import FORWARD_LOCK, SerializedModel, SessionStore, create_session, growth_bytes, served_digest
from specdec.server.settings import ServerSettings

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 408, 409, 413, 422, 429, 503)
}


@dataclass
class ServerContext:
    """Everything the endpoints share."""

    model: LanguageModel
    tokenizer: Any | None
    settings: ServerSettings
    eos_ids: frozenset[int]
    drafter_factory: Callable[[], Drafter | None] | None
    drafter_name: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    store: SessionStore = field(init=False)
    started: float = field(default_factory=time.time)

    #: the draft model behind its own scheduler, when the server batches drafts too (else None)
    draft_model: Any | None = None
    #: how many edge draft tokens a busy batched pass verifies (None: all; the serialised server)
    draft_cap: DraftCap | None = None
    #: γ auto across OpenAI requests: each starts from the last ended one's controller for its rule
    gamma_memory: GammaMemory = field(default_factory=GammaMemory)

    def __post_init__(self) -> None:
        self.store = SessionStore(self.settings, on_evict=self._evicted)
        #: the tokenizer's vocabulary fingerprint, computed once here (edge sessions are checked against it)
        self.vocab_digest = served_digest(self.tokenizer)
        #: generation slots of the OpenAI endpoints and the worker threads that run them
        self.active = threading.BoundedSemaphore(self.settings.max_active_requests)
        #: of those, the ones a request's further choices may take (half: a request with many prompts
        #: never takes the slots other requests are admitted to)
        self.spare = threading.BoundedSemaphore(max(1, self.settings.max_active_requests // 2))
        self.executor = ThreadPoolExecutor(self.settings.max_active_requests, thread_name_prefix="specdec-generate",
                                           initializer=one_openmp_thread)
        probe = self.model.new_cache(1)
        #: KV bytes per position of one session (0 for models without a KV cache we can measure)
        self.kv_per_position = int(getattr(probe, "bytes_per_position", 0))
        #: the same for the draft model an OpenAI request drafts with on the server (0: none)
        draft_probe = self.draft_model.new_cache(1) if self.draft_model is not None else None
        self.draft_kv_per_position = int(getattr(draft_probe, "bytes_per_position", 0))
        from specdec.server.responses_api import ResponseStore

        #: the Responses API's stored responses (``store``, ``previous_response_id``)
        self.responses = ResponseStore()
        #: requests in flight on the OpenAI endpoints: each one's way to end early (see :meth:`abort_requests`)
        self.live: set[Callable[[], None]] = set()

    def abort_requests(self) -> int:
        """End every request in flight: its generation stops, a stream sends an error event and
        [DONE], a plain request answers 503 (a stopping server's grace period is over).  Returns
        how many there were.  Runs on the event loop's thread."""
        aborts = list(self.live)
        for abort in aborts:
            abort()
        return len(aborts)

    @functools.cached_property
    def token_bytes(self) -> Any:
        """Each token's own bytes (:class:`specdec.tokenizer.TokenBytes`; logprobs' ``bytes``)."""
        from specdec.tokenizer import TokenBytes

        return TokenBytes(self.tokenizer)

    @functools.cached_property
    def reasoning_on(self) -> bool:
        """Whether chat answers' thinking is split from their content (:mod:`specdec.server.reasoning`)."""
        from specdec.server.reasoning import parser_on

        return self.tokenizer is not None and parser_on(self.settings.reasoning_parser, self.tokenizer)

    @functools.cached_property
    def reasoning_tags(self) -> Any:
        """The thinking block's tags, read off the tokenizer once (:func:`specdec.server.reasoning.tags_of`)."""
        from specdec.server.reasoning import THINK, tags_of

        return tags_of(self.tokenizer) if self.tokenizer is not None else THINK

    def _evicted(self, reason: str) -> None:
        self.metrics.sessions_evicted.labels(reason).inc()


def error_response(status: int, message: str, kind: str, metrics: ServerMetrics | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.http_errors.labels(str(status)).inc()
    return JSONResponse(error_body(message, kind, status, param), status_code=status, headers=headers)


def _validation_param(exc: RequestValidationError) -> str | None:
    """The field the first schema error is about (``"temperature"``, ``"messages.0.role"``), if any."""
    errors = exc.errors()
    loc = ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") if errors else ""
    return loc or None


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return "invalid request: the body must be a JSON object (send Content-Type: application/json)"
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with a 413 before the app sees them,
    and bodies that trickle in (no part within ``timeout_s`` seconds) with a 408."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, max_bytes: int, metrics: ServerMetrics,
                 timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def _reject(self, scope: dict, receive: Callable, send: Callable, size: str) -> None:
        message = f"request body {size} is over this server's limit of {self.max_bytes} bytes"
        await error_response(413, message, "request_too_large", self.metrics)(scope, receive, send)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._reject(scope, receive, send, f"of {declared} bytes")
                    return
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {self.timeout_s:g} s"
                await error_response(408, message, "timeout", self.metrics, {"Connection": "close"})(scope, receive, send)
                return
            if message["type"] != "http.request":  # client went away
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(scope, receive, send, "of more")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def serving_model(model: LanguageModel, settings: ServerSettings, metrics: ServerMetrics) -> LanguageModel:
    """``model`` behind the batching scheduler (or, with ``batching=False``, behind one lock), with
    a prefix cache in front of its prefills where that is exact."""
    inner = model.inner if isinstance(model, (SerializedModel, BatchedModel)) else model
    prefix = None
    if settings.prefix_cache_bytes > 0 and supports_prefix_cache(inner):
        prefix = PrefixCache(settings.prefix_cache_bytes, on_reuse=metrics.prefix_reused.inc)
    lock = model.lock if isinstance(model, SerializedModel) else FORWARD_LOCK
    if settings.max_model_len is not None and settings.max_model_len > inner.max_length:
        raise ConfigError(f"--max-model-len {settings.max_model_len} is longer than the model's context ({inner.max_length})")
    if not settings.batching:
        served = SerializedModel(inner, lock, initial_length=settings.kv_initial_length, prefix_cache=prefix)
    else:
        scheduler_metrics = SchedulerMetrics(metrics.registry)
        # the forward lock: wrappers that run the target's weights outside the scheduler (the serialised
        # self-speculative views) then never overlap its batches
        scheduler = Scheduler(inner, settings.scheduler_config(), on_pass=scheduler_metrics.observer("target"),
                              name="target", lock=lock)
        scheduler.metrics = scheduler_metrics
        served = BatchedModel(inner, scheduler, initial_length=settings.kv_initial_length, prefix_cache=prefix)
    if settings.max_model_len is not None:  # every request and session sizes itself from this
        served.max_length = settings.max_model_len
    return served


def precision(model: Any) -> str | None:
    """How the served target computes: "int8 (KERNEL)" for an int8 native target, else its dtype;
    ", float16 cache" after it where its keys and values are held in float16 (``--kv-dtype``)."""
    quant, kernel = getattr(model, "quant", None), getattr(model, "int8_kernel", None)
    kv = getattr(model, "kv_dtype", None)
    cache = f", {str(kv).removeprefix('torch.')} cache" if kv is not None and str(kv).startswith("torch.") else ""
    if quant:
        return (f"{quant} ({kernel})" if kernel else str(quant)) + cache
    dtype = getattr(model, "dtype", None)
    return str(dtype).removeprefix("torch.") + cache if dtype is not None else None


def create_app(
    model: LanguageModel,
    *,
    tokenizer: Any | None = None,
    settings: ServerSettings | None = None,
    eos_ids: frozenset[int] = frozenset(),
    drafter_factory: Callable[[], Drafter | None] | None = None,
    drafter_name: str = "none",
    draft_model: Any | None = None,
) -> FastAPI:
    """The ASGI app serving ``model`` (the target).

    ``tokenizer`` enables text prompts and the OpenAI endpoints; ``drafter_factory`` makes a fresh
    drafter for each OpenAI request (speculative decoding on the server itself; ``None`` = plain
    decoding).  Draft models should be wrapped with :func:`specdec.server.sessions.serialized`.
    """
    settings = settings or ServerSettings()
    metrics = ServerMetrics()
    served = serving_model(model, settings, metrics)
    draft_cap = None
    if isinstance(served, BatchedModel):
        if isinstance(draft_model, BatchedModel):  # the draft's passes too
            draft_model.scheduler.metrics = served.scheduler.metrics
            draft_model.scheduler.on_pass = served.scheduler.metrics.observer(draft_model.scheduler.name)
        if settings.draft_cap:
            draft_cap = DraftCap(costs=calibrate(served.inner))  # before the scheduler runs anything
            observe = served.scheduler.on_pass

            def on_pass(stats: PassStats) -> None:
                observe(stats)
                draft_cap.observe_pass(stats.tokens, stats.seconds)

            served.scheduler.on_pass = on_pass
            if isinstance(draft_model, BatchedModel):  # the server's own drafting costs rows too
                observe_draft = draft_model.scheduler.on_pass

                def on_draft_pass(stats: PassStats) -> None:
                    observe_draft(stats)
                    draft_cap.observe_draft_pass(stats.tokens, stats.seconds)

                draft_model.scheduler.on_pass = on_draft_pass
    ctx = ServerContext(
        model=served,
        metrics=metrics,
        tokenizer=tokenizer,
        settings=settings,
        eos_ids=eos_ids,
        drafter_factory=drafter_factory,
        drafter_name=drafter_name,
        draft_model=draft_model,
        draft_cap=draft_cap,
    )
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        """Sweep idle sessions on a timer (not only when requests arrive), then hand the heap's
        free pages back to the OS (see :mod:`specdec.server.memory`)."""

        async def sweeper() -> None:
            loop = asyncio.get_running_loop()
            while True:
                await asyncio.sleep(settings.sweep_interval_s)
                await loop.run_in_executor(None, ctx.store.sweep)
                ctx.metrics.active_sessions.set(len(ctx.store))
                await loop.run_in_executor(None, memory.release_free_memory)

        import anyio.to_thread

        # plain endpoints run in worker threads that wait for the scheduler: one per busy session
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, settings.max_sessions + settings.max_active_requests + 8)
        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(
        lifespan=lifespan,
        title="specdec",
        version=__version__,
        description="Lossless speculative decoding: edge-cloud verify API and OpenAI-compatible completions.",
    )
    app.state.ctx = ctx
    store = ctx.store

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, metrics, exc.headers, exc.param)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        err = ApiError(503, f"{exc}; retry later")
        return error_response(503, err.message, err.kind, metrics, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # the OpenAI endpoints (and vLLM's /tokenize, /detokenize) answer a bad request as OpenAI and
        # vLLM do (400: an OpenAI client's BadRequestError); the edge-cloud session API keeps its documented 422
        status = 422 if request.url.path.startswith("/v1/sessions") else 400
        return error_response(status, _validation_message(exc), "invalid_request_error", metrics,
                              param=_validation_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no such endpoint: {request.method} {request.url.path}"
        return error_response(exc.status_code, detail, "invalid_request_error", metrics)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - a bug
        # a failed session round leaves its session as it was (:meth:`EdgeSession.verify` commits last)
        after = "; the session is unchanged" if request.url.path.startswith("/v1/sessions") else ""
        return error_response(500, f"internal error ({type(exc).__name__}){after}", "server_error", metrics)

    def owner(request: Request) -> str:
        """The caller's owner id, set by :class:`Guard` from its key (checked before the body was read)."""
        found = request.scope.get(OWNER)
        if found is None:  # pragma: no cover - the Guard middleware always sets it
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
        return found

    guarded = [Depends(owner)]
    session_path = Path(min_length=1, max_length=128, description="the id POST /v1/sessions returned")

    @app.get("/health", response_model=Health)
    def health() -> Health:
        store.sweep()
        return Health(model=settings.model_name, vocab_size=ctx.model.vocab_size, max_context=ctx.model.max_length,
                      sessions=len(store), precision=precision(ctx.model), vocab_digest=ctx.vocab_digest,
                      drafter=ctx.drafter_name if ctx.drafter_factory is not None else "none")

    @app.get("/version")
    def version() -> dict[str, str]:
        """The server's specdec version (vLLM's endpoint; open like /health)."""
        from specdec import __version__

        return {"version": __version__}

    @app.get("/metrics", dependencies=guarded if settings.metrics_need_key else [], response_class=Response, responses={401: {"model": ErrorResponse}})
    def prometheus() -> Response:
        store.sweep()
        metrics.active_sessions.set(len(store))
        prefix = getattr(ctx.model, "prefix_cache", None)
        if prefix is not None:
            metrics.prefix_bytes.set(prefix.bytes)
        for model in (ctx.model, ctx.draft_model):  # what is queued now, not as the last pass began
            scheduler = getattr(model, "scheduler", None)
            if scheduler is not None and getattr(scheduler, "metrics", None) is not None:
                scheduler.metrics.queue.labels(scheduler.name).set(len(scheduler))
        return Response(content=metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/sessions", dependencies=guarded, response_model=CreateSessionResponse, status_code=201, responses=_ERRORS)
    def create(req: CreateSessionRequest, who: str = Depends(owner)) -> CreateSessionResponse:
        n = len(req.prompt_ids or ()) + len(req.generated_ids) or len(req.prompt or "") // 2
        store.reserve(who, ctx.kv_per_position * (max(n, settings.kv_initial_length) + 64))
        session, reply = create_session(req, ctx.model, ctx.tokenizer, settings, settings.session_id_prefix + secrets.token_urlsafe(16), owner=who)
        store.add(session)
        metrics.sessions_created.labels(session.wire).inc()
        metrics.active_sessions.set(len(store))
        return reply

    @app.get("/v1/sessions/{session_id}", dependencies=guarded, response_model=SessionInfo, responses=_ERRORS)
    def info(session_id: str = session_path, who: str = Depends(owner)) -> SessionInfo:
        return store.get(session_id, who).info()

    @app.delete("/v1/sessions/{session_id}", dependencies=guarded, responses=_ERRORS)
    def delete(session_id: str = session_path, who: str = Depends(owner)) -> dict[str, Any]:
        if not store.remove(session_id, who):
            raise ApiError(404, f"unknown session {session_id!r}")
        metrics.active_sessions.set(len(store))
        return {"session_id": session_id, "deleted": True}

    @app.post("/v1/sessions/{session_id}/verify", dependencies=guarded, response_model=VerifyResponse, responses=_ERRORS)
    def verify(req: VerifyRequest, session_id: str = session_path, who: str = Depends(owner)) -> VerifyResponse:
        store.sweep()
        session = store.get(session_id, who)
        started = time.perf_counter()
        with session.lock:
            new_positions = len(req.unverified_tokens) + len(req.draft_tokens) + 2
            store.ensure_kv(who, growth_bytes(session.target.cache, new_positions), busy=session.id)
            unverified_before = session.unverified
            cap = None
            if ctx.draft_cap is not None and req.parents is None and session.wire in CAPPED_WIRES:
                cap = ctx.draft_cap.cap(session.wire, wanted=len(req.draft_tokens))
            reply = session.verify(req, settings, draft_cap=cap)
            session.last_used = time.monotonic()
            unverified = session.unverified - unverified_before
        if reply.metrics.replayed:
            metrics.replays.inc()
        else:
            metrics.observe_verify(
                wire=session.wire, lossless=reply.metrics.lossless, gamma=reply.metrics.gamma,
                accepted=reply.num_accepted, emitted=len(reply.tokens), seconds=time.perf_counter() - started,
                unverified=unverified,
            )
            if ctx.draft_cap is not None:
                ctx.draft_cap.observe_tokens(len(reply.tokens))
                if reply.path is None:
                    ctx.draft_cap.observe_round(session.wire, reply.metrics.gamma, reply.num_accepted)
        return reply

    from specdec.server.openai_api import openai_router
    from specdec.server.responses_api import responses_router

    app.include_router(openai_router(ctx), dependencies=guarded)
    app.include_router(responses_router(ctx), dependencies=guarded)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, metrics=metrics, timeout_s=settings.body_timeout_s)
    app.add_middleware(Guard, keys=settings.keys, allowed_hosts=settings.allowed_hosts,
                       on_error=lambda status: metrics.http_errors.labels(str(status)).inc(),
                       open_metrics=not settings.metrics_need_key)
    return app
