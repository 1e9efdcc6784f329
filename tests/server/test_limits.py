"""Session bounds (count with LRU eviction, idle TTL, all-busy 429) and the serve command's guards.

In-process (the app object directly): these are about the store's bookkeeping, not the wire.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from fastapi.testclient import TestClient

from specdec.cli import main
from specdec.errors import ConfigError
from specdec.models.toy import ToyLM
from specdec.server import ServerSettings, create_app
from specdec.server.command import is_loopback


def _client(**settings) -> TestClient:
    return TestClient(create_app(ToyLM(4, order=1, seed=0), settings=ServerSettings(**settings)), base_url="http://localhost")


def _new(client: TestClient) -> str:
    r = client.post("/v1/sessions", json={"prompt_ids": [1], "temperature": 0.0})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def test_least_recently_used_session_is_evicted():
    client = _client(max_sessions=2)
    a, b = _new(client), _new(client)
    assert client.post(f"/v1/sessions/{a}/verify", json={"seq": 0}).status_code == 200  # a is now the most recent
    c = _new(client)
    assert client.get(f"/v1/sessions/{b}").status_code == 404
    assert client.get(f"/v1/sessions/{a}").status_code == 200 and client.get(f"/v1/sessions/{c}").status_code == 200
    assert 'specdec_sessions_evicted_total{reason="lru"} 1.0' in client.get("/metrics").text


def test_idle_sessions_expire():
    client = _client(session_ttl_s=0.2)
    sid = _new(client)
    time.sleep(0.3)
    r = client.get("/health")
    assert r.status_code == 200
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0})
    assert r.status_code == 404 and "expired" in r.json()["error"]["message"]


def test_all_sessions_busy_is_a_429():
    client = _client(max_sessions=1)
    sid = _new(client)
    store = client.app.state.ctx.store
    lock = store.get(sid).lock
    with lock:  # a verify in progress
        r = client.post("/v1/sessions", json={"prompt_ids": [1], "temperature": 0.0})
    assert r.status_code == 429 and "busy" in r.json()["error"]["message"]
    assert client.get(f"/v1/sessions/{sid}").status_code == 200


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max sessions"):
        ServerSettings(max_sessions=0)
    with pytest.raises(ValueError, match="max gamma"):
        ServerSettings(max_gamma=65)
    with pytest.raises(ValueError, match="tree must be 'chain', 'auto' or a node count"):
        ServerSettings(tree="bushy")
    for kw in ({"gamma": 5}, {"tree": 5}):  # the server's own drafts keep to its bound too
        with pytest.raises(ValueError, match=r"\(5\) drafts more than its max gamma \(4\)"):
            ServerSettings(max_gamma=4, **kw)
    ServerSettings(max_gamma=4, gamma=4, tree=4)


def test_serve_refuses_an_open_public_address(capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error: refusing to listen on 0.0.0.0 without an API key") and "\n" not in err
    assert main(["serve", "--host", "127.0.0.1", "--api-key", " "]) == 2
    assert "API key is empty" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("10.0.0.1")
    assert main(["serve", "--tree", "0"]) == 2
    assert capsys.readouterr().err.strip() == "specdec: error: tree node count must be between 1 and 64, got 0"
    assert main(["serve", "--prefix-cache-mib", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "specdec: error: --prefix-cache-mib must be a finite number >= 0 (0 turns prefix caching off), got -1"
    # NaN / infinite sizes ended in a conversion traceback; zero limits named internals (a repr, bytes)
    for argv, says in ((["--max-kv-mib", "nan"], "--max-kv-mib must be a finite number > 0, got nan"),
                       (["--max-kv-mib", "inf"], "--max-kv-mib must be a finite number > 0, got inf"),
                       (["--max-kv-mib", "-1"], "--max-kv-mib must be a finite number > 0, got -1"),
                       (["--prefix-cache-mib", "nan"], "--prefix-cache-mib must be a finite number >= 0"),
                       (["--max-tokens-per-pass", "0"], "the tokens per pass must be >= 1, got 0"),
                       (["--prefill-chunk", "0"], "the prefill chunk must be >= 1, got 0"),
                       (["--max-queue", "0"], "the queue length must be >= 1, got 0")):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("specdec: error: " + says) and "\n" not in err, err
    with pytest.raises(ValueError, match="prefix cache"):
        ServerSettings(prefix_cache_bytes=-1)


def test_metrics_are_open_unless_the_operator_asks_for_the_key():
    assert _client(api_key="k").get("/metrics").status_code == 200
    guarded = _client(api_key="k", metrics_need_key=True)
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


def test_per_position_counters_of_the_verify_api():
    client = _client()
    sid = _new(client)
    assert client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2, 3]}).status_code == 200
    text = client.get("/metrics").text
    for k in (1, 2, 3):
        assert f'specdec_draft_position_proposed_total{{position="{k}",wire="greedy"}} 1.0' in text


def test_serve_refuses_bad_names_lengths_and_templates_before_loading(capsys, tmp_path):
    """vLLM's --served-model-name, --max-model-len and --chat-template: bad values are one line and
    exit 2 before any model loads (a missing file, a template that does not compile, a length
    that leaves no room to generate, a blank name)."""
    for argv, message in ((["--chat-template", str(tmp_path / "missing.jinja")], "neither a file nor a Jinja template"),
                          (["--chat-template", "{% for m in messages %}"], "does not compile"),
                          (["--max-model-len", "1"], "max model length must be >= 2"),
                          (["--served-model-name", " "], "served model name")):
        assert main(["serve", "--target", "definitely-not-loaded", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("specdec: error:") and message in err and "\n" not in err, err


def test_a_request_may_fill_the_context_to_its_last_position():
    """prompt + max_tokens <= the context, as in vLLM (a request with max_tokens = context - prompt
    was a 400 that named one token less): such a request gets every token plain decoding gives,
    speculative or not; one more is a 400; a request without max_tokens gets what is left of its
    endpoint's default; ``truncate_prompt_tokens: -1`` keeps as many as leave room for max_tokens;
    a prompt that fills the context is a 400 that says so; an edge session commits up to the
    context's last position too."""
    from specdec.drafters import ModelDrafter

    from toy_server import LetterTokenizer

    target = ToyLM(6, order=2, seed=3)
    target.max_length = 24
    draft = target.perturbed(0.05, seed=1)

    def client(drafter: bool) -> TestClient:
        app = create_app(target, tokenizer=LetterTokenizer(), settings=ServerSettings(draft_cap=False),
                         drafter_factory=(lambda: ModelDrafter(draft)) if drafter else None, drafter_name="toy")
        return TestClient(app, base_url="http://localhost")

    plain, spec = client(False), client(True)
    prompt = "abcabcabcabcabcabcab"  # 20 tokens: room for 4

    def ask(c: TestClient, **kw):
        return c.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "ignore_eos": True, **kw})

    want = ask(plain, max_tokens=4).json()
    assert want["usage"]["completion_tokens"] == 4 and want["choices"][0]["finish_reason"] == "length"
    for kw in ({"gamma": 6}, {"tree": 8}, {"gamma": "auto"}):
        got = ask(spec, max_tokens=4, **kw).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"], kw
    r = ask(plain, max_tokens=5)
    assert r.status_code == 400 and "at most 4" in r.text, r.text
    assert ask(plain).json()["usage"]["completion_tokens"] == 4  # the default 16, cut to the room left
    long = prompt * 3
    r = plain.post("/v1/completions", json={"prompt": long, "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 21, r.text
    r = plain.post("/v1/completions", json={"prompt": long[:24], "max_tokens": 1, "temperature": 0})
    assert r.status_code == 400 and "fill the model's context of 24" in r.text, r.text
    sid = plain.post("/v1/sessions", json={"prompt_ids": list(range(1, 6)) * 4, "temperature": 0.0}).json()["session_id"]
    committed = 0
    for seq in range(4):
        r = plain.post(f"/v1/sessions/{sid}/verify", json={"seq": seq})
        assert r.status_code == 200, r.text
        committed += len(r.json()["tokens"])
    assert committed == 4
    r = plain.post(f"/v1/sessions/{sid}/verify", json={"seq": 4})
    assert r.status_code == 400, r.text
    # a session resumed with generated_ids that fill the context: the message counts both parts
    r = plain.post("/v1/sessions", json={"prompt_ids": [1] * 20, "generated_ids": [2] * 4, "temperature": 0.0})
    assert r.status_code == 400 and "20 + 4 = 24 tokens, which fill the model's context of 24" in r.text, r.text
    r = plain.post("/v1/sessions", json={"prompt_ids": [1] * 20, "generated_ids": [2] * 3, "temperature": 0.0})
    assert r.status_code == 201, r.text


def test_the_sweep_never_drops_a_busy_session():
    client = _client(session_ttl_s=60.0)
    sid = _new(client)
    store = client.app.state.ctx.store
    session = store.get(sid)
    session.last_used -= 3600.0  # idle far past the TTL, without waiting for it
    held, done = threading.Event(), threading.Event()

    def verify_in_progress() -> None:  # a round holds the session's lock until the sweep is over
        with session.lock:
            held.set()
            done.wait(10.0)  # a guard against a sweep that waits for this lock: it must not hang the test

    worker = threading.Thread(target=verify_in_progress)
    worker.start()
    held.wait(30.0)
    try:
        assert store.sweep() == 0
        assert len(store) == 1
    finally:
        done.set()
        worker.join()
    assert client.get(f"/v1/sessions/{sid}").status_code == 200  # still there (and used just now)
    session.last_used -= 3600.0
    assert store.sweep() == 1 and len(store) == 0  # idle and free: swept


def test_served_model_names_are_at_most_256_characters():
    """A 256-character served model name is accepted, 257 characters are refused."""
    ServerSettings(model_name="m" * 256)
    with pytest.raises(ValueError, match="served model name must be 1 to 256 characters"):
        ServerSettings(model_name="m" * 257)


@pytest.mark.parametrize("kw, says", [
    ({"max_body_bytes": 1023}, "max body size must be >= 1024 bytes"),
    ({"default_max_tokens": 0}, "default max tokens must be >= 1"),
    ({"api_keys": ("good", "  ")}, "an API key is empty"),
    ({"body_timeout_s": 0.0}, "body timeout must be > 0 seconds"),
    ({"shutdown_timeout_s": math.inf}, "shutdown timeout must be >= 0 seconds"),
    ({"max_active_requests": 0}, "max active requests must be >= 1"),
    ({"session_ttl_s": 0.0}, "session TTL must be > 0 seconds"),
    ({"model_aliases": ("beta", " ")}, "served model name"),  # aliases are checked as the first name is
    ({"model_aliases": ("b" * 257,)}, "served model name"),
    ({"session_ttl_s": math.nan}, "session TTL must be > 0 seconds"),
    ({"max_gamma": 0}, "max gamma must be between 1 and"),
    ({"api_key": "  "}, "the API key is empty"),  # blank, not only ""
    ({"sweep_interval_s": 0.0}, "sweep interval must be > 0 seconds"),
    ({"header_timeout_s": 0.0}, "header timeout must be > 0 seconds"),
    ({"body_timeout_s": math.nan}, "body timeout must be > 0 seconds"),
    ({"shutdown_timeout_s": math.nan}, "shutdown timeout must be >= 0 seconds"),
    ({"max_kv_bytes": 0}, "key/value budget must be >= 1 byte"),
    ({"kv_initial_length": 0}, "initial KV length must be >= 1"),
])
def test_out_of_range_settings_are_refused(kw, says):
    """Each setting just past its bound (or NaN) is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=says):
        ServerSettings(**kw)


def test_smallest_accepted_settings():
    """The bounds themselves are accepted: 1024-byte bodies, 1 token, 1 request, a 0 s shutdown, a
    2-token context, max gamma 1, prefix caching off (0 bytes), a 1-byte KV budget, a 1-position
    initial KV cache."""
    ServerSettings(max_body_bytes=1024, default_max_tokens=1, max_active_requests=1, shutdown_timeout_s=0.0)
    s = ServerSettings(max_model_len=2, max_gamma=1, gamma=1, tree="chain", prefix_cache_bytes=0, max_kv_bytes=1,
                       kv_initial_length=1)
    assert s.max_model_len == 2 and s.prefix_cache_bytes == 0


def test_names_and_keys_are_listed_once():
    """An alias equal to the model name, and a key file repeating --api-key, are not listed twice."""
    s = ServerSettings(model_name="a", model_aliases=("a", "b"), api_key="k1", api_keys=("k1", "k2"))
    assert s.model_names == ("a", "b")
    assert s.keys == ("k1", "k2")



def test_the_batching_options_reach_the_scheduler_config():
    """--max-tokens-per-pass, --prefill-chunk, --max-queue and --gather-gap-ms are passed on."""
    cfg = ServerSettings(max_tokens_per_pass=32, prefill_chunk=16, max_queue=7, gather_gap_s=0.0).scheduler_config()
    assert (cfg.max_tokens, cfg.chunk, cfg.max_queue, cfg.gather_gap) == (32, 16, 7, 0.0)
