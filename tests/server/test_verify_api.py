"""The verify API against a server process: idempotent seq, 409s, bad input -> 4xx, session unchanged."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig, process_logits
from specdec.server.metrics import ServerMetrics

from .conftest import API_KEY, MAX_GAMMA, MAX_LENGTH, VOCAB

TARGET = ToyLM(VOCAB, order=2, seed=3)  # the server's model


def _create(api: httpx.Client, **fields) -> dict:
    body = {"prompt_ids": [1, 2, 3], "temperature": 1.0, "seed": 11, "wire": "sparse-q", **fields}
    r = api.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _info(api: httpx.Client, sid: str) -> dict:
    r = api.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    info = r.json()
    info.pop("idle_s")
    return info


def _uniform_rows(tokens: list[int]) -> list[dict]:
    """A valid sparse q for each draft token: uniform over the token and its neighbour."""
    return [{"ids": [t, (t + 1) % VOCAB], "probs": [0.5, 0.5]} for t in tokens]


def _round(api: httpx.Client, sid: str, seq: int, tokens: list[int]) -> httpx.Response:
    return api.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "draft_tokens": tokens, "q": _uniform_rows(tokens)})


def _error(r: httpx.Response, status: int | tuple[int, ...]) -> str:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert isinstance(message, str) and len(message) > 10
    return message


def test_health_is_open_everything_else_needs_the_key(toy_server):
    assert httpx.get(toy_server.url + "/health", timeout=60).json()["vocab_size"] == VOCAB
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.post(toy_server.url + "/v1/sessions", json={"prompt_ids": [1]}, headers=headers, timeout=60)
        assert "API key" in _error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(toy_server.url + "/metrics", timeout=60).status_code == 200  # scrapers need no key by default


def test_retry_of_the_last_seq_returns_the_stored_verdict(api):
    sid = _create(api)["session_id"]
    first = _round(api, sid, 0, [1, 2, 3])
    assert first.status_code == 200
    before = _info(api, sid)
    for _ in range(3):  # a random rule: only a stored verdict can repeat itself
        again = _round(api, sid, 0, [1, 2, 3])
        assert again.status_code == 200
        a, b = first.json(), again.json()
        assert b["metrics"].pop("replayed") is True and a["metrics"].pop("replayed") is False
        assert a == b
        assert _info(api, sid) == before
    # the same seq with another draft is a conflict, and changes nothing either
    assert "different draft" in _error(_round(api, sid, 0, [4, 4]), 409)
    assert _info(api, sid) == before
    assert _round(api, sid, 1, [0]).status_code == 200
    assert _info(api, sid)["next_seq"] == 2


def test_out_of_order_seq_is_a_conflict(api):
    sid = _create(api)["session_id"]
    assert "expects seq 0" in _error(_round(api, sid, 1, [1]), 409)
    assert _round(api, sid, 0, [1]).status_code == 200
    for seq in (2, 7, 1000):
        assert "expects seq 1 (or 0 to repeat the last round)" in _error(_round(api, sid, seq, [1]), 409)
    assert _info(api, sid)["next_seq"] == 1


def _bad_requests(sid: str) -> list[tuple[str, dict, int | tuple[int, ...], str]]:
    """(name, httpx request kwargs, status, message fragment); the valid next round is seq 1."""
    url = f"/v1/sessions/{sid}/verify"

    def body(**kw) -> dict:
        return {"method": "POST", "url": url, "json": {"seq": 1, "draft_tokens": [1, 2], "q": _uniform_rows([1, 2]), **kw}}

    def raw(text: str, content_type: str = "application/json") -> dict:
        return {"method": "POST", "url": url, "content": text.encode(), "headers": {"content-type": content_type}}

    rows_nan = '{"seq": 1, "draft_tokens": [1], "q": [{"ids": [1, 2], "probs": [NaN, 0.5]}]}'
    return [
        ("no key", {**body(), "headers": {"Authorization": "Bearer nope"}}, 401, "API key"),
        ("id out of vocab", body(draft_tokens=[1, VOCAB], q=_uniform_rows([1, VOCAB])), 400, "outside the vocabulary"),
        ("q id out of vocab", body(draft_tokens=[1], q=[{"ids": [1, 99], "probs": [0.5, 0.5]}]), 400, "outside the vocabulary"),
        ("negative id", body(draft_tokens=[-1], q=[0.5]), 422, "greater than or equal to 0"),
        ("gamma over the server's bound", body(draft_tokens=[1] * (MAX_GAMMA + 1), q=_uniform_rows([1] * (MAX_GAMMA + 1))), 400, f"at most {MAX_GAMMA}"),
        ("gamma over the protocol's bound", body(draft_tokens=[1] * 65, q=None), 422, "at most 64"),
        ("NaN probability", raw(rows_nan), 422, "finite"),
        ("negative probability", body(draft_tokens=[1], q=[{"ids": [1, 2], "probs": [0.5, -0.5]}]), 422, "greater than or equal to 0"),
        ("probability over 1", body(draft_tokens=[1], q=[{"ids": [1], "probs": [1.5]}]), 422, "less than or equal to"),
        ("row sum over 1", body(draft_tokens=[1], q=[{"ids": [1, 2], "probs": [0.6, 0.6]}]), 422, "sums to"),
        ("draft token with q = 0", body(draft_tokens=[1], q=[{"ids": [2], "probs": [1.0]}]), 422, "q = 0"),
        ("sparse-q without q", body(q=None), 400, "needs 'q'"),
        ("scalar q in sparse-q mode", body(q=[0.5, 0.5]), 400, "needs 'q'"),
        ("q rows mismatch", body(q=_uniform_rows([1])), 422, "rows but there are"),
        ("unverified id out of vocab", body(unverified_tokens=[VOCAB + 3]), 400, "outside the vocabulary"),
        ("negative seq", body(seq=-1), 422, "greater than or equal to 0"),
        ("malformed JSON", raw('{"seq": 1, "draft_tokens": [1,'), 422, "JSON"),
        ("not JSON", raw("seq=1", "application/x-www-form-urlencoded"), 422, "JSON object"),
        ("oversized body", raw(json.dumps({"seq": 1, "draft_tokens": [1], "pad": "x" * 70000})), 413, "limit"),
        ("unknown field", body(extra=1), 422, "Extra inputs"),
        ("unknown session", {"method": "POST", "url": "/v1/sessions/nope/verify", "json": {"seq": 0}}, 404, "unknown session"),
    ]


def test_every_bad_request_is_a_4xx_with_a_message_and_changes_nothing(api):
    a = _create(api)["session_id"]
    twin = _create(api)["session_id"]  # same seed, same rounds, never sees a bad request
    for sid in (a, twin):
        assert _round(api, sid, 0, [1, 2, 3]).status_code == 200
    before = _info(api, a)
    for name, request, status, fragment in _bad_requests(a):
        message = _error(api.request(**request), status)
        assert fragment in message, (name, message)
        assert _info(api, a) == before, name
    # the session goes on exactly as its twin: no randomness, cache or context was touched
    for seq, draft in ((1, [1, 2]), (2, [0, 5, 5]), (3, [2])):
        ra, rt = _round(api, a, seq, draft), _round(api, twin, seq, draft)
        assert ra.status_code == rt.status_code == 200
        assert ra.json()["tokens"] == rt.json()["tokens"]


def test_mode_mismatches_and_session_lifecycle(api):
    greedy = _create(api, temperature=0.0, wire="greedy")["session_id"]
    r = api.post(f"/v1/sessions/{greedy}/verify", json={"seq": 0, "draft_tokens": [1], "q": [0.5]})
    assert "ids only" in _error(r, 400)
    scalar = _create(api, wire="lossy-scalar")
    assert scalar["method"] == "lossy_resample_p" and scalar["lossless"] is False
    r = api.post(f"/v1/sessions/{scalar['session_id']}/verify", json={"seq": 0, "draft_tokens": [1], "q": _uniform_rows([1])})
    assert "one probability per draft token" in _error(r, 400)
    ok = api.post(f"/v1/sessions/{scalar['session_id']}/verify", json={"seq": 0, "draft_tokens": [1], "q": [0.4]})
    assert ok.status_code == 200 and ok.json()["metrics"]["lossless"] is False
    assert api.delete(f"/v1/sessions/{greedy}").status_code == 200
    assert "unknown session" in _error(api.get(f"/v1/sessions/{greedy}"), 404)
    assert "unknown session" in _error(api.delete(f"/v1/sessions/{greedy}"), 404)
    # creation errors
    assert "no tokenizer" in _error(api.post("/v1/sessions", json={"prompt": "hello"}), 400)
    assert "outside the vocabulary" in _error(api.post("/v1/sessions", json={"prompt_ids": [VOCAB]}), 400)
    assert "context" in _error(api.post("/v1/sessions", json={"prompt_ids": [1] * MAX_LENGTH}), 400)
    assert "temperature 0" in _error(api.post("/v1/sessions", json={"prompt_ids": [1], "wire": "greedy"}), 422)
    assert "no such endpoint" in _error(api.get("/v1/nothing"), 404)


def test_context_full_is_a_400(api):
    info = _create(api, prompt_ids=[1] * (MAX_LENGTH - 8), temperature=0.0, wire="greedy")
    sid = info["session_id"]
    assert info["max_length"] == MAX_LENGTH
    assert "context full" in _error(api.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1] * 8}), 400)
    assert api.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1] * 6}).status_code == 200


def test_a_tree_wider_than_the_room_left_is_context_full(api):
    """Every node of a tree takes a row of the target's cache, however shallow the tree: 7 nodes
    two deep are refused with the 6 positions the session has left, the bound its edge drafts to.
    They used to pass the depth check; where the cache ends with the model's context the pass
    then failed with another message."""
    sid = _create(api, prompt_ids=[1] * (MAX_LENGTH - 6), temperature=0.0, wire="greedy")["session_id"]
    wide = {"seq": 0, "draft_tokens": [0, 1, 2, 3, 1, 2, 3], "parents": [-1, -1, -1, -1, 0, 0, 0]}
    assert "this round needs 7 more positions" in _error(api.post(f"/v1/sessions/{sid}/verify", json=wide), 400)
    fits = {"seq": 0, "draft_tokens": [0, 1, 2, 3, 1, 2], "parents": [-1, -1, -1, -1, 0, 0]}
    assert api.post(f"/v1/sessions/{sid}/verify", json=fits).status_code == 200


def _greedy_next(history: list[int], cfg: SamplingConfig, prompt_len: int) -> int:
    from specdec.sampling import PenaltyState

    state = PenaltyState.start(torch.tensor(history[:prompt_len]), VOCAB)
    if len(history) > prompt_len:
        state.append(torch.tensor(history[prompt_len:]))
    return int(process_logits(TARGET.logits_for(history).unsqueeze(0), cfg, state)[0].argmax())


def test_resume_and_unverified_tokens_keep_the_penalty_state(api):
    """A session re-created with generated_ids (or fed unverified tokens) continues as the original."""
    fields = {"temperature": 0.0, "wire": "greedy", "repetition_penalty": 1.3, "frequency_penalty": 0.7}
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.7)
    prompt = [1, 2, 3]
    sid = _create(api, **fields)["session_id"]
    history = list(prompt)
    for seq in range(4):
        r = api.post(f"/v1/sessions/{sid}/verify", json={"seq": seq, "draft_tokens": [history[-1]]})
        history += r.json()["tokens"]
    generated = history[len(prompt):]
    resumed = _create(api, **fields, prompt_ids=prompt, generated_ids=generated)["session_id"]
    assert _info(api, resumed)["committed"] == len(generated)
    forced = _create(api, **fields)["session_id"]
    r = api.post(f"/v1/sessions/{forced}/verify", json={"seq": 0, "draft_tokens": [], "unverified_tokens": generated})
    assert r.status_code == 200 and r.json()["metrics"]["lossless"] is False
    assert _info(api, forced)["unverified"] == len(generated)
    expected = _greedy_next(history, cfg, len(prompt))
    assert r.json()["tokens"] == [expected]
    r = api.post(f"/v1/sessions/{resumed}/verify", json={"seq": 0, "draft_tokens": []})
    assert r.json()["tokens"] == [expected]
    r = api.post(f"/v1/sessions/{sid}/verify", json={"seq": 4, "draft_tokens": []})
    assert r.json()["tokens"] == [expected]


def test_prometheus_metrics(api):
    sid = _create(api)["session_id"]
    assert _round(api, sid, 0, [1, 2]).status_code == 200
    assert _round(api, sid, 5, [1, 2]).status_code == 409
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "specdec_active_sessions ",
        'specdec_verify_calls_total{lossless="true",wire="sparse-q"}',
        'specdec_acceptance_rate{wire="sparse-q"}',
        'specdec_verify_latency_seconds_bucket{le="0.005",wire="sparse-q"}',
        'specdec_tokens_per_call_count{wire="sparse-q"}',
        'specdec_http_errors_total{status="409"}',
    ):
        assert name in text, name


def test_tree_rounds_over_the_wire(api):
    """A greedy tree round: the server walks the tree, returns the accepted path, and its session
    continues exactly as plain greedy decoding; bad parents are a 422 and change nothing."""
    sid = _create(api, temperature=0.0, wire="greedy")["session_id"]
    hist = [1, 2, 3]
    best = [int(TARGET.logits_for(hist).argmax())]
    best.append(int(TARGET.logits_for(hist + best).argmax()))
    wrong = (best[0] + 1) % VOCAB
    # two root candidates (a wrong one first), the right one has the right child
    body = {"seq": 0, "draft_tokens": [wrong, best[0], best[1]], "parents": [-1, -1, 1]}
    for bad in ([-1, 2, 0], [-1, -1]):
        _error(api.post(f"/v1/sessions/{sid}/verify", json={**body, "parents": bad}), 422)
    r = api.post(f"/v1/sessions/{sid}/verify", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["path"] == [1, 2] and out["tokens"][:2] == best and out["num_accepted"] == 2
    third = int(TARGET.logits_for(hist + best).argmax())
    assert out["tokens"][2] == third
    # a chain round afterwards still lines up with plain greedy
    r = api.post(f"/v1/sessions/{sid}/verify", json={"seq": 1, "draft_tokens": []})
    assert r.json()["tokens"] == [int(TARGET.logits_for(hist + best + [third]).argmax())] and r.json()["path"] is None


def test_an_id_equal_to_the_vocabulary_size_is_a_400_and_changes_nothing(api: httpx.Client):
    """``VOCAB`` itself is the first id outside [0, VOCAB): in a draft, in the unverified tokens and
    in a sparse q row (each checked alone: no other field holds a bad id to give the 400)."""
    greedy = _create(api, temperature=0.0, wire="greedy")["session_id"]
    before = _info(api, greedy)
    url = f"/v1/sessions/{greedy}/verify"
    assert "draft_tokens[1] = 6 is outside the vocabulary" in _error(api.post(url, json={"seq": 0, "draft_tokens": [1, VOCAB]}), 400)
    assert "unverified_tokens[0] = 6 is outside the vocabulary" in _error(
        api.post(url, json={"seq": 0, "unverified_tokens": [VOCAB]}), 400)
    assert _info(api, greedy) == before
    sparse = _create(api)["session_id"]
    before = _info(api, sparse)
    row = {"ids": [1, VOCAB], "probs": [0.5, 0.5]}  # the drafted token is fine, its q row is not
    r = api.post(f"/v1/sessions/{sparse}/verify", json={"seq": 0, "draft_tokens": [1], "q": [row]})
    assert "q row id 6 is outside the vocabulary" in _error(r, 400)
    assert _info(api, sparse) == before
    for sid in (greedy, sparse):  # still usable at seq 0
        body = {"seq": 0, "draft_tokens": [1]}
        if sid == sparse:
            body["q"] = [{"ids": [1], "probs": [1.0]}]
        assert api.post(f"/v1/sessions/{sid}/verify", json=body).status_code == 200


def test_a_logprobs_session_refuses_unverified_tokens(api: httpx.Client):
    """The target never scores unverified tokens, so a session that reports logprobs takes none."""
    sid = _create(api, temperature=0.0, wire="greedy", logprobs=2)["session_id"]
    before = _info(api, sid)
    r = api.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1], "unverified_tokens": [2, 3]})
    assert "takes no unverified tokens" in _error(r, 400)
    assert _info(api, sid) == before and before["unverified"] == 0 and before["lossless"] is True
    r = api.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1]})
    assert r.status_code == 200 and len(r.json()["logprobs"]) == len(r.json()["tokens"])


def test_a_resumed_sessions_constraints_see_its_generated_ids(api: httpx.Client):
    """min_tokens counts the resumed tokens, and a bad word may span the resume point: the
    session's constraint history holds generated_ids as if it had generated them itself."""
    prompt, generated = [1, 2, 3], [4, 5, 1]
    best = int(TARGET.logits_for(prompt + generated).argmax())  # greedy's next token, nothing masked
    greedy = {"temperature": 0.0, "wire": "greedy", "prompt_ids": prompt, "generated_ids": generated}

    def next_token(**fields) -> int:
        sid = _create(api, **greedy, **fields)["session_id"]
        r = api.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": []})
        assert r.status_code == 200, r.text
        return r.json()["tokens"][0]

    assert next_token() == best
    assert next_token(min_tokens=3, floor_ids=[best]) == best  # 3 generated already: the floor is over
    assert next_token(min_tokens=4, floor_ids=[best]) != best  # one more to go: still masked
    assert next_token(bad_token_ids=[[generated[-1], best]]) != best  # completes a bad word across the resume
    assert next_token(bad_token_ids=[[generated[-2], best]]) == best  # does not


def _value(m: ServerMetrics, name: str, **labels: str):
    return m.registry.get_sample_value(name, labels)


def test_a_verify_round_counts_what_it_drafted_accepted_and_emitted():
    """gamma 3, 1 accepted, 2 emitted, 2 unverified: each counter gets its own number."""
    m = ServerMetrics()
    m.observe_verify(wire="greedy", lossless=False, gamma=3, accepted=1, emitted=2, seconds=0.01, unverified=2)
    assert _value(m, "specdec_draft_tokens_proposed_total", wire="greedy") == 3
    assert _value(m, "specdec_draft_tokens_accepted_total", wire="greedy") == 1
    assert _value(m, "specdec_tokens_emitted_total", wire="greedy") == 2
    assert _value(m, "specdec_tokens_per_call_sum", wire="greedy") == 2
    assert _value(m, "specdec_unverified_tokens_total") == 2
    assert _value(m, "specdec_verify_calls_total", wire="greedy", lossless="false") == 1
    assert _value(m, "specdec_draft_position_accepted_total", wire="greedy", position="1") == 1
    assert _value(m, "specdec_draft_position_accepted_total", wire="greedy", position="2") is None


def test_the_acceptance_gauge_is_since_start_not_the_last_round():
    """4 of 4 then 0 of 4 accepted: the gauge reads 0.5."""
    m = ServerMetrics()
    for accepted in (4, 0):
        m.observe_verify(wire="greedy", lossless=True, gamma=4, accepted=accepted, emitted=accepted + 1, seconds=0.0,
                         unverified=0)
    assert _value(m, "specdec_acceptance_rate", wire="greedy") == pytest.approx(0.5)


def test_positions_past_16_are_pooled_into_the_last_label():
    """A 20-token draft: positions 16 to 20 are counted under position 16, no label past it."""
    m = ServerMetrics()
    m.observe_verify(wire="greedy", lossless=True, gamma=20, accepted=0, emitted=1, seconds=0.0, unverified=0)
    assert _value(m, "specdec_draft_position_proposed_total", wire="greedy", position="16") == 5
    assert _value(m, "specdec_draft_position_proposed_total", wire="greedy", position="17") is None


def _stats(**kw):
    base = dict(lossless=True, target_calls=5, draft_tokens_proposed=100, draft_tokens_accepted=29, generated_tokens=3,
                prompt_tokens=7, proposed_per_position=[100], acceptance_per_position=[0.29], ttft_s=0.2, wall_s=1.0)
    return SimpleNamespace(**{**base, **kw})


def test_a_completion_counts_its_target_calls_tokens_and_positions():
    """One OpenAI completion: target calls, tokens emitted, per-position acceptance (rounded, not
    truncated) and the mean inter-token time (after the first token) as its stats give them."""
    m = ServerMetrics()
    m.observe_generation("chat", _stats())
    assert _value(m, "specdec_verify_calls_total", wire="openai", lossless="true") == 5
    assert _value(m, "specdec_tokens_emitted_total", wire="openai") == 3
    assert _value(m, "specdec_draft_position_accepted_total", wire="openai", position="1") == 29  # 0.29 * 100
    assert _value(m, "specdec_inter_token_seconds_sum", endpoint="chat") == pytest.approx((1.0 - 0.2) / 2)
    assert _value(m, "specdec_prompt_tokens_total", endpoint="chat") == 7


def test_a_one_token_completion_has_no_inter_token_time():
    """A completion of one token observes a first-token time but no inter-token time."""
    m = ServerMetrics()
    m.observe_generation("completions", _stats(generated_tokens=1))
    assert _value(m, "specdec_time_to_first_token_seconds_count", endpoint="completions") == 1
    assert not _value(m, "specdec_inter_token_seconds_count", endpoint="completions")


def test_a_completion_counts_drafted_accepted_acceptance_and_latency():
    """One completion: proposed / accepted draft tokens, the acceptance gauge (29/100) and the
    end-to-end time (wall_s, not the first-token time) as its stats give them."""
    m = ServerMetrics()
    m.observe_generation("chat", _stats())
    assert _value(m, "specdec_draft_tokens_proposed_total", wire="openai") == 100
    assert _value(m, "specdec_draft_tokens_accepted_total", wire="openai") == 29
    assert _value(m, "specdec_acceptance_rate", wire="openai") == pytest.approx(0.29)
    assert _value(m, "specdec_request_seconds_sum", endpoint="chat") == pytest.approx(1.0)
    assert _value(m, "specdec_time_to_first_token_seconds_sum", endpoint="chat") == pytest.approx(0.2)


def test_a_lossy_completion_is_labelled_lossless_false():
    m = ServerMetrics()
    m.observe_generation("completions", _stats(lossless=False))
    assert _value(m, "specdec_verify_calls_total", wire="openai", lossless="false") == 5
    assert _value(m, "specdec_verify_calls_total", wire="openai", lossless="true") is None


def test_an_empty_completion_observes_no_first_token_time():
    """Zero tokens generated: no first-token time is observed (there was no first token)."""
    m = ServerMetrics()
    m.observe_generation("completions", _stats(generated_tokens=0))
    assert not _value(m, "specdec_time_to_first_token_seconds_count", endpoint="completions")
    assert _value(m, "specdec_request_seconds_count", endpoint="completions") == 1


def test_first_token_times_up_to_60_s_have_buckets():
    """The first-token histogram has 25 s and 60 s buckets past the latency ones."""
    m = ServerMetrics()
    m.observe_generation("chat", _stats(ttft_s=30.0, wall_s=40.0))
    assert _value(m, "specdec_time_to_first_token_seconds_bucket", endpoint="chat", le="60.0") == 1
    assert _value(m, "specdec_time_to_first_token_seconds_bucket", endpoint="chat", le="25.0") == 0


def test_a_verify_round_observes_its_latency_and_one_unverified_token():
    m = ServerMetrics()
    m.observe_verify(wire="greedy", lossless=False, gamma=2, accepted=1, emitted=2, seconds=0.3, unverified=1)
    assert _value(m, "specdec_verify_latency_seconds_sum", wire="greedy") == pytest.approx(0.3)
    assert _value(m, "specdec_unverified_tokens_total") == 1


def test_the_acceptance_gauge_is_kept_per_wire():
    """coupled 0/4, then greedy 4/4: each wire's gauge counts only its own rounds."""
    m = ServerMetrics()
    m.observe_verify(wire="coupled", lossless=True, gamma=4, accepted=0, emitted=1, seconds=0.0, unverified=0)
    m.observe_verify(wire="greedy", lossless=True, gamma=4, accepted=4, emitted=5, seconds=0.0, unverified=0)
    assert _value(m, "specdec_acceptance_rate", wire="greedy") == 1.0
    assert _value(m, "specdec_acceptance_rate", wire="coupled") == 0.0


def test_positions_never_drafted_have_no_series_and_no_created_series():
    """A position drafted in no round gets no series (not a 0); the output has no *_created series."""
    m = ServerMetrics()
    m.observe_generation("chat", _stats(proposed_per_position=[100, 0], acceptance_per_position=[0.29, 0.0]))
    assert _value(m, "specdec_draft_position_proposed_total", wire="openai", position="2") is None
    names = {line.split("{")[0].split(" ")[0] for line in m.render().decode().splitlines() if not line.startswith("#")}
    assert not [n for n in names if n.endswith("_created")], names


def test_a_two_token_completion_has_an_inter_token_time():
    """Two tokens: one gap after the first, observed as wall - ttft."""
    m = ServerMetrics()
    m.observe_generation("chat", _stats(generated_tokens=2))
    assert _value(m, "specdec_inter_token_seconds_sum", endpoint="chat") == pytest.approx(0.8)
