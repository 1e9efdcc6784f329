"""Fuzzing every JSON endpoint of the server process from its own OpenAPI schema: never a 5xx.

Bodies come from the published schema (``tests/schema_strategy.py``: well-typed bodies that reach
deep into the handlers), from arbitrary JSON values, and from raw bytes.  Every answer must be a
success or a 4xx whose JSON body says what was wrong.
"""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategy import from_schema

from .conftest import API_KEY, MAX_GAMMA, VOCAB

FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def spec(toy_server) -> dict:
    return httpx.get(toy_server.url + "/openapi.json", timeout=60).json()


@pytest.fixture(scope="module")
def client(toy_server):
    with httpx.Client(base_url=toy_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _body_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


def _session(client: httpx.Client, wire: str) -> str:
    body = {"prompt_ids": [1, 2], "wire": wire, "temperature": 0.0 if wire == "greedy" else 1.0}
    return client.post("/v1/sessions", json=body).json()["session_id"]


POSTS = ["/v1/sessions", "/v1/sessions/{session_id}/verify", "/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", POSTS)
def test_schema_driven_bodies_never_get_a_5xx(client, spec, path):
    sessions = {w: _session(client, w) for w in ("greedy", "coupled", "sparse-q", "lossy-scalar")}

    @FUZZ
    @given(body=from_schema(_body_schema(spec, path), spec), wire=st.sampled_from(sorted(sessions)))
    def run(body, wire):
        _check(client.post(path.replace("{session_id}", sessions[wire]), json=body))

    run()


@pytest.mark.parametrize("path", POSTS)
def test_arbitrary_json_never_gets_a_5xx(client, path):
    sid = _session(client, "sparse-q")

    @FUZZ
    @given(body=_json, session=st.one_of(st.just(sid), st.text(min_size=1, max_size=200)))
    def run(body, session):
        _check(client.post(path.replace("{session_id}", quote(session, safe="")), json=body))

    run()


_RAW_JSON = [b'{"seq": 0, "draft_tokens": [1], "q": [NaN]}', b'{"seq": Infinity}', b'{"prompt_ids": [1e999]}',
             b'{"seq": 0, "draft_tokens": [1], "q": [{"ids": [1], "probs": [-Infinity]}]}', b"[" * 5000, b'"' + b"x" * 1000]


@FUZZ
@given(raw=st.binary(max_size=200) | st.sampled_from(_RAW_JSON),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]))
def test_raw_bytes_never_get_a_5xx(client, raw, content_type):
    for path in ("/v1/sessions", "/v1/completions", "/v1/chat/completions"):
        _check(client.post(path, content=raw, headers={"content-type": content_type}))


def _rows(draw, tokens: list[int]) -> list[dict]:
    rows = []
    for t in tokens:
        ids = draw(st.lists(st.integers(0, VOCAB), min_size=0, max_size=3, unique=True))
        if draw(st.booleans()):
            ids = [t] + [i for i in ids if i != t]
        probs = draw(st.lists(st.floats(-0.1, 1.1, allow_nan=False), min_size=len(ids), max_size=len(ids)))
        if ids and draw(st.booleans()):
            probs = [1.0 / len(ids)] * len(ids)
        rows.append({"ids": ids, "probs": probs})
    return rows


@st.composite
def _near_valid_round(draw, next_seq: int) -> dict:
    """Bodies close to a valid round: right or nearly right seq, ids around the vocabulary edge."""
    tokens = draw(st.lists(st.integers(0, VOCAB), max_size=MAX_GAMMA + 1))
    body: dict = {"seq": draw(st.sampled_from([next_seq, next_seq, max(next_seq - 1, 0), next_seq + 1]))}
    if draw(st.booleans()) or tokens:
        body["draft_tokens"] = tokens
    kind = draw(st.sampled_from(["none", "rows", "scalars"]))
    if kind == "rows":
        body["q"] = _rows(draw, tokens)
    elif kind == "scalars":
        body["q"] = draw(st.lists(st.floats(-0.1, 1.1, allow_nan=False), min_size=len(tokens), max_size=len(tokens)))
    if draw(st.integers(0, 5)) == 0:
        body["unverified_tokens"] = draw(st.lists(st.integers(0, VOCAB), max_size=3))
    return body


@pytest.mark.parametrize("wire", ["greedy", "coupled", "sparse-q", "lossy-scalar"])
def test_near_valid_rounds_never_get_a_5xx_and_keep_the_session_consistent(client, wire):
    sid = _session(client, wire)
    statuses: list[int] = []

    @FUZZ
    @given(data=st.data())
    def run(data):
        info = client.get(f"/v1/sessions/{sid}").json()
        body = data.draw(_near_valid_round(info["next_seq"]))
        r = client.post(f"/v1/sessions/{sid}/verify", json=body)
        _check(r)
        statuses.append(r.status_code)
        after = client.get(f"/v1/sessions/{sid}").json()
        if r.status_code == 200 and not r.json()["metrics"]["replayed"]:
            assert after["next_seq"] == info["next_seq"] + 1
            assert after["committed"] == info["committed"] + len(body.get("unverified_tokens", [])) + len(r.json()["tokens"])
        else:  # an error or a replay changes nothing
            assert (after["next_seq"], after["committed"]) == (info["next_seq"], info["committed"])

    run()
    assert statuses.count(200) >= 5  # the fuzzer reached the verification path, not only the validators
