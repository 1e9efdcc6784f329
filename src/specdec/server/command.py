"""``specdec serve``: load the models, build the app, run uvicorn.

Argument parsing stays import-light; FastAPI, uvicorn and the models load only when the command runs.
"""

from __future__ import annotations

import argparse
import ipaddress
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
            "clients use /v1/completions and /v1/chat/completions (speculative decoding with the local "
            f"--draft). Every endpoint but /health needs 'Authorization: Bearer KEY' when a key is set "
            f"(--api-key or ${API_KEY_ENV}); a non-loopback --host needs a key."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help=f"bearer token clients must send (default: ${API_KEY_ENV})")
    _add_models(p)
    g = p.add_argument_group("limits")
    g.add_argument("--max-sessions", type=int, default=64, help="edge sessions held at once; the least recently used idle one is evicted past this (default 64)")
    g.add_argument("--session-ttl", type=float, default=900.0, help="seconds an idle session is kept (default 900)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted (default 1 MiB)")
    g.add_argument("--max-gamma", type=int, default=defaults.MAX_GAMMA, help=f"longest draft verified in one round (default {defaults.MAX_GAMMA})")
    g.add_argument("--gamma", default=defaults.DEFAULT_GAMMA, help="draft length for the OpenAI endpoints: integer, 'auto' or 'guide' (default auto)")
    g.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a chat request that gives none (default 256)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn log level (default warning)")


def drafter_factory(engine: Any) -> Callable[[], Any] | None:
    """A fresh drafter per OpenAI request (drafters keep per-sequence state)."""
    from specdec.drafters import ModelDrafter, NgramDrafter
    from specdec.server.sessions import serialized

    if engine.drafter is None:
        return None
    if engine.draft_model is not None:
        model = serialized(engine.draft_model.model)
        return lambda: ModelDrafter(model)
    spawn = getattr(engine.drafter, "spawn", None)  # a self-speculative view of the target
    if spawn is not None:
        return lambda: spawn(serialized)
    return lambda: NgramDrafter(max_ngram=defaults.NGRAM_MAX, min_ngram=defaults.NGRAM_MIN)


def run(args: argparse.Namespace) -> int:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise ConfigError("the API key is empty")
    if not is_loopback(args.host) and key is None:
        raise ConfigError(
            f"refusing to listen on {args.host} without an API key: pass --api-key or set {API_KEY_ENV}"
            " (only loopback addresses may run without one)"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port must be between 0 and 65535, got {args.port}")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise MissingPackageError(f"serving needs the 'serve' extra ({exc.name} is missing): pip install 'specdec[serve]'") from None
    from specdec.engine import Engine, EngineConfig, parse_gamma
    from specdec.server.app import create_app
    from specdec.server.settings import ServerSettings

    settings_kw = dict(
        api_key=key,
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        max_body_bytes=args.max_body_bytes,
        max_gamma=args.max_gamma,
        gamma=parse_gamma(args.gamma),
        default_max_tokens=args.default_max_tokens,
    )
    ServerSettings(**settings_kw)  # check the limits before loading models

    def log(msg: str) -> None:
        print(f"[specdec] {msg}", file=sys.stderr, flush=True)

    engine = Engine.build(
        EngineConfig(target=args.target, draft=args.draft, backend=args.backend, dtype=args.dtype, draft_dtype=args.draft_dtype),
        progress=log,
    )
    settings = ServerSettings(model_name=engine.target.name, **settings_kw)
    app = create_app(
        engine.target.model,
        tokenizer=engine.target.tokenizer,
        settings=settings,
        eos_ids=engine.target.eos_ids,
        drafter_factory=drafter_factory(engine),
        drafter_name=engine.drafter_name,
    )
    auth = "bearer key required" if key else "no key (loopback only)"
    log(f"serving {engine.target.name} (draft {engine.drafter_name}) on http://{args.host}:{args.port} ({auth})")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=75)
    except OSError as exc:
        raise SpecdecError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0
