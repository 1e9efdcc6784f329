"""Scale-out on Ray Serve: a local Ray instance, 2 toy verifier replicas behind the gateway, loopback only.

One Ray instance for the whole module (starting Ray costs ~20 s of a 2-core box); the replica-kill
test runs last because it leaves the deployment with one fresh replica.  Skipped without ``ray``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from serverproc import free_port  # noqa: E402
from specdec.decoder import SpeculativeDecoder  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.models.toy import ToyLM  # noqa: E402
from specdec.remote.client import RemoteConfig  # noqa: E402
from specdec.remote.edge import generate_remote  # noqa: E402
from specdec.sampling import SamplingConfig  # noqa: E402
from specdec.server import scaleout  # noqa: E402
from specdec.verify import get_rule  # noqa: E402
from starlette.requests import Request  # noqa: E402
from toy_server import ToyApp  # noqa: E402

# one worker runs the whole module (with `pytest -n 2 --dist loadgroup`): one Ray instance, not two
pytestmark = pytest.mark.xdist_group("ray_serve")

KEY = "ray-test-key"
TARGET = ToyLM(4, order=2, seed=0)  # what every replica serves (ToyApp's defaults)
DRAFT = TARGET.perturbed(1.0, seed=1)
TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
#: (prompt, sampling) of the edge sessions: greedy and coupled, the two wires whose output is a
#: pure function of prompt and seed (so "identical to an undisturbed run" is checkable token for token)
JOBS = [([1 + i % 3, i % 4], SamplingConfig(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3, seed=100 + i, max_new_tokens=60))
        for i in range(6)]


# ----------------------------------------------------------------------------- the gateway alone (no Ray instance)


class _FakeHandle:
    """Stands in for the verifier's deployment handle: call k of ``outcomes`` fails with a lost
    replica (``"dead"``) or answers ``("whole", 200, [], body)``."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = outcomes
        self.calls: list[str | None] = []
        self.request = self

    def options(self, **_: object) -> "_FakeHandle":
        return self

    def remote(self, req: dict, replica: str | None = None):
        self.calls.append(replica)
        outcome = self.outcomes[len(self.calls) - 1]

        async def gen():
            if outcome == "dead":
                from ray.exceptions import ActorDiedError

                raise ActorDiedError()
            yield ("whole", 200, [("content-type", "application/json")], b'{"ok": true}')

        return gen()


def _gateway_call(outcomes: list[str], path: str, retries: int = 2):
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": [(b"host", b"127.0.0.1")],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    handle = _FakeHandle(outcomes)
    gateway = scaleout.Gateway(handle, retries=retries)
    resp = asyncio.run(gateway(Request(scope, receive)))
    return resp, handle.calls


def test_session_paths_name_their_replica():
    assert scaleout.session_replica("/v1/sessions/abc12345.XyZ/verify") == "abc12345"
    assert scaleout.session_replica("/v1/sessions/abc12345.XyZ") == "abc12345"
    assert scaleout.session_replica("/v1/sessions/plainid/verify") is None  # a single-process server's id
    assert scaleout.session_replica("/v1/sessions") is None
    assert scaleout.session_replica("/v1/completions") is None
    # stored Responses API responses: by their id in the path, or the one a new response continues
    assert scaleout.bound_replica("GET", "/v1/responses/resp_abc12345.ff00", b"") == "abc12345"
    assert scaleout.bound_replica("DELETE", "/v1/responses/resp_abc12345.ff00", b"") == "abc12345"
    assert scaleout.bound_replica("GET", "/v1/responses/resp_ff00", b"") is None  # a single-process server's id
    body = b'{"input": "x", "previous_response_id": "resp_abc12345.ff00"}'
    assert scaleout.bound_replica("POST", "/v1/responses", body) == "abc12345"
    assert scaleout.bound_replica("POST", "/v1/responses", b'{"input": "x"}') is None
    assert scaleout.bound_replica("POST", "/v1/responses", b'{"previous_response_id": ') is None  # the replica answers
    assert scaleout.bound_replica("POST", "/v1/completions", body) is None
    assert scaleout.bound_replica("GET", "/v1/sessions/abc12345.XyZ", b"") == "abc12345"


def test_only_the_first_separator_splits_a_session_or_response_id():
    assert scaleout.session_replica("/v1/sessions/abc12345.x.y/verify") == "abc12345"
    assert scaleout.response_replica("resp_abc12345.x.y") == "abc12345"


def test_a_stored_response_id_must_start_with_resp():
    assert scaleout.response_replica("abc12345.ff00") is None
    assert scaleout.bound_replica("GET", "/v1/responses/abcdefgh.ff00", b"") is None


def test_only_a_post_continues_a_stored_response():
    body = b'{"previous_response_id": "resp_abc12345.ff00"}'
    assert scaleout.bound_replica("POST", "/v1/responses", body) == "abc12345"
    assert scaleout.bound_replica("GET", "/v1/responses", body) is None


def test_session_id_prefix_is_checked():
    from specdec.errors import ConfigError
    from specdec.server import ServerSettings

    assert ServerSettings(session_id_prefix="abc12345.").session_id_prefix == "abc12345."
    for bad in ("a/b.", "x" * 65, "a b"):
        with pytest.raises(ConfigError, match="session id prefix"):
            ServerSettings(session_id_prefix=bad)


def test_gateway_runs_a_request_again_when_its_replica_died_before_answering():
    resp, calls = _gateway_call(["dead", "dead", "ok"], "/v1/completions")
    assert resp.status_code == 200 and resp.headers[scaleout.RETRIES_HEADER] == "2"
    assert calls == [None, None, None]  # not pinned: the router may pick any live replica
    resp, calls = _gateway_call(["ok"], "/v1/sessions")
    assert resp.status_code == 200 and scaleout.RETRIES_HEADER not in resp.headers and calls == [None]


def test_gateway_answers_404_for_a_session_whose_replica_died_and_503_when_none_answers():
    resp, calls = _gateway_call(["dead", "ok"], "/v1/sessions/abc12345.XyZ/verify")
    assert resp.status_code == 404 and calls == ["abc12345"]  # the edge re-creates it; never run elsewhere
    error = json.loads(resp.body)["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": None, "code": 404}
    assert "replica holding it is gone" in error["message"]
    resp, calls = _gateway_call(["dead"] * 3, "/v1/completions", retries=2)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1" and len(calls) == 3
    error = json.loads(resp.body)["error"]
    assert (error["type"], error["param"], error["code"]) == ("server_error", None, 503) and "retry later" in error["message"]


def test_serve_config_file_entry_point_builds_the_replicas_from_serve_options():
    from specdec.errors import ConfigError

    app = scaleout.app_builder({"replicas": 3, "api-key": "k", "target": "smollm2-135m", "replica_cpus": 0.5})
    verifier = app._bound_deployment.init_args[0]._bound_deployment  # Gateway(Verifier(...))
    assert verifier.name == "Verifier" and verifier.num_replicas == 3 and verifier.ray_actor_options["num_cpus"] == 0.5
    build = verifier.init_args[0]
    assert build.args.target == "smollm2-135m" and build.settings_kw["api_key"] == "k"
    with pytest.raises(ConfigError, match="without an API key"):
        scaleout.app_builder({"host": "0.0.0.0"})  # the same checks as the command line


def test_serve_ray_refuses_bad_replica_options():
    import subprocess
    import sys

    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="replica CPUs must be > 0"):
        scaleout.app_builder({"replica-cpus": 0})
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--ray", "--replicas", "0"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 2 and "specdec: error: replicas must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def _proxy_killed() -> Exception:
    import ray

    return ray.exceptions.ActorDiedError()


@pytest.mark.parametrize("failure", [lambda: TimeoutError("HTTP proxies not available after 60s."), _proxy_killed],
                         ids=["timed_out", "proxy_killed"])
def test_a_serve_proxy_slower_than_serves_own_timeout_is_waited_for(monkeypatch, failure):
    """Serve gives its HTTP proxy 60 s to report ready, and its controller kills a proxy that misses
    its ready checks and starts another (both seen on a loaded two-core machine); either way
    ``start`` waits for the port and joins the running controller, instead of failing.  Faked:
    Serve's start fails once, the port opens 0.5 s later; with nothing ever listening the wait
    ends in a clear TimeoutError."""
    import socket

    import ray
    from ray import serve

    calls: list[str] = []
    timers: list[threading.Timer] = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def fake_start(http_options):
        calls.append("start")
        if len(calls) == 1:  # the first call of each scaleout.start times out
            if not timers:  # the port opens once, 0.5 s after the first
                timers.append(threading.Timer(0.5, server.listen))
                timers[0].start()
            raise failure()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {"gcs_address": "fake:6379"})())
    monkeypatch.setattr(serve, "start", fake_start)
    monkeypatch.setattr(serve, "run", lambda *a, **k: calls.append("run"))
    monkeypatch.setattr(scaleout, "application", lambda *a, **k: None)
    logged: list[str] = []
    try:
        url = scaleout.start(ToyApp(api_key=KEY), replicas=1, host="0.0.0.0", port=port, log=logged.append)
    finally:
        server.close()
    assert calls == ["start", "start", "run"] and url.endswith(f":{port}")
    assert any("slow to start" in line for line in logged)
    calls.clear()
    monkeypatch.setattr(scaleout, "PROXY_WAIT_S", 0.5)
    with pytest.raises(TimeoutError, match="nothing listens"):
        scaleout.start(ToyApp(api_key=KEY), replicas=1, host="127.0.0.1", port=port)
    assert calls == ["start"]


# ----------------------------------------------------------------------------- 2 replicas on a local Ray instance


@pytest.fixture(scope="module")
def cluster():
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]), "OMP_NUM_THREADS": "1"}}
    url = scaleout.start(ToyApp(api_key=KEY), replicas=2, host="127.0.0.1", port=free_port(), num_cpus=2,
                         replica_cpus=0.5, runtime_env=env)
    yield url
    scaleout.stop()


class Replicas:
    """httpx event hook: which replica answered each request (by session id, or 'other')."""

    def __init__(self) -> None:
        self.by_session: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def __call__(self, resp: httpx.Response) -> None:
        path = resp.request.url.path
        replica = resp.headers.get(scaleout.REPLICA_HEADER, "gateway")
        sid = path.split("/")[3] if path.startswith("/v1/sessions/") else None
        if sid is None and path == "/v1/sessions" and resp.status_code == 201:
            resp.read()
            sid = resp.json()["session_id"]
        if sid is not None:
            with self.lock:
                self.by_session.setdefault(sid, []).append(replica)


def _local(prompt: list[int], cfg: SamplingConfig) -> list[int]:
    method = "greedy" if cfg.temperature == 0 else "coupled"
    return SpeculativeDecoder(TARGET, None, get_rule(method)).generate(prompt, cfg).tokens


def _edge(url: str, prompt: list[int], cfg: SamplingConfig, hook: Replicas, on_tokens=None):
    with httpx.Client(event_hooks={"response": [hook]}, timeout=60) as client:
        return generate_remote(prompt, cfg, RemoteConfig(url=url, api_key=KEY, retry_budget_s=120.0),
                               drafter=ModelDrafter(DRAFT), gamma=3, client=client, on_tokens=on_tokens)


def _completion(api: httpx.Client, i: int) -> httpx.Response:
    body = {"prompt": [i % 4, 1], "max_tokens": 20, "temperature": 0.0 if i % 2 == 0 else 1.0, "seed": 7 + i}
    if i % 2:
        body["method"] = "coupled"
    return api.post("/v1/completions", json=body)


def _api(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60.0)


def test_requests_are_balanced_over_both_replicas_and_sessions_stay_on_theirs(cluster):
    with _api(cluster) as api:
        # four creations in flight at a time, as for the OpenAI requests below: one after another
        # both replicas are idle at each, Serve's router breaks the tie by a coin flip, and all
        # 12 landed on one replica with p = 2 / 2**12 (about 1 run in 2,000)
        with ThreadPoolExecutor(4) as pool:
            created = list(pool.map(lambda _: api.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]}), range(12)))
        assert all(r.status_code == 201 for r in created)
        # a session id names the replica that holds it, and that replica answered
        owners = [r.json()["session_id"].split(scaleout.SEPARATOR)[0] for r in created]
        assert owners == [r.headers[scaleout.REPLICA_HEADER] for r in created]
        assert len(set(owners)) == 2, f"sessions were all created on one replica: {Counter(owners)}"
        # every later request of a session goes to its replica (the others do not know it)
        for r, owner in zip(created, owners):
            sid = r.json()["session_id"]
            for seq in range(3):
                v = api.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "draft_tokens": [1, 2]})
                assert v.status_code == 200 and v.headers[scaleout.REPLICA_HEADER] == owner
            info = api.get(f"/v1/sessions/{sid}")
            assert info.status_code == 200 and info.json()["next_seq"] == 3
            assert api.delete(f"/v1/sessions/{sid}").status_code == 200
            assert api.get(f"/v1/sessions/{sid}").status_code == 404  # gone from its replica too
        # OpenAI requests (not bound to a session) are spread over both replicas too: four in
        # flight at a time, so the router sees a busy replica (one request after another leaves
        # both idle, and a queue-length probe that times out on a loaded machine then sent all
        # 12 to one replica in a CI-like run)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: _completion(api, i), range(12)))
        assert all(r.status_code == 200 for r in answers)
        assert len({r.headers[scaleout.REPLICA_HEADER] for r in answers}) == 2
        # a seeded request gives the same text whichever replica serves it
        for i, r in enumerate(answers[:4]):
            again = _completion(api, i)
            assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        # a stream comes through chunk by chunk, with the same text as the non-streaming answer
        body = {"prompt": [0, 1], "max_tokens": 20, "temperature": 0.0, "stream": True}
        with api.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == answers[0].json()["choices"][0]["text"]
        # auth is the replica's own: no key, no session
        assert httpx.post(cluster + "/v1/sessions", json={"prompt_ids": [1]}, timeout=60).status_code == 401


def test_edge_sessions_through_the_gateway_are_exact_and_pinned(cluster):
    hook = Replicas()
    for prompt, cfg in JOBS[:4]:
        out = _edge(cluster, prompt, cfg, hook)
        assert out.token_ids == _local(prompt, cfg) and out.lossless
        assert out.remote["session_recreates"] == 0
    assert len(hook.by_session) == 4
    for sid, answered in hook.by_session.items():
        assert set(answered) == {sid.split(scaleout.SEPARATOR)[0]}, answered


def test_a_killed_replica_loses_no_request_and_changes_no_output(cluster):
    """Six edge sessions and a stream of OpenAI requests run concurrently; one replica's process is
    killed mid-run.  Every session finishes with the tokens of an undisturbed run (the ones that lived
    on the dead replica are re-created on the other), and every request issued got its answer."""
    hook = Replicas()
    reference = [_local(p, cfg) for p, cfg in JOBS]
    with _api(cluster) as api:
        undisturbed = [_completion(api, i).json()["choices"][0]["text"] for i in range(4)]
    progress = [0] * len(JOBS)
    killed: list[str] = []
    kill_lock = threading.Lock()
    results: list = [None] * len(JOBS)
    errors: list[BaseException] = []

    def maybe_kill(i: int, tokens: list[int]) -> None:
        progress[i] += len(tokens)
        with kill_lock:
            if killed or min(progress) < 12:
                return
            victim = Counter(r for rs in hook.by_session.values() for r in rs).most_common(1)[0][0]
            scaleout.kill_replica(victim)
            killed.append(victim)

    def session(i: int) -> None:
        prompt, cfg = JOBS[i]
        try:
            results[i] = _edge(cluster, prompt, cfg, hook, on_tokens=lambda t: maybe_kill(i, t))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    issued = answered = rerun = 0
    openai_texts: list[tuple[int, str]] = []
    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(JOBS))]
    for t in threads:
        t.start()
    with _api(cluster) as api:
        while any(t.is_alive() for t in threads):
            i = issued % 4
            issued += 1
            r = _completion(api, i)
            if r.status_code == 200:
                answered += 1
                rerun += int(r.headers.get(scaleout.RETRIES_HEADER, 0))
                openai_texts.append((i, r.json()["choices"][0]["text"]))
    for t in threads:
        t.join()
    assert not errors, errors
    assert killed, "the kill never happened (the sessions finished too early)"
    victim = killed[0]
    assert [r.token_ids for r in results] == reference
    assert all(r.lossless for r in results)
    on_victim = [i for i, r in enumerate(results) if r.remote["session_recreates"] > 0]
    assert on_victim, "no session lived on the killed replica"
    sessions_of_victim = {sid for sid, rs in hook.by_session.items() if sid.startswith(victim + scaleout.SEPARATOR)}
    assert sessions_of_victim
    assert sum(r.remote["session_creates"] for r in results) == len(JOBS) + sum(
        r.remote["session_recreates"] for r in results)
    # no OpenAI request was lost either, and the answers are those of the undisturbed run
    assert issued > 0 and answered == issued
    assert all(text == undisturbed[i] for i, text in openai_texts)
    # the re-created sessions live on a replica that is not the dead one
    late = [sid for sid in hook.by_session if not sid.startswith(victim + scaleout.SEPARATOR)]
    assert late


def test_an_empty_replica_part_pins_to_no_replica():
    """'/v1/sessions/.x' and 'resp_.x' name no replica (None, not ''): the gateway then treats
    the request as unbound (retried elsewhere, never a 404 for a 'gone' replica)."""
    assert scaleout.session_replica("/v1/sessions/.XyZ/verify") is None
    assert scaleout.response_replica("resp_.ff00") is None
    assert scaleout.bound_replica("GET", "/v1/responses/resp_.ff00", b"") is None


class _Raising:
    """A verifier handle whose call fails with ``exc`` (not a lost replica)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls, self.request = exc, 0, self

    def options(self, **_: object) -> "_Raising":
        return self

    def remote(self, req: dict, replica: str | None = None):
        self.calls += 1
        exc = self.exc

        async def gen():
            raise exc
            yield  # pragma: no cover

        return gen()


def test_an_error_that_is_not_a_lost_replica_is_not_retried_or_hidden():
    """Only a dead replica is retried / answered 404 or 503: any other failure propagates at once."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 80), "scheme": "http", "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    handle = _Raising(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(scaleout.Gateway(handle, retries=2)(Request(scope, receive)))
    assert handle.calls == 1


def test_a_failed_lifespan_startup_does_not_hang_the_replica():
    """An app whose lifespan start-up fails ('lifespan.startup.failed') still lets start() return
    (requests then reach the app), instead of every request waiting forever."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "no"})

    async def main():
        host = scaleout.AsgiHost(app)
        await asyncio.wait_for(host.start(), timeout=10)

    asyncio.run(main())


def test_a_false_option_in_a_serve_config_is_left_out():
    """Serve config files give flags as booleans: False means 'not set', never '--flag False'."""
    app = scaleout.app_builder({"replicas": 2, "api_key": "k", "fast-attention": False, "target": "smollm2-135m"})
    build = app._bound_deployment.init_args[0]._bound_deployment.init_args[0]
    assert build.args.fast_attention is False and build.args.replicas == 2


def test_a_responses_body_that_is_not_an_object_pins_to_no_replica():
    """A POST /v1/responses body that is JSON but not an object (mentioning previous_response_id)
    is bound to no replica (the replica answers the bad body), not a gateway crash."""
    assert scaleout.bound_replica("POST", "/v1/responses", b'["previous_response_id", "resp_abc.x"]') is None
    assert scaleout.bound_replica("POST", "/v1/responses", b'"previous_response_id"') is None


def test_only_the_responses_collection_itself_continues_a_stored_response():
    body = json.dumps({"previous_response_id": "resp_r1.x"}).encode()
    assert scaleout.bound_replica("POST", "/v1/responses", body) == "r1"
    assert scaleout.bound_replica("POST", "/v1/responsesx", body) is None


def test_hop_by_hop_and_length_headers_are_not_forwarded():
    headers = [("Content-Length", "3"), ("transfer-encoding", "chunked"), ("Connection", "close"), ("x-a", "1")]
    assert scaleout._plain(headers) == {"x-a": "1"}


def test_the_gateway_takes_as_many_requests_as_all_replicas_together():
    app = scaleout.application(lambda prefix: None, replicas=3, max_ongoing=5)
    assert app._bound_deployment.name == "Gateway" and app._bound_deployment.max_ongoing_requests == 15


def test_each_replica_builds_its_app_with_its_own_session_id_prefix(monkeypatch):
    from specdec.server import command

    seen = []
    monkeypatch.setattr(command, "build_app", lambda args, kw: seen.append(kw))
    scaleout.EngineApp(object(), {"api_key": "k"})("r7.")
    assert seen == [{"api_key": "k", "session_id_prefix": "r7."}]


def test_start_hands_ray_the_runtime_env_and_cpus_only_for_a_new_instance(monkeypatch):
    import ray
    from ray import serve

    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    monkeypatch.setattr(serve, "run", lambda *a, **k: None)
    monkeypatch.setattr(scaleout, "application", lambda *a, **k: None)
    env = {"env_vars": {"A": "1"}}
    scaleout.start(None, replicas=1, host="127.0.0.1", port=1, num_cpus=2, runtime_env=env)
    scaleout.start(None, replicas=1, host="127.0.0.1", port=1, address="ray://h:1", num_cpus=2, runtime_env=env)
    assert inits[0]["num_cpus"] == 2 and inits[0]["runtime_env"] == env and inits[0]["address"] is None
    assert "num_cpus" not in inits[1] and inits[1]["runtime_env"] == env and inits[1]["address"] == "ray://h:1"
