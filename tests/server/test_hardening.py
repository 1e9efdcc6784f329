"""Hardening of the server: each test reproduces one finding of an audit (it failed before the fix).

Memory (KV sized to use, grown on demand, total capped), a completion that outlives its client,
sessions bound to the key that made them, authentication before the body is read, slow clients,
Host/Origin checks without a key, numerically unsafe sampling parameters, ``max_new_tokens``
honoured by every round, idle sessions swept on a timer, and an access log without secrets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import types

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from serverproc import ServerProcess
from tiny import tiny_native
from toy_server import LetterTokenizer
from specdec.errors import ConfigError
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig, process_logits
from specdec.server import ServerSettings, create_app, runner
from specdec.server.app import BodyLimit
from specdec.server.errors import ApiError
from specdec.server.guard import Guard, host_name
from specdec.server.metrics import ServerMetrics
from specdec.server.runner import AccessLogRedactor, install_log_redaction, read_key_file
from specdec.server.sessions import SessionStore


def _app(**settings):
    """The server on a 6-token toy model with these settings."""
    return create_app(ToyLM(6, order=1, seed=0), settings=ServerSettings(**settings))


def _session(client: TestClient, **body) -> str:
    r = client.post("/v1/sessions", json={"prompt_ids": [1, 2, 3], "temperature": 0.0, **body})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


# ----------------------------------------------------------------------------- memory


def test_a_port_in_use_fails_before_any_model_loads():
    from specdec.server.command import _check_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            _check_port("127.0.0.1", port)
    _check_port("127.0.0.1", port)  # free again


def test_kv_cache_is_sized_to_use_and_grows():
    model = tiny_native()
    client = TestClient(create_app(model, settings=ServerSettings()), base_url="http://localhost")
    sid = _session(client)
    cache = client.app.state.ctx.store.get(sid).target.cache
    per_position = cache.bytes_per_position
    assert cache.nbytes <= 128 * per_position  # not the whole 4,096-token context up front
    for seq in range(5):  # lossy appends: 61 positions a round
        r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "unverified_tokens": [seq + 1] * 60})
        assert r.status_code == 200, r.text
    assert cache.length > 300
    assert cache.length * per_position <= cache.nbytes < 1024 * per_position  # grown on demand, not to the context


def test_total_kv_bytes_are_capped():
    model = tiny_native()
    per_position = model.new_cache(1).bytes_per_position
    cap = per_position * 1024  # room for three 200-token sessions
    app = create_app(model, settings=ServerSettings(max_kv_bytes=cap, api_keys=("key-a", "key-b")))
    a = TestClient(app, headers={"Authorization": "Bearer key-a"})
    b = TestClient(app, headers={"Authorization": "Bearer key-b"})
    body = {"prompt_ids": [i % 60 + 1 for i in range(200)], "temperature": 0.0}
    assert all(a.post("/v1/sessions", json=body).status_code == 201 for _ in range(5))  # evicts its own
    store = app.state.ctx.store
    assert 0 < store.kv_bytes() <= cap
    r = b.post("/v1/sessions", json=body)
    assert r.status_code == 503 and r.headers["Retry-After"] and "KV cache" in r.json()["error"]["message"]
    assert store.kv_bytes() <= cap


def test_openai_requests_count_under_the_kv_cap():
    """A completion holds the KV bytes its caches can grow to (prompt + max_tokens + a round's
    rows) while it runs: past the cap it is refused with 503 before any work, beside sessions
    that already hold memory, and the hold is given back when it ends."""
    model = tiny_native()
    per_position = model.new_cache(1).bytes_per_position
    cap = per_position * 1024
    app = create_app(model, tokenizer=LetterTokenizer(), settings=ServerSettings(max_kv_bytes=cap))
    client = TestClient(app, base_url="http://localhost")
    store = app.state.ctx.store
    ok = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert store.claimed_bytes == 0  # given back
    too_big = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2000, "temperature": 0})
    assert too_big.status_code == 503 and too_big.headers["Retry-After"] and "KV cache" in too_big.json()["error"]["message"]
    assert store.claimed_bytes == 0 and app.state.ctx.active._value == app.state.ctx.settings.max_active_requests
    store.claim("", cap - 100 * per_position)  # a running completion holding most of the memory
    body = {"prompt_ids": [i % 60 + 1 for i in range(200)], "temperature": 0.0}
    assert client.post("/v1/sessions", json=body).status_code == 503  # sessions see the hold too
    store.release(cap - 100 * per_position)
    assert client.post("/v1/sessions", json=body).status_code == 201


# ----------------------------------------------------------------------------- sampling parameters


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_numerically_unsafe_values_are_refused(field):
    with pytest.raises(ConfigError, match=field.replace("_", " ")):
        SamplingConfig(**{field: 1e-300})
    with pytest.raises(ConfigError):
        SamplingConfig(**{field: 1e300})
    client = TestClient(_app(), base_url="http://localhost")
    r = client.post("/v1/sessions", json={"prompt_ids": [1], field: 1e-300})
    assert r.status_code == 400 and field.replace("_", " ") in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [1, 2], field: 1e-300, "max_tokens": 2})
    assert r.status_code == 400, r.text


def test_smallest_allowed_values_stay_finite():
    from specdec import defaults

    logits = torch.randn(3, 50) * 40  # [3, V]
    cfg = SamplingConfig(temperature=defaults.MIN_TEMPERATURE, repetition_penalty=defaults.MIN_REPETITION_PENALTY)
    from specdec.sampling import PenaltyState

    probs = process_logits(logits, cfg, PenaltyState.start(torch.arange(25), 50), torch.tensor([1, 2]))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3, dtype=probs.dtype))


# ----------------------------------------------------------------------------- max_new_tokens


def test_max_new_tokens_bounds_every_round():
    model = ToyLM(6, order=1, seed=0)
    client = TestClient(create_app(model, settings=ServerSettings()), base_url="http://localhost")
    free = _session(client)
    greedy: list[int] = []
    for seq in range(8):
        greedy += client.post(f"/v1/sessions/{free}/verify", json={"seq": seq}).json()["tokens"]
    sid = _session(client, max_new_tokens=1)
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": greedy[:6]})
    assert r.status_code == 200 and r.json()["tokens"] == greedy[:1]
    assert client.get(f"/v1/sessions/{sid}").json()["committed"] == 1
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 1, "draft_tokens": greedy[1:4]})
    assert r.status_code == 400 and "max_new_tokens" in r.json()["error"]["message"]
    sid = _session(client, max_new_tokens=3)
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "unverified_tokens": [1, 2, 3]})
    assert r.status_code == 400 and client.get(f"/v1/sessions/{sid}").json()["committed"] == 0


# ----------------------------------------------------------------------------- keys and owners


def test_sessions_are_bound_to_the_key_that_made_them():
    app = _app(api_keys=("key-a", "key-b"))
    a = TestClient(app, headers={"Authorization": "Bearer key-a"})
    b = TestClient(app, headers={"Authorization": "Bearer key-b"})
    sid = _session(a)
    assert b.get(f"/v1/sessions/{sid}").status_code == 404
    assert b.post(f"/v1/sessions/{sid}/verify", json={"seq": 0}).status_code == 404
    assert b.delete(f"/v1/sessions/{sid}").status_code == 404
    assert a.post(f"/v1/sessions/{sid}/verify", json={"seq": 0}).status_code == 200
    assert a.get(f"/v1/sessions/{sid}").status_code == 200
    assert TestClient(app).get(f"/v1/sessions/{sid}").status_code == 401


def test_another_key_cannot_evict_a_session():
    app = _app(api_keys=("key-a", "key-b"), max_sessions=1)
    a = TestClient(app, headers={"Authorization": "Bearer key-a"})
    b = TestClient(app, headers={"Authorization": "Bearer key-b"})
    sid = _session(a)
    r = b.post("/v1/sessions", json={"prompt_ids": [1], "temperature": 0.0})
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert a.get(f"/v1/sessions/{sid}").status_code == 200
    _session(a)  # a key may still evict its own idle sessions
    assert a.get(f"/v1/sessions/{sid}").status_code == 404


def test_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# operators\nkey-one\n\n  key-two  \n")
    assert read_key_file(f) == ("key-one", "key-two")
    f.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no keys"):
        read_key_file(f)


def test_unauthenticated_body_is_never_read():
    """The key is checked from the headers; a client without one cannot make the server buffer a body."""
    app = _app(api_key="secret")
    reads = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 60_000, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/sessions", "raw_path": b"/v1/sessions", "query_string": b"",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json")], "client": ("1.2.3.4", 5),
             "server": ("x", 80), "scheme": "http", "http_version": "1.1", "root_path": "", "asgi": {"version": "3.0"}}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 401 and reads == 0


# ----------------------------------------------------------------------------- Host / Origin without a key


def test_keyless_server_checks_host_and_origin():
    app = _app()
    ok = TestClient(app, base_url="http://127.0.0.1:8000")
    assert ok.get("/v1/models").status_code == 200
    assert TestClient(app, base_url="http://localhost").get("/v1/models").status_code == 200
    assert TestClient(app, base_url="http://[::1]:9").get("/v1/models").status_code == 200
    r = TestClient(app, base_url="http://evil.example:8000").post("/v1/sessions", json={"prompt_ids": [1]})
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    r = ok.post("/v1/sessions", json={"prompt_ids": [1]}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and "Origin" in r.json()["error"]["message"]
    assert ok.get("/v1/models", headers={"Origin": "http://localhost:3000"}).status_code == 200
    keyed = TestClient(_app(api_key="k"), base_url="http://example.com", headers={"Authorization": "Bearer k"})
    assert keyed.get("/v1/models").status_code == 200  # a key is the protection there


# ----------------------------------------------------------------------------- idle sessions and /health


def test_idle_sessions_are_swept_without_requests():
    app = _app(session_ttl_s=0.2, sweep_interval_s=0.05)
    with TestClient(app, base_url="http://localhost") as client:
        _session(client)
        store = app.state.ctx.store
        assert len(store) == 1
        deadline = time.monotonic() + 5
        while len(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(store) == 0  # swept by the timer: no request came in
        assert client.get("/health").json()["sessions"] == 0


def test_each_sweep_hands_free_heap_memory_back(monkeypatch):
    """Sessions come and go, each freeing KV buffers of a few MiB: the timer's sweep then trims the
    C heap (glibc malloc_trim), which held a loaded server's RSS flat (see server/memory.py)."""
    from specdec.server import memory

    calls = []
    monkeypatch.setattr(memory, "release_free_memory", lambda: calls.append(1) or True)
    app = _app(sweep_interval_s=0.05)
    with TestClient(app, base_url="http://localhost"):
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(calls) >= 2


def test_release_free_memory_runs_where_glibc_is():
    import platform

    from specdec.server.memory import release_free_memory

    expected = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert release_free_memory() is expected


def test_health_is_not_stale():
    app = _app(session_ttl_s=0.2, sweep_interval_s=60)
    client = TestClient(app, base_url="http://localhost")
    _session(client)
    time.sleep(0.3)
    assert client.get("/health").json()["sessions"] == 0


def test_health_names_the_servers_drafter():
    """/health says what the OpenAI endpoints speculate with, and "none" for plain decoding."""
    from specdec.drafters.model import ModelDrafter

    plain = TestClient(_app(), base_url="http://localhost")
    assert plain.get("/health").json()["drafter"] == "none"
    draft = ToyLM(6, order=1, seed=1)
    app = create_app(ToyLM(6, order=1, seed=0), settings=ServerSettings(),
                     drafter_factory=lambda: ModelDrafter(draft), drafter_name="toy-draft")
    assert TestClient(app, base_url="http://localhost").get("/health").json()["drafter"] == "toy-draft"


# ----------------------------------------------------------------------------- the access log


def test_access_log_redacts_session_ids_and_query_strings():
    redactor = AccessLogRedactor()
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", "/v1/sessions/AbC123_-x/verify?api_key=s3cret", "1.1", 200), None)
    assert redactor.filter(record)
    line = record.getMessage()
    assert "AbC123_-x" not in line and "s3cret" not in line and "/v1/sessions/" in line and "/verify" in line


def test_a_record_with_exactly_three_args_has_its_path_redacted():
    """The path is args[2]: a record of exactly (client, method, path) is redacted too."""
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "%s %s %s", ("1.2.3.4", "GET", "/v1/sessions/abc/verify?api_key=x"), None)
    assert AccessLogRedactor().filter(record)
    assert record.args == ("1.2.3.4", "GET", "/v1/sessions/…/verify")


def test_installing_the_redaction_twice_adds_one_filter():
    logger = logging.getLogger("uvicorn.access")
    before = list(logger.filters)
    try:
        install_log_redaction()
        install_log_redaction()
        assert sum(isinstance(f, AccessLogRedactor) for f in logger.filters) == 1
    finally:
        logger.filters[:] = before


# ----------------------------------------------------------------------------- real server processes


@pytest.fixture(scope="module")
def strict_server():
    srv = ServerProcess.toy("--api-key", "k", "--header-timeout", "1", "--body-timeout", "1", "--log-level", "info",
                            capture_stdout=True)
    with srv:
        yield srv


def test_slow_headers_are_cut_off(strict_server):
    with socket.create_connection(("127.0.0.1", strict_server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes the headers
        s.settimeout(8)
        started = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 8


def test_slow_bodies_are_cut_off(strict_server):
    with socket.create_connection(("127.0.0.1", strict_server.port)) as s:
        s.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt_ids\"")
        s.settimeout(8)
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") or reply == b""


def test_server_access_log_has_no_secrets(strict_server):
    h = {"Authorization": "Bearer k"}
    sid = httpx.post(strict_server.url + "/v1/sessions", json={"prompt_ids": [1], "temperature": 0.0}, headers=h, timeout=60).json()["session_id"]
    assert httpx.post(f"{strict_server.url}/v1/sessions/{sid}/verify?api_key=topsecret", json={"seq": 0}, headers=h, timeout=60).status_code == 200
    strict_server.proc.terminate()
    strict_server.proc.wait(timeout=10)
    log = strict_server.proc.stderr.read() + strict_server.proc.stdout.read()
    assert "/verify" in log and sid not in log and "topsecret" not in log


# ----------------------------------------------------------------------------- disconnects


class _SlowModel:
    """A toy target whose forward passes take 10 ms and are counted."""
    def __init__(self) -> None:
        self.inner = ToyLM(6, order=1, seed=0)
        self.vocab_size, self.max_length = self.inner.vocab_size, self.inner.max_length
        self.calls = 0

    def new_cache(self, max_length=None):
        return self.inner.new_cache(max_length)

    def forward(self, tokens, cache, *, last_only=False):
        self.calls += 1
        time.sleep(0.01)
        return self.inner.forward(tokens, cache, last_only=last_only)


class _Letters:
    """A tokenizer for toy vocabularies: token i is the letter chr(97 + i)."""
    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i)) for i in ids)


@pytest.mark.parametrize("how", ["timeout", "stream cut"])
def test_completion_stops_when_its_client_goes_away(caplog, how):
    """A client that stops waiting (a timeout) or drops a stream after a few chunks ends its
    completion: generation stops long before its 1500 tokens, and the request's slot and KV claim
    are given back."""
    import gc

    import uvicorn

    from serverproc import free_port

    model = _SlowModel()
    model.max_length = 2048
    app = create_app(model, tokenizer=_Letters(), settings=ServerSettings())
    ctx = app.state.ctx
    ctx.kv_per_position = 64  # a toy cache has no byte size: give it one, so that the request claims KV bytes
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {"prompt": [1, 2], "max_tokens": 1500, "temperature": 0}
        if how == "timeout":
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=0.5, json=body)
        else:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                chunks = 0
                for line in r.iter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        assert ctx.store.claimed_bytes > 0 and ctx.active._value == ctx.settings.max_active_requests - 1
                        break
            assert chunks == 3
        # wait until generation has stood still for 0.5 s (a loaded machine may notice the
        # disconnect late), then check it stopped long before its 1500 tokens
        first, deadline = model.calls, time.monotonic() + 20
        while True:
            time.sleep(0.5)
            if model.calls == first:
                break
            first = model.calls
            assert time.monotonic() < deadline, "generation went on after the client disconnected"
        assert first < 1000, "generation went on after the client disconnected"
        assert ctx.store.claimed_bytes == 0 and ctx.active._value == ctx.settings.max_active_requests
        gc.collect()  # an abandoned future whose exception nobody retrieved is logged when collected
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], "a traceback in the log"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("failure", ["internal", "client"])
def test_a_completion_failing_after_its_stream_began_says_whose_fault_it_was(monkeypatch, failure):
    """A failure after the first streamed piece arrives as an error event with the status it would
    have had: 500 / server_error for a bug, 400 / invalid_request_error for a SpecdecError (the
    stream's 200 is already sent).  A bug in a non-streamed completion is a 500 that does not speak
    of a session it never had."""
    from specdec.engine import TextPiece
    from specdec.errors import SpecdecError
    from specdec.server import openai_api

    def failing(job, on_piece, cancelled, on_done=None):
        piece = on_piece(0)
        if piece is not None:
            piece(TextPiece(text="ab", token_ids=[0, 1]))
        raise RuntimeError("a bug") if failure == "internal" else SpecdecError("the sequence would exceed its context")

    monkeypatch.setattr(openai_api, "_run_choices", failing)
    app = create_app(ToyLM(6, order=1, seed=0), tokenizer=LetterTokenizer(), settings=ServerSettings())
    client = TestClient(app, base_url="http://localhost", raise_server_exceptions=False)
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    error = events[-1]["error"]
    assert streamed.status_code == 200 and events[0]["choices"][0]["text"] == "ab"
    if failure == "internal":
        assert (error["code"], error["type"]) == (500, "server_error") and "RuntimeError" in error["message"]
        plain = client.post("/v1/completions", json=body)
        assert plain.status_code == 500 and "session" not in plain.json()["error"]["message"], plain.text
    else:
        assert (error["code"], error["type"]) == (400, "invalid_request_error") and "context" in error["message"]


def test_a_claim_fits_the_kv_cap_exactly_and_not_one_byte_more():
    cap = 1 << 20
    store = SessionStore(ServerSettings(max_kv_bytes=cap))
    assert not store.try_claim(cap + 1) and store.claimed_bytes == 0
    assert store.try_claim(cap - 10) and store.claimed_bytes == cap - 10
    assert not store.try_claim(11) and store.claimed_bytes == cap - 10  # refused: nothing held for it
    assert store.try_claim(10) and store.claimed_bytes == cap  # the last bytes
    assert not store.try_claim(1)
    store.release(cap)
    assert store.claimed_bytes == 0 and store.try_claim(cap)


def test_host_name_strips_ports_and_brackets_only():
    """A Host header's name: the port and IPv6 brackets go, a bare IPv6 address stays whole."""
    assert host_name("[::1]:8000") == "::1"
    assert host_name("localhost:80") == "localhost"
    assert host_name("::1") == "::1"
    assert host_name("Example.com") == "Example.com"


def test_allowed_hosts_are_matched_without_case():
    """A keyless server answers to an --allowed-host name whatever its case, in the setting or the header."""
    client = TestClient(_app(allowed_hosts=("Box.LAN",)), base_url="http://127.0.0.1")
    for host in ("box.lan", "BOX.lan:8000"):
        assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
    r = client.get("/v1/models", headers={"Host": "other.lan"})
    assert r.status_code == 403


def test_bearer_scheme_is_case_insensitive_and_the_token_trimmed():
    """'bearer k' and 'Bearer  k' (an extra space) authenticate as 'Bearer k' does."""
    client = TestClient(_app(api_key="k"), base_url="http://localhost")
    for value in ("Bearer k", "bearer k", "BEARER k", "Bearer  k"):
        assert client.get("/v1/models", headers={"Authorization": value}).status_code == 200, value
    assert client.get("/v1/models", headers={"Authorization": "Bearer kk"}).status_code == 401


def test_a_401_names_the_bearer_scheme_and_is_counted():
    """A refused key: 401 with 'WWW-Authenticate: Bearer', counted in specdec_http_errors_total."""
    client = TestClient(_app(api_key="k"), base_url="http://localhost")
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert 'specdec_http_errors_total{status="401"} 1.0' in client.get("/metrics").text


def test_a_bad_host_403_is_counted():
    """A keyless server's Host refusal is counted in specdec_http_errors_total."""
    app = _app()
    assert TestClient(app, base_url="http://evil.example").get("/v1/models").status_code == 403
    text = TestClient(app, base_url="http://localhost").get("/metrics").text
    assert 'specdec_http_errors_total{status="403"} 1.0' in text


def test_version_is_open_without_a_key():
    """/version is public, as /health is, on a server with a key."""
    client = TestClient(_app(api_key="k"), base_url="http://localhost")
    assert client.get("/version").status_code == 200


def test_a_body_of_exactly_the_limit_is_read():
    """A Content-Length equal to --max-body-bytes is served; one byte more is a 413."""
    client = TestClient(_app(max_body_bytes=1024), base_url="http://localhost")
    prompt = {"prompt_ids": [1], "temperature": 0.0}
    body = json.dumps(prompt).encode()
    exact = body[:-1] + b" " * (1024 - len(body)) + b"}"
    assert len(exact) == 1024
    r = client.post("/v1/sessions", content=exact, headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text
    r = client.post("/v1/sessions", content=exact + b" ", headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_a_body_without_content_length_is_cut_at_the_limit():
    """A streamed body (no Content-Length) one byte past the limit is a 413 before the app sees it."""
    seen: list[dict] = []

    async def inner(scope, receive, send):  # pragma: no cover - must not run
        seen.append(scope)

    sent: list[dict] = []
    parts = iter([b"x" * 1000, b"y" * 25])

    async def receive():
        chunk = next(parts)
        return {"type": "http.request", "body": chunk, "more_body": chunk.startswith(b"x")}

    async def send(message):
        sent.append(message)

    limit = BodyLimit(inner, max_bytes=1024, metrics=ServerMetrics())
    asyncio.run(limit({"type": "http", "headers": []}, receive, send))
    assert sent[0]["status"] == 413 and not seen


def test_a_body_that_stops_arriving_is_a_408_that_closes_the_connection():
    """No part of the body within ``timeout_s``: a 408 'timeout' error with ``Connection: close``
    (the connection holds an unread body, so it cannot serve another request), and the app never
    sees the request."""
    seen: list[dict] = []

    async def inner(scope, receive, send):  # pragma: no cover - must not run
        seen.append(scope)

    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(10)  # never in time

    async def send(message):
        sent.append(message)

    limit = BodyLimit(inner, max_bytes=1024, metrics=ServerMetrics(), timeout_s=0.01)
    asyncio.run(limit({"type": "http", "headers": []}, receive, send))
    headers = {k.decode().lower(): v.decode() for k, v in sent[0]["headers"]}
    assert sent[0]["status"] == 408 and headers["connection"] == "close" and not seen
    assert b"did not arrive within 0.01 s" in sent[1]["body"]


def test_a_validation_error_names_three_problems_and_counts_the_rest():
    """A request with four bad fields: the 400/422 message lists three of them and '(and 1 more)'."""
    client = TestClient(_app(), base_url="http://localhost")
    r = client.post("/v1/sessions", json={"prompt_ids": "x", "temperature": "hot", "top_p": "x", "top_k": "x"})
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert message.count("; ") == 2 and message.endswith("(and 1 more)"), message


def test_every_error_body_has_openais_four_fields_and_names_the_field_at_fault():
    """Each way an error is answered (a schema error, a check in the handler, an unknown path, the
    key guard before the app) sends ``message``, ``type``, ``param`` and ``code``; ``param`` is the
    field at fault where there is one, else null."""
    client = TestClient(_app(api_key="k"), base_url="http://localhost", headers={"Authorization": "Bearer k"})
    bad_type = client.post("/v1/completions", json={"prompt": [1, 2], "temperature": "hot"})
    out_of_vocab = client.post("/v1/completions", json={"prompt": [1, 2], "stop_token_ids": [6]})
    nested = client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    unknown = client.get("/v1/nothing")
    no_key = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    answers = [(bad_type, 400, "temperature"), (out_of_vocab, 400, "stop_token_ids"), (nested, 400, "messages.0.role"),
               (unknown, 404, None), (no_key, 401, None)]
    for r, status, param in answers:
        error = r.json()["error"]
        assert r.status_code == status and set(error) == {"message", "type", "param", "code"}, r.text
        assert (error["param"], error["code"]) == (param, status), r.text


def test_a_max_model_len_past_the_models_context_is_refused():
    """max_model_len longer than the model's own context is a ConfigError naming both."""
    model = ToyLM(6, order=1, seed=0)
    with pytest.raises(ConfigError, match=f"--max-model-len {model.max_length + 1} is longer than the model's context"):
        create_app(model, settings=ServerSettings(max_model_len=model.max_length + 1))
    create_app(model, settings=ServerSettings(max_model_len=model.max_length))


def test_health_says_none_without_a_drafter_factory():
    """/health names no drafter where the server has no drafter factory, whatever name it was given."""
    app = create_app(ToyLM(6, order=1, seed=0), settings=ServerSettings(), drafter_name="ignored")
    assert TestClient(app, base_url="http://localhost").get("/health").json()["drafter"] == "none"


def test_delete_answers_the_id_and_deleted():
    """DELETE /v1/sessions/{id} answers exactly {session_id, deleted: true}."""
    client = TestClient(_app(), base_url="http://localhost")
    sid = client.post("/v1/sessions", json={"prompt_ids": [1]}).json()["session_id"]
    assert client.delete(f"/v1/sessions/{sid}").json() == {"session_id": sid, "deleted": True}


def _read_response(sock) -> bytes:
    """One whole HTTP/1.1 response (its headers and its Content-Length body) off ``sock``; b"" if closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_the_header_deadline_ends_once_the_headers_arrive():
    """A keep-alive connection whose first request's headers came in time is not cut when the
    header deadline passes later: its next request, sent after the deadline, is answered."""
    with ServerProcess.toy("--header-timeout", "0.5") as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.settimeout(10)
            request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            s.sendall(request)
            assert _read_response(s).startswith(b"HTTP/1.1 200")
            time.sleep(1.0)  # past the first deadline, idle between requests (keep-alive)
            s.sendall(request)
            assert _read_response(s).startswith(b"HTTP/1.1 200")


def test_a_new_session_reserves_its_first_allocation_under_the_kv_cap():
    """A one-token session still allocates kv_initial_length positions: where that is past the KV
    cap it is refused (503), and the cap is never exceeded."""
    model = tiny_native()
    per_position = model.new_cache(1).bytes_per_position
    cap = per_position * 200
    app = create_app(model, settings=ServerSettings(max_kv_bytes=cap, kv_initial_length=256))
    client = TestClient(app, base_url="http://localhost")
    r = client.post("/v1/sessions", json={"prompt_ids": [1], "temperature": 0.0})
    assert r.status_code == 503, r.text
    assert app.state.ctx.store.kv_bytes() <= cap


def test_only_a_401_names_the_bearer_scheme():
    """'WWW-Authenticate: Bearer' goes with a 401 (a missing/bad key) only: a 403 (a forbidden Host,
    a session of another key) is not a request to authenticate.  Break: the header on 403 too."""
    assert ApiError(401, "no key").headers == {"WWW-Authenticate": "Bearer"}
    assert ApiError(403, "forbidden").headers is None
    assert ApiError(403, "forbidden").kind == "authentication_error"


def test_an_out_of_order_seq_is_a_409_conflict_error():
    """A verify whose seq is not the one the session expects is a 409 of type 'conflict_error' (a
    client retries or resyncs on it, unlike an invalid request).  Break: 409 typed as invalid_request_error."""
    client = TestClient(_app(), base_url="http://localhost")
    sid = _session(client)
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 5})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("conflict_error", 409) and "out-of-order seq 5" in error["message"]


def test_each_status_gets_its_openai_error_type():
    """ApiError's default ``type`` per status, as OpenAI clients branch on it (some of these statuses
    are raised by no handler today, so only this pins them).  Breaks: 413/500/403 mapped to another type."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "authentication_error",
             404: "not_found_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
             500: "server_error", 502: "server_error", 503: "overloaded_error"}
    for status, kind in kinds.items():
        assert ApiError(status, "x").kind == kind, status
    assert ApiError(400, "x", kind="custom").kind == "custom"  # a kind given wins


def test_a_full_scheduler_queue_is_a_503_with_retry_after(monkeypatch):
    """A pass refused by a full scheduler queue (Overloaded) is a 503 'overloaded_error' with a
    Retry-After header, as every 503 of the server is.  Break: the handler drops the headers."""
    import specdec.server.app as app_module
    from specdec.server.scheduler import Overloaded

    def full(*args, **kwargs):
        raise Overloaded("the scheduler queue is full")

    client = TestClient(_app(), base_url="http://localhost")
    monkeypatch.setattr(app_module, "create_session", full)
    r = client.post("/v1/sessions", json={"prompt_ids": [1], "temperature": 0.0})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    assert r.headers["Retry-After"] and "retry later" in r.json()["error"]["message"]


def test_a_deleted_session_leaves_the_active_sessions_gauge():
    """DELETE updates specdec_active_sessions at once.  Break: the gauge left at the old count."""
    client = TestClient(_app(), base_url="http://localhost")
    sid = _session(client)
    _session(client)
    assert client.delete(f"/v1/sessions/{sid}").status_code == 200
    ctx = client.app.state.ctx
    assert ctx.metrics.active_sessions._value.get() == 1  # read before /metrics (which sets it again)


def test_a_retried_round_counts_as_a_replay_not_a_verify():
    """A verify sent twice with the same seq is answered from the stored verdict: it counts in
    specdec_verify_replays_total and not again in the verify calls.  Break: the replay not counted."""
    client = TestClient(_app(), base_url="http://localhost")
    sid = _session(client)
    first = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2]})
    again = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2]})
    assert first.status_code == again.status_code == 200 and first.json()["tokens"] == again.json()["tokens"]
    text = client.get("/metrics").text
    assert "specdec_verify_replays_total 1.0" in text, text
    assert 'specdec_verify_calls_total{lossless="true",wire="greedy"} 1.0' in text, text


def test_a_given_retry_after_wins_over_the_default():
    """ApiError(429/503, retry_after=N) sends 'Retry-After: N'; only a missing one gets the server's
    default.  Break: the default always used for 429/503."""
    from specdec import defaults

    assert ApiError(429, "busy", retry_after=7).headers == {"Retry-After": "7"}
    assert ApiError(503, "full").headers == {"Retry-After": str(defaults.SERVER_RETRY_AFTER_S)}
    assert ApiError(400, "bad").headers is None


def test_max_model_len_is_the_context_the_server_states():
    """With max_model_len below the model's context, /health states it as max_context (requests and
    sessions size themselves from it).  Break: the served model's max_length left at the model's."""
    for batching in (True, False):
        client = TestClient(_app(max_model_len=40, batching=batching), base_url="http://localhost")
        assert client.get("/health").json()["max_context"] == 40


def test_the_batched_target_shares_the_forward_lock():
    """The target's scheduler runs its passes under the server's forward lock (or a serialised
    model's own lock), so serialised views of the same weights never overlap its batches.
    Break: the lock not passed on (the scheduler then makes a private one)."""
    from specdec.server.sessions import FORWARD_LOCK, SerializedModel

    assert _app().state.ctx.model.scheduler.pass_lock is FORWARD_LOCK

    model = SerializedModel(ToyLM(6, order=1, seed=0), threading.Lock())
    app = create_app(model, settings=ServerSettings())
    assert app.state.ctx.model.scheduler.pass_lock is model.lock


def test_an_unknown_path_names_the_method_and_path():
    """A 404 for a path no endpoint serves says which (method and path), not Starlette's bare
    'Not Found'.  Break: the detail passed through unchanged."""
    client = TestClient(_app(), base_url="http://localhost")
    r = client.post("/v1/nothing/here")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such endpoint: POST /v1/nothing/here"


def test_further_choices_get_half_the_generation_slots():
    """A request's further choices may take at most half the slots (at least one), so one request with
    many prompts never takes the slots other requests are admitted to.  Break: all of them."""
    for active, spare in ((8, 4), (5, 2), (1, 1)):
        ctx = _app(max_active_requests=active).state.ctx
        taken = 0
        while ctx.spare.acquire(blocking=False):
            taken += 1
        assert taken == spare, active


def test_a_declared_body_over_the_limit_is_refused_naming_its_size():
    """A Content-Length over --max-body-bytes is refused from the header, naming the declared size,
    before the body is read.  Break: the header not checked (the body read up to the limit, and the
    413 says only 'of more')."""
    client = TestClient(_app(max_body_bytes=1024), base_url="http://localhost")
    r = client.post("/v1/sessions", content=b" " * 2000, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == "request body of 2000 bytes is over this server's limit of 1024 bytes"


def test_a_cross_origin_403_is_counted():
    """A keyless server's Origin refusal is counted in specdec_http_errors_total, as its Host refusal is."""
    app = _app()
    client = TestClient(app, base_url="http://localhost")
    r = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # as the Host refusal
    assert 'specdec_http_errors_total{status="403"} 1.0' in client.get("/metrics").text


def test_an_origin_without_a_host_name_is_refused():
    """An Origin that names no host (empty, or a sandboxed page's 'null') is not a loopback Origin: 403."""
    client = TestClient(_app(), base_url="http://localhost")
    for origin in ("", "null"):
        assert client.get("/v1/models", headers={"Origin": origin}).status_code == 403, repr(origin)


def test_a_host_with_an_unclosed_bracket_stays_whole():
    """A malformed Host ('[box.lan' without its ']') is kept whole, not read as 'box.lan': a keyless
    server refuses it even though 'box.lan' is an allowed host."""
    assert host_name("[::1") == "[::1" and host_name("[box.lan") == "[box.lan"
    client = TestClient(_app(allowed_hosts=("box.lan",)), base_url="http://localhost")
    assert client.get("/v1/models", headers={"Host": "box.lan"}).status_code == 200
    assert client.get("/v1/models", headers={"Host": "[box.lan"}).status_code == 403


def test_guard_leaves_metrics_open_by_default():
    """Guard on its own (no open_metrics given) lets a scraper read /metrics without a key, and
    still asks a key for everything else."""

    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    guard = Guard(app, keys=("k",))
    for path in ("/metrics", "/v1/models"):
        scope = {"type": "http", "path": path, "headers": [(b"host", b"localhost")]}
        asyncio.run(guard(scope, None, send))
    assert reached == ["/metrics"] and sent[0]["status"] == 401


def test_a_missing_host_is_refused_even_with_an_empty_allowed_host():
    """A keyless server never answers a request without a Host name, whatever names were allowed
    (an empty --allowed-host does not open it to Host-less requests)."""

    reached: list[str] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    asyncio.run(Guard(app, keys=(), allowed_hosts=("",))({"type": "http", "path": "/v1/models", "headers": []}, None, send))
    assert reached == [] and sent[0]["status"] == 403


def test_a_key_file_that_is_a_directory_is_a_config_error(tmp_path):
    """Any OSError reading the file (here IsADirectoryError, not FileNotFoundError) is a ConfigError."""
    with pytest.raises(ConfigError, match="cannot read the key file"):
        read_key_file(tmp_path)


def test_serve_hands_uvicorn_the_connection_limit_and_the_grace_plus_flush(monkeypatch):
    import uvicorn

    from specdec import defaults

    seen = {}

    class Config:
        def __init__(self, app, **kw):
            seen.update(kw)

    monkeypatch.setattr(uvicorn, "Config", Config)
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    ctx = types.SimpleNamespace(settings=types.SimpleNamespace(shutdown_timeout_s=7.0), live=())
    app = types.SimpleNamespace(state=types.SimpleNamespace(ctx=ctx))
    logger = logging.getLogger("uvicorn.access")
    before = list(logger.filters)
    try:
        runner.serve(app, host="127.0.0.1", port=1, limit_concurrency=3)
    finally:
        logger.filters[:] = before
    assert seen["limit_concurrency"] == 3
    assert seen["timeout_graceful_shutdown"] == 7.0 + defaults.SERVER_SHUTDOWN_FLUSH_S


def _metric(client: TestClient, name: str, **labels: str) -> float | None:
    """A sample of the in-process server's Prometheus registry."""
    return client.app.state.ctx.metrics.registry.get_sample_value(name, labels)


def test_unverified_tokens_are_counted_per_round_not_cumulatively():
    """specdec_unverified_tokens_total counts the tokens each round appended unverified (2 + 2 = 4),
    not the session's running total after each round (2 + 4)."""
    client = TestClient(_app(), base_url="http://localhost")
    sid = _session(client)
    for seq in range(2):
        r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "unverified_tokens": [1, 2]})
        assert r.status_code == 200, r.text
    assert _metric(client, "specdec_unverified_tokens_total") == 4.0


def test_accepted_and_emitted_draft_tokens_go_to_their_own_counters():
    """A round's accepted draft tokens count in specdec_draft_tokens_accepted_total, its emitted ones
    (accepted + the next token) in specdec_tokens_emitted_total."""
    client = TestClient(_app(), base_url="http://localhost")
    sid = _session(client)
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2, 3]})
    assert r.status_code == 200, r.text
    accepted, emitted = r.json()["num_accepted"], len(r.json()["tokens"])
    assert emitted == accepted + 1
    assert _metric(client, "specdec_draft_tokens_accepted_total", wire="greedy") == accepted
    assert _metric(client, "specdec_tokens_emitted_total", wire="greedy") == emitted


def test_a_session_is_idle_from_the_end_of_its_last_round_not_its_start(monkeypatch):
    """The idle clock restarts when a verify round ends: a round that took longer than the TTL does
    not leave its session to the next sweep.  The round's length is simulated by moving the session's
    last use (set when the round began) 2 TTLs back while the round runs."""
    from specdec.server import sessions

    real = sessions.EdgeSession.verify

    def slow_round(self, *args, **kwargs):
        self.last_used -= 2 * 900.0  # as if this round had run for 2 TTLs
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sessions.EdgeSession, "verify", slow_round)
    client = TestClient(_app(session_ttl_s=900.0), base_url="http://localhost")
    sid = _session(client)
    assert client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1]}).status_code == 200
    store = client.app.state.ctx.store
    assert store.sweep() == 0 and len(store) == 1
    assert client.get(f"/v1/sessions/{sid}").status_code == 200


def test_unverified_tokens_count_in_a_rounds_kv_growth_under_the_cap():
    """A round's KV growth is sized from everything it appends (unverified tokens + draft), so a
    round whose 200 unverified tokens would grow the cache past the KV cap is refused (503) and the
    cap holds; sizing it from the draft alone would let the cache grow past the cap."""
    model = tiny_native()
    per_position = model.new_cache(1).bytes_per_position
    cap = per_position * 164  # a new session's first allocation fits, a 200-position growth does not
    client = TestClient(create_app(model, settings=ServerSettings(max_kv_bytes=cap)), base_url="http://localhost")
    sid = _session(client)
    store = client.app.state.ctx.store
    assert store.kv_bytes() <= cap
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "unverified_tokens": [1] * 200})
    assert r.status_code == 503, r.text
    assert store.kv_bytes() <= cap


class _CapRecorder:
    """Stands in for the server's DraftCap: notes what the verify endpoint tells it and asks it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cap(self, wire, *, wanted=None, **_):
        self.calls.append(("cap", wire, wanted))
        return None

    def observe_tokens(self, tokens):
        self.calls.append(("tokens", tokens))

    def observe_round(self, wire, gamma, accepted, **_):
        self.calls.append(("round", wire, gamma, accepted))


def test_the_draft_cap_learns_emitted_tokens_from_every_round_and_acceptance_from_chains_only():
    """Each verified round reports all the tokens it emitted (accepted + next) to the draft cap; only a
    chain round teaches it acceptance per position (a tree's gamma/accepted are no chain's)."""
    client = TestClient(_app(), base_url="http://localhost")
    cap = _CapRecorder()
    client.app.state.ctx.draft_cap = cap
    sid = _session(client)
    chain = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2, 3]}).json()
    assert cap.calls == [("cap", "greedy", 3), ("tokens", len(chain["tokens"])),
                         ("round", "greedy", 3, chain["num_accepted"])]
    cap.calls.clear()
    tree = client.post(f"/v1/sessions/{sid}/verify",
                       json={"seq": 1, "draft_tokens": [1, 2, 3], "parents": [-1, -1, 0]}).json()
    assert tree["path"] is not None
    assert cap.calls == [("tokens", len(tree["tokens"]))]
