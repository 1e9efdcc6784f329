"""Scale-out on Ray Serve: N verifier replicas behind a gateway, edge sessions pinned to their replica.

Two deployments make one Serve application:

* ``Verifier`` (N replicas): each replica holds the target (and the server-side draft) and runs the
  very app ``specdec serve`` runs — batching scheduler, admission limits, keys, metrics — on the
  requests the gateway hands it.  A replica names the sessions it creates
  ``<replica id>.<random>``, so the id itself says where the session's KV cache lives.
* ``Gateway`` (the HTTP ingress): reads each request and forwards it through a deployment handle
  whose router (:class:`SessionAffinityRouter`) sends ``/v1/sessions/<id>/…`` to the replica named
  in the id (and a stored Responses API response's requests, ``resp_<replica>.<x>``, to the replica
  that stores it) and everything else (session creation, OpenAI requests, ``/health``) to the less loaded
  of two random replicas (Serve's power-of-two-choices rule).

When a replica dies its sessions are gone.  A request for one of them is answered 404 (by the
gateway when the call itself failed, by another replica when the router no longer lists the dead
one), and the edge client re-creates the session with everything it has committed — on a live
replica — and repeats the round: greedy and coupled outputs are unchanged token for token, the
other rules stay exact in distribution.  A request not bound to a session that failed with its
replica before any byte was answered (session creation, a non-streaming completion, the start of a
stream) is run again on another replica; a stream cut after its first chunk ends early (its client
sees a truncated response).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from typing import Any, AsyncIterator, Callable

from specdec import defaults
from specdec.errors import MissingPackageError
from specdec.server.errors import error_body

#: response header naming the replica that answered (load-balancing and affinity are visible)
REPLICA_HEADER = "x-specdec-replica"
#: response header: times the gateway ran the request again because its replica died (absent: 0)
RETRIES_HEADER = "x-specdec-gateway-retries"
#: separates the replica id from the random part of a session id
SEPARATOR = "."
APP_NAME = "specdec"

_SESSION = re.compile(r"^/v1/sessions/([^/]+)")


def session_replica(path: str) -> str | None:
    """The replica a session-bound path is pinned to (``/v1/sessions/<replica>.<x>/…``), else None."""
    m = _SESSION.match(path)
    if m is None or SEPARATOR not in m.group(1):
        return None
    return m.group(1).split(SEPARATOR, 1)[0] or None


def response_replica(response_id: Any) -> str | None:
    """The replica that stores a Responses API response (``resp_<replica>.<x>``), else None."""
    if not isinstance(response_id, str) or not response_id.startswith("resp_"):
        return None
    rest = response_id[len("resp_"):]
    if SEPARATOR not in rest:
        return None
    return rest.split(SEPARATOR, 1)[0] or None


def bound_replica(method: str, path: str, body: bytes) -> str | None:
    """The replica a request must reach, else None: a session's (its id in the path), a stored
    response's (``GET`` / ``DELETE /v1/responses/<id>``), or the one a new response continues
    (``previous_response_id`` in a ``POST /v1/responses`` body)."""
    replica = session_replica(path)
    if replica is not None:
        return replica
    if path.startswith("/v1/responses/"):
        return response_replica(path[len("/v1/responses/"):].split("/", 1)[0])
    if path == "/v1/responses" and method == "POST" and b"previous_response_id" in body:
        try:
            found = json.loads(body)
        except ValueError:
            return None  # the replica answers the bad body
        return response_replica(found.get("previous_response_id")) if isinstance(found, dict) else None
    return None


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise MissingPackageError(f"--ray needs the 'ray' extra ({exc.name} is missing): pip install 'specdec[ray]'") from None


# ----------------------------------------------------------------------------- the ASGI app in a replica


class AsgiHost:
    """Runs an ASGI app inside a replica: its lifespan once, then one request at a time per call."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._ready: asyncio.Future | None = None  # set once the lifespan start-up has run
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Run the app's lifespan start-up (timers such as the idle-session sweep) once; every
        caller waits until it is done."""
        if self._ready is not None:
            await self._ready
            return
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._ready = ready
        stop = self._stop = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "lifespan.startup"}
            await stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict) -> None:
            if message["type"].startswith("lifespan.startup") and not ready.done():
                ready.set_result(message["type"])

        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
        await ready

    async def call(self, req: dict[str, Any]) -> AsyncIterator[tuple]:
        """Run one HTTP request; yields ``("whole", status, headers, body)`` for an ordinary response,
        or ``("start", status, headers)`` then ``("chunk", bytes)`` items for an event stream."""
        await self.start()
        disconnected = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": req["body"], "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        queue: asyncio.Queue = asyncio.Queue()

        async def send(message: dict) -> None:
            await queue.put(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req["method"],
            "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(), "root_path": "",
            "query_string": req["query_string"], "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in req["headers"]],
            "client": tuple(req["client"]) if req.get("client") else None, "server": None,
        }
        task = asyncio.create_task(self._run(scope, receive, send, queue))
        try:
            start = await queue.get()
            if start is None:
                raise RuntimeError("the app sent no response")
            status = start["status"]
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers", ())]
            streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)
            body: list[bytes] = []
            if streaming:
                yield ("start", status, headers)
            while True:
                message = await queue.get()
                if message is None:
                    break
                chunk = message.get("body", b"")
                if streaming:
                    if chunk:
                        yield ("chunk", chunk)
                else:
                    body.append(chunk)
                if not message.get("more_body", False):
                    break
            if not streaming:
                yield ("whole", status, headers, b"".join(body))
        finally:
            disconnected.set()  # the caller went away (or the response is over): the app may stop
            await asyncio.wait([task], timeout=5.0)

    async def _run(self, scope: dict, receive: Callable, send: Callable, queue: asyncio.Queue) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            await queue.put(None)


# ----------------------------------------------------------------------------- Serve pieces


_ROUTER: type | None = None


def affinity_router() -> type:
    """The request router: a session's requests go to its replica, the rest by power of two choices.

    Built on first use (so that importing this module needs no Ray) and importable as
    ``specdec.server.scaleout.SessionAffinityRouter``, which is how Serve finds it in each process.
    """
    global _ROUTER
    if _ROUTER is not None:
        return _ROUTER
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

    class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
        async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list:
            wanted = pending_request.kwargs.get("replica") if pending_request is not None else None
            if wanted:
                for replica in candidate_replicas:
                    if replica.replica_id.unique_id == wanted:
                        return [[replica]]
                # the replica is gone: any other one answers 404 and the edge re-creates the session
            return await super().choose_replicas(candidate_replicas, pending_request)

    SessionAffinityRouter.__module__ = __name__
    SessionAffinityRouter.__qualname__ = "SessionAffinityRouter"
    _ROUTER = SessionAffinityRouter
    return _ROUTER


def __getattr__(name: str) -> Any:  # PEP 562: the router class, built lazily
    if name == "SessionAffinityRouter":
        return affinity_router()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Verifier:
    """One replica: the serving app built by ``build(session_id_prefix)`` (a picklable callable)."""

    def __init__(self, build: Callable[[str], Any]) -> None:
        from ray import serve

        self.name = serve.get_replica_context().replica_id.unique_id
        self.host = AsgiHost(build(self.name + SEPARATOR))

    async def request(self, req: dict[str, Any], replica: str | None = None) -> AsyncIterator[tuple]:
        async for item in self.host.call(req):
            if item[0] in ("whole", "start"):
                item = (item[0], item[1], [*item[2], (REPLICA_HEADER, self.name)], *item[3:])
            yield item

    def pid(self) -> int:
        import os

        return os.getpid()


def _lost(exc: BaseException) -> bool:
    """Did the call fail because its replica died or became unreachable?"""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(exc, (RayActorError, ActorUnavailableError))


class Gateway:
    """The HTTP ingress: forwards each request to a verifier replica (see the module docstring)."""

    def __init__(self, verifier: Any, retries: int = defaults.RAY_GATEWAY_RETRIES) -> None:
        self.verifier = verifier.options(stream=True)
        self.retries = retries

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        body = await request.body()
        path = request.url.path
        replica = bound_replica(request.method, path, body)
        req = {
            "method": request.method, "path": path, "query_string": request.url.query.encode(),
            "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]], "body": body,
            "client": (request.client.host, request.client.port) if request.client else None,
        }
        for attempt in range(self.retries + 1):
            gen = self.verifier.request.remote(req, replica=replica)
            try:
                first = await gen.__anext__()
                break
            except Exception as exc:  # noqa: BLE001 - only a lost replica is handled here
                if not _lost(exc):
                    raise
                if replica is not None:
                    return JSONResponse(error_body("unknown session or stored response: the replica holding it is gone;"
                                                   " create a new one", "invalid_request_error", 404), status_code=404)
                if attempt == self.retries:
                    return JSONResponse(error_body("no verifier replica answered; retry later", "server_error", 503),
                                        status_code=503, headers={"Retry-After": str(defaults.SERVER_RETRY_AFTER_S)})
                await asyncio.sleep(0.2 * (attempt + 1))  # nothing was answered: run it again elsewhere
        extra = [(RETRIES_HEADER, str(attempt))] if attempt else []
        if first[0] == "whole":
            _, status, headers, content = first
            return Response(content, status_code=status, headers=_plain(headers + extra))

        _, status, headers = first
        headers = headers + extra

        async def chunks() -> AsyncIterator[bytes]:
            async for item in gen:
                yield item[1]

        return StreamingResponse(chunks(), status_code=status, headers=_plain(headers))


def _plain(headers: list[tuple[str, str]]) -> dict[str, str]:
    skip = {"content-length", "transfer-encoding", "connection"}
    return {k: v for k, v in headers if k.lower() not in skip}


# ----------------------------------------------------------------------------- building and running


def application(build: Callable[[str], Any], *, replicas: int, replica_cpus: float = 1.0,
                gateway_cpus: float = 0.0, max_ongoing: int = defaults.RAY_MAX_ONGOING_REQUESTS) -> Any:
    """The Serve application: ``replicas`` verifiers built by ``build`` behind one gateway."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    verifier = serve.deployment(
        Verifier, name="Verifier", num_replicas=replicas, max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": replica_cpus},
        request_router_config=RequestRouterConfig(request_router_class=f"{__name__}.SessionAffinityRouter"),
    )
    gateway = serve.deployment(Gateway, name="Gateway", num_replicas=1, max_ongoing_requests=max_ongoing * replicas,
                               ray_actor_options={"num_cpus": gateway_cpus})
    return gateway.bind(verifier.bind(build))


def replica_actor_names(app_name: str = APP_NAME) -> list[str]:
    """Named actors of the running verifier replicas (``SERVE_REPLICA::<app>#Verifier#<id>``)."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#Verifier#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(replica_id: str, app_name: str = APP_NAME) -> None:
    """Kill one verifier replica's process at once (a crash: Serve starts a fresh replica later)."""
    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{app_name}#Verifier#{replica_id}", namespace="serve")
    ray.kill(actor, no_restart=True)


#: seconds a slow Serve proxy is waited for after Serve's own 60 s
PROXY_WAIT_S = 120.0


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; TimeoutError after ``timeout_s``."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s") from None
            time.sleep(0.2)


def start(build: Callable[[str], Any], *, replicas: int, host: str, port: int, address: str | None = None,
          num_cpus: float | None = None, replica_cpus: float = 1.0, blocking: bool = False,
          runtime_env: dict[str, Any] | None = None, log: Callable[[str], None] | None = None) -> str:
    """Connect to (``address``) or start a Ray instance, run the application; returns its URL.

    ``log`` is told the Ray cluster's address (what ``ray.init(address=...)`` of an operator's
    script, or a second node's ``ray start --address``, needs)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address is None and num_cpus is not None:
            kw["num_cpus"] = num_cpus
        if runtime_env is not None:
            kw["runtime_env"] = runtime_env
        ray.init(address=address, **kw)
    if log is not None:
        log(f"Ray cluster at {ray.get_runtime_context().gcs_address}")
    try:
        serve.start(http_options={"host": host, "port": port})
    except (TimeoutError, ray.exceptions.ActorDiedError):
        # Serve gives its HTTP proxy 60 s to report ready (missed once on a loaded two-core machine,
        # the controller and proxy up a little later), and its controller kills a proxy that misses
        # its 5 s ready checks and starts another (seen under load: ActorDiedError, "killed by
        # ray.kill"): either way, wait for the port, then join the running controller
        if log is not None:
            log(f"Ray Serve's HTTP proxy is slow to start; waiting up to {PROXY_WAIT_S:g} s more for port {port}")
        wait_for_port("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port, PROXY_WAIT_S)
        serve.start(http_options={"host": host, "port": port})
    serve.run(application(build, replicas=replicas, replica_cpus=replica_cpus), name=APP_NAME, route_prefix="/",
              blocking=blocking)
    return f"http://{host}:{port}"


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


# ----------------------------------------------------------------------------- `specdec serve --ray` / config files


class EngineApp:
    """``build`` for the CLI: every replica loads the models named by the ``specdec serve`` options."""

    def __init__(self, args: argparse.Namespace, settings_kw: dict[str, Any]) -> None:
        self.args = args
        self.settings_kw = settings_kw

    def __call__(self, session_id_prefix: str) -> Any:
        from specdec.server.command import build_app

        return build_app(self.args, {**self.settings_kw, "session_id_prefix": session_id_prefix})


def app_builder(config: dict[str, Any]) -> Any:
    """Serve config-file entry point (``import_path: specdec.server.scaleout:app_builder``).

    ``args`` of the config are the ``specdec serve`` options as a mapping (``target``, ``draft``,
    ``api_key``, ``replicas``, ``replica_cpus``, ...; dashes or underscores).
    """
    from specdec.cli import build_parser
    from specdec.server.command import settings_from_args

    config = {k.replace("-", "_"): v for k, v in (config or {}).items()}
    argv = ["serve"]
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    args = build_parser().parse_args(argv)
    return application(EngineApp(args, settings_from_args(args)), replicas=args.replicas, replica_cpus=args.replica_cpus)
