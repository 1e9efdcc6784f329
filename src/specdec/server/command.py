"""``specdec serve``: load the models, build the app, run uvicorn.

Argument parsing stays import-light; FastAPI, uvicorn and the models load only when the command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from typing import Any, Callable

from specdec import defaults
from specdec.errors import ConfigError, MissingPackageError, SpecdecError

API_KEY_ENV = "SPECDEC_API_KEY"


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_parser(sub: Any) -> None:
    from specdec.cli import _add_models

    p = sub.add_parser(
        "serve",
        help="serve a target model over HTTP (edge-cloud verify API + OpenAI-compatible completions)",
        description=(
            "Serve the target: edges create sessions and send drafts to /v1/sessions/{id}/verify; OpenAI "
            "clients use /v1/completions, /v1/chat/completions and /v1/responses (the last two with tools too; speculative decoding with the local "
            f"--draft). Every endpoint but /health, /version, /metrics (see --metrics-need-key), /openapi.json and /docs needs 'Authorization: Bearer KEY' when a key is set "
            f"(--api-key or ${API_KEY_ENV}); a non-loopback --host needs a key."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help=f"bearer token clients must send (default: ${API_KEY_ENV})")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="file of accepted keys, one per line ('#' comments); each session belongs to the key that made it")
    p.add_argument("--metrics-need-key", action="store_true", help="require the API key on /metrics too (default: /metrics is open for scrapers)")
    _add_models(p)
    m = p.add_argument_group("what clients see (vLLM's spellings)")
    m.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names the OpenAI endpoints answer to; responses carry the first (default: the --target name)")
    m.add_argument("--max-model-len", type=int, metavar="N",
                   help="longest context (prompt + output) a request or edge session may use, at most the model's own"
                        " (default: the model's own)")
    m.add_argument("--chat-template", metavar="PATH|TEMPLATE",
                   help="render chat conversations with this Jinja template (a file, or the template itself) instead"
                        " of the model's")
    m.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request's own chat_template (vLLM's extension) render its conversation instead of"
                        " the model's (off by default, as in vLLM: a template is code the server runs, in Jinja's sandbox)")
    m.add_argument("--reasoning-parser", choices=("auto", "think", "none"), default="auto",
                   help="a reasoning model's <think> ... </think> goes to the chat message's 'reasoning' (and"
                        " 'reasoning_content'), the rest to 'content', streamed as such: 'think' on, 'none' off,"
                        " 'auto' on where the tokenizer has both tags as tokens of their own, as DeepSeek-R1's"
                        " distillations and Qwen3 do (default auto)")
    g = p.add_argument_group("limits")
    g.add_argument("--max-sessions", type=int, default=64, help="edge sessions held at once; the least recently used idle one is evicted past this (default 64)")
    g.add_argument("--session-ttl", type=float, default=900.0, help="seconds an idle session is kept (default 900)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted (default 1 MiB)")
    g.add_argument("--max-gamma", type=int, default=defaults.MAX_GAMMA, help="longest draft (tokens, or tree nodes) of one verification round, from 1 to "
                   f"{defaults.MAX_GAMMA}: what an edge client may send through the session API (`specdec generate --remote` "
                   "drafts no more), and what the OpenAI endpoints draft: a request's gamma or tree above it is a 400, "
                   f"gamma and tree 'auto' stay at or below it (default {defaults.MAX_GAMMA})")
    g.add_argument("--gamma", default=defaults.DEFAULT_GAMMA, help=f"draft length for the OpenAI endpoints: an integer from 1 to {defaults.MAX_GAMMA}, 'auto' or 'guide' (default auto)")
    g.add_argument("--tree", default=defaults.DEFAULT_TREE,
                   help="token trees for the OpenAI endpoints (a request's 'tree' field overrides it): 'chain' (default: one "
                        f"candidate per position), 'auto' (node budget from measured cost and acceptance) or a node count N from 1 to {defaults.MAX_TREE_NODES}. "
                        "A tree's target pass runs between the batched passes, not inside them: for a lightly loaded server")
    g.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a chat request that gives none (default 256)")
    g.add_argument("--max-kv-mib", type=float, default=defaults.SERVER_MAX_KV_BYTES / 2**20,
                   help=f"KV cache memory all sessions and OpenAI requests together may hold, MiB (default {defaults.SERVER_MAX_KV_BYTES >> 20})")
    g.add_argument("--prefix-cache-mib", type=float, default=defaults.SERVER_PREFIX_CACHE_BYTES / 2**20,
                   help="memory for the keys/values of prompt beginnings seen more than once (chat template, system"
                        " message, earlier turns), which later prompts copy instead of computing again; exact, so only"
                        f" for batch-invariant targets; 0 turns it off (default {defaults.SERVER_PREFIX_CACHE_BYTES >> 20})")
    g.add_argument("--header-timeout", type=float, default=defaults.SERVER_HEADER_TIMEOUT_S,
                   help=f"seconds a client may take to send its request headers (default {defaults.SERVER_HEADER_TIMEOUT_S:g})")
    g.add_argument("--body-timeout", type=float, default=defaults.SERVER_BODY_TIMEOUT_S,
                   help=f"seconds a client may pause while sending a body (default {defaults.SERVER_BODY_TIMEOUT_S:g})")
    g.add_argument("--shutdown-timeout", type=float, default=defaults.SERVER_SHUTDOWN_TIMEOUT_S,
                   help="on Ctrl-C or SIGTERM the server takes no new connections and gives requests in flight this"
                        " many seconds to finish; then each ends with an error (a stream: an error event and [DONE]);"
                        f" a second signal stops at once (default {defaults.SERVER_SHUTDOWN_TIMEOUT_S:g})")
    g.add_argument("--max-connections", type=int, default=defaults.SERVER_MAX_CONNECTIONS,
                   help=f"connections served at once; more are answered 503 (default {defaults.SERVER_MAX_CONNECTIONS})")
    b = p.add_argument_group("batching")
    b.add_argument("--no-batching", action="store_true",
                   help="run one request's forward pass at a time under a lock (the serialised server; for comparisons)")
    b.add_argument("--no-draft-cap", action="store_true",
                   help="verify every edge draft token even when the batch is busy (default: only the positions whose"
                        " measured acceptance is worth a row of the pass; lossless either way)")
    b.add_argument("--max-tokens-per-pass", type=int, default=defaults.SCHEDULER_MAX_TOKENS,
                   help=f"rows (tokens) of all requests in one forward pass (default {defaults.SCHEDULER_MAX_TOKENS})")
    b.add_argument("--prefill-chunk", type=int, default=defaults.SCHEDULER_PREFILL_CHUNK,
                   help=f"longest piece of one prompt per pass (default {defaults.SCHEDULER_PREFILL_CHUNK})")
    b.add_argument("--max-queue", type=int, default=defaults.SCHEDULER_MAX_QUEUE,
                   help=f"forward passes waiting at most; more are answered 503 (default {defaults.SCHEDULER_MAX_QUEUE})")
    b.add_argument("--gather-gap-ms", type=float, default=defaults.SCHEDULER_GATHER_GAP_S * 1e3,
                   help="before a pass, wait for the sequences the last pass finished while they keep coming back,"
                        " at most this many ms after the latest and never longer than the last pass took; 0 starts"
                        f" each pass at once (default {defaults.SCHEDULER_GATHER_GAP_S * 1e3:g})")
    b.add_argument("--max-active-requests", type=int, default=defaults.SERVER_MAX_ACTIVE_REQUESTS,
                   help=f"OpenAI completions generating at once; more are answered 429 (default {defaults.SERVER_MAX_ACTIVE_REQUESTS})")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without a key, also answer to this Host name (loopback names always work); repeatable")
    r = p.add_argument_group("scale-out (Ray Serve; needs the 'ray' extra)")
    r.add_argument("--ray", action="store_true",
                   help="run --replicas verifier replicas on Ray Serve behind one HTTP gateway; edge sessions stay on their replica")
    r.add_argument("--replicas", type=int, default=defaults.RAY_REPLICAS, help=f"verifier replicas with --ray (default {defaults.RAY_REPLICAS})")
    r.add_argument("--replica-cpus", type=float, default=defaults.RAY_REPLICA_CPUS,
                   help=f"CPUs Ray reserves for each replica (default {defaults.RAY_REPLICA_CPUS:g})")
    r.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster to join ('auto', or HOST:PORT); default: start a local Ray instance")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn log level (default warning)")


def draft_server_model(engine: Any, *, batching: bool, prefix_cache_bytes: int = 0) -> Any | None:
    """The draft model as the server shares it: behind its own batching scheduler, or a lock, with
    its own prefix cache where it is batch-invariant (room for the positions ``prefix_cache_bytes``
    holds of the target's: :func:`specdec.server.prefix_cache.draft_prefix_cache`)."""
    if engine.drafter is None or engine.draft_model is None:
        return None
    target = engine.target.model if prefix_cache_bytes > 0 else None
    return served_draft(engine.draft_model.model, target, batching=batching, prefix_cache_bytes=prefix_cache_bytes)


def served_draft(model: Any, target: Any | None, *, batching: bool, prefix_cache_bytes: int = 0) -> Any:
    """``model`` (a draft) wrapped for the server; see :func:`draft_server_model`."""
    from specdec.server.prefix_cache import draft_prefix_cache
    from specdec.server.scheduler import BatchedModel, Scheduler
    from specdec.server.sessions import serialized

    prefix = draft_prefix_cache(target, model, prefix_cache_bytes) if target is not None else None
    if not batching:
        return serialized(model, prefix_cache=prefix)
    return BatchedModel(model, Scheduler(model, name="draft"), initial_length=defaults.SERVER_KV_INITIAL_LENGTH,
                        prefix_cache=prefix)


def drafter_factory(engine: Any, draft_model: Any | None = None) -> Callable[[], Any] | None:
    """A fresh drafter per OpenAI request (drafters keep per-sequence state), sampling at the
    engine's drafter's temperature factor."""
    from specdec.drafters.base import temperature_factor

    make = _fresh_drafter(engine, draft_model)
    factor = temperature_factor(engine.drafter)
    if make is None or factor == 1.0:
        return make

    def calibrated() -> Any:
        drafter = make()
        drafter.temperature_factor = factor
        return drafter

    return calibrated


def _fresh_drafter(engine: Any, draft_model: Any | None) -> Callable[[], Any] | None:
    from specdec.drafters import ModelDrafter, NgramDrafter
    from specdec.drafters.hybrid import LookupThenModel
    from specdec.server.sessions import serialized

    if engine.drafter is None:
        return None
    if engine.draft_model is not None:
        from specdec.drafters.fed import FedDrafter

        inner = engine.drafter.model if isinstance(engine.drafter, LookupThenModel) else engine.drafter
        if isinstance(inner, FedDrafter):
            raise ConfigError(f"--draft {engine.drafter_name}: a fed draft runs with generate and bench; the server's "
                              "batched draft passes do not carry its features")
        model = draft_model if draft_model is not None else serialized(engine.draft_model.model)
        if isinstance(engine.drafter, LookupThenModel):  # DRAFT+lookup
            return lambda: LookupThenModel(ModelDrafter(model, lazy_prefill=True))
        return lambda: ModelDrafter(model, lazy_prefill=True)
    if isinstance(engine.drafter, LookupThenModel) and not hasattr(engine.drafter.model, "spawn"):
        raise ConfigError(f"the server cannot share the drafter {engine.drafter_name!r} between requests")
    spawn = getattr(engine.drafter, "spawn", None)  # a self-speculative view of the target (+lookup)
    if spawn is not None:
        return lambda: spawn(serialized)
    return lambda: NgramDrafter(max_ngram=defaults.NGRAM_MAX, min_ngram=defaults.NGRAM_MIN)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Check the ``serve`` options and turn them into :class:`ServerSettings` keywords (no models loaded)."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise ConfigError("the API key is empty")
    from specdec.server.runner import read_key_file

    more_keys = read_key_file(args.api_key_file) if args.api_key_file else ()
    if key is None and more_keys:
        key, more_keys = more_keys[0], more_keys[1:]
    if not is_loopback(args.host) and key is None:
        raise ConfigError(
            f"refusing to listen on {args.host} without an API key: pass --api-key or set {API_KEY_ENV}"
            " (only loopback addresses may run without one)"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port must be between 0 and 65535, got {args.port}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MissingPackageError(f"serving needs the 'serve' extra ({exc.name} is missing): pip install 'specdec[serve]'") from None
    from specdec.engine import parse_gamma, parse_tree
    from specdec.server.settings import ServerSettings

    # sizes in MiB become bytes below: a NaN or infinite one would fail that conversion with a traceback
    for flag, mib, low in (("--max-kv-mib", args.max_kv_mib, "> 0"), ("--prefix-cache-mib", args.prefix_cache_mib, ">= 0")):
        if not math.isfinite(mib) or mib < 0 or (low == "> 0" and int(mib * 2**20) < 1):
            raise ConfigError(f"{flag} must be a finite number {low}" + (" (0 turns prefix caching off)" if low == ">= 0" else "")
                              + f", got {mib:g}")
    settings_kw: dict[str, Any] = dict(
        api_key=key,
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        max_body_bytes=args.max_body_bytes,
        max_gamma=args.max_gamma,
        gamma=parse_gamma(args.gamma),
        tree=parse_tree(args.tree),
        default_max_tokens=args.default_max_tokens,
        api_keys=more_keys,
        max_kv_bytes=int(args.max_kv_mib * 2**20),
        prefix_cache_bytes=int(args.prefix_cache_mib * 2**20),
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        allowed_hosts=tuple(args.allowed_host),
        batching=not args.no_batching,
        draft_cap=not args.no_draft_cap,
        max_tokens_per_pass=args.max_tokens_per_pass,
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        gather_gap_s=args.gather_gap_ms / 1e3,
        max_active_requests=args.max_active_requests,
        metrics_need_key=args.metrics_need_key,
        max_model_len=getattr(args, "max_model_len", None),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        reasoning_parser=getattr(args, "reasoning_parser", "auto"),
    )
    names = getattr(args, "served_model_name", None)
    if names:
        settings_kw.update(model_name=names[0], model_aliases=tuple(names[1:]))
    if getattr(args, "chat_template", None) is not None:
        from specdec.tokenizer import read_chat_template

        read_chat_template(args.chat_template)  # a bad template fails before any model loads
    if args.max_connections < 1:
        raise ConfigError(f"max connections must be >= 1, got {args.max_connections}")
    if getattr(args, "replicas", 1) < 1:
        raise ConfigError(f"replicas must be >= 1, got {args.replicas}")
    if not getattr(args, "replica_cpus", 1.0) > 0:
        raise ConfigError(f"replica CPUs must be > 0, got {args.replica_cpus}")
    ServerSettings(**settings_kw)  # check the limits before loading models
    from specdec.engine import parse_temperature_factor

    parse_temperature_factor(getattr(args, "draft_temperature_factor", "auto"))
    if args.port and not getattr(args, "ray", False):  # last: every other setting is checked first
        _check_port(args.host, args.port)
    return settings_kw


def _check_port(host: str, port: int) -> None:
    """Fail before any model loads where ``host:port`` cannot be listened on (taken, or not an
    address of this machine) -- rather than after loading, with the server's own traceback."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
        try:
            sock.bind(addr)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _log(msg: str) -> None:
    print(f"[specdec] {msg}", file=sys.stderr, flush=True)


def build_app(args: argparse.Namespace, settings_kw: dict[str, Any]) -> Any:
    """Load the models named by ``args`` and build the serving app (one process, or one Ray
    replica), on the compute thread that will run their passes (:mod:`specdec.server.compute`)."""
    from specdec.server.compute import COMPUTE

    return COMPUTE.run(_build_app, args, settings_kw)


def _build_app(args: argparse.Namespace, settings_kw: dict[str, Any]) -> Any:
    from specdec.engine import Engine, EngineConfig, drafts_chains_only
    from specdec.server.app import create_app
    from specdec.server.settings import ServerSettings
    from specdec.tokenizer import read_chat_template

    template = getattr(args, "chat_template", None)
    engine = Engine.build(
        EngineConfig(target=args.target, draft=args.draft, backend=args.backend, dtype=args.dtype,
                     draft_dtype=args.draft_dtype, draft_vocab=getattr(args, "draft_vocab", "auto"),
                     draft_temperature_factor=getattr(args, "draft_temperature_factor", "auto"), int8_kernel=getattr(args, "int8_kernel", "auto"),
                     kv_dtype=getattr(args, "kv_dtype", "auto"),
                     chat_template=read_chat_template(template) if template is not None else None),
        progress=_log,
    )
    settings = ServerSettings(**{"model_name": engine.target.name, **settings_kw})
    if drafts_chains_only(engine.drafter):  # as `generate --tree` says it; a request's tree would be silently a chain
        asked = f" (--tree {args.tree} is not used)" if settings.tree != "chain" else ""
        _log(f"the drafter {engine.drafter_name} has no tree pass: it drafts chains{asked}, and so do requests that ask for a tree")
    draft = draft_server_model(engine, batching=settings.batching, prefix_cache_bytes=settings.prefix_cache_bytes)
    return create_app(
        engine.target.model,
        tokenizer=engine.target.tokenizer,
        settings=settings,
        eos_ids=engine.target.eos_ids,
        drafter_factory=drafter_factory(engine, draft),
        drafter_name=engine.drafter_name,
        draft_model=draft,
    )


def run_ray(args: argparse.Namespace, settings_kw: dict[str, Any]) -> int:
    """``serve --ray``: ``--replicas`` verifier replicas on Ray Serve behind one HTTP gateway."""
    from specdec.server import scaleout

    scaleout.require_ray()
    n_keys = len(settings_kw["api_keys"]) + (settings_kw["api_key"] is not None)
    auth = "bearer key required" if n_keys else "no key (loopback only)"
    where = args.ray_address or "a local Ray instance"
    _log(f"serving {args.target} on {args.replicas} Ray Serve replicas ({where}) at http://{args.host}:{args.port} ({auth})")
    scaleout.start(scaleout.EngineApp(args, settings_kw), replicas=args.replicas, host=args.host, port=args.port,
                   address=args.ray_address, replica_cpus=args.replica_cpus, blocking=True, log=_log)
    return 0


def run(args: argparse.Namespace) -> int:
    settings_kw = settings_from_args(args)
    if getattr(args, "ray", False):
        return run_ray(args, settings_kw)
    from specdec.server.runner import serve

    key = settings_kw["api_key"]
    app = build_app(args, settings_kw)
    settings = app.state.ctx.settings
    n_keys = len(settings.keys)
    auth = (f"bearer key required ({n_keys} keys)" if n_keys > 1 else "bearer key required") if key else "no key (loopback only)"
    from specdec.server.app import precision

    numerics = precision(app.state.ctx.model)
    _log(f"serving {settings.model_name}{f' ({numerics})' if numerics else ''} (draft {app.state.ctx.drafter_name})"
         f" on http://{args.host}:{args.port} ({auth})")
    tokenizer = app.state.ctx.tokenizer
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        _log("this model has no chat template: chat requests get a 400 (start with --chat-template PATH|TEMPLATE to"
             " serve them); /v1/completions serves plain prompts")
    try:
        serve(app, host=args.host, port=args.port, log_level=args.log_level, header_timeout_s=args.header_timeout,
              limit_concurrency=args.max_connections)
    except OSError as exc:
        raise SpecdecError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0
